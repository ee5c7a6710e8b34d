"""What a lone request's speculative verification step costs, op by op, against a plain decode step.

One engine core of the embedded model with prompt lookup (N = --drafts) serves one of
compare_llama's repeat passages; once it decodes, the core's start-up calibration hook
(Speculator.calibrating) makes each step verify exactly K drafts (its last token repeated, verified
as any drafts are), for K = 0 (a plain decode step), 3 and N. It prints:

- each K's median step time over --rounds alternating rounds;
- torch.profiler's table of ops by self time over --profile-steps steps at K = 0 and K = N (the CPU
  ops per step: divide by --profile-steps);
- the plain interval between tokens (no speculator) over 4 repeat passages, 64 tokens each.

Compare builds by running it in each checkout in turn (the machines here are noisy: alternate).

    PYTHONPATH=bench:. .venv/bin/python bench/verify_step.py --drafts 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from compare_llama import make_prompts
from torch.profiler import ProfilerActivity, profile

from service.config_loading import load_settings
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.core import TorchEngineCore
from service.engine.torch.loading import build_core
from service.serving import config_for


def encode(core: TorchEngineCore, text: str) -> list[int]:
    rendered = core.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return core.tokenizer.encode(rendered, False)


def plain_intervals(core: TorchEngineCore) -> list[float]:
    """Seconds between a lone request's tokens, without speculation, over 4 repeat passages."""
    speculator, core.speculator = core.speculator, None
    intervals: list[float] = []
    try:
        for i, text in enumerate(make_prompts(1001, 4, 96, "repeat")):
            params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
            core.add_request(GenerationRequest(f"plain-{i}", encode(core, text), params, time.monotonic()))
            last = None
            while core.has_work():
                outputs = core.step()
                now = time.perf_counter()
                if any(out.token_ids for out in outputs):
                    if last is not None:
                        intervals.append(now - last)
                    last = now
    finally:
        core.speculator = speculator
    return intervals


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--drafts", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    config = {
        "method": "ngram",
        "num_speculative_tokens": args.drafts,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
    }
    settings = load_settings(num_threads=2, max_model_len=2048, speculative_config=json.dumps(config))
    core = build_core(config_for(settings))
    core.start(lambda: None, lambda error: None)
    speculator = core.speculator
    assert speculator is not None
    print("row costs timed at start-up:", speculator.lengths.row_costs if speculator.lengths else None)
    intervals = plain_intervals(core)
    prompt = encode(core, make_prompts(0, 1, 96, "repeat")[0])
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    outputs = core.add_request(GenerationRequest("verify", prompt, params, time.monotonic()))
    while not outputs:  # the prompt, to its first token
        outputs = core.step()
    counts = sorted({0, min(3, args.drafts), args.drafts})
    seconds: dict[int, list[float]] = {k: [] for k in counts}
    for round_ in range(args.rounds):
        for k in counts if round_ % 2 == 0 else reversed(counts):
            speculator.calibrating = k
            started = time.perf_counter()
            core.step()
            seconds[k].append(time.perf_counter() - started)
    for k in (0, args.drafts):
        speculator.calibrating = k
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for _ in range(args.profile_steps):
                core.step()
        print(f"=== {k} drafts ({k + 1} rows), {args.profile_steps} steps")
        print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    speculator.calibrating = None
    core.abort("verify")
    steps = {k: round(statistics.median(v) * 1e3, 2) for k, v in seconds.items()}
    print("median step ms by drafts verified:", steps)
    print(f"plain interval between tokens: median {statistics.median(intervals) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
