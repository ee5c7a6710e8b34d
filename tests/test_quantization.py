"""Quantized weights: formats, GGUF int4 blocks, CPU kernels, ModelOpt checkpoints, serving.

Every reference here is computed from the published formula, written in this file, never by
calling the code under test:

* formats (service.engine.models.quant): dequantize() against the formula in float64, to float32
  rounding (2^-21 of the largest value); quantize() round trips within half a step (int4, int8) or
  e4m3's 3-bit mantissa (fp8);
* GGUF Q4_0/Q4_1 blocks decoded as int4: equal to gguf.quants.dequantize (float32), bitwise but
  for the sign of zero;
* CPU int4/int8 kernels against F.linear on the dequantized weight in float32: <= 1e-5 of the
  largest output in float32, <= 2^-6 (two bfloat16 roundings and scales held in bfloat16, with
  margin) with bfloat16 activations;
* tiny ModelOpt FP8 / NVFP4 checkpoints written here against transformers run on their
  dequantized weights (emulated fp8/nvfp4 is weight-only): max |logit diff| <= 1e-4 in float32,
  <= 0.15 in bfloat16 (as test_model_numerics), logits of order 1-10;
* GGUFs with Q4_0 / Q4_1 layers served as int4 directly against the same file dequantized to
  float32: <= 1e-4 (int4 direct is exact to the file; the logits layer stays float);
* float checkpoints quantized at load (int8_wo, int4_wo, fp8) against transformers on weights
  quantized by the formulas here: <= 1e-4 in float32;
* refusals: one-line QuantizationErrors naming the tensor or checkpoint and the problem;
* the embedded model served over HTTP under the int4_wo, int8_wo and fp8 profiles, and a ModelOpt
  NVFP4 directory, with the official openai client.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from service.engine.models import quant_linear
from service.engine.models.attention import CausalAttention
from service.engine.models.llama import LlamaForCausalLM
from service.engine.models.loader import build_model, load_gguf, load_hf_dir
from service.engine.models.quant import (
    FP8Weight,
    Int4Weight,
    Int8Weight,
    NVFP4Weight,
    QuantizationError,
    concat_rows,
    gguf_q4_0,
    gguf_q4_1,
)
from service.engine.models.quant_linear import FP8Linear, Int4Linear, Int8Linear, NVFP4Linear
from tests.conftest import EMBEDDED_NAME, TEST_THREADS, ServerProcess, start_server, wait_ready
from tests.test_model_numerics import _write_gguf

torch.set_num_threads(TEST_THREADS)

FLOAT32_LOGITS_TOLERANCE = 1e-4
BFLOAT16_LOGITS_TOLERANCE = 0.15
KERNEL_FLOAT32_TOLERANCE = 1e-5  # of the largest |output|
KERNEL_BFLOAT16_TOLERANCE = 2**-6  # of the largest |output|
CPU = torch.device("cpu")

# ---------------------------------------------------------------------------------------------
# Published formulas, implemented here independently of service code


def decode_e4m3(t: torch.Tensor) -> torch.Tensor:
    """float8 e4m3fn (OCP FP8) by its bits, float64: sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN (no infinities)."""
    bits = t.view(torch.uint8).long()
    sign = torch.where(bits >> 7 == 1, -1.0, 1.0).double()
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).double()
    normal = (1 + mantissa / 8) * torch.pow(2.0, (exponent - 7).double())
    subnormal = mantissa / 8 * 2.0**-6
    value = sign * torch.where(exponent == 0, subnormal, normal)
    return torch.where((bits & 0x7F) == 0x7F, torch.nan, value)


def decode_e2m1(code: torch.Tensor) -> torch.Tensor:
    """A 4-bit e2m1 (FP4) code by its bits, float64: sign bit 3, 2 exponent bits (bias 1), 1
    mantissa bit; exponent 0 is subnormal (m * 0.5)."""
    code = code.long()
    sign = torch.where(code >> 3 == 1, -1.0, 1.0).double()
    exponent = (code >> 1) & 0x3
    mantissa = (code & 0x1).double()
    normal = (1 + mantissa / 2) * torch.pow(2.0, (exponent - 1).double())
    return sign * torch.where(exponent == 0, mantissa * 0.5, normal)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] codes, element 2j in the low nibble of byte j."""
    codes = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    return codes


