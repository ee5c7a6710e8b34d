"""How much prompt lookup could gain on a workload's own greedy text, whatever verification costs.

The speed-up speculative decoding brings is bounded by what the model writes: prompt lookup can only
propose text that occurred before, and a draft counts only where it is the model's own next token.
This script serves compare_llama.py's prompts (the same seeds: `--workload repeat`, c=1, its rounds
and requests) through one engine core of the embedded model without speculation, greedy, ignore_eos,
then replays each answer step by step with the lookup the server would run (service/engine/torch/
speculative/ngram.py, the given N / min / max), every draft verified:

- `steps`: the steps decoding the answer would take if each step verified all N drafts found
  (accepted drafts plus the step's own token), against one step a token without speculation;
- `bound`: tokens / steps, the decode speed-up if a step with N + 1 rows cost what one row does:
  no draft count or cheaper kernel can beat it on this text;
- `by_match`: per suffix-match length (0: no match), the steps and the drafts they would accept.

The text depends on the host's numerics (activation dtype, kernels), so run it where the bar is
measured; it runs no server and takes about a minute.

    PYTHONPATH=bench .venv/bin/python bench/speculation_bound.py --rounds 3 --requests 4 \
        --input-words 96 --output-len 96 --out bench/results/<dir>/speculation_bound.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from compare_llama import make_prompts

from service.config_loading import load_settings
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.loading import build_core
from service.engine.torch.speculative.ngram import lookup
from service.serving import config_for


def replay(prompt: list[int], answer: list[int], num_tokens: int, min_n: int, max_n: int) -> dict:
    """The answer decoded again with every lookup draft verified: steps, and accepted drafts by
    the length of the suffix that matched."""
    tokens, at, steps = prompt + answer, len(prompt), 0
    by_match: dict[int, list[int]] = {}
    while at < len(tokens):
        drafts, matched = lookup(tokens[:at], num_tokens, min_n, max_n)
        accepted = 0
        while (
            accepted < len(drafts)
            and at + accepted < len(tokens)
            and tokens[at + accepted] == drafts[accepted]
        ):
            accepted += 1
        steps_accepted = by_match.setdefault(matched, [0, 0])
        steps_accepted[0] += 1
        steps_accepted[1] += accepted
        at += accepted + 1  # the accepted drafts and the step's own token
        steps += 1
    return {"tokens": len(answer), "steps": steps, "by_match": by_match}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--input-words", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0, help="compare_llama.py's --seed")
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    core = build_core(config_for(load_settings(max_model_len=2048)))
    core.start(lambda: None, lambda error: None)
    tokenizer = core.tokenizer
    answers = []
    for r in range(args.rounds):
        seed = args.seed * 1_000_003 + 1 * 1000 + r  # compare_llama.py's seed for c=1, round r
        for i, text in enumerate(make_prompts(seed, args.requests, args.input_words, "repeat")):
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            prompt = tokenizer.encode(rendered, False)
            params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            core.add_request(GenerationRequest(f"{r}-{i}", prompt, params, time.monotonic()))
            answer: list[int] = []
            while core.has_work():
                for out in core.step():
                    answer.extend(out.token_ids)
            found = replay(
                prompt, answer, args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max
            )
            answers.append({"round": r, "request": i, **found, "bound": found["tokens"] / found["steps"],
                            "text": tokenizer.decode(answer)})  # fmt: skip
            print(f"round {r} request {i}: {found['tokens']} tokens in {found['steps']} steps "
                  f"(bound {found['tokens'] / found['steps']:.2f}x)", flush=True)  # fmt: skip
    rounds = []
    for r in range(args.rounds):
        mine = [a for a in answers if a["round"] == r]
        rounds.append(sum(a["tokens"] for a in mine) / sum(a["steps"] for a in mine))
    result = {
        "command": "bench/speculation_bound.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "bound_by_round": rounds,
        "bound_median": sorted(rounds)[len(rounds) // 2],
        "bound_all": sum(a["tokens"] for a in answers) / sum(a["steps"] for a in answers),
        "answers": answers,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "answers"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
