"""Issue 28's summary.json from one GPU session's outputs (bench/gpu_session.sh phases ours8b-28,
sampled-28 and fp8-28, and floor8b), with the host's commit passed in (the device's .git is not
reliable).

    python3 bench/issue28_summary.py OUT COMMIT

Reads OUT/floor8b.txt, OUT/ours8b_bf16.json, OUT/ours8b_sampled.json, OUT/ours8b_fp8.json (each the
JSON document bench/compare_llama.py --out writes; medians over its rounds) and writes
OUT/summary.json with the issue's keys, every command, and `errors`: what is missing or failed
(a phase whose document is absent counts as failed). Prints the targets, met or not.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

CONCURRENCY = ("1", "64", "256")


def load(path: Path, errors: list[str]) -> dict[str, Any]:
    if not path.is_file():
        errors.append(f"{path.name}: missing (the phase failed or did not run)")
        return {}
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def ours(document: dict[str, Any], concurrency: str, metric: str) -> float | None:
    value = document.get("median", {}).get(concurrency, {}).get("ours", {}).get(metric)
    return None if value is None else round(float(value), 2)


def main() -> None:
    out, commit = Path(sys.argv[1]), sys.argv[2]
    errors: list[str] = []
    floor = None
    floor_file = out / "floor8b.txt"
    if floor_file.is_file():
        found = re.search(r"batch-1 ceiling ([\d.]+) tok/s", floor_file.read_text())
        floor = float(found.group(1)) if found else None
    if floor is None:
        errors.append("floor8b.txt: missing or without a batch-1 ceiling")
    bf16 = load(out / "ours8b_bf16.json", errors)
    sampled = load(out / "ours8b_sampled.json", errors)
    fp8 = load(out / "ours8b_fp8.json", errors)
    summary = {
        "commit": commit,
        "device": (out / "device.txt").read_text().strip() if (out / "device.txt").is_file() else None,
        "commands": {
            name: doc.get("command") for name, doc in (("bf16", bf16), ("sampled", sampled), ("fp8", fp8))
        },
        "floor_8b_tok_s": floor,
        "ours_8b_tok_s": {c: ours(bf16, c, "output_tok_per_s") for c in CONCURRENCY},
        "ours_8b_itl_p50_ms": {c: ours(bf16, c, "itl_p50_ms") for c in CONCURRENCY},
        "ours_8b_ttft_p50_ms": {c: ours(bf16, c, "ttft_p50_ms") for c in CONCURRENCY},
        "ours_8b_sampled_c256_tok_s": ours(sampled, "256", "output_tok_per_s"),
        "ours_8b_fp8_c1_tok_s": ours(fp8, "1", "output_tok_per_s"),
        "errors": errors,
    }
    tok, itl, ttft = summary["ours_8b_tok_s"], summary["ours_8b_itl_p50_ms"], summary["ours_8b_ttft_p50_ms"]
    checks = {
        "batch 1 >= 0.80 x floor": floor is not None and tok["1"] is not None and tok["1"] >= 0.8 * floor,
        "c64 >= 5000 tok/s, ITL p50 <= 15 ms": (tok["64"] or 0) >= 5000 and (itl["64"] or 1e9) <= 15,
        "c256 >= 10000 tok/s, TTFT p50 <= 1 s": (tok["256"] or 0) >= 10000 and (ttft["256"] or 1e9) <= 1000,
        "sampled c256 within 10% of greedy": bool(
            summary["ours_8b_sampled_c256_tok_s"]
            and tok["256"]
            and summary["ours_8b_sampled_c256_tok_s"] >= 0.9 * tok["256"]
        ),
        "fp8 batch 1 >= 1.5 x bf16": bool(
            summary["ours_8b_fp8_c1_tok_s"] and tok["1"] and summary["ours_8b_fp8_c1_tok_s"] >= 1.5 * tok["1"]
        ),
    }
    summary["targets_met"] = checks
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, met in checks.items():
        print(f"{'met' if met else 'NOT met'}: {name}")


if __name__ == "__main__":
    main()
