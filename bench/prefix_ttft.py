"""Time to first token with a long shared system prompt: cold (first use) vs warm (prefix cached).

    .venv/bin/python bench/prefix_ttft.py --url http://127.0.0.1:8000 --system-tokens 1024 --trials 5

Each trial uses a new system prompt of exactly --system-tokens tokens (token ids, via
/v1/completions), sends it once with one question (cold) and then with another question (warm),
and reports median TTFTs and the median of per-trial cold/warm ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx


def ttft(client: httpx.Client, url: str, model: str, prompt: list[int]) -> tuple[float, int]:
    body = {
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    first = None
    cached = 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:
                first = time.perf_counter() - started
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None
    return first, cached


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    model = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    rng = random.Random(0)
    cold, warm, ratios, cached = [], [], [], []
    with httpx.Client(timeout=300) as client:
        ttft(client, args.url, model, [rng.randrange(100, 40000) for _ in range(32)])  # warm-up
        for _ in range(args.trials):
            system = [rng.randrange(100, 40000) for _ in range(args.system_tokens)]
            questions = [[rng.randrange(100, 40000) for _ in range(args.question_tokens)] for _ in range(2)]
            c, _ = ttft(client, args.url, model, system + questions[0])
            w, hit = ttft(client, args.url, model, system + questions[1])
            cold.append(c)
            warm.append(w)
            ratios.append(c / w)
            cached.append(hit)
    median = {
        "cold_ttft_ms": 1000 * statistics.median(cold),
        "warm_ttft_ms": 1000 * statistics.median(warm),
        "cold_over_warm": statistics.median(ratios),
        "warm_cached_tokens": statistics.median(cached),
    }
    trials = {"cold_ms": [round(1000 * x, 1) for x in cold], "warm_ms": [round(1000 * x, 1) for x in warm]}
    print(json.dumps({"config": vars(args), "median": median, **trials}, indent=2))


if __name__ == "__main__":
    main()
