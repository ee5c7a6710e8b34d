"""The Triton fp8 rows kernel (service/engine/models/triton_fp8.py) against the emulated fp8 layer,
under TRITON_INTERPRET=1 where no GPU is present (tests/conftest.py), natively on one; and compiled
for Hopper on the CPU, since the interpreter accepts Python the compiler rejects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.engine.models.quant import FP8Weight
from service.engine.models.quant_linear import FP8Linear
from service.engine.triton_support import available as triton_available
from tests.test_triton_unified_attention import compile_for_hopper

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton (pip install triton)")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _layer(out_features: int, in_features: int, bias: bool, seed: int = 0) -> FP8Linear:
    generator = torch.Generator().manual_seed(seed)
    weight = FP8Weight.quantize(torch.randn(out_features, in_features, generator=generator) * 0.05)
    b = (
        torch.nn.Parameter(torch.randn(out_features, generator=generator).to(torch.bfloat16))
        if bias
        else None
    )
    return FP8Linear(weight, b, torch.bfloat16, DEVICE)


@needs_triton
@pytest.mark.parametrize(
    ("out_features", "in_features", "bias"), [(48, 64, False), (40, 300, True), (17, 513, False)]
)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_rows_kernel_agrees_with_the_emulated_layer(
    out_features: int, in_features: int, bias: bool, rows: int
) -> None:
    """Output channels and inputs that are not multiples of the kernel's blocks, with and without
    a bias: within the bf16 rounding of the output (the emulated layer also rounds its scaled
    weights to bf16; the kernel applies the scale in float32)."""
    from service.engine.models.triton_fp8 import fp8_rows_linear

    layer = _layer(out_features, in_features, bias)
    x = (
        torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
        .to(torch.bfloat16)
        .to(DEVICE)
    )
    with torch.inference_mode():
        got = fp8_rows_linear(x, layer.q, layer.scale, layer.bias)
        want = layer.emulated(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    error = float((got.float() - want.float()).norm() / want.float().norm())
    assert error < 1e-2, error


@needs_triton
def test_the_rows_kernel_reads_strided_rows_and_refuses_too_many() -> None:
    from service.engine.models.triton_fp8 import ROWS_MAX, fp8_rows_linear

    layer = _layer(32, 64, False)
    wide = torch.randn(4, 128).to(torch.bfloat16).to(DEVICE)
    strided = wide[:, :64]  # rows 128 apart
    with torch.inference_mode():
        assert torch.equal(
            fp8_rows_linear(strided, layer.q, layer.scale, None),
            fp8_rows_linear(strided.contiguous(), layer.q, layer.scale, None),
        )
        with pytest.raises(ValueError, match=f"at most {ROWS_MAX} rows"):
            fp8_rows_linear(torch.zeros(ROWS_MAX + 1, 64, dtype=torch.bfloat16, device=DEVICE), layer.q,
                            layer.scale, None)  # fmt: skip


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from service.engine.models import triton_fp8

kernel = triton_fp8._fp8_rows_kernel
for has_bias in (False, True):
    constexprs = {"HAS_BIAS": has_bias, "BLOCK_M": triton_fp8.ROWS_MAX, "BLOCK_N": triton_fp8.BLOCK_N,
                  "BLOCK_K": triton_fp8.BLOCK_K, "IN_FP32": False}
    kinds = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
             "bias_ptr": "*bf16" if has_bias else "*fp32", "out_ptr": "*bf16"}
    signature = {n: "constexpr" if n in constexprs else kinds.get(n, "i32") for n in kernel.arg_names}
    source = ASTSource(kernel, signature, {(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    options = {"num_warps": 4, "num_stages": 4}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"], "no cubin"
    print(has_bias, "compiled")
"""


@needs_triton
def test_the_rows_kernel_compiles_for_hopper(pytestconfig: pytest.Config, tmp_path: Path) -> None:
    assert compile_for_hopper(_COMPILE_FOR_HOPPER, pytestconfig, tmp_path).count("compiled") == 2
