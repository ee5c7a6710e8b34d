"""Quality and speed of each weight precision on one GGUF file, in process, in one run.

    .venv/bin/python bench/quality.py --out bench/results/cpu-2026-11-24/quality.json

Per precision (the model built as the engine builds it: same loader, same CPU prepacking):
- perplexity over tests/data/perplexity.txt (GPL-3 + Apache-2.0 texts, ~10k tokens) in
  non-overlapping windows of --window tokens;
- greedy agreement with the reference precision (bf16) over the 50 prompts of
  tests/data/prompts.txt, chat-formatted: share of prompts whose first --tokens generated tokens
  are identical, and the mean length of the common prefix;
- "int4_wo+w4a8": int4_wo on the W4A8 kernel (NIM_CPU_INT4_KERNEL=auto: each block of 32
  activations rounded to int8, native/w4a8.py); "int4_wo" alone is aten's weight-only kernel;
- "int4_wo+dense": int4_wo with its prompts (the perplexity windows, each greedy prompt) through
  the bf16 copies NIM_DENSE_PROMPT_ROWS attaches (service/engine/models/prompt_rows.py), decode
  steps on the int4 kernel, as the engine serves it under bf16 activations;
- decode tok/s at batch 1 and 32 (dense KV cache, greedy, no serving overhead) and the achieved
  weight bandwidth: bytes of weights read per step x steps per second.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from engine_bench import DenseAttention

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from service.engine.models import prompt_rows  # noqa: E402
from service.engine.models.attention import CausalAttention  # noqa: E402
from service.engine.models.base import BuildOptions  # noqa: E402
from service.engine.models.loader import build_model, load_gguf  # noqa: E402
from service.engine.models.quant_linear import Int4Linear  # noqa: E402
from service.engine.torch.device import choose_dtype  # noqa: E402
from service.text.tokenizer import Tokenizer  # noqa: E402


def embedded_gguf() -> Path:
    return next((REPO / "model_store" / "smollm2-135m-instruct").glob("*.gguf"))


DENSE = "+dense"  # a precision's suffix: prompt rows through dense bf16 copies
W4A8 = "+w4a8"  # int4_wo's suffix: its layers on the W4A8 kernel (activations rounded to int8)


def load(path: Path, precision: str):
    base = precision.removesuffix(DENSE).removesuffix(W4A8)
    dtype = torch.float32 if base == "fp32" else choose_dtype("auto", torch.device("cpu"))
    config, weights = load_gguf(path, base)
    kernel = "w4a8" if W4A8 in precision else "aten"
    model = build_model(
        config, weights, dtype, "cpu", BuildOptions(prepack_cpu=True, int4_kernel=kernel)
    )  # as the engine builds it (the head as loaded)
    if precision.endswith(DENSE):
        layers = [layer.module for layer in model.linear_layers() if isinstance(layer.module, Int4Linear)]
        if not layers or dtype != torch.bfloat16 or any(m.attach_dense() for m in layers):
            raise SystemExit(f"{precision}: needs native int4 layers under bf16 activations")
    model.dense_prompts = precision.endswith(DENSE)
    return model, config, dtype


def prompt_forward(model, ids: torch.Tensor, positions: torch.Tensor, attention):
    """The model over a prompt: every row through the dense copies where the model holds them."""
    if not model.dense_prompts:
        return model(ids, positions, attention)
    with prompt_rows.split(len(ids), list(range(len(ids)))):
        return model(ids, positions, attention)


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start : start + window + 1])
        if len(chunk) < 2:
            break
        hidden = prompt_forward(model, chunk[:-1], torch.arange(len(chunk) - 1), CausalAttention())
        logits = model.compute_logits(hidden)
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


@torch.inference_mode()
def greedy(model, config, dtype, prompt: list[int], tokens: int) -> list[int]:
    cache = DenseAttention(
        config.num_layers, 1, config.num_kv_heads, config.head_dim, len(prompt) + tokens, dtype, "cpu"
    )
    hidden = prompt_forward(model, torch.tensor(prompt), torch.arange(len(prompt)), cache)
    cache.pos = len(prompt)
    out = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
    for _ in range(tokens - 1):
        hidden = model(torch.tensor(out[-1:]), torch.tensor([cache.pos]), cache)
        cache.pos += 1
        out.append(int(model.compute_logits(hidden).argmax(-1)))
    return out


@torch.inference_mode()
def decode_speed(model, config, dtype, batch: int, steps: int, repeat: int) -> float:
    """Median decode tok/s over `repeat` runs of `steps` steps after a 128-token prompt."""
    rates = []
    for _ in range(repeat):
        cache = DenseAttention(
            config.num_layers, batch, config.num_kv_heads, config.head_dim, 128 + steps + 1, dtype, "cpu"
        )
        prompt = torch.randint(100, 40000, (batch, 128), generator=torch.Generator().manual_seed(0))
        hidden = model(prompt.reshape(-1), torch.arange(128).repeat(batch), cache)
        cache.pos = 128
        token = model.compute_logits(hidden.view(batch, 128, -1)[:, -1]).argmax(-1)
        started = time.perf_counter()
        for _ in range(steps):
            hidden = model(token, torch.full((batch,), cache.pos), cache)
            cache.pos += 1
            token = model.compute_logits(hidden).argmax(-1)
        rates.append(batch * steps / (time.perf_counter() - started))
    return statistics.median(rates)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, default=None, help="default: the embedded model")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "int4_wo", "int8_wo", "fp32", "fp8"])
    parser.add_argument("--reference", default="bf16")
    parser.add_argument("--text", type=Path, default=REPO / "tests/data/perplexity.txt")
    parser.add_argument("--prompts", type=Path, default=REPO / "tests/data/prompts.txt")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.gguf or embedded_gguf()
    tokenizer = Tokenizer.from_gguf(path)
    text_ids = tokenizer.encode(args.text.read_text())
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": line}]), add_special_tokens=False
        )
        for line in args.prompts.read_text().splitlines()
        if line.strip()
    ]
    order = [args.reference] + [p for p in args.precisions if p != args.reference]
    results: dict[str, dict] = {}
    reference: list[list[int]] = []
    for precision in order:
        started = time.perf_counter()
        model, config, dtype = load(path, precision)
        load_s = time.perf_counter() - started
        row: dict = {"activations": str(dtype).removeprefix("torch."), "load_s": round(load_s, 1)}
        row["weight_mb"] = round(model.weight_nbytes() / 1e6, 1)
        phase = time.perf_counter()
        row["perplexity"] = round(perplexity(model, text_ids, args.window), 4)
        row["perplexity_s"] = round(time.perf_counter() - phase, 1)
        phase = time.perf_counter()
        outputs = [greedy(model, config, dtype, p, args.tokens) for p in prompts]
        row["greedy_s"] = round(time.perf_counter() - phase, 1)
        if precision == args.reference:
            reference = outputs
        prefixes = [common_prefix(o, r) for o, r in zip(outputs, reference, strict=True)]
        row["greedy_identical"] = round(sum(p == args.tokens for p in prefixes) / len(prefixes), 3)
        row["greedy_mean_common_prefix"] = round(statistics.mean(prefixes), 2)
        for batch in args.batches:
            rate = decode_speed(model, config, dtype, batch, args.steps, args.repeat)
            row[f"decode_tok_s_b{batch}"] = round(rate, 1)
            row[f"weight_gb_s_b{batch}"] = round(model.weight_nbytes() * rate / batch / 1e9, 2)
        results[precision] = row
        print(precision, json.dumps(row), flush=True)
        del model
    ref_ppl = results[args.reference]["perplexity"]
    for row in results.values():
        row["perplexity_vs_reference"] = round(row["perplexity"] / ref_ppl - 1, 5)
    report = {
        "command": " ".join(sys.argv),
        "model": str(path),
        "text_tokens": len(text_ids),
        "prompts": len(prompts),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "reference": args.reference,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
