"""The Q8 CPU kernel (q8.cpp): int8 weights with one float16 scale per block of 32 inputs (llama.cpp's
Q8_0), times activations rounded to int8 per block of 32 (quantize.h, as the W4A8 kernel rounds
them), summed in integers. The logits projection under float32 activations (`Q8Linear`;
rank_loading's `_logits_path`, NIM_COMPACT_LOGITS=auto).

Why: with float32 activations (CPUs without bf16 instructions: AVX2 hosts, AVX-512 before Cooper
Lake) the head was float16 through fbgemm: 2 bytes a weight, the embedded model's 49152 x 576 head
56.6 MB a token, 3.4 ms of a 13.6 ms decode step at one stream on an AVX2 host. Here it is 1.06
bytes a weight (30 MB, what llama.cpp's Q8_0 head reads), and the integer sums take fewer
instructions a weight than float16's convert-and-multiply.

What rounds: each weight to int8 steps of its block's largest magnitude / 127 (the scale itself
rounded to float16 first, so the stored scale is the one quantized with), each input to int8 steps
of its own block's. bench/README.md "A Q8 logits head under float32 activations" states what that
moves greedy tokens and logprobs by against the float head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from service.engine.native import extension
from service.engine.native.quantize import BLOCK, rounded_activations
from service.model.quantization import QuantizationError

extension.define(
    {"q8_linear": "q8_linear(Tensor x, Tensor packed, Tensor scales, int out_features, int isa=-1) -> Tensor"}
)
TILE = 16  # output rows per tile of the packed layout
# Weights are scaled per BLOCK inputs too, so a weight block meets one activation block.
ISAS = {"portable": 0, "avx2": 1, "avx512_vnni": 2}
_HALF_MAX = float(torch.finfo(torch.float16).max)
_QUANTIZE_ROWS = 4096  # rows quantized at a time


def problem() -> str | None:
    """None once the kernel is loaded (the native CPU ops extension built), else why it cannot be."""
    return extension.problem()


def isa() -> str:
    """The instructions the loaded kernel runs here (extension.isa)."""
    return extension.isa()


def serving_problem(in_features: int) -> str | None:
    """Why a logits projection of `in_features` inputs would not be served on this kernel here (it
    cannot be built or loaded; only its portable C++ path is available, which is for tests, not
    speed; the shape; its start-up `check`), or None."""
    why = problem()
    if why is None and extension.isa() == "portable":
        why = "this CPU (or ATEN_CPU_CAPABILITY) offers the Q8 kernel neither AVX2 nor AVX-512 VNNI"
    return why or shape_problem(in_features) or check()


def shape_problem(in_features: int) -> str | None:
    """Why a layer of `in_features` inputs cannot run on the kernel, or None."""
    if in_features < 1 or in_features % BLOCK:
        return f"its {in_features} inputs are not whole blocks of {BLOCK}"
    return None


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """float [N, K] -> (int8 [N, K], float16 [N, K / 32]): each block of 32 weights of a row to
    int8 steps of its largest magnitude / 127, that scale rounded to float16 before it divides (an
    all-zero block, or one below float16's smallest step, takes scale 0 and zeros). Row chunks at a
    time: a vocabulary's float32 temporaries stay small. QuantizationError where a block's scale is
    not finite in float16 (a weight beyond 127 x 65504, or not finite)."""
    n, k = weight.shape
    if shape_problem(k) is not None:
        raise QuantizationError(f"Q8 weights need K ({k}) in whole blocks of {BLOCK}")
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, k // BLOCK, dtype=torch.float16)
    for start in range(0, n, _QUANTIZE_ROWS):
        blocks = weight[start : start + _QUANTIZE_ROWS].detach().float().reshape(-1, k // BLOCK, BLOCK)
        largest = blocks.abs().amax(-1)
        if not bool(torch.isfinite(largest).all()) or float(largest.max()) / 127.0 > _HALF_MAX:
            raise QuantizationError("Q8 weights: a block's scale is not finite in float16")
        rows = slice(start, start + blocks.shape[0])
        scale[rows] = (largest / 127.0).half()
        divisor = scale[rows].float().unsqueeze(-1)
        steps = torch.where(divisor > 0, blocks / divisor.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        q[rows] = steps.round_().clamp_(-127, 127).to(torch.int8).reshape(-1, k)
    return q, scale


def pack(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize`'s (q, scale) in the kernel's layout (q8.cpp): (int8 [N / 16, K / 32, 512],
    float16 [N / 16, K / 32, 16]), N padded to whole tiles with zero rows of scale 0."""
    n, k = q.shape
    tiles = -(-n // TILE)
    pad = tiles * TILE - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
    # [tile, row, block, part, j] -> [tile, block, part, row, j]
    packed = q.view(tiles, TILE, k // BLOCK, BLOCK // 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    scales = scale.view(tiles, TILE, k // BLOCK).permute(0, 2, 1).contiguous()
    return packed.view(tiles, k // BLOCK, TILE * BLOCK), scales


def dequantize(packed: Tensor, scales: Tensor, out_features: int) -> Tensor:
    """The weight `pack` holds, float32 [out_features, K]."""
    tiles, blocks, _ = packed.shape
    parts = packed.view(tiles, blocks, BLOCK // 4, TILE, 4)  # [tile, block, part, row, j]
    q = parts.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, blocks, BLOCK)
    scale = scales.permute(0, 2, 1).reshape(tiles * TILE, blocks, 1)
    return (q.float() * scale.float()).view(tiles * TILE, blocks * BLOCK)[:out_features]


def linear(x: Tensor, packed: Tensor, scales: Tensor, out_features: int, isa: int = -1) -> Tensor:
    """x [M, K] (float32 or bf16) @ W.T -> float32 [M, out_features] (`isa`: -1 the host's best)."""
    out: Tensor = torch.ops.nim_cpu.q8_linear(x, packed, scales, out_features, isa)
    return out


def reference(x: Tensor, packed: Tensor, scales: Tensor, out_features: int) -> Tensor:
    """What the kernel computes, in float64: the inputs as the kernel rounds them
    (`quantize.rounded_activations`) times the dequantized weight."""
    return rounded_activations(x) @ dequantize(packed, scales, out_features).double().t()


class Q8Linear(nn.Module):
    """y = x @ W.T in float32 for W held as Q8 blocks (no bias: the logits projections it holds
    have none); x float32 or bf16, [..., K]."""

    packed: Tensor
    scales: Tensor

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        why = problem()  # loads the extension: the op runs only once it is
        if why is not None:
            raise RuntimeError(f"the Q8 logits head needs the native CPU ops: {why}")
        self.out_features, self.in_features = weight.shape
        packed, scales = pack(*quantize(weight))
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        out = linear(rows, self.packed, self.scales, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q8 blocks of {BLOCK}"


# The start-up check: a layer of these shapes (a partial tile; more tiles than one thread takes,
# q8.cpp's kBytesPerThread), inputs of every sign and scale.
_CHECK_SHAPE = (200, 256)
_CHECK_ROWS = 40
_CHECK_PROBED = (1, 2, 3, 4, 5, 7, 8, 9, 17, 33)
_CHECK_TOLERANCE = 1e-5  # relative to an output's sum of absolute products: float32 rounding


def check() -> str | None:
    """None where the loaded kernel computes `reference` (to float32 rounding) for float32 and
    bf16 inputs, on every instruction set this host has alike to the bit, weights at int8's
    extremes included, and every row alike at any batch size and place; else what it got wrong."""
    generator = torch.Generator().manual_seed(0)
    n, k = _CHECK_SHAPE
    weight = torch.randn(n, k, generator=generator) * torch.logspace(-4, 1, n)[:, None]
    weight[0, :BLOCK] = 0.0  # an all-zero block
    packed, scales = pack(*quantize(weight))
    packed[1, 0] = -128  # beyond quantize's range: the kernel must still sum it exactly
    packed[2, 1] = 127
    x = torch.randn(_CHECK_ROWS, k, generator=generator) * torch.logspace(-3, 3, _CHECK_ROWS)[:, None]
    x[0] = 0
    x[1] = 1e3  # every input at +127
    x[2] = -1e3
    here = extension.isa()
    available = [code for name, code in ISAS.items() if code <= ISAS[here]]
    for dtype in (torch.float32, torch.bfloat16):
        inputs = x.to(dtype)
        with torch.inference_mode():
            out = linear(inputs, packed, scales, n)
            expected = reference(inputs, packed, scales, n)
            # Each output against its own sum of absolute products (float32 rounding of that sum).
            magnitude = reference(inputs.abs(), packed.to(torch.int16).abs(), scales.abs(), n).clamp_min(
                1e-30
            )
            error = ((out.double() - expected).abs() / magnitude).max()
            if not error <= _CHECK_TOLERANCE:
                return f"the Q8 kernel is {float(error):.2g} off its float64 reference ({dtype})"
            for code in available:
                if not torch.equal(linear(inputs, packed, scales, n, code), out):
                    return f"the Q8 kernel's {here} and instruction set {code} disagree ({dtype})"
            for rows in _CHECK_PROBED:
                for offset in (0, 1, _CHECK_ROWS - rows):
                    part = linear(inputs[offset : offset + rows], packed, scales, n)
                    if not torch.equal(part, out[offset : offset + rows]):
                        return f"the Q8 kernel computes a row differently at batch {rows} ({dtype})"
    return None
