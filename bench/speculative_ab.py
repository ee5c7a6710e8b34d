"""Speculative decoding against none, in process, one engine core, alternating rounds (c=1).

One core of the embedded model is built with NIM_SPECULATIVE_CONFIG's ngram method; each round
generates the same request twice, once with speculation and once without (the core's speculator
switched off), in alternating order, and reports each side's median output tok/s and their ratio.
Workloads: `repeat` asks the model to rewrite a given text (the output repeats its input, so prompt
lookup has something to accept); `random` is a prompt of random common words (little to accept:
what the back-off costs); `passages` asks for one of compare_llama's repeat-workload passages
(seeded by the round) to be rewritten, the prompts of `compare_llama.py --workload repeat`.
`--fixed` adds a third side: speculation with every draft the lookup found (up to
num_speculative_tokens) instead of the count a lone request chooses by measured step cost
(service/engine/torch/speculative/draft_length.py). Greedy, ignore_eos; tok/s counts the tokens after
the first (decode only). The machines here are shared and noisy: compare the ratio measured within
one run.

    .venv/bin/python bench/speculative_ab.py --workload repeat --rounds 3 --output-len 96
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from service.config_loading import load_settings
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.core import TorchEngineCore
from service.engine.torch.loading import build_core
from service.serving import config_for

TEXT = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "the members agreed to move the opening date to the spring, to hire two more librarians, and to "
    "spend the remaining funds on children's books and a small reading garden behind the building."
)
WORDS = [
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
]


def prompt_of(core: TorchEngineCore, workload: str, round_index: int) -> list[int]:
    if workload == "passages":
        from compare_llama import make_prompts  # bench/, beside this script

        text = make_prompts(round_index, 1, 96, "repeat")[0]
    elif workload == "repeat":
        text = f"Rewrite the following text exactly, word for word:\n\n{TEXT}"
    else:
        rng = random.Random(round_index)
        text = " ".join(rng.choice(WORDS) for _ in range(64))
    rendered = core.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return core.tokenizer.encode(rendered, False)


def generate(core: TorchEngineCore, prompt: list[int], output_len: int, tag: str) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    core.add_request(GenerationRequest(tag, prompt, params, time.monotonic()))
    first, tokens = None, []
    while core.has_work():
        for out in core.step():
            if out.token_ids and first is None:
                first = time.perf_counter()
            tokens.extend(out.token_ids)
    assert first is not None
    return (len(tokens) - 1) / (time.perf_counter() - first), tokens  # decode tok/s after the first token


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=["repeat", "random", "passages"], default="repeat")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}',
    )
    parser.add_argument(
        "--fixed", action="store_true", help="a third side: every draft found, not the chosen count"
    )
    args = parser.parse_args()
    settings = load_settings(
        num_threads=args.threads, max_model_len=2048, speculative_config=args.speculative_config
    )
    core = build_core(config_for(settings))
    core.start(lambda: None, lambda error: None)
    speculator = core.speculator
    sides = ["speculative", "plain", *(["fixed"] if args.fixed else [])]
    rates: dict[str, list[float]] = {side: [] for side in sides}
    lengths = speculator.lengths if speculator is not None else None
    for r in range(args.rounds):
        prompt = prompt_of(core, args.workload, r)
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        outputs = []
        for side in order:
            core.speculator = None if side == "plain" else speculator
            if speculator is not None:
                speculator.lengths = lengths if side == "speculative" else None
            core.pool.reset_cache()  # neither side reuses the other's prompt
            rate, tokens = generate(core, prompt, args.output_len, f"{side}-{r}")
            rates[side].append(rate)
            outputs.append(tokens)
        assert all(tokens == outputs[0] for tokens in outputs), "greedy output differs between sides"
    if speculator is not None:
        speculator.lengths = lengths
    counts = speculator.counts if speculator is not None else None
    medians = {side: statistics.median(values) for side, values in rates.items()}
    result = {
        "workload": args.workload,
        "rounds": args.rounds,
        "output_len": args.output_len,
        "threads": args.threads,
        "speculative_config": args.speculative_config,
        "tok_s": rates,
        "median_tok_s": medians,
        "ratio": medians["speculative"] / medians["plain"],
        "ratio_fixed": medians["fixed"] / medians["plain"] if args.fixed else None,
        "row_costs": lengths.row_costs if lengths is not None else None,
        "acceptance": None
        if counts is None or not counts.num_draft_tokens
        else {
            "drafts": counts.num_drafts,
            "draft_tokens": counts.num_draft_tokens,
            "accepted_tokens": counts.num_accepted_tokens,
            "per_position": counts.accepted_per_position,
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
