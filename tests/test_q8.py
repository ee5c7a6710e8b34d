"""The Q8 CPU kernel (service/engine/native/q8.cpp, q8.py): int8 weights with a float16 scale per
block of 32, inputs rounded to int8 per block of 32, integer sums.

References are the formula written here (each block's int8 steps, in float64), never the kernel:

* `quantize` rounds each block of a row to int8 steps of its own float16 scale; zero blocks (and
  blocks below float16's smallest step) take scale 0; `pack` and `dequantize` are inverse over
  partial tiles;
* the kernel computes the formula to float32 rounding for float32 and bf16 inputs, and every
  instruction set this host has (portable C++, AVX2, AVX-512 VNNI) gives the same bits, weights
  at int8's extremes (-128 included) and inputs at +-127 steps included;
* a row's outputs do not depend on the rows beside it (batch sizes and places), a NaN row spoils
  only itself, and mismatched shapes are refused with the reason;
* `check()`, the start-up check, passes here and reports a kernel that is off.
"""

from __future__ import annotations

import pytest
import torch

from service.engine.models.cpu_linear import batch_dependence
from service.engine.native import q8
from service.model.quantization import QuantizationError

pytestmark = pytest.mark.skipif(q8.problem() is not None, reason=f"the native CPU ops: {q8.problem()}")


def _formula(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight.T in float64, x's blocks of 32 rounded to int8 steps of max|x| / 127."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.full_like(largest, 127.0) / largest  # float32 division, as the kernel rounds
    steps = (blocks * torch.where(largest > 0, inverse, 0.0)).round()
    rounded = steps.clamp(-127, 127).double() * (largest / 127.0).double()
    return rounded.view(m, k) @ weight.double().T


def _instruction_sets() -> list[int]:
    return [code for code in q8.ISAS.values() if code <= q8.ISAS[q8.isa()]]


def test_each_block_rounds_to_int8_steps_of_its_own_float16_scale() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 96, generator=generator) * torch.logspace(-3, 2, 40)[:, None]
    weight[0, :32] = 0.0
    weight[1, 32:64] = 1e-9  # below float16's smallest scale
    q, scale = q8.quantize(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (40, 3)
    blocks = weight.view(40, 3, 32)
    assert torch.equal(scale, (blocks.abs().amax(-1) / 127).half())
    assert scale[0, 0] == 0 and scale[1, 1] == 0 and not q[0, :32].any() and not q[1, 32:64].any()
    steps = scale.float()[..., None]
    error = (q.view(40, 3, 32).float() * steps - blocks).abs()
    # Half a step, and the float16 rounding of the scale at the block's largest weight (127 steps).
    assert bool((error <= steps * (0.5 + 127 * 2.0**-11) + 1e-8).all())
    assert int(q.abs().max()) == 127


def test_pack_and_dequantize_are_inverse_over_partial_tiles() -> None:
    generator = torch.Generator().manual_seed(1)
    for n in (1, 16, 40):
        weight = torch.randn(n, 64, generator=generator)
        q, scale = q8.quantize(weight)
        packed, scales = q8.pack(q, scale)
        assert packed.shape == (-(-n // 16), 2, 512) and scales.shape == (-(-n // 16), 2, 16)
        want = (q.view(n, 2, 32).float() * scale.float()[..., None]).view(n, 64)
        assert torch.equal(q8.dequantize(packed, scales, n), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 32), (40, 96), (100, 576)], ids=str)
def test_the_kernel_computes_its_formula_alike_on_every_instruction_set(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    n, k = shape
    generator = torch.Generator().manual_seed(n + k)
    packed, scales = q8.pack(*q8.quantize(torch.randn(n, k, generator=generator) * 0.05))
    packed[0, 0, :64] = -128  # int8's extremes, beyond what quantize writes
    packed[0, 0, 64:128] = 127
    weight = q8.dequantize(packed, scales, n)
    x = torch.randn(11, k, generator=generator) * torch.logspace(-2, 3, 11)[:, None]
    x[0] = 0.0
    x[1] = 7.0  # every input a whole +127 steps
    x[2, ::2] = -7.0
    x = x.to(dtype)
    with torch.inference_mode():
        want = _formula(x, weight)
        for rows in (1, 3, 4, 5, 11):  # the kernel's 4-row passes and their remainders
            got = q8.linear(x[:rows], packed, scales, n)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            scale = want[:rows].abs().amax(-1, keepdim=True).clamp_min(1e-30)
            assert float(((got.double() - want[:rows]).abs() / scale).max()) <= 1e-5
            for code in _instruction_sets():
                assert torch.equal(q8.linear(x[:rows], packed, scales, n, code), got), code


def test_a_row_is_computed_alike_at_any_batch_size_and_place() -> None:
    generator = torch.Generator().manual_seed(2)
    layer = q8.Q8Linear(torch.randn(300, 128, generator=generator) * 0.1)
    x = torch.randn(70, 128, generator=generator)
    x[:, ::9] *= 30  # a few large channels, as a head's input has
    with torch.inference_mode():
        assert batch_dependence(layer, x, (1, 2, 3, 4, 5, 7, 8, 9, 17, 33, 64)) is None
        assert layer(x.view(7, 10, 128)).shape == (7, 10, 300)


def test_a_nan_or_infinite_row_spoils_only_itself_and_a_tiny_row_gives_zeros() -> None:
    generator = torch.Generator().manual_seed(3)
    layer = q8.Q8Linear(torch.randn(48, 64, generator=generator))
    x = torch.randn(6, 64, generator=generator)
    with torch.inference_mode():
        clean = layer(x)
        x[3, 7] = float("nan")
        x[4, 40] = float("inf")  # its block's steps would mean nothing: NaN, not a sign
        x[5] = 1e-39  # subnormal: 127 / max overflows
        spoiled = layer(x)
    assert bool(spoiled[3].isnan().all()) and bool(spoiled[4].isnan().all())
    assert not spoiled[5].any()
    assert torch.equal(spoiled[:3], clean[:3])


def test_mismatched_shapes_are_refused_with_the_reason() -> None:
    with pytest.raises(QuantizationError, match="whole blocks of 32"):
        q8.quantize(torch.randn(4, 48))
    assert q8.shape_problem(48) == "its 48 inputs are not whole blocks of 32"
    assert q8.shape_problem(576) is None
    packed, scales = q8.pack(*q8.quantize(torch.randn(20, 64)))
    with pytest.raises(RuntimeError, match="does not match K"):
        q8.linear(torch.randn(2, 96), packed, scales, 20)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        q8.linear(torch.randn(2, 64), packed, scales, 33)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        q8.linear(torch.randn(2, 64, dtype=torch.float64), packed, scales, 20)
    with pytest.raises(RuntimeError, match="positive multiple of 32"):
        q8.linear(
            torch.randn(2, 0), torch.zeros(1, 0, 512, dtype=torch.int8), torch.zeros(1, 0, 16).half(), 16
        )
    assert q8.shape_problem(0) is not None
    with pytest.raises(QuantizationError, match="not finite"):
        q8.quantize(torch.full((1, 32), float("inf")))


def test_the_start_up_check_passes_here_and_reports_a_kernel_that_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert q8.check() is None
    assert q8.serving_problem(576) is None
    assert q8.serving_problem(48) == "its 48 inputs are not whole blocks of 32"
    plain = q8.linear

    def off(
        x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int, isa: int = -1
    ) -> torch.Tensor:
        return plain(x, packed, scales, n, isa) * 1.001

    monkeypatch.setattr(q8, "linear", off)
    assert (problem := q8.check()) is not None and "off its float64 reference" in problem
