"""Structured output on the CPU: the embedded model's default profile under the same load with and
without a JSON-schema constraint, on one server, in one run (rounds alternate; medians).

    .venv/bin/python bench/structured_cpu.py --concurrency 32 \
        --out bench/results/cpu-2026-11-24/structured_cpu.json

The schema asks for one long string ({"story": string of at least 2,000 characters}), so constrained
answers run to max_tokens as the unconstrained ones do with ignore_eos: both rounds produce the same
number of tokens and tok/s compares like with like. What it measures is the constraint's cost per
step (a bitmask per constrained row, filled by xgrammar and applied to the logits, and the token
accepted by the matcher), at every step of every row. Target (issue 17): constrained throughput at
concurrency 32 at least 80% of unconstrained.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_load
import nim_server

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}},
    "required": ["story"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--port", type=int, default=8340)
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "nim-bench" / "structured")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    log = args.workdir / "server.log"
    env = {"NIM_NUM_THREADS": str(args.threads), "NIM_KV_CACHE_MAX_TOKENS": "65536"}
    process = nim_server.start(env, args.port, log)
    try:
        nim_server.wait_ready(url, process, log)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        vocab = 49152
        results = {}
        for concurrency in args.concurrency:
            free = argparse.Namespace(
                url=url,
                model=model,
                concurrency=concurrency,
                requests=2 * concurrency,
                input_len=args.input_len,
                output_len=args.output_len,
                seed=0,
            )
            constrained = argparse.Namespace(
                **vars(free), extra_body={"ignore_eos": False, "guided_json": SCHEMA}
            )
            warm = argparse.Namespace(
                **{**vars(constrained), "requests": 4, "concurrency": 2, "output_len": 4}
            )
            asyncio.run(http_load.run_once(warm, vocab))  # the grammar compiled and cached
            results[str(concurrency)] = http_load.compare_rounds(
                free, constrained, args.rounds, vocab, ("unconstrained", "constrained")
            )
    finally:
        process.terminate()
        process.wait(60)
    report = {
        "schema": SCHEMA,
        "threads": args.threads,
        "torch": torch.__version__,
        "load": results,
    }
    http_load.write_report(report, args.out)


if __name__ == "__main__":
    main()
