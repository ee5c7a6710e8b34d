"""The sampler alone: the batched one beside the per-row one it replaced, same logits, same process.

    PYTHONPATH=. .venv/bin/python bench/sampler_batched.py [--old-commit a19e2e6] [--vocab 49152]

For each batch size and parameter mix, both samplers pick one token per row from the same random
[B, V] logits (alternating, --rounds times each); medians in milliseconds and their ratio. The
per-row sampler is read from git at --old-commit (service/engine/torch/sampler.py there, with one
torch.Generator per row). Prints one JSON document with the command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import ModuleType

import torch

from service.engine.protocol import SamplingParams
from service.engine.torch import sampler as new

MIXES = {
    "greedy": SamplingParams(max_tokens=64, temperature=0),
    "greedy+logprobs5": SamplingParams(max_tokens=64, temperature=0, logprobs=5),
    "t0.8_top_p0.95": SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95),
    "t1.0_top_k50": SamplingParams(max_tokens=64, temperature=1.0, top_k=50),
    "t0.7_penalties": SamplingParams(
        max_tokens=64, temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.3
    ),
}


def load_old(commit: str) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{commit}:service/engine/torch/sampler.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as handle:
        handle.write(source)
    spec = importlib.util.spec_from_file_location("old_sampler", handle.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def timed(
    sample: Callable[[torch.Tensor, list[object]], object], logits: torch.Tensor, rows: list[object]
) -> float:
    logits = logits.clone()  # the samplers adjust logits in place
    start = time.perf_counter()
    sample(logits, rows)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old-commit", default="a19e2e6")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    old = load_old(args.old_commit)
    generator = torch.Generator().manual_seed(0)
    history = list(range(1, 300))
    results = []
    for batch in args.batch or [1, 32, 256]:
        logits = torch.randn(batch, args.vocab, generator=generator) * 4
        for name, params in MIXES.items():
            old_rows = [
                old.SamplingRow(
                    params, old.make_generator(params, torch.device("cpu")), history, 200, frozenset()
                )
                for _ in range(batch)
            ]
            new_rows = [
                new.SamplingRow(params, new.request_seed(params), history, 200, frozenset())
                for _ in range(batch)
            ]
            times: dict[str, list[float]] = {"per_row": [], "batched": []}
            for _ in range(args.rounds):
                times["per_row"].append(timed(old.sample, logits, old_rows))
                times["batched"].append(timed(new.sample, logits, new_rows))
            per_row, batched = statistics.median(times["per_row"]), statistics.median(times["batched"])
            results.append(
                {
                    "batch": batch,
                    "params": name,
                    "per_row_ms": round(per_row, 3),
                    "batched_ms": round(batched, 3),
                    "speedup": round(per_row / batched, 2),
                }
            )
            print(json.dumps(results[-1]), file=sys.stderr)
    print(
        json.dumps(
            {"command": " ".join(sys.argv), "threads": torch.get_num_threads(), "results": results}, indent=1
        )
    )


if __name__ == "__main__":
    main()
