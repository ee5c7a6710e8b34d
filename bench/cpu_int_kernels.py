"""aten's CPU weight-only int kernels against the float matmul, at the embedded model's layer shapes.

    .venv/bin/python bench/cpu_int_kernels.py --out bench/results/.../kernels.json
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/cpu_int_kernels.py   # an AVX-512 host's AVX2 kernels

For M rows (1, 8, 32) and each projection of SmolLM2-135M (qkv, o, gate_up, down, and the 49152-row
logits head), the median time of: F.linear on float32 and bfloat16 weights, and
`_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` (group 32) with float32 and bfloat16 inputs,
and the float32 layers the engine builds: oneDNN's packed layer (PackedLinear, small batches padded
where its probe says so) and fbgemm's float16 one (HalfPackedLinear, the compact logits head under
float32 activations); and the int8 head with its input rows quantized too (W8A8Linear, the compact
logits head under bf16 activations where its probe passes; absent where it does not), with its
integer matmul alone (its calls as the layer makes them: chunks of inputs, each input with its
outliers' row); the head
table's int8 lookups (2,048 ids: a prompt chunk); and oneDNN's int8 matmul with signed inputs at
one row (3 calls: the path W8A8Linear avoids, a reference loop off AMX, e.g. under
ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI); and the W4A8 kernel (service/engine/native/w4a8.cpp: int4
weights, inputs rounded to int8 per block of 32, integer sums; NIM_CPU_INT4_KERNEL=auto) where it
builds, with each input dtype (it takes both as they come); and the Q8 kernel
(service/engine/native/q8.cpp: int8 weights with a scale per block of 32, inputs rounded to int8
per block of 32; the compact logits head's first choice), float32 and bf16 inputs.
The finding it was written for (bench/README.md "CPU precisions by measurement"): with float32
inputs the int kernels take a scalar path 10-40x slower than with bfloat16 inputs, on AVX2 and
AVX-512 alike, bf16 instructions or not; so the engine runs them in bf16 under fp32 activations
(BuildOptions.int_kernels_in_bf16). Prints one JSON document (with the command) and writes --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from service.engine.models.cpu_linear import HalfPackedLinear, PackedLinear
from service.engine.models.quant import Int8Weight
from service.engine.models.w8a8 import CHUNK_ROWS, W8A8Linear, w8a8_problem
from service.engine.native import q8, w4a8

INT8_MM = torch.ops.aten._weight_int8pack_mm
INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu
# [N out, K in] of SmolLM2-135M's projections.
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 4)


def measure(rows: int, n: int, k: int, reps: int) -> dict[str, float]:
    weight = torch.randn(n, k)
    int8_values = torch.randint(-127, 127, (n, k), dtype=torch.int8)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32), 1
    )
    w4a8_layer = w4a8.pack(
        torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 32) * 0.01 + 1e-3,
        torch.zeros(n, k // 32), 32,
    )  # fmt: skip
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype == torch.float32 else "bf16"
        x, w = torch.randn(rows, k).to(dtype), weight.to(dtype)
        scale8, scales4 = torch.rand(n).to(dtype), torch.rand(k // 32, n, 2).to(dtype)
        result[f"float_{name}"] = median_ms(lambda x=x, w=w: F.linear(x, w), reps)
        result[f"int8_{name}_inputs"] = median_ms(lambda x=x, s=scale8: INT8_MM(x, int8_values, s), reps)
        result[f"int4_{name}_inputs"] = median_ms(lambda x=x, s=scales4: INT4_MM(x, packed4, 32, s), reps)
        if w4a8.problem() is None:  # the W4A8 kernel, inputs rounded to int8 per block of 32
            result[f"w4a8_{name}_inputs"] = median_ms(lambda x=x: w4a8.linear(x, *w4a8_layer, 32, n), reps)
    x = torch.randn(rows, k)
    packed = PackedLinear(weight, None)
    packed.pad_small = packed.needs_padding()
    half = HalfPackedLinear(weight)
    with torch.inference_mode():
        result["packed_fp32"] = median_ms(lambda: packed(x), reps)
        result["fbgemm_fp16_weights"] = median_ms(lambda: half(x), reps)
        if q8.problem() is None and q8.shape_problem(k) is None:  # the compact head (first choice)
            blocks = q8.Q8Linear(weight * 0.02)
            result["q8_int8_inputs"] = median_ms(lambda: blocks(x), reps)
            x_bf16 = x.bfloat16()
            result["q8_int8_inputs_from_bf16"] = median_ms(lambda: blocks(x_bf16), reps)
        if w8a8_problem(k) is None:
            integer = W8A8Linear(Int8Weight.quantize(weight), torch.device("cpu"))
            result["w8a8_int8_inputs"] = median_ms(lambda: integer(x.bfloat16()), reps)
            # As the layer calls it: each chunk of inputs with its outliers' rows.
            calls = [
                torch.randint(1, 256, (2 * min(CHUNK_ROWS, rows - start), k), dtype=torch.uint8)
                for start in range(0, rows, CHUNK_ROWS)
            ]
            result["w8a8_kernel_alone"] = median_ms(lambda: [integer.scaled_sums(q) for q in calls], reps)
    return result


def lookup(n: int, k: int, ids: int, reps: int) -> float:
    """An int8 embedding lookup of `ids` tokens (Int8Embedding's rows, widened to float)."""
    table = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    picked = torch.randint(0, n, (ids,))
    return median_ms(lambda: table.index_select(0, picked).float(), reps)


def signed_inputs(n: int, k: int, rows: int, reps: int) -> float:
    """oneDNN's int8 matmul with signed inputs (zero point 0): the path W8A8Linear avoids."""
    packed = torch.ops.onednn.qlinear_prepack(torch.randint(-127, 128, (n, k), dtype=torch.int8), [1, k])
    scale, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int64)
    x = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
    return median_ms(
        lambda: torch.ops.onednn.qlinear_pointwise(
            x, 1.0, 0, packed, scale, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        ),
        reps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--reps", type=int, default=100, help="timed calls per case (the head: a tenth)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {
        f"M{rows}_{name}": measure(rows, n, k, max(5, args.reps // 10) if name == "head" else args.reps)
        for rows in args.rows
        for name, (n, k) in SHAPES.items()
    }
    n, k = SHAPES["head"]
    report = {
        "command": " ".join(["python", *sys.argv]),
        "head_lookup_ms": {f"{ids}_ids": lookup(n, k, ids, args.reps) for ids in (1, 32, 2048)},
        "head_signed_inputs_1_row_ms": signed_inputs(n, k, 1, 3),
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", "default"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "w4a8": w4a8.problem() or w4a8.isa(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "ms": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
