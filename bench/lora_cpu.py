"""Multi-LoRA throughput on the CPU: the embedded model's default profile served with four
adapters, loaded with base-model requests and with the four adapters mixed round robin, on the same
server in one run (rounds alternate base, mixed, base, mixed, ...; medians).

    .venv/bin/python bench/lora_cpu.py --concurrency 32 --out bench/results/cpu-2026-11-24/lora_cpu.json

The adapters are random (rank --rank on all seven projections of every layer, PEFT layout), so
every mixed step runs four adapters' shrink/expand matmuls on q/k/v/o/gate/up/down: the worst case
for a given rank. Target (issue 15): mixed throughput at least 70% of the base model's at
concurrency 32. Load: http_load.py's client (token-id prompts, streaming, ignore_eos).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_load
import nim_server

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from service.config_loading import load_settings  # noqa: E402
from service.engine.lora import TARGETS, projection_shape  # noqa: E402
from service.engine.torch.loading import read_weights  # noqa: E402
from service.serving import config_for  # noqa: E402

ADAPTERS = ("a0", "a1", "a2", "a3")


def write_random_adapter(directory: Path, rank: int, seed: int, nan: bool = False) -> None:
    """A random adapter for the embedded model (rank `rank` on all seven projections of every
    layer, PEFT layout, bfloat16); with `nan`, one weight is NaN (an adapter the server refuses)."""
    config, _ = read_weights(config_for(load_settings()))  # the embedded model's shape
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in TARGETS:
            out_features, in_features = projection_shape(config, module)
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a = torch.randn(rank, in_features, generator=generator) * 0.01
            b = torch.randn(out_features, rank, generator=generator) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    if nan:
        tensors[next(iter(tensors))][0, 0] = float("nan")
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (directory / "adapter_config.json").write_text(json.dumps(settings))


def write_adapters(root: Path, rank: int) -> None:
    for seed, name in enumerate(ADAPTERS):
        write_random_adapter(root / name, rank, seed)


def serve(source: Path, port: int, log: Path, threads: int, rank: int) -> subprocess.Popen:
    env = {
        "NIM_PEFT_SOURCE": str(source),
        "NIM_MAX_GPU_LORAS": str(len(ADAPTERS)),
        "NIM_MAX_LORA_RANK": str(rank),
        "NIM_NUM_THREADS": str(threads),
        "NIM_KV_CACHE_MAX_TOKENS": "65536",
    }
    return nim_server.start(env, port, log)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--port", type=int, default=8330)
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "nim-bench" / "lora_cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    source = args.workdir / f"adapters-r{args.rank}"
    if not source.exists():
        write_adapters(source, args.rank)
    url = f"http://127.0.0.1:{args.port}"
    log = args.workdir / "server.log"
    process = serve(source, args.port, log, args.threads, args.rank)
    try:
        nim_server.wait_ready(url, process, log)
        base_model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        vocab = 49152
        results = {}
        for concurrency in args.concurrency:
            load = argparse.Namespace(
                url=url,
                model=base_model,
                concurrency=concurrency,
                requests=2 * concurrency,
                input_len=args.input_len,
                output_len=args.output_len,
                seed=0,
            )
            mixed = argparse.Namespace(**{**vars(load), "models": list(ADAPTERS)})
            warm = argparse.Namespace(**{**vars(mixed), "requests": 8, "concurrency": 4, "output_len": 4})
            asyncio.run(http_load.run_once(warm, vocab))  # every adapter read and in a slot
            results[str(concurrency)] = http_load.compare_rounds(
                load, mixed, args.rounds, vocab, ("base", "mixed")
            )
    finally:
        process.terminate()
        process.wait(60)
    report = {
        "adapters": {"count": len(ADAPTERS), "rank": args.rank, "targets": list(TARGETS)},
        "threads": args.threads,
        "torch": torch.__version__,
        "load": results,
    }
    http_load.write_report(report, args.out)


if __name__ == "__main__":
    main()
