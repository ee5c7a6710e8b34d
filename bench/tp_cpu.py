"""Tensor parallelism on the CPU, for the record: the same random checkpoint served with one rank
and with --tp ranks (gloo, one process each), the same load against both, in one run.

    .venv/bin/python bench/tp_cpu.py --tp 2 --concurrency 1 8 --out bench/results/tp_cpu.json

The checkpoint is written once (random bf16 weights of a Llama shape that --tp divides, a byte-level
tokenizer; decode time depends on shapes, not values). Each server runs with NIM_NUM_THREADS set
to the machine's cores: one rank uses them all, --tp ranks split them. Load: http_load.py's
client (token-id prompts, streaming, ignore_eos), medians of --repeat runs. Also recorded: each
process's peak resident memory (VmHWM) after the load, rank by rank: no rank holds the whole
model. On one host the ranks share its memory bandwidth and cores, so this measures the cost of
the collectives and the extra processes, not a speed-up (that needs a rank per socket or GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_load
import nim_server

REPO = Path(__file__).resolve().parent.parent
SHAPE = dict(hidden=1024, intermediate=4096, layers=12, heads=16, kv_heads=8, vocab=256)


def write_checkpoint(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if (directory / "config.json").exists():
        return
    directory.mkdir(parents=True)
    s = SHAPE
    head_dim = s["hidden"] // s["heads"]
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": rand(s["vocab"], s["hidden"]),
        "model.norm.weight": torch.ones(s["hidden"], dtype=torch.bfloat16),
        "lm_head.weight": rand(s["vocab"], s["hidden"]),
    }
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(s["hidden"], dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(s["hidden"], dtype=torch.bfloat16),
                p + "self_attn.q_proj.weight": rand(s["heads"] * head_dim, s["hidden"]),
                p + "self_attn.k_proj.weight": rand(s["kv_heads"] * head_dim, s["hidden"]),
                p + "self_attn.v_proj.weight": rand(s["kv_heads"] * head_dim, s["hidden"]),
                p + "self_attn.o_proj.weight": rand(s["hidden"], s["heads"] * head_dim),
                p + "mlp.gate_proj.weight": rand(s["intermediate"], s["hidden"]),
                p + "mlp.up_proj.weight": rand(s["intermediate"], s["hidden"]),
                p + "mlp.down_proj.weight": rand(s["hidden"], s["intermediate"]),
            }
        )
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))


def peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(found.group(1)) / 1024 if found else float("nan")


def serve(checkpoint: Path, tp: int, port: int, log: Path, threads: int) -> subprocess.Popen:
    env = {
        "NIM_MODEL_NAME": str(checkpoint),
        "NIM_MODEL_PROFILE": f"torch-generic-bf16-tp{tp}-pp1-throughput",
        "NIM_NUM_THREADS": str(threads),
        "NIM_KV_CACHE_MAX_TOKENS": "65536",
    }
    if tp > 1:
        env["NIM_TENSOR_PARALLEL_SIZE"] = str(tp)
    return nim_server.start(env, port, log)


def measure(tp: int, args: argparse.Namespace, checkpoint: Path, workdir: Path) -> dict:
    port = 8310 + tp
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"server-tp{tp}.log"
    process = serve(checkpoint, tp, port, log, args.threads)
    started = time.monotonic()
    try:
        nim_server.wait_ready(url, process, log)
        ready_s = time.monotonic() - started
        results = {}
        for concurrency in args.concurrency:
            load = argparse.Namespace(
                url=url,
                model=checkpoint.name,
                concurrency=concurrency,
                requests=max(2 * concurrency, 4),
                input_len=args.input_len,
                output_len=args.output_len,
                seed=0,
            )
            warm = argparse.Namespace(**{**vars(load), "requests": 2, "concurrency": 1, "output_len": 4})
            asyncio.run(http_load.run_once(warm, SHAPE["vocab"]))
            runs = [asyncio.run(http_load.run_once(load, SHAPE["vocab"])) for _ in range(args.repeat)]
            results[str(concurrency)] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        ranks = re.search(r"started ranks 1-\d+ \(pids ([\d, ]+)\)", log.read_text())
        pids = [process.pid] + ([int(p) for p in ranks.group(1).split(", ")] if ranks else [])
        peaks = {f"rank {r}": round(peak_rss_mb(pid), 1) for r, pid in enumerate(pids)}
        return {"tp": tp, "ready_s": round(ready_s, 1), "peak_rss_mb": peaks, "load": results}
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "nim-bench" / "tp_cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.workdir / "random-llama-tp"
    write_checkpoint(checkpoint)
    one = measure(1, args, checkpoint, args.workdir)
    many = measure(args.tp, args, checkpoint, args.workdir)
    ratios = {
        c: round(many["load"][c]["output_tok_per_s"] / one["load"][c]["output_tok_per_s"], 3)
        for c in one["load"]
    }
    report = {
        "shape": SHAPE,
        "threads": args.threads,
        "torch": torch.__version__,
        "tp1": one,
        f"tp{args.tp}": many,
        f"tok_per_s_ratio_tp{args.tp}_over_tp1": ratios,
    }
    http_load.write_report(report, args.out)


if __name__ == "__main__":
    main()
