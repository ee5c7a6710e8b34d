"""Where one decode step's time goes, in process: engine overhead beside the model's forward pass.

    PYTHONPATH=. .venv/bin/python bench/step_profile.py --batch 1 --batch 32 [--device cuda]

For each batch size, `batch` requests (input --input-len tokens, ignore_eos) are brought to
steady-state decode in the real TorchEngine; then --steps decode steps are timed phase by phase
by wrapping the engine's own methods (nothing in the engine is changed for this):

- step: the whole engine step (schedule, plan, forward, sampling, output processing, stats);
- forward: the runner's forward pass (model + logits, eager or a replayed CUDA graph; on CUDA
  synchronised, so it includes the GPU's time);
- overhead = step - forward: what the engine adds per step, the figure the decode-speed issue
  bounds (1 ms at batch 1, 3 ms at batch 32 on the CPU).

On CUDA it also profiles --profile-steps steps with torch.profiler and reports, per step, the
kernel launches the host issued (cudaLaunchKernel and friends; a replayed CUDA graph counts as
one cudaGraphLaunch) and the host time outside waits for the GPU. On the CPU it profiles them on
the engine's own thread (the profiler records the thread that starts it) and reports the PyTorch
ops per step and the --top ops by self time: the per-step breakdown.

Prints one JSON document: medians per batch size, and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

from service.config import Settings
from service.config_loading import load_settings
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.engine import TorchEngine
from service.engine.torch.loading import build_engine
from service.serving import config_for

LAUNCH_EVENTS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cudaGraphLaunch",
    "cuLaunchKernelEx",
)


class PhaseTimer:
    """Wraps a bound method so each call's wall time is recorded while `armed`."""

    def __init__(
        self,
        owner: object,
        name: str,
        sync: Callable[[], None] | None = None,
        times: list[float] | None = None,
    ) -> None:
        self.owner, self.name, self.sync = owner, name, sync
        self.original = getattr(owner, name)
        self.times: list[float] = [] if times is None else times
        self.armed = False
        setattr(owner, name, self._call)

    def _call(self, *args, **kwargs):
        if not self.armed:
            return self.original(*args, **kwargs)
        started = time.perf_counter()
        result = self.original(*args, **kwargs)
        if self.sync is not None:
            self.sync()
        self.times.append(time.perf_counter() - started)
        return result


def run_batch(engine: TorchEngine, batch: int, args: argparse.Namespace) -> dict[str, float]:
    device = engine.core.config.device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    step = PhaseTimer(engine.core, "step")
    forward = PhaseTimer(engine.core.runner, "forward", sync)
    timers = [step, forward]
    if engine.core.runner.decode_graphs is not None:
        timers.append(PhaseTimer(engine.core.runner.decode_graphs, "run", sync, forward.times))
    rng = random.Random(batch)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(batch)]
    total = args.warmup_steps + args.steps + args.profile_steps + 8
    params = SamplingParams(max_tokens=total, temperature=args.temperature, ignore_eos=True)
    decoding = threading.Event()

    async def one(i: int) -> None:
        request = GenerationRequest(f"p{batch}-{i}", prompts[i], params, time.monotonic())
        async for out in engine.generate(request):
            if out.num_generated_tokens >= 2:
                decoding.set()

    async def drive() -> None:
        tasks = [asyncio.create_task(one(i)) for i in range(batch)]
        # Wait until every request decodes (all prefills done), then for the warm-up steps.
        while engine.stats().num_waiting or not decoding.is_set():
            if engine.failure is not None:
                raise RuntimeError(f"the engine died: {engine.failure}")
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        await asyncio.to_thread(wait_steps, engine, args.warmup_steps)
        for timer in timers:
            timer.armed = True
        await asyncio.to_thread(wait_steps, engine, args.steps)
        for timer in timers:
            timer.armed = False
        if args.profile_steps:
            profiler = profile_steps if device.type == "cuda" else cpu_op_profile
            result["profile"] = await asyncio.to_thread(profiler, engine, args.profile_steps, args.top)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    result: dict = {}
    asyncio.run(drive())
    for timer in timers:
        setattr(timer.owner, timer.name, timer.original)
    n = min(len(step.times), len(forward.times))
    steps, forwards = step.times[:n], forward.times[:n]
    overheads = [s - f for s, f in zip(steps, forwards, strict=True)]
    result.update(
        {
            "batch": batch,
            "steps_timed": n,
            "step_ms": 1e3 * statistics.median(steps),
            "forward_ms": 1e3 * statistics.median(forwards),
            "overhead_ms": 1e3 * statistics.median(overheads),
            "decode_tok_per_s": batch / statistics.median(steps),
        }
    )
    return result


