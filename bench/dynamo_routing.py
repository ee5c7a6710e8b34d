"""KV-aware routing across Dynamo workers vs round-robin over the same workers, on one machine.

    .venv/bin/python bench/dynamo_routing.py --workers 2 --out FILE [--track-active-blocks]

Workload: 32 conversations, each opening with a distinct 512-token prefix (token ids drawn from a
seeded generator) and running 4 turns; a turn's prompt is the previous turn's prompt, its answer
(re-tokenized) and a new 24-token user message; greedy, 16 tokens per answer. Turns are sent in
random order (any conversation whose previous turn has finished may go next, picked by a seeded
generator) by 8 concurrent clients, streamed through /v1/completions of this server's router.

The same workload runs three times, each on a fresh deployment: `--workers` Dynamo workers behind
the router in kv mode, the same workers behind the router in round-robin mode, and one plain
server (`serve`, the reference for the answers). Every engine gets NIM_NUM_THREADS=1 and the same
KV cache size (--kv-tokens per engine).

Metrics (the JSON states them too): for turns 2-4, the requests a prefix cache can serve,
- prefix hit rate = sum of usage.prompt_tokens_details.cached_tokens / sum of prompt_tokens;
- TTFT p50 = the median time from sending a request to its first streamed chunk with text, ms.
Turn 1 figures are reported beside them. errors counts requests that failed; the answers of
every turn are compared with the plain server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import nim_server  # noqa: E402
from service.dynamo.local import LocalDeployment  # noqa: E402
from service.store.model_store import EMBEDDED_MODEL_NAME, embedded_model_path  # noqa: E402
from service.text.tokenizer import Tokenizer  # noqa: E402

CONVERSATIONS, TURNS, PREFIX_TOKENS, USER_TOKENS, ANSWER_TOKENS, CONCURRENCY = 32, 4, 512, 24, 16, 8
TOKEN_RANGE = (300, 40_000)  # ordinary tokens of the embedded vocabulary (no special ones)


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float | None = None
    answer: str = ""
    error: str | None = None


@dataclass
class Conversation:
    index: int
    prompt: list[int]
    turns: list[Turn] = field(default_factory=list)


def workload(seed: int, conversations: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's prefix and its user messages (token ids)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(*TOKEN_RANGE) for _ in range(PREFIX_TOKENS)] for _ in range(conversations)]
    users = [
        [[rng.randrange(*TOKEN_RANGE) for _ in range(USER_TOKENS)] for _ in range(TURNS)]
        for _ in range(conversations)
    ]
    return prefixes, users


async def one_turn(client: httpx.AsyncClient, url: str, prompt: list[int], record: Turn) -> None:
    body = {
        "model": EMBEDDED_MODEL_NAME, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    pieces: list[str] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return
                for choice in chunk.get("choices") or ():
                    if choice["text"] and record.ttft_ms is None:
                        record.ttft_ms = (time.perf_counter() - started) * 1000
                    pieces.append(choice["text"])
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    record.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.answer = "".join(pieces)


async def run_workload(url: str, seed: int, tokenizer: Tokenizer, count: int) -> list[Conversation]:
    prefixes, users = workload(seed, count)
    conversations = [Conversation(i, list(prefixes[i])) for i in range(count)]
    ready = list(range(count))  # conversations whose next turn may go now
    rng = random.Random(seed + 1)
    wake = asyncio.Event()
    remaining = count * TURNS

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal remaining
        while remaining > 0:
            if not ready:
                wake.clear()
                await wake.wait()
                continue
            conversation = conversations[ready.pop(rng.randrange(len(ready)))]
            turn = len(conversation.turns)
            prompt = conversation.prompt + users[conversation.index][turn]
            record = Turn(conversation.index, turn + 1)
            conversation.turns.append(record)
            await one_turn(client, url, prompt, record)
            conversation.prompt = prompt + tokenizer.encode(record.answer, add_special_tokens=False)
            remaining -= 1
            if turn + 1 < TURNS:
                ready.append(conversation.index)
            wake.set()

    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(CONCURRENCY)))
    return conversations


def summarize(conversations: list[Conversation], wall_s: float) -> dict[str, Any]:
    turns = [t for c in conversations for t in c.turns]
    later = [t for t in turns if t.turn > 1 and t.error is None]
    first = [t for t in turns if t.turn == 1 and t.error is None]

    def hit_rate(ts: list[Turn]) -> float:
        return sum(t.cached_tokens for t in ts) / max(1, sum(t.prompt_tokens for t in ts))

    def p50(ts: list[Turn]) -> float:
        values = [t.ttft_ms for t in ts if t.ttft_ms is not None]
        return statistics.median(values) if values else float("nan")

    return {
        "requests": len(turns),
        "errors": sum(t.error is not None for t in turns),
        "error_messages": sorted({t.error for t in turns if t.error})[:5],
        "prefix_hit_rate": round(hit_rate(later), 4),
        "ttft_p50_ms": round(p50(later), 1),
        "turn1_prefix_hit_rate": round(hit_rate(first), 4),
        "turn1_ttft_p50_ms": round(p50(first), 1),
        # turns 2-4 that did not find their conversation's 512-token prefix where they were sent
        "prefix_misses": sum(t.cached_tokens < PREFIX_TOKENS - 16 for t in later),
        "all_turns_prefix_hit_rate": round(hit_rate(later + first), 4),
        "all_turns_ttft_p50_ms": round(p50(later + first), 1),
        "wall_s": round(wall_s, 1),
    }


def answers(conversations: list[Conversation]) -> dict[tuple[int, int], str]:
    return {(t.conversation, t.turn): t.answer for c in conversations for t in c.turns if t.error is None}


def measure_routed(workers: int, mode: str, args: argparse.Namespace, tokenizer: Tokenizer, root: Path):
    engine = {"NIM_NUM_THREADS": "1", "NIM_KV_CACHE_MAX_TOKENS": str(args.kv_tokens)}
    router = {"NIM_DYNAMO_ROUTER_MODE": mode,
              "NIM_DYNAMO_ROUTER_TRACK_ACTIVE_BLOCKS": "1" if args.track_active_blocks else "0"}  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NIM_")}, "HF_HUB_OFFLINE": "1"}
    deployment = LocalDeployment(
        workers, args.port, root / mode, env=env, workers_env=engine, router_env=router
    )
    print(f"{mode}: starting {workers} workers and the router", flush=True)
    deployment.start()
    try:
        started = time.perf_counter()
        conversations = asyncio.run(run_workload(deployment.url, args.seed, tokenizer, args.conversations))
        wall = time.perf_counter() - started
    finally:
        codes = deployment.stop()
    result = summarize(conversations, wall)
    result["exit_codes"] = codes
    print(f"{mode}: {result}", flush=True)
    return result, conversations


def measure_single(args: argparse.Namespace, tokenizer: Tokenizer, root: Path):
    env = {"NIM_NUM_THREADS": "1", "NIM_KV_CACHE_MAX_TOKENS": str(args.kv_tokens)}
    log = root / "single.log"
    root.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    process = nim_server.start(env, args.port, log)
    try:
        nim_server.wait_ready(url, process, log)
        started = time.perf_counter()
        conversations = asyncio.run(run_workload(url, args.seed, tokenizer, args.conversations))
        wall = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(60)
    result = summarize(conversations, wall)
    print(f"single: {result}", flush=True)
    return result, conversations


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--seed", type=int, default=41)
    parser.add_argument("--conversations", type=int, default=CONVERSATIONS, help="fewer for a smoke run")
    parser.add_argument("--kv-tokens", type=int, default=32768, help="KV cache tokens per engine")
    parser.add_argument("--track-active-blocks", action="store_true",
                        help="the kv router also weighs in-flight blocks (Dynamo's default)")  # fmt: skip
    parser.add_argument("--no-single", action="store_true", help="skip the plain-server reference run")
    args = parser.parse_args()
    load_before = os.getloadavg()
    tokenizer = Tokenizer.from_gguf(embedded_model_path())
    root = Path(tempfile.mkdtemp(prefix="dynamo-routing-"))
    kv, kv_conversations = measure_routed(args.workers, "kv", args, tokenizer, root)
    rr, rr_conversations = measure_routed(args.workers, "round-robin", args, tokenizer, root)
    equal: dict[str, str] = {}
    single = None
    if not args.no_single:
        single, single_conversations = measure_single(args, tokenizer, root)
        reference = answers(single_conversations)
        for name, convs in (("kv", kv_conversations), ("round_robin", rr_conversations)):
            got = answers(convs)
            same = sum(got.get(key) == text for key, text in reference.items())
            equal[name] = f"{same}/{len(reference)}"
    gain = kv["prefix_hit_rate"] - rr["prefix_hit_rate"]
    speedup = rr["ttft_p50_ms"] / kv["ttft_p50_ms"]
    report = {
        "command": " ".join(["bench/dynamo_routing.py", *sys.argv[1:]]),
        "kv_prefix_hit_rate": kv["prefix_hit_rate"],
        "rr_prefix_hit_rate": rr["prefix_hit_rate"],
        "kv_ttft_p50_ms": kv["ttft_p50_ms"],
        "rr_ttft_p50_ms": rr["ttft_p50_ms"],
        "errors": kv["errors"] + rr["errors"],
        "greedy_answers_equal_to_single_server": equal,
        "targets": {
            "hit_rate_gain": round(gain, 4),
            "hit_rate_gain_at_least_0.3": gain >= 0.3,
            "ttft_speedup": round(speedup, 2),
            "ttft_speedup_at_least_1.5": speedup >= 1.5,
            "no_errors": kv["errors"] + rr["errors"] == 0,
        },
        "metric_definitions": {
            "prefix_hit_rate": "turns 2-4: sum(usage.prompt_tokens_details.cached_tokens) "
            "/ sum(usage.prompt_tokens)",
            "ttft_p50_ms": "turns 2-4: median ms from sending a request to its first streamed text chunk",
            "turn1_*": "the same over turn 1 (nothing to hit: every prefix is new)",
            "prefix_misses": "turns 2-4 whose cached tokens did not cover their conversation's prefix",
            "errors": "failed requests of the kv and round-robin runs",
        },
        "workload": {
            "conversations": args.conversations,
            "turns": TURNS,
            "prefix_tokens": PREFIX_TOKENS,
            "user_tokens": USER_TOKENS,
            "answer_tokens": ANSWER_TOKENS,
            "concurrency": CONCURRENCY,
            "seed": args.seed,
            "greedy": True,
        },
        "deployment": {
            "workers": args.workers,
            "threads_per_engine": 1,
            "kv_tokens_per_engine": args.kv_tokens,
            "kv_router_tracks_active_blocks": args.track_active_blocks,
            "discovery": "file",
            "model": EMBEDDED_MODEL_NAME,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "kv": kv,
        "round_robin": rr,
        "single": single,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps({k: report[k] for k in list(report)[:8]}, indent=2, default=str))


if __name__ == "__main__":
    main()