E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def modelopt_fp8(weight: torch.Tensor, per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt FP8: scale = amax / 448 (per tensor, or per output row as [N, 1]); w_fp8 = w / scale."""
    amax = weight.abs().amax(1, keepdim=True) if per_channel else weight.abs().amax()
    scale = (amax / 448.0).float()
    q = (weight / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def modelopt_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4: weight_scale_2 = amax / (6 * 448); per 16-input block, weight_scale =
    block_amax / 6 / weight_scale_2 as e4m3; values w / (weight_scale * weight_scale_2) rounded to
    the nearest e2m1, packed two per byte, low nibble first."""
    n, k = weight.shape
    global_scale = (weight.abs().amax() / (6.0 * 448.0)).float()
    blocks = weight.float().reshape(n, k // 16, 16)
    block_scale = (blocks.abs().amax(-1) / 6.0 / global_scale).to(torch.float8_e4m3fn)
    step = block_scale.float() * global_scale
    scaled = torch.where(step[..., None] > 0, blocks / step[..., None], torch.zeros_like(blocks))
    magnitude = (scaled.abs().clamp(max=6.0)[..., None] - E2M1_MAGNITUDES).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).reshape(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), block_scale, global_scale


def nvfp4_reference(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """float64 [N, K]: e2m1(code) * e4m3(block scale) * global scale (per tensor, or per row [N])."""
    values = decode_e2m1(unpack_nibbles(packed))
    scales = decode_e4m3(block_scale).repeat_interleave(16, dim=1)
    return values * scales * global_scale.double().reshape(-1, 1).expand(values.shape[0], 1)


def int8_per_row(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-row int8 round to nearest, dequantized (float32): scale = amax / 127."""
    scale = weight.abs().amax(1, keepdim=True) / 127.0
    return (weight / scale).round().clamp(-127, 127) * scale


def assert_float32_exact(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """ours (float32) equals the float64 reference up to float32 rounding of the largest value."""
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    limit = 2**-21 * reference.abs().max().item()
    assert (ours.double() - reference).abs().max().item() <= limit


def random_e4m3(shape: tuple[int, ...], generator: torch.Generator, positive: bool = False) -> torch.Tensor:
    """Every e4m3 bit pattern but NaN (and, if positive, no sign bit or zero), uniformly."""
    bits = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    if positive:
        bits = (bits & 0x7F).clamp(1, 0x7E)
    bits[(bits & 0x7F) == 0x7F] = 0
    return bits.view(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# 1. Formats


def test_int4_dequantize_is_the_formula() -> None:
    g = torch.Generator().manual_seed(1)
    n, k, group = 6, 256, 64
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.1 + 1e-3
    zero = torch.randn(n, k // group, generator=g) * 0.2
    weight = Int4Weight(q, scale, zero, group).validate("w")
    # x = (q - 8) * scale + zero, one scale and zero per group of `group` consecutive inputs
    reference = torch.empty(n, k, dtype=torch.float64)
    for row in range(n):
        for col in range(k):
            s, z = scale[row, col // group].item(), zero[row, col // group].item()
            reference[row, col] = (q[row, col].item() - 8) * s + z
    assert weight.shape == (n, k)
    assert_float32_exact(weight.dequantize(), reference)


def test_int8_dequantize_is_the_formula() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (7, 96), generator=g, dtype=torch.int8)
    scale = torch.rand(7, generator=g) * 0.05 + 1e-4
    weight = Int8Weight(q, scale).validate("w")
    reference = q.double() * scale.double()[:, None]
    assert_float32_exact(weight.dequantize(), reference)


def test_fp8_dequantize_is_the_formula() -> None:
    g = torch.Generator().manual_seed(3)
    q = random_e4m3((16, 64), g)
    scale = torch.rand(16, generator=g) + 0.01
    weight = FP8Weight(q, scale).validate("w")
    reference = decode_e4m3(q) * scale.double()[:, None]
    assert not reference.isnan().any()
    assert decode_e4m3(torch.tensor([448.0, -0.001953125]).to(torch.float8_e4m3fn)).tolist() == [
        448.0,
        -(2.0**-9),
    ]  # the decoder itself: the largest normal, the smallest subnormal
    assert_float32_exact(weight.dequantize(), reference)


def test_nvfp4_dequantize_is_the_formula() -> None:
    g = torch.Generator().manual_seed(4)
    n, k = 5, 64
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    block_scale = random_e4m3((n, k // 16), g, positive=True)
    global_scale = torch.rand(n, generator=g) * 1e-3 + 1e-5
    weight = NVFP4Weight(packed, block_scale, global_scale).validate("w")
    assert weight.shape == (n, k)
    assert decode_e2m1(torch.arange(16)).tolist() == [
        *(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
        *(-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0),
    ]
    assert_float32_exact(weight.dequantize(), nvfp4_reference(packed, block_scale, global_scale))
    # Low nibble first: byte 0x71 holds 0.5 (code 1) then 6.0 (code 7).
    one = NVFP4Weight(
        torch.full((1, 8), 0x71, dtype=torch.uint8),
        torch.ones(1, 1).to(torch.float8_e4m3fn),
        torch.ones(1),
    )
    assert one.dequantize()[0, :4].tolist() == [0.5, 6.0, 0.5, 6.0]


def _test_weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes and offsets, one constant group and one zero row."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.pow(10.0, torch.empty(rows, 1).uniform_(-3, 1, generator=g))
    offset = torch.randn(rows, 1, generator=g) * magnitude
    weight = torch.randn(rows, cols, generator=g) * magnitude + offset
    weight[1, :32] = 0.37  # a constant group
    weight[2] = 0.0
    return weight


def test_int4_quantize_round_trip_within_half_a_step() -> None:
    weight = _test_weights(12, 256, seed=5)
    for group in (32, 64, 128):
        quantized = Int4Weight.quantize(weight, group).validate("w")
        assert quantized.group_size == group and quantized.q.dtype == torch.uint8
        assert int(quantized.q.max()) <= 15
        step = quantized.scale.repeat_interleave(group, dim=1)
        error = (quantized.dequantize() - weight).abs()
        # half a step, plus float32 rounding of the terms (q - 8) * scale and zero
        slack = 1e-6 * (weight.abs() + 8 * step)
        assert bool((error <= step / 2 + slack).all()), group
        assert torch.allclose(quantized.dequantize()[1, :32], torch.full((32,), 0.37))
        assert bool((quantized.dequantize()[2] == 0).all())


def test_int8_quantize_round_trip_within_half_a_step() -> None:
    weight = _test_weights(12, 160, seed=6)
    quantized = Int8Weight.quantize(weight).validate("w")
    assert quantized.q.dtype == torch.int8 and int(quantized.q.abs().max()) <= 127
    error = (quantized.dequantize() - weight).abs()
    assert bool((error <= quantized.scale[:, None] / 2 * (1 + 1e-6) + 1e-7 * weight.abs()).all())
    nonzero = weight.abs().amax(1) > 0
    assert bool((quantized.q.abs().amax(1)[nonzero] == 127).all())  # each row's largest uses the range
    assert bool((quantized.dequantize()[2] == 0).all())


def test_fp8_quantize_round_trip_within_e4m3_precision() -> None:
    weight = _test_weights(12, 160, seed=7)
    quantized = FP8Weight.quantize(weight).validate("w")
    assert quantized.q.dtype == torch.float8_e4m3fn and quantized.input_scale is None
    error = (quantized.dequantize() - weight).abs()
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals spaced 2^-9 (half: 2^-10)
    bound = weight.abs() * 2**-4 + quantized.scale[:, None] * 2**-10
    assert bool((error <= bound * (1 + 1e-6)).all())
    nonzero = weight.abs().amax(1) > 0
    assert bool((quantized.q.float().abs().amax(1)[nonzero] == 448).all())


def _int4(rows: int, seed: int, group: int = 32) -> Int4Weight:
    return Int4Weight.quantize(_test_weights(rows, 128, seed), group)


def _nvfp4(rows: int, seed: int) -> NVFP4Weight:
    packed, block_scale, global_scale = modelopt_nvfp4(_test_weights(rows, 64, seed))
    return NVFP4Weight(packed, block_scale, global_scale.reshape(1).expand(rows).clone(), torch.tensor(0.1))


def _fp8_per_tensor(rows: int, seed: int, input_scale: float | None, factor: float = 1.0) -> FP8Weight:
    q, scale = modelopt_fp8(_test_weights(rows, 64, seed) * factor)
    return FP8Weight(
        q, scale.reshape(1).expand(rows).clone(), None if input_scale is None else torch.tensor(input_scale)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda i: _int4(8 + 4 * i, seed=10 + i),
        lambda i: Int8Weight.quantize(_test_weights(8 + 4 * i, 64, 20 + i)),
        lambda i: _fp8_per_tensor(8 + 4 * i, seed=30 + i, input_scale=0.5 + i),
        lambda i: _nvfp4(8 + 4 * i, seed=40 + i),
    ],
    ids=["int4", "int8", "fp8", "nvfp4"],
)
def test_concat_rows_equals_concatenated_dequantized_shards(make) -> None:
    shards = [make(i) for i in range(3)]
    fused = concat_rows(shards)
    assert type(fused) is type(shards[0])
    assert fused.shape == (sum(s.shape[0] for s in shards), shards[0].shape[1])
    assert torch.equal(fused.dequantize(), torch.cat([s.dequantize() for s in shards]))


def test_fp8_shards_with_different_scales_fuse_exactly() -> None:
    # Per-tensor checkpoint scales that differ by orders of magnitude (q, k, v of one layer).
    shards = [
        _fp8_per_tensor(8, seed=50 + i, input_scale=s, factor=f)
        for i, (s, f) in enumerate(((0.2, 1.0), (0.7, 1e-3), (0.4, 30.0)))
    ]
    scales = {float(s.scale[0]) for s in shards}
    assert len(scales) == 3 and max(scales) / min(scales) > 1e3
    fused = concat_rows(shards)
    reference = torch.cat([decode_e4m3(s.q) * s.scale.double()[:, None] for s in shards])
    assert torch.equal(fused.dequantize().double(), reference.float().double())
    assert float(fused.input_scale) == pytest.approx(0.7)  # one activation: the largest static scale


def test_concat_rows_refuses_mixed_shards() -> None:
    with pytest.raises(QuantizationError, match="different formats"):
        concat_rows([_int4(8, 1), Int8Weight.quantize(_test_weights(8, 128, 2))])
    with pytest.raises(QuantizationError, match="group sizes"):
        concat_rows([_int4(8, 1, group=32), _int4(8, 2, group=64)])
    with pytest.raises(QuantizationError, match="input_scale"):
        concat_rows([_fp8_per_tensor(8, 1, 0.5), _fp8_per_tensor(8, 2, None)])


NAME = "model.layers.3.mlp.down_proj.weight"


@pytest.mark.parametrize(
    ("weight", "problem"),
    [
        (Int4Weight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2), torch.zeros(4, 2), 32), "uint8"),
        (Int4Weight(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2), torch.zeros(4, 2), 16), "group"),
        (
            Int4Weight(torch.zeros(4, 96, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 1), 64),
            "divide",
        ),
        (Int4Weight(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 2), 32), "scale"),
        (
            Int4Weight(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2).half(), torch.zeros(4, 2), 32),
            "float32",
        ),
        (Int8Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4)), "int8"),
        (Int8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(3)), r"scale has shape \(3,\)"),
        (Int8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4).half()), "float32"),
        (FP8Weight(torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(4)), "float8_e4m3fn"),
        (FP8Weight(torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(1)), r"weight_scale has shape"),
        (FP8Weight(torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.zeros(4)), "non-positive"),
        (FP8Weight(torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(4), torch.ones(2)), "input_scale"),
        (
            NVFP4Weight(
                torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, 2).to(torch.float8_e4m3fn), torch.ones(4)
            ),
            "uint8",
        ),
        (
            NVFP4Weight(
                torch.zeros(4, 12, dtype=torch.uint8), torch.ones(4, 1).to(torch.float8_e4m3fn), torch.ones(4)
            ),
            "24 inputs are not a multiple of the 16",
        ),
        (
            NVFP4Weight(
                torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1).to(torch.float8_e4m3fn), torch.ones(4)
            ),
            r"weight_scale has shape \(4, 1\), expected \(4, 2\)",
        ),
        (
            NVFP4Weight(torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 2), torch.ones(4)),
            "float8_e4m3fn",
        ),
        (
            NVFP4Weight(
                torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 2).to(torch.float8_e4m3fn), torch.ones(1)
            ),
            "weight_scale_2 has shape",
        ),
    ],
)
def test_validate_refuses_malformed_weights_naming_the_tensor(weight, problem: str) -> None:
    with pytest.raises(QuantizationError, match=problem) as info:
        weight.validate(NAME)
    message = str(info.value)
    assert message.startswith(f"{NAME}: ") and "\n" not in message


# ---------------------------------------------------------------------------------------------
# 2. GGUF Q4_0 / Q4_1 blocks


@pytest.mark.parametrize(
    ("kind", "decode"),
    [(gguf.GGMLQuantizationType.Q4_0, gguf_q4_0), (gguf.GGMLQuantizationType.Q4_1, gguf_q4_1)],
    ids=["Q4_0", "Q4_1"],
)
def test_gguf_int4_blocks_decode_bitwise(kind: gguf.GGMLQuantizationType, decode) -> None:
    n, k = 24, 256
    array = _test_weights(n, k, seed=60).numpy()
    raw = gguf.quants.quantize(array, kind)
    assert raw.dtype == np.uint8 and raw.shape == (n, k // 32 * (18 if kind.name == "Q4_0" else 20))
    weight = decode(raw, n, k).validate("blk.0.ffn_up.weight")
    assert weight.group_size == 32 and weight.q.dtype == torch.uint8
    reference = gguf.quants.dequantize(raw, kind)
    ours = weight.dequantize().numpy()
    reference = reference.reshape(n, k)
    assert ours.dtype == np.float32 and reference.dtype == np.float32
    # Bitwise, but for the sign of zero: Q4_0's d * 0 is -0.0 where d < 0, the int4 form's
    # (q - 8) * scale + 0.0 is +0.0 (equal values; no matmul can tell them apart).
    differ = ours.view(np.uint32) != reference.view(np.uint32)
    assert np.all((ours == 0) & (reference == 0) | ~differ)
    assert np.array_equal(ours, reference)


# ---------------------------------------------------------------------------------------------
# 3. Kernels


def _bias(n: int, dtype: torch.dtype) -> nn.Parameter:
    g = torch.Generator().manual_seed(n)
    return nn.Parameter((torch.randn(n, generator=g) * 0.1).to(dtype), requires_grad=False)


def _check_kernel(layer: nn.Module, dequantized: torch.Tensor, bias: nn.Parameter | None, dtype) -> None:
    g = torch.Generator().manual_seed(70)
    for rows in (1, 5, 33):
        x = torch.randn(rows, dequantized.shape[1], generator=g).to(dtype)
        with torch.inference_mode():
            out = layer(x)
        reference = F.linear(x.float(), dequantized, None if bias is None else bias.float())
        assert out.dtype == dtype and out.shape == reference.shape
        tolerance = KERNEL_FLOAT32_TOLERANCE if dtype == torch.float32 else KERNEL_BFLOAT16_TOLERANCE
        error = (out.float() - reference).abs().max().item()
        assert error <= tolerance * reference.abs().max().item(), (rows, error)


KERNEL_SHAPES = [(40, 256, 32, True), (100, 128, 64, False), (48, 256, 128, True), (64, 64, 32, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k", "group", "with_bias"), KERNEL_SHAPES)
def test_int4_cpu_kernel_matches_dequantized_matmul(
    n: int, k: int, group: int, with_bias: bool, dtype: torch.dtype
) -> None:
    weight = Int4Weight.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05, group)
    bias = _bias(n, dtype) if with_bias else None
    layer = Int4Linear(weight, bias, dtype, CPU)
    assert layer.native and layer.out_features == n  # 40 and 100 rows are padded to multiples of 16
    _check_kernel(layer, weight.dequantize(), bias, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k", "with_bias"), [(40, 256, True), (100, 128, False)])
def test_int8_cpu_kernel_matches_dequantized_matmul(n: int, k: int, with_bias: bool, dtype) -> None:
    weight = Int8Weight.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05)
    bias = _bias(n, dtype) if with_bias else None
    layer = Int8Linear(weight, bias, dtype, CPU)
    assert layer.native
    _check_kernel(layer, weight.dequantize(), bias, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_emulated_layers_are_the_dequantized_weight_in_the_activation_dtype(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp8 and nvfp4 on CPU, and int4/int8 where emulated (as on CUDA, forced here): F.linear with
    the dequantized weight cast to the activation dtype, bitwise."""
    base = torch.randn(48, 128, generator=torch.Generator().manual_seed(80)) * 0.05
    bias = _bias(48, dtype)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(81)).to(dtype)
    fp8 = FP8Weight.quantize(base)
    nvfp4 = NVFP4Weight(*modelopt_nvfp4(base)[:2], modelopt_nvfp4(base)[2].reshape(1).expand(48).clone())
    layers = [(FP8Linear(fp8, bias, dtype, CPU), fp8), (NVFP4Linear(nvfp4, bias, dtype, CPU), nvfp4)]
    monkeypatch.setattr(quant_linear, "precision_mode", lambda precision, device: "emulated")
    int4, int8 = Int4Weight.quantize(base, 32), Int8Weight.quantize(base)
    layers += [(Int4Linear(int4, bias, dtype, CPU), int4), (Int8Linear(int8, bias, dtype, CPU), int8)]
    for layer, weight in layers:
        assert not layer.native, layer
        with torch.inference_mode():
            assert torch.equal(layer(x), F.linear(x, weight.dequantize().to(dtype), bias)), layer


# ---------------------------------------------------------------------------------------------
# 4./5. ModelOpt checkpoints written here

_SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)
_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_hf_model(config_class=transformers.LlamaConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """Every parameter random (norms around 1, biases non-zero) and bfloat16-representable."""
    config = config_class(**copy.deepcopy(_SMALL))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g)
            value = 1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise
            param.copy_(value.to(torch.bfloat16).float())
    return model.eval()


def _is_decoder_linear(name: str) -> bool:
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and name.split(".")[-2] in _DECODER_LINEARS
    )