def start_engine(settings: Settings) -> TorchEngine:
    """The engine of `settings`, started. Loaded on a thread that ends with the load, as the server
    does: the engine's own thread is then the only one holding an OpenMP pool (TorchEngine.start)."""
    built: list[TorchEngine] = []
    loader = threading.Thread(target=lambda: built.append(build_engine(config_for(settings))))
    loader.start()
    loader.join()
    engine = built[0]
    asyncio.run(engine.start())
    return engine


def wait_steps(engine: TorchEngine, count: int) -> None:
    start = engine.stats().num_steps
    while engine.stats().num_steps < start + count:
        if engine.failure is not None:
            raise RuntimeError(f"the engine died: {engine.failure}")
        time.sleep(0.001)


def cpu_op_profile(engine: TorchEngine, count: int, top: int) -> dict:
    """`count` steps under torch.profiler, started and stopped on the engine's thread."""
    from torch.profiler import ProfilerActivity, profile

    original = engine.core.step
    prof = profile(activities=[ProfilerActivity.CPU])
    left = [count]
    done = threading.Event()

    def step() -> list:
        if left[0] == count:
            prof.__enter__()
        outputs = original()
        if not done.is_set():
            left[0] -= 1
            if left[0] == 0:
                prof.__exit__(None, None, None)
                done.set()
        return outputs

    engine.core.step = step  # type: ignore[method-assign]
    try:
        while not done.wait(0.01):
            if engine.failure is not None:
                raise RuntimeError(f"the engine died: {engine.failure}")
    finally:
        engine.core.step = original  # type: ignore[method-assign]
    # aten's ops, oneDNN's, fbgemm's (quantized::) and this project's native ones (nim_cpu::)
    events = [
        e for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::", "nim_cpu::", "quantized::"))
    ]
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "steps": count,
        "ops_per_step": sum(e.count for e in events) / count,
        "profiled_step_ms": sum(e.self_cpu_time_total for e in events) / 1e3 / count,
        "top_ops": [
            {
                "op": e.key,
                "calls_per_step": e.count / count,
                "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / count, 3),
            }
            for e in ranked
        ],
    }


def profile_steps(engine: TorchEngine, count: int, top: int = 0) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    start = engine.stats().num_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wait_steps(engine, count)
    steps = engine.stats().num_steps - start
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in LAUNCH_EVENTS)
    sync_us = sum(
        e.cpu_time_total for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize")
    )
    step_us = sum(e.cpu_time_total for e in events if e.key.endswith("_step")) or 0.0
    return {
        "steps": steps,
        "launches_per_step": launches / max(steps, 1),
        "sync_wait_ms_per_step": sync_us / 1e3 / max(steps, 1),
        "profiled_step_ms": step_us / 1e3 / max(steps, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--batch", type=int, action="append", help="batch size (repeatable; default 1 and 32)"
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=16, help="steps under torch.profiler (0: none)")
    parser.add_argument("--top", type=int, default=15, help="CPU: the ops reported, by self time")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None, help="NIM_MODEL_NAME (default: the embedded model)")
    args = parser.parse_args()
    batches = args.batch or [1, 32]
    settings = load_settings(
        model_name=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(64, *batches),
        max_num_batched_tokens=max(1024, *batches),
        max_model_len=args.max_model_len,
        kv_cache_max_tokens=max(batches) * (args.input_len + 512) + args.max_model_len,
    )
    started = time.monotonic()
    engine = start_engine(settings)
    ready_s = time.monotonic() - started
    results = [run_batch(engine, b, args) for b in batches]
    asyncio.run(engine.stop())
    print(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "device": str(engine.core.config.device),
                "dtype": str(engine.core.config.dtype),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "ready_s": ready_s,
                "profile": settings.model_profile,
                "paths": {path.name: path.used for path in engine.info.paths},
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
