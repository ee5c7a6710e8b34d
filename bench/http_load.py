"""Load generator over the HTTP API: fixed input/output lengths, fixed concurrency, streaming.

A light single-process asyncio client (heavy multi-process clients take most of a 2-core
machine and understate every server). Prompts are token ids, so input length is exact;
`ignore_eos` makes every request produce exactly --output-len tokens.

    .venv/bin/python bench/http_load.py --url http://127.0.0.1:8000 --concurrency 8 --requests 32

Reports TTFT and ITL p50/p99, requests/s and output tokens/s (medians of --repeat runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Result:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    latency: float = 0.0
    error: str | None = None


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    extra: dict | None = None,
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),  # e.g. a structured-output constraint
    }
    result = Result()
    started = last = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = chunk["error"]["message"]
                return result
            now = time.perf_counter()
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                if result.ttft == 0.0:
                    result.ttft = now - started
                else:
                    result.itls.append(now - last)
                last = now
    result.latency = time.perf_counter() - started
    return result


def compare_rounds(
    baseline: argparse.Namespace, variant: argparse.Namespace, rounds: int, vocab: int, names: tuple[str, str]
) -> dict:
    """The same load as `baseline` and as `variant`, alternating for `rounds` rounds on one server:
    each one's medians and the variant's output tok/s over the baseline's, per round and median."""
    runs: dict[str, list[dict[str, float]]] = {names[0]: [], names[1]: []}
    for _ in range(rounds):
        runs[names[0]].append(asyncio.run(run_once(baseline, vocab)))
        runs[names[1]].append(asyncio.run(run_once(variant, vocab)))
    medians = {
        kind: {key: round(statistics.median(r[key] for r in rs), 2) for key in rs[0]}
        for kind, rs in runs.items()
    }
    pairs = zip(runs[names[0]], runs[names[1]], strict=True)
    ratios = [v["output_tok_per_s"] / b["output_tok_per_s"] for b, v in pairs]
    ratio = f"{names[1]}_over_{names[0]}"
    return {
        **medians,
        f"{ratio}_per_round": [round(r, 3) for r in ratios],
        f"{ratio}_median": round(statistics.median(ratios), 3),
    }


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(r[key] for r in runs), 2) for key in runs[0]}


def write_report(report: dict, out: Path | None) -> None:
    """Print the report as JSON and keep it in `out`, with the command that produced it."""
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), **report}
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run_once(args: argparse.Namespace, vocab: int) -> dict[str, float]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.requests)]
    # Request i names models[i % len(models)] (LoRA adapters mixed round robin), else args.model.
    models = getattr(args, "models", None) or [args.model]
    queue: asyncio.Queue[tuple[str, list[int]]] = asyncio.Queue()
    for i, p in enumerate(prompts):
        queue.put_nowait((models[i % len(models)], p))
    results: list[Result] = []
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                model, prompt = queue.get_nowait()
                extra = getattr(args, "extra_body", None)
                results.append(await one_request(client, args.url, model, prompt, args.output_len, extra))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, first: {errors[0]}")
    ttfts = [r.ttft for r in results]
    itls = [x for r in results for x in r.itls]
    return {
        "requests_per_s": len(results) / elapsed,
        "output_tok_per_s": sum(r.output_tokens for r in results) / elapsed,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "itl_p50_ms": 1000 * percentile(itls, 50),
        "itl_p99_ms": 1000 * percentile(itls, 99),
        "itl_mean_ms": 1000 * statistics.fmean(itls) if itls else float("nan"),
        "elapsed_s": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=49152, help="prompt token ids are drawn below this")
    args = parser.parse_args()

    models = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"]
    args.model = args.model or models[0]["id"]
    vocab = args.vocab
    warm = argparse.Namespace(**{**vars(args), "requests": args.warmup, "concurrency": 1, "output_len": 4})
    asyncio.run(run_once(warm, vocab))
    runs = [asyncio.run(run_once(args, vocab)) for _ in range(args.repeat)]
    summary = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(
        json.dumps(
            {"config": {k: v for k, v in vars(args).items() if k != "url"}, "median": summary, "runs": runs},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