def write_modelopt_checkpoint(
    hf_model: transformers.PreTrainedModel,
    directory: Path,
    algo: str,
    *,
    in_config_json: bool = False,
) -> None:
    """Quantize every decoder linear of `hf_model` with ModelOpt's formulas, write the checkpoint as
    ModelOpt exports it, and set the model's weights to the dequantized ones (the float reference)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(90)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if not _is_decoder_linear(name):
                tensors[name] = param.detach().to(torch.bfloat16).contiguous()
                continue
            prefix = name.removesuffix(".weight")
            weight = param.detach().float()
            input_scale = (torch.rand((), generator=g) * 0.05 + 0.01).float()
            if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
                q, scale = modelopt_fp8(weight, per_channel=algo != "FP8")
                tensors[name], tensors[f"{prefix}.weight_scale"] = q, scale
                if algo == "FP8":
                    tensors[f"{prefix}.input_scale"] = input_scale
                dequantized = decode_e4m3(q) * scale.double()
            else:
                packed, block_scale, global_scale = modelopt_nvfp4(weight)
                tensors[name], tensors[f"{prefix}.weight_scale"] = packed, block_scale
                tensors[f"{prefix}.weight_scale_2"] = global_scale
                tensors[f"{prefix}.input_scale"] = input_scale
                dequantized = nvfp4_reference(packed, block_scale, global_scale)
            if name.endswith(("k_proj.weight", "v_proj.weight")):  # static KV scales, unused
                tensors[f"{prefix}.{name.split('.')[-2][0]}_scale"] = torch.tensor(1.0)
            param.copy_(dequantized.float())
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(hf_model.config.to_json_string())
    config["torch_dtype"] = "bfloat16"
    quantization = {
        "quant_algo": algo,
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"],
        **({"group_size": 16} if algo == "NVFP4" else {}),
    }
    if in_config_json:
        config["quantization_config"] = {"quant_method": "modelopt", **quantization}
    else:
        (directory / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quantization})
        )
    (directory / "config.json").write_text(json.dumps(config))


def _prompt(length: int = 20, vocab_size: int = 256, seed: int = 1234) -> torch.Tensor:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def _our_logits(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, torch.arange(input_ids.shape[0]), CausalAttention()))


def _hf_logits(model: transformers.PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids[None]).logits[0].float()


# variant -> (transformers config class, quant_algo, declared in config.json, layer class)
MODELOPT_CASES = {
    "fp8": (transformers.LlamaConfig, "FP8", False, FP8Linear),
    "fp8-per-channel-qwen2": (transformers.Qwen2Config, "FP8_PER_CHANNEL_PER_TOKEN", False, FP8Linear),
    "nvfp4": (transformers.LlamaConfig, "NVFP4", False, NVFP4Linear),
    "nvfp4-config-json": (transformers.LlamaConfig, "NVFP4", True, NVFP4Linear),
}


@pytest.mark.parametrize("case", list(MODELOPT_CASES))
def test_modelopt_checkpoint_matches_transformers_on_dequantized_weights(case: str, tmp_path: Path) -> None:
    config_class, algo, in_config_json, layer_class = MODELOPT_CASES[case]
    hf_model = _tiny_hf_model(config_class, seed=len(case))
    write_modelopt_checkpoint(hf_model, tmp_path, algo, in_config_json=in_config_json)
    precision = "nvfp4" if algo == "NVFP4" else "fp8"
    input_ids = _prompt()
    reference = _hf_logits(hf_model, input_ids)

    config, weights = load_hf_dir(tmp_path, precision)
    model = build_model(config, weights, torch.float32, "cpu")
    layer = model.model.layers[1]
    for linear in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert type(linear) is layer_class and not linear.native
    assert type(model.lm_head) is nn.Linear  # excluded from quantization: bf16 in the checkpoint
    if config.attention_bias:
        assert layer.self_attn.qkv_proj.bias is not None and not layer.self_attn.qkv_proj.bias.is_meta
    if algo == "FP8":  # q, k, v fused with the largest of their static input scales
        shards = [
            load_file(tmp_path / "model.safetensors")[f"model.layers.1.self_attn.{p}_proj.input_scale"]
            for p in "qkv"
        ]
        assert float(layer.self_attn.qkv_proj.input_scale) == max(float(s) for s in shards)

    ours = _our_logits(model, input_ids)
    max_diff = (ours - reference).abs().max().item()
    print(f"{case} fp32: max |logit diff| = {max_diff:.3g} (max |logit| {reference.abs().max().item():.3g})")
    assert max_diff <= FLOAT32_LOGITS_TOLERANCE
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))

    if not in_config_json and config_class is transformers.LlamaConfig:
        config, weights = load_hf_dir(tmp_path, precision)
        model = build_model(config, weights, torch.bfloat16, "cpu")
        bf16 = _our_logits(model, input_ids)
        bf16_diff = (bf16 - reference).abs().max().item()
        print(f"{case} bf16: max |logit diff| vs float32 = {bf16_diff:.3g}")
        assert bf16_diff <= BFLOAT16_LOGITS_TOLERANCE


@pytest.fixture(scope="module")
def modelopt_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Valid FP8 and NVFP4 checkpoints and an unquantized one, for the refusals to break."""
    root = tmp_path_factory.mktemp("modelopt")
    dirs = {"fp8": root / "fp8", "nvfp4": root / "nvfp4", "plain": root / "plain"}
    write_modelopt_checkpoint(_tiny_hf_model(seed=3), dirs["fp8"], "FP8")
    write_modelopt_checkpoint(_tiny_hf_model(seed=4), dirs["nvfp4"], "NVFP4")
    _tiny_hf_model(seed=5).save_pretrained(dirs["plain"])
    return dirs


