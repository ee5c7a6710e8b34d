"""Host overhead of serving, before and after a change, over HTTP with the engine in its own process.

    .venv/bin/python bench/host_overhead.py --before /path/to/old/checkout \
        --rounds 3 --out bench/results/.../host_overhead.json

Each round starts the server of each checkout in turn (the embedded model, NIM_ENGINE_PROCESS=on
unless --engine-process says otherwise, the same settings), and measures on it:

- batch 1: one streaming request at a time (--b1-requests of them), greedy, ignore_eos, --output-len
  tokens: the median interval between tokens is one engine step as the client sees it (the model's
  forward pass plus every host hop between the engine and the socket);
- c=64: 64 such streams at once (--c64-requests in all): output tok/s and the median interval.

The model's forward pass is the same code in both checkouts (their greedy and seeded answers, with
logprobs, are compared exactly: any difference fails the run), so the difference between the two
step times is host time. Rounds alternate the checkouts so drift on a shared machine hits both;
medians are reported, with the after/before ratios per round. Prints one JSON document (with the
command) and writes it to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import httpx
import nim_server  # bench/nim_server.py and bench/http_load.py (this script's directory is on sys.path)
from http_load import run_once, write_report


def measure(repo: Path, args: argparse.Namespace, port: int, workdir: Path) -> dict[str, object]:
    env = {
        "NIM_ENGINE_PROCESS": args.engine_process,
        "NIM_MAX_NUM_SEQS": "64",
        "NIM_CACHE_PATH": str(workdir / "cache"),
        "NIM_NUM_THREADS": str(args.threads) if args.threads else "",
    }
    env = {k: v for k, v in env.items() if v}
    log = workdir / f"{repo.name}-{port}.log"
    process = nim_server.start(env, port, log, repo=repo)
    url = f"http://127.0.0.1:{port}"
    try:
        nim_server.wait_ready(url, process, log)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        vocab = args.vocab
        load = argparse.Namespace(url=url, model=model, input_len=args.input_len, output_len=args.output_len,
                                  seed=args.seed)  # fmt: skip
        # Warm-up: the first requests pay for lazy initialisation on both sides.
        asyncio.run(run_once(argparse.Namespace(**vars(load), requests=8, concurrency=8), vocab))
        b1 = asyncio.run(
            run_once(argparse.Namespace(**vars(load), requests=args.b1_requests, concurrency=1), vocab)
        )
        c64 = asyncio.run(
            run_once(argparse.Namespace(**vars(load), requests=args.c64_requests, concurrency=64), vocab)
        )
        answers = [
            httpx.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": "The capital of France is", "max_tokens": 32,
                      "logprobs": 2, **sampling},
                timeout=120,
            ).json()["choices"][0]
            for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7})
        ]  # fmt: skip
    finally:
        process.terminate()
        process.wait(60)
    return {
        "b1_step_ms": round(b1["itl_p50_ms"], 3),
        "b1_tok_per_s": round(b1["output_tok_per_s"], 2),
        "c64_step_ms": round(c64["itl_p50_ms"], 3),
        "c64_itl_mean_ms": round(c64["itl_mean_ms"], 3),
        "c64_ttft_p50_ms": round(c64["ttft_p50_ms"], 3),
        "c64_tok_per_s": round(c64["output_tok_per_s"], 2),
        "answers": [{"text": a["text"], "logprobs": a["logprobs"]} for a in answers],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", type=Path, required=True, help="the checkout to compare against")
    parser.add_argument("--after", type=Path, default=nim_server.REPO, help="default: this checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-process", default="on", choices=["on", "off"])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--b1-requests", type=int, default=4)
    parser.add_argument("--c64-requests", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152, help="prompt token ids are drawn below this")
    parser.add_argument("--threads", type=int, default=0, help="NIM_NUM_THREADS (0: the server's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict[str, object]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for side in order:
                runs[side].append(measure(sides[side], args, args.port, Path(tmp)))
    first = runs["before"][0]["answers"]
    for side, results in runs.items():
        for result in results:
            if result["answers"] != first:
                raise SystemExit(f"{side}'s answers differ: {result['answers']} vs {first}")
    numeric = (
        "b1_step_ms",
        "b1_tok_per_s",
        "c64_step_ms",
        "c64_itl_mean_ms",
        "c64_ttft_p50_ms",
        "c64_tok_per_s",
    )

    def values(side: str, key: str) -> list[float]:
        return [float(r[key]) for r in runs[side]]  # type: ignore[arg-type]

    medians = {side: {key: statistics.median(values(side, key)) for key in numeric} for side in runs}
    ratios = {
        key: [round(a / b, 3) for a, b in zip(values("after", key), values("before", key), strict=True)]
        for key in numeric
    }
    timings = {
        side: [{k: v for k, v in r.items() if k != "answers"} for r in rs] for side, rs in runs.items()
    }
    report = {
        "checkouts": {side: str(path) for side, path in sides.items()},
        "engine_process": args.engine_process,
        "settings": {k: v for k, v in vars(args).items() if k not in ("before", "after", "out")},
        "medians": medians,
        "after_over_before_per_round": ratios,
        "after_over_before_median": {key: statistics.median(v) for key, v in ratios.items()},
        "greedy_and_seeded_answers_equal": True,
        "runs": timings,
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
