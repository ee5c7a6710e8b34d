"""KV cache dtypes: tokens held in one memory budget, and how much greedy predictions change.

    .venv/bin/python bench/kv_quant.py --budget-gib 1

For each cache dtype, the number of tokens the same byte budget holds (bytes per token =
2 x layers x kv_heads x (head_dim x bytes(dtype) [+ one fp16 scale per (token, head) when
quantized])), and, teacher-forced on 8 chat prompts x 40 generated tokens, the share of
positions whose most likely next token matches the bf16 cache's. For scale, the same
comparison for fp32 weights (not a cache setting) is printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from tests.test_engine import chat_prompts, make_engine, next_token_predictions, request, run_all


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--generated", type=int, default=40)
    args = parser.parse_args()
    base = make_engine()
    prompts = chat_prompts(base)
    out = run_all(
        base, [request(f"g{i}", p, max_tokens=args.generated, ignore_eos=True) for i, p in enumerate(prompts)]
    )
    sequences = [p + out[f"g{i}"].token_ids for i, p in enumerate(prompts)]
    skip = [len(p) for p in prompts]
    reference = next_token_predictions(base, sequences, skip)
    budget = args.budget_gib * 2**30
    rows = {"bf16": {"bytes_per_token": base.config.kv_spec.bytes_per_token()}}
    rows["bf16"]["tokens_in_budget"] = int(budget // rows["bf16"]["bytes_per_token"])
    asyncio.run(base.stop())
    for name, overrides in (("int8", {"kv_cache_dtype": "int8"}), ("fp8", {"kv_cache_dtype": "fp8"}),
                            ("fp32 weights (for scale)", {"dtype": "float32"})):  # fmt: skip
        engine = make_engine(**overrides)
        got = next_token_predictions(engine, sequences, skip)
        asyncio.run(engine.stop())
        agree = sum(a == b for r, g in zip(reference, got, strict=True) for a, b in zip(r, g, strict=True))
        total = sum(len(r) for r in reference)
        row = {"next_token_agreement": round(agree / total, 4)}
        if "kv_cache_dtype" in overrides:
            row["bytes_per_token"] = engine.config.kv_spec.bytes_per_token()
            row["tokens_in_budget"] = int(budget // row["bytes_per_token"])
            row["tokens_vs_bf16"] = round(row["tokens_in_budget"] / rows["bf16"]["tokens_in_budget"], 3)
        rows[name] = row
    print(json.dumps({"config": vars(args), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