def _copy_with(source: Path, target: Path, edit) -> Path:
    """A copy of a checkpoint directory with its tensors edited by `edit(dict)`."""
    target.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (target / file.name).write_bytes(file.read_bytes())
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _refusal(call, match: str) -> str:
    with pytest.raises(QuantizationError, match=match) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    return message


def _load_all(path: Path, precision: str) -> None:
    config, weights = load_hf_dir(path, precision)
    build_model(config, weights, torch.float32, "cpu")


LAYER = "model.layers.0.self_attn.k_proj"


def _set_quant(directory: Path, algo: str) -> None:
    settings = json.loads((directory / "hf_quant_config.json").read_text())
    settings["quantization"]["quant_algo"] = algo
    (directory / "hf_quant_config.json").write_text(json.dumps(settings))


def test_unsupported_quant_algo_is_refused(modelopt_dirs: dict[str, Path], tmp_path: Path) -> None:
    awq = _copy_with(modelopt_dirs["fp8"], tmp_path / "awq", lambda t: None)
    _set_quant(awq, "W4A16_AWQ")
    message = _refusal(lambda: load_hf_dir(awq, "fp8"), "'W4A16_AWQ' is not supported")
    assert "FP8" in message and "NVFP4" in message  # says what is


def test_non_modelopt_quant_method_is_refused(modelopt_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy_with(modelopt_dirs["plain"], tmp_path / "awq", lambda t: None)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (directory / "config.json").write_text(json.dumps(config))
    message = _refusal(
        lambda: load_hf_dir(directory, "int4_wo"), "quantization method 'awq' is not supported"
    )
    assert "config.json" in message


def test_fp8_weight_stored_as_bf16_is_refused(modelopt_dirs: dict[str, Path], tmp_path: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{LAYER}.weight"] = tensors[f"{LAYER}.weight"].float().to(torch.bfloat16)

    directory = _copy_with(modelopt_dirs["fp8"], tmp_path / "bf16", edit)
    message = _refusal(lambda: _load_all(directory, "fp8"), "must be float8_e4m3fn, got torch.bfloat16")
    assert message.startswith(f"{LAYER}.weight:")


@pytest.mark.parametrize(("source", "shape"), [("fp8", (3,)), ("fp8", (32, 2)), ("nvfp4", (32, 3))])
def test_weight_scale_of_the_wrong_shape_is_refused(
    modelopt_dirs: dict[str, Path], tmp_path: Path, source: str, shape: tuple[int, ...]
) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        old = tensors[f"{LAYER}.weight_scale"]
        tensors[f"{LAYER}.weight_scale"] = torch.ones(shape).to(old.dtype)

    directory = _copy_with(modelopt_dirs[source], tmp_path / "scale", edit)
    message = _refusal(lambda: _load_all(directory, source), "weight_scale")
    assert LAYER in message and str(shape).replace(" ", "") in message.replace(" ", "")


def test_nvfp4_without_weight_scale_2_is_refused(modelopt_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy_with(
        modelopt_dirs["nvfp4"], tmp_path / "nos2", lambda t: t.pop(f"{LAYER}.weight_scale_2")
    )
    message = _refusal(lambda: _load_all(directory, "nvfp4"), "weight_scale_2")
    assert message.startswith(f"{LAYER}.weight:")


def test_fused_shards_that_disagree_are_refused_naming_the_layer(
    modelopt_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """k_proj without the input_scale its q_proj and v_proj have: q, k and v fuse into one layer
    with one activation scale, so the checkpoint is refused, saying which layer."""
    directory = _copy_with(modelopt_dirs["fp8"], tmp_path / "nok", lambda t: t.pop(f"{LAYER}.input_scale"))
    message = _refusal(lambda: _load_all(directory, "fp8"), "input_scale")
    assert "model.layers.0.self_attn" in message


def test_modelopt_checkpoint_serves_only_its_precision(modelopt_dirs: dict[str, Path]) -> None:
    for precision in ("bf16", "fp32", "int4_wo", "nvfp4"):
        message = _refusal(lambda p=precision: load_hf_dir(modelopt_dirs["fp8"], p), f"not {precision}")
        assert "FP8" in message and "fp8" in message
    _refusal(lambda: load_hf_dir(modelopt_dirs["nvfp4"], "fp8"), "serves as nvfp4, not fp8")


def test_nvfp4_is_not_quantized_at_load(modelopt_dirs: dict[str, Path], int4_ggufs: dict[str, Path]) -> None:
    _refusal(lambda: load_gguf(int4_ggufs["Q4_1"], "nvfp4"), "nvfp4 .*not GGUF")
    message = _refusal(lambda: _load_all(modelopt_dirs["plain"], "nvfp4"), "ModelOpt NVFP4 checkpoints")
    assert message.startswith("model.layers.")


# ---------------------------------------------------------------------------------------------
# 6. GGUF with Q4_1 layers: int4 directly from the file

_GGUF_DECODER_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_int4_gguf(
    hf_model: transformers.PreTrainedModel, path: Path, kind: gguf.GGMLQuantizationType
) -> None:
    """The model in llama.cpp's llama layout, decoder linears as `kind` (Q4_0/Q4_1) blocks, the
    rest F32."""

    def quantized(gguf_name: str) -> gguf.GGMLQuantizationType | None:
        is_linear = gguf_name.startswith("blk.") and gguf_name.split(".")[2] in _GGUF_DECODER_LINEARS
        return kind if is_linear and gguf_name.endswith(".weight") else None

    _write_gguf(hf_model, "llama", path, quantized)


INT4_KINDS = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}


@pytest.fixture(scope="module")
def int4_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    paths = {name: root / f"tiny-{name.lower()}.gguf" for name in INT4_KINDS}
    for name, path in paths.items():
        write_int4_gguf(_tiny_hf_model(seed=7), path, INT4_KINDS[name])
    return paths


@pytest.mark.parametrize("kind", list(INT4_KINDS))
def test_gguf_int4_served_directly_matches_the_file_dequantized(
    int4_ggufs: dict[str, Path], kind: str
) -> None:
    config, weights = load_gguf(int4_ggufs[kind], "int4_wo")
    int4 = build_model(config, weights, torch.float32, "cpu")
    config, weights = load_gguf(int4_ggufs[kind], "fp32")
    reference = build_model(config, weights, torch.float32, "cpu")

    for layer in int4.model.layers:
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            assert type(linear) is Int4Linear and linear.native and linear.group_size == 32
    # The logits layer stays in the activation dtype under every precision.
    assert type(int4.lm_head) is nn.Linear and type(int4.model.embed_tokens) is nn.Embedding

    input_ids = _prompt()
    ours, expected = _our_logits(int4, input_ids), _our_logits(reference, input_ids)
    max_diff = (ours - expected).abs().max().item()
    largest = expected.abs().max().item()
    print(f"gguf {kind} int4_wo: max |logit diff| = {max_diff:.3g} (max |logit| {largest:.3g})")
    assert max_diff <= FLOAT32_LOGITS_TOLERANCE
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("kind", list(INT4_KINDS))
def test_gguf_int4_weights_are_read_exactly(int4_ggufs: dict[str, Path], kind: str) -> None:
    """The int4 weights the loader yields (q/k rows un-permuted) are the file's blocks, exactly."""
    _, int4_weights = load_gguf(int4_ggufs[kind], "int4_wo")
    _, float_weights = load_gguf(int4_ggufs[kind], "fp32")
    floats = dict(float_weights)
    seen = 0
    for name, weight in int4_weights:
        if isinstance(weight, Int4Weight):
            assert torch.equal(weight.dequantize(), floats[name]), name
            seen += 1
    assert seen == 2 * len(_DECODER_LINEARS)


def _int4_per_group(weight: torch.Tensor, group: int) -> torch.Tensor:
    """Asymmetric min/max int4 per group of inputs, round to nearest, dequantized:
    step = (max - min) / 15, q = round((w - min) / step), w' = q * step + min."""
    n, k = weight.shape
    groups = weight.reshape(n, k // group, group)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    return (((groups - low) / step).round().clamp(0, 15) * step + low).reshape(n, k)


def _fp8_per_row(weight: torch.Tensor) -> torch.Tensor:
    q, scale = modelopt_fp8(weight, per_channel=True)
    return (decode_e4m3(q) * scale.double()).float()


# precision -> (tied embeddings, layer class, per-layer reference quantizer)
AT_LOAD_CASES = {
    # case: (precision, transformers config class, tied embeddings, layer class, reference quantizer)
    "int8_wo": ("int8_wo", transformers.LlamaConfig, False, Int8Linear, int8_per_row),
    # groups of 128 inputs where K allows, else 64; the tied table stays float
    "int4_wo-tied": ("int4_wo", transformers.LlamaConfig, True, Int4Linear, None),
    "fp8": ("fp8", transformers.LlamaConfig, False, FP8Linear, _fp8_per_row),
    # q/k/v biases given after their quantized weights (see below)
    "int4_wo-qwen2-biases-last": ("int4_wo", transformers.Qwen2Config, False, Int4Linear, None),
}


@pytest.mark.parametrize("case", list(AT_LOAD_CASES))
def test_float_checkpoint_quantized_at_load_matches_reference(case: str, tmp_path: Path) -> None:
    precision, config_class, tied, layer_class, quantizer = AT_LOAD_CASES[case]
    hf_model = _tiny_hf_model(config_class, seed=21)
    if tied:
        hf_model.config.tie_word_embeddings = True
        hf_model.lm_head.weight = hf_model.model.embed_tokens.weight
    hf_model.save_pretrained(tmp_path)
    config, weights = load_hf_dir(tmp_path, precision)
    if config.attention_bias:
        # A bias after its quantized layer replaced the nn.Linear: it must land on the new layer.
        listed = list(weights)
        weights = iter([w for w in listed if "bias" not in w[0]] + [w for w in listed if "bias" in w[0]])
    model = build_model(config, weights, torch.float32, "cpu")

    with torch.no_grad():  # the reference: each layer's weight quantized by the formula
        for name, param in hf_model.named_parameters():
            if _is_decoder_linear(name):
                group = 128 if param.shape[1] % 128 == 0 else 64
                param.copy_(quantizer(param) if quantizer else _int4_per_group(param, group))
    layer = model.model.layers[0]
    assert type(layer.mlp.down_proj) is layer_class and type(layer.self_attn.qkv_proj) is layer_class
    if precision == "int4_wo":
        assert (layer.self_attn.qkv_proj.group_size, layer.mlp.down_proj.group_size) == (64, 128)
    # The logits layer (the embedding table when tied) stays in the activation dtype.
    assert type(model.model.embed_tokens) is nn.Embedding
    assert model.lm_head is None if tied else type(model.lm_head) is nn.Linear
    if config.attention_bias:
        assert layer.self_attn.qkv_proj.bias is not None and not layer.self_attn.qkv_proj.bias.is_meta

    input_ids = _prompt()
    ours, reference = _our_logits(model, input_ids), _hf_logits(hf_model, input_ids)
    max_diff = (ours - reference).abs().max().item()
    print(f"quantized at load {case}: max |logit diff| = {max_diff:.3g}")
    assert max_diff <= FLOAT32_LOGITS_TOLERANCE


# ---------------------------------------------------------------------------------------------
# 7. Serving over HTTP with the official openai client

CAPITAL = [{"role": "user", "content": "Name the capital of France."}]


def _expected_mode(precision: str) -> str:
    """The table the engine documents: on CPU, int4/int8 run on aten's packed kernels and fp8/nvfp4
    are emulated; on CUDA only fp8 from compute capability 8.9 is native."""
    if not torch.cuda.is_available():
        return "native" if precision in ("int4_wo", "int8_wo") else "emulated"
    native_fp8 = torch.cuda.get_device_capability() >= (8, 9)
    return "native" if precision == "fp8" and native_fp8 else "emulated"


@contextlib.contextmanager
def serving(log: Path, env: dict[str, str]) -> Iterator[ServerProcess]:
    """A server started with `env`, ready; stopped cleanly (exit 0) afterwards."""
    server = start_server(log, env=env)
    try:
        wait_ready(server)
        yield server
    finally:
        assert server.stop() == 0, server.log()


@pytest.fixture(
    scope="module",
    params=["int4_wo", "int8_wo", "fp8"],
)
def profile_server(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerProcess]]:
    precision = request.param
    profile = f"torch-generic-{precision}-tp1-pp1-throughput"
    log = tmp_path_factory.mktemp(precision) / "server.log"
    with serving(log, {"NIM_MODEL_PROFILE": profile}) as server:
        yield precision, server


def test_embedded_model_serves_quantized_profiles(profile_server: tuple[str, ServerProcess]) -> None:
    precision, server = profile_server
    meta = httpx.get(f"{server.base_url}/v1/metadata", timeout=10).json()
    profile = meta["selectedProfile"]
    assert profile["name"] == f"torch-generic-{precision}-tp1-pp1-throughput"
    assert profile["tags"]["precision"] == precision
    assert profile["runtime"]["weight_precision"] == precision
    assert profile["runtime"]["precision_mode"] == _expected_mode(precision)

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=EMBEDDED_NAME, messages=CAPITAL, temperature=0, max_tokens=8)
    content = out.choices[0].message.content
    print(f"{precision}: {content!r}")
    assert "Paris" in content
    assert 1 <= out.usage.completion_tokens <= 8


def _byte_level_tokenizer(directory: Path) -> None:
    """A 256-token byte-level BPE (one token per byte, no merges): every text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))


def test_modelopt_nvfp4_directory_serves_completions(tmp_path: Path) -> None:
    directory = tmp_path / "tiny-nvfp4"
    write_modelopt_checkpoint(_tiny_hf_model(seed=11), directory, "NVFP4")
    _byte_level_tokenizer(directory)
    with serving(tmp_path / "server.log", {"NIM_MODEL_NAME": str(directory)}) as server:
        meta = httpx.get(f"{server.base_url}/v1/metadata", timeout=10).json()
        runtime = meta["selectedProfile"]["runtime"]
        assert meta["selectedProfile"]["name"] == "torch-generic-nvfp4-tp1-pp1-throughput"
        assert (runtime["weight_precision"], runtime["precision_mode"]) == ("nvfp4", "emulated")
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        [model] = client.models.list().data
        assert model.id == "tiny-nvfp4"
        out = client.completions.create(
            model=model.id,
            prompt="Once upon a time",
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage.prompt_tokens == len("Once upon a time")  # one token per byte
        assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
        assert isinstance(out.choices[0].text, str)


def test_a_tensor_in_two_shards_is_refused(modelopt_dirs: dict[str, Path], tmp_path: Path) -> None:
    sharded = _copy_with(modelopt_dirs["fp8"], tmp_path / "sharded", lambda t: None)
    tensors = load_file(sharded / "model.safetensors")
    name = f"{LAYER}.weight_scale"
    save_file({name: tensors[name]}, str(sharded / "model-extra.safetensors"), metadata={"format": "pt"})
    _refusal(lambda: _load_all(sharded, "fp8"), "appears in more than one shard")


def test_an_unsupported_checkpoint_is_one_line_at_selection(
    modelopt_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """list-model-profiles and serve see a ProfileError (one line), not a traceback."""
    from service.config_loading import load_settings
    from service.selection.manifests import ProfileError
    from service.selection.planning import manifest_for

    awq = _copy_with(modelopt_dirs["plain"], tmp_path / "awq", lambda t: None)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ProfileError, match="quantization method 'awq' is not supported"):
        manifest_for(load_settings(model_name=str(awq)))
    manifest = manifest_for(load_settings(model_name=str(modelopt_dirs["nvfp4"])))
    assert {p.precision for p in manifest.profiles} == {"nvfp4"}
