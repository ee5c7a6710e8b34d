"""Where a prefill-heavy step's time goes, in process: the steps that bring --prompts prompts of
--input-len tokens to their first token, timed one by one, then the same under torch.profiler.

    PYTHONPATH=. python3 bench/gpu/prefill_profile.py CHECKPOINT --profile PROFILE \\
        --prompts 64 --input-len 256 --max-batched-tokens 8192 --json OUT.json

Why: on an H200 (2026-11-28, 8B shape, bf16) concurrency 64 waited 1.76 s for its first tokens
(TTFT p50) where its ~16,600 prompt tokens are about 0.3 s of the GPU's arithmetic; decode steps
were 10 ms. This says which: the mixed steps' own time (forward pass and the rest of the step),
their tokens, and the kernels that take the GPU's time (on a CPU: the ops, for the rehearsal).

Each round submits every prompt at once (random tokens, new each round: no prefix-cache hits) with
max_tokens 2 and waits for all to finish; round 1 warms up, round 2 is timed step by step (step,
forward, tokens, prefill chunks), round 3 runs under the profiler. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: step_profile's timer, start
from step_profile import PhaseTimer, start_engine

from service.config_loading import load_settings
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.engine import TorchEngine


def run_round(engine: TorchEngine, prompts: list[list[int]], tag: str) -> float:
    """Every prompt at once, two tokens each; the wall seconds until the last has finished."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> None:
        request = GenerationRequest(f"{tag}-{i}", prompts[i], params, time.monotonic())
        async for _ in engine.generate(request):
            pass

    async def drive() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return time.perf_counter() - started

    return asyncio.run(drive())


def top_kernels(prof: Any, top: int, cuda: bool) -> list[dict[str, Any]]:
    """On CUDA the kernels by device time (CUPTI sees every thread's); on a CPU the ops by self time
    of the thread that started the profiler, which is not the engine's: few or none."""
    events = list(prof.key_averages())
    if cuda:
        ranked = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
        return [
            {"kernel": e.key[:120], "calls": e.count, "device_ms": round(e.self_device_time_total / 1e3, 3)}
            for e in ranked
            if e.self_device_time_total > 0
        ]
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [
        {"op": e.key[:120], "calls": e.count, "cpu_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in ranked
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint")
    parser.add_argument("--profile", required=True, help="NIM_MODEL_PROFILE")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, help="default: the server's for this device")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    settings = load_settings(
        model_name=args.checkpoint,
        model_profile=args.profile,
        max_num_seqs=max(args.prompts, 8),
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len,
    )
    started = time.monotonic()
    engine = start_engine(settings)
    ready_s = time.monotonic() - started
    cuda = engine.core.config.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    rng = random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.prompts)]

    run_round(engine, prompts(), "warm")
    step = PhaseTimer(engine.core, "step", sync)
    forward = PhaseTimer(engine.core.runner, "forward", sync)
    schedule = engine.core.scheduler.schedule
    shapes: list[tuple[int, int]] = []  # per step: tokens, prefill chunks (more than one token)

    def scheduled() -> Any:
        out = schedule()
        shapes.append((out.num_tokens, sum(1 for c in out.chunks if c.num_tokens > 1)))
        return out

    engine.core.scheduler.schedule = scheduled  # type: ignore[method-assign]
    step.armed = forward.armed = True
    wall = run_round(engine, prompts(), "timed")
    step.armed = forward.armed = False
    engine.core.scheduler.schedule = schedule  # type: ignore[method-assign]
    steps = [
        {
            "tokens": tokens,
            "prefill_chunks": chunks,
            "step_ms": round(s * 1e3, 2),
            "forward_ms": round(f * 1e3, 2),
        }
        for (tokens, chunks), s, f in zip(shapes, step.times, forward.times, strict=False)
    ]
    prefill_steps = [s for s in steps if s["prefill_chunks"]]
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        profiled_wall = run_round(engine, prompts(), "profiled")
    asyncio.run(engine.stop())
    prompt_tokens = args.prompts * args.input_len
    document = {
        "command": " ".join(sys.argv),
        "device": str(engine.core.config.device),
        "torch": torch.__version__,
        "ready_s": round(ready_s, 1),
        "prompt_tokens": prompt_tokens,
        "round_wall_ms": round(wall * 1e3, 1),
        "prompt_tok_per_s": round(prompt_tokens / wall, 1),
        "steps": steps,
        "prefill_step_ms_median": statistics.median(s["step_ms"] for s in prefill_steps)
        if prefill_steps
        else None,
        "stepping_share_of_wall": round(sum(step.times) / wall, 3),
        "forward_share_of_steps": round(sum(forward.times) / max(sum(step.times), 1e-9), 3),
        "profiled_round_wall_ms": round(profiled_wall * 1e3, 1),
        "top": top_kernels(prof, args.top, cuda),
    }
    args.json.write_text(json.dumps(document, indent=1) + "\n")
    print(
        f"{prompt_tokens} prompt tokens in {wall * 1e3:.0f} ms ({prompt_tokens / wall:.0f} tok/s) over "
        f"{len(steps)} steps; prefill step median {document['prefill_step_ms_median']} ms; "
        f"forward {document['forward_share_of_steps']:.0%} of step time"
    )


if __name__ == "__main__":
    main()
