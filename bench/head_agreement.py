"""How far each CPU logits head moves the embedded model's greedy tokens from the float head.

    PYTHONPATH=. .venv/bin/python bench/head_agreement.py [--dtype bfloat16|float32] [--prompts 50]

The embedded model (int4_wo layers, as served) is built once per head: the activation dtype's
own (the reference), the int8 weight-only head (`NIM_COMPACT_LOGITS=weight-only`), the integer
head (under bf16 activations; service/engine/models/w8a8.py: `auto` where the Q8 head cannot run),
under float32 activations the float16 one (`weight-only`), and the Q8 one (`auto` under either
activation dtype; service/engine/native/q8.py).
For each of the first --prompts prompts of tests/data/prompts.txt
(chat template applied) the reference decodes --new-tokens greedy tokens; each head then reads
that continuation teacher-forced, one forward pass, and each step is compared: the same token, or
a near-tie taken the other way (its margin in the reference's logprobs; the prompt's comparison
ends there). Reported per head: steps compared, flips, the largest flip margin, and the chosen
token's mean |logprob difference|. Prints one JSON document (with the command); --out writes it.
tests/test_w8a8_logits.py and tests/test_cpu_int_kernels.py hold the bounds on 10 prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from service.engine.models.attention import CausalAttention
from service.engine.models.base import BuildOptions, CausalLM, LogitsFormat
from service.engine.models.loader import build_model, load_gguf
from service.engine.models.w8a8 import w8a8_problem
from service.engine.native.q8 import problem as q8_problem
from service.store.model_store import embedded_model_path
from service.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent


def logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0]), CausalAttention())).float()


def agreement(reference: CausalLM, model: CausalLM, prompts: list[list[int]], new_tokens: int) -> dict:
    compared, margins, moved = 0, [], []
    for prompt in prompts:
        ids, start = list(prompt), len(prompt)
        for _ in range(new_tokens):
            ids.append(int(logits(reference, torch.tensor(ids))[-1].argmax()))
        sequence = torch.tensor(ids[:-1])
        want_rows = logits(reference, sequence)[start - 1 :].log_softmax(-1)
        got_rows = logits(model, sequence)[start - 1 :].log_softmax(-1)
        for step, (want, got) in enumerate(zip(want_rows, got_rows, strict=True)):
            token, other = ids[start + step], int(got.argmax())
            if int(want.argmax()) != token:  # the reference's own step-by-step and one-pass disagree
                break
            compared += 1
            if other != token:
                margins.append(float(want[token] - want[other]))
                break
            moved.append(abs(float(got[token] - want[token])))
    return {
        "steps": compared,
        "flips": len(margins),
        "largest_flip_margin": round(max(margins, default=0.0), 4),
        "mean_abs_logprob_diff": round(statistics.fmean(moved), 4) if moved else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    heads: dict[str, LogitsFormat] = {"weight_only_int8": "int8"}
    hidden = load_gguf(embedded_model_path(), "int4_wo")[0].hidden_size  # the config; weights load lazily
    if dtype == torch.bfloat16 and w8a8_problem(hidden) is None:
        heads["integer_w8a8"] = "w8a8"
    if dtype == torch.float32:
        heads["float16"] = "fp16"
    if q8_problem() is None:
        heads["q8_blocks"] = "q8"

    def build(logits_format: LogitsFormat) -> CausalLM:
        config, weights = load_gguf(embedded_model_path(), "int4_wo")
        # As served: under float32 activations the int layers compute in bf16 (rank_loading).
        options = BuildOptions(
            prepack_cpu=True, logits_format=logits_format, int_kernels_in_bf16=dtype == torch.float32
        )
        return build_model(config, weights, dtype, "cpu", options)

    tokenizer = Tokenizer.from_gguf(embedded_model_path())
    lines = [line for line in (REPO / "tests/data/prompts.txt").read_text().splitlines() if line.strip()]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": line}]), add_special_tokens=False
        )
        for line in lines[: args.prompts]
    ]
    reference = build("float")
    report = {
        "command": " ".join(["python", *sys.argv]),
        "dtype": args.dtype,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "against_the_float_head": {
            name: agreement(reference, build(fmt), prompts, args.new_tokens) for name, fmt in heads.items()
        },
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
