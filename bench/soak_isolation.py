"""Soak: bad requests and bad adapters harm nobody else (issue 32's proof).

One server on the embedded model, NIM_PEFT_SOURCE holding a good adapter and a poisoned one (NaN
weights, refused when read). --requests streaming chat requests at --concurrency, drawn with a fixed
seed: --cut of the clients close their stream after a few chunks, --unsatisfiable carry a
constraint no text satisfies (guided_regex "a[^\\s\\S]"), --bad-adapter name the poisoned adapter or
one that does not exist; a tenth of the rest run the good adapter. Every request is greedy.

What it checks, and reports as JSON (with the command):
- every well-formed request that was not cut finished without an error, and its text equals the
  text of the same request in a second run that holds only the well-formed requests;
- every unsatisfiable request failed alone (a 400 or an error frame), every bad adapter name was a
  404, and no cut client's request kept running;
- /v1/health/ready answered 200 at every probe (every 0.5 s) throughout both runs;
- afterwards: no request running or waiting, no KV block in use.

    .venv/bin/python bench/soak_isolation.py --requests 10000 --concurrency 64 \
        --out bench/results/cpu-2026-11-25/soak_isolation.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_load
import lora_cpu
import nim_server

MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "Name a colour.", "What is rain?", "Tell me a fact.", "Say hello to Ann.", "Count to five.",
    "What is a cat?", "Name a fruit.", "Why is the sky blue?", "Give me a word that rhymes with tree.",
    "What is two plus two?", "Describe the sea.", "Name a planet.", "What do bees make?",
    "Say something kind.", "What is a river?", "Name a tool.",
]  # fmt: skip
UNSATISFIABLE = {"guided_regex": "a[^\\s\\S]"}


@dataclass(frozen=True)
class Job:
    index: int
    kind: str  # ok | cut | unsatisfiable | bad_adapter
    model: str
    question: str
    max_tokens: int
    cut_after: int = 0  # chunks read before a cut client closes its stream


@dataclass
class Outcome:
    status: int = 0
    text: str = ""
    error: str | None = None
    finished: bool = False  # [DONE] seen


@dataclass
class Probe:
    probes: int = 0
    not_ready: list[str] = field(default_factory=list)


def draw_jobs(args: argparse.Namespace) -> list[Job]:
    rng = random.Random(args.seed)
    jobs = []
    for i in range(args.requests):
        roll = rng.random()
        question = rng.choice(QUESTIONS)
        max_tokens = rng.randint(4, args.max_tokens)
        if roll < args.unsatisfiable:
            jobs.append(Job(i, "unsatisfiable", MODEL, question, max_tokens))
        elif roll < args.unsatisfiable + args.bad_adapter:
            jobs.append(
                Job(i, "bad_adapter", rng.choice(["poisoned", "no-such-adapter"]), question, max_tokens)
            )
        elif roll < args.unsatisfiable + args.bad_adapter + args.cut:
            model = "good" if rng.random() < 0.1 else MODEL
            jobs.append(Job(i, "cut", model, question, args.max_tokens, cut_after=rng.randint(1, 3)))
        else:
            jobs.append(Job(i, "ok", "good" if rng.random() < 0.1 else MODEL, question, max_tokens))
    return jobs


async def run_job(client: httpx.AsyncClient, job: Job) -> Outcome:
    body: dict = {
        "model": job.model,
        "messages": [{"role": "user", "content": job.question}],
        "max_tokens": job.max_tokens,
        "temperature": 0,
        "stream": True,
        **(UNSATISFIABLE if job.kind == "unsatisfiable" else {}),
    }
    outcome = Outcome()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            outcome.error = response.json()["error"]["message"]
            return outcome
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.finished = True
                break
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                outcome.error = event["error"]["message"]
                continue
            for choice in event["choices"]:
                outcome.text += choice["delta"].get("content") or ""
            chunks += 1
            if job.kind == "cut" and chunks >= job.cut_after:
                break  # the client leaves: the stream is closed with the connection
    return outcome


async def probe_readiness(client: httpx.AsyncClient, probe: Probe, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            response = await client.get("/v1/health/ready", timeout=5)
            if response.status_code != 200:
                probe.not_ready.append(f"{response.status_code} {response.text[:200]}")
        except httpx.HTTPError as exc:
            probe.not_ready.append(f"transport: {exc}")
        probe.probes += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def run_all(url: str, jobs: list[Job], concurrency: int) -> tuple[dict[int, Outcome], Probe, float]:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    probe, stop = Probe(), asyncio.Event()
    outcomes: dict[int, Outcome] = {}
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                job = queue.get_nowait()
                try:
                    outcomes[job.index] = await run_job(client, job)
                except httpx.HTTPError as exc:
                    outcomes[job.index] = Outcome(error=f"transport: {exc}")

        prober = asyncio.create_task(probe_readiness(client, probe, stop))
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        stop.set()
        await prober
    return outcomes, probe, elapsed


def gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def settled(url: str, timeout: float = 30) -> dict[str, float]:
    """Running, waiting and KV usage once the server has let go of everything (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        found = {
            "running": gauge(metrics, "vllm:num_requests_running"),
            "waiting": gauge(metrics, "vllm:num_requests_waiting"),
            "kv_cache_usage": gauge(metrics, "vllm:kv_cache_usage_perc"),
        }
        if not any(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cut", type=float, default=0.20)
    parser.add_argument("--unsatisfiable", type=float, default=0.02)
    parser.add_argument("--bad-adapter", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "nim-bench" / "soak")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    source = args.workdir / "adapters"
    lora_cpu.write_random_adapter(source / "good", rank=8, seed=1)
    lora_cpu.write_random_adapter(source / "poisoned", rank=8, seed=2, nan=True)
    log = args.workdir / "server.log"
    env = {
        "NIM_PEFT_SOURCE": str(source),
        "NIM_MAX_LORA_RANK": "8",
        "NIM_NUM_THREADS": "2",
        "NIM_KV_CACHE_MAX_TOKENS": "65536",
        "NIM_MAX_NUM_SEQS": str(args.concurrency),
        "NIM_MAX_PENDING_REQUESTS": str(4 * args.concurrency),
    }
    url = f"http://127.0.0.1:{args.port}"
    server = nim_server.start(env, args.port, log)
    try:
        nim_server.wait_ready(url, server, log)
        jobs = draw_jobs(args)
        mixed, mixed_probe, mixed_s = asyncio.run(run_all(url, jobs, args.concurrency))
        after_mixed = settled(url)
        clean_jobs = [job for job in jobs if job.kind == "ok"]
        clean, clean_probe, clean_s = asyncio.run(run_all(url, clean_jobs, args.concurrency))
        after_clean = settled(url)
    finally:
        server.terminate()
        server.wait(60)

    by_kind: dict[str, list[Job]] = {}
    for job in jobs:
        by_kind.setdefault(job.kind, []).append(job)
    ok_errors = [j.index for j in by_kind["ok"] if mixed[j.index].error or not mixed[j.index].finished]
    differs = [j.index for j in by_kind["ok"] if mixed[j.index].text != clean[j.index].text]
    clean_errors = [j.index for j in clean_jobs if clean[j.index].error or not clean[j.index].finished]
    unsat = by_kind.get("unsatisfiable", [])
    unsat_alone = [
        j.index for j in unsat if mixed[j.index].error and "admits no token" in mixed[j.index].error
    ]
    bad = by_kind.get("bad_adapter", [])
    bad_404 = [j.index for j in bad if mixed[j.index].status == 404]
    report = {
        "requests": {kind: len(group) for kind, group in sorted(by_kind.items())},
        "concurrency": args.concurrency,
        "seconds": {"mixed": round(mixed_s, 1), "well_formed_only": round(clean_s, 1)},
        "well_formed": {
            "errors_in_mixed_run": len(ok_errors),
            "errors_in_clean_run": len(clean_errors),
            "texts_differing_from_clean_run": len(differs),
            "examples": [{"index": i, "mixed": mixed[i].text, "clean": clean[i].text} for i in differs[:3]],
        },
        "unsatisfiable_failed_alone": f"{len(unsat_alone)}/{len(unsat)}",
        "bad_adapter_404": f"{len(bad_404)}/{len(bad)}",
        "readiness": {
            "probes": mixed_probe.probes + clean_probe.probes,
            "not_200": mixed_probe.not_ready + clean_probe.not_ready,
        },
        "after_mixed_run": after_mixed,
        "after_clean_run": after_clean,
        "poisoned_adapter_refused": "not served: adapter poisoned" in log.read_text(),
    }
    passed = (
        not ok_errors
        and not clean_errors
        and not differs
        and len(unsat_alone) == len(unsat)
        and len(bad_404) == len(bad)
        and report["poisoned_adapter_refused"]
        and not report["readiness"]["not_200"]
        and not any(after_mixed.values())
        and not any(after_clean.values())
    )
    report["passed"] = passed
    http_load.write_report(report, args.out)
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
