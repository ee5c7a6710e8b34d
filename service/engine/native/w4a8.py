"""The W4A8 CPU kernel (w4a8.cpp): int4 weights times int8-quantized activations, summed in integers.

aten's CPU int4 kernel widens every weight to bf16 and multiplies in floating point: 12-18 GB/s
of int4 at decode shapes on a 2-core AVX-512 host, so a small model's decode step is bound by that
arithmetic, not by reading its weights. llama.cpp's Q4_1 x Q8_1 instead quantizes each block of 32
activations to int8 and sums nibble-times-int8 products in integer dot-product instructions
(VNNI's vpdpbusd, AVX2's vpmaddubsw). w4a8.cpp does the same over this project's Int4Weight
(any group size that is a multiple of 32), with the zero term taken from the exact float sum of
the activations; docs/engine.md states what the activations' rounding costs.

The kernel is part of the native CPU ops extension (extension.py: built on first use, cached
under TORCH_EXTENSIONS_DIR). Where it cannot be built or loaded, `problem()` says why and the int4
layers keep aten's kernel.

Which instructions it uses follows torch's own CPU capability (so ATEN_CPU_CAPABILITY=avx2 makes
an AVX-512 host run the AVX2 path, as it does aten's kernels) and the CPU's flags: AVX-512 VNNI,
else AVX2, else portable C++. All three compute every output with the same integer sums and the
same float operations in the same order, so they agree bitwise (tests/test_w4a8.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from service.engine.native import extension
from service.engine.native.quantize import BLOCK, rounded_activations

# The ops' schemas (w4a8.cpp registers their CPU implementations and w4a8_isa).
extension.define(
    {
        "w4a8_linear": "w4a8_linear(Tensor x, Tensor packed, Tensor scales, int group, int out_features, "
        "int isa=-1) -> Tensor",
        "w4a8_moe": "w4a8_moe(Tensor x, Tensor expert_ids, Tensor weights, Tensor gate_up, "
        "Tensor gate_up_scales, Tensor down, Tensor down_scales, int gate_up_group, int down_group, "
        "int intermediate) -> Tensor",
    }
)
TILE = 16  # output rows per tile of the packed layout


def problem() -> str | None:
    """None once the kernel is loaded (the native CPU ops extension built), else why it cannot be."""
    return extension.problem()


def isa() -> str:
    """The instructions the loaded kernel runs here (extension.isa)."""
    return extension.isa()


def serving_problem() -> str | None:
    """Why the engine would not serve int4 layers on this kernel here (`problem`, or only its
    portable C++ path available: that path is for tests, not speed), or None."""
    problem_here = problem()
    if problem_here is None and isa() == "portable":
        return "this CPU (or ATEN_CPU_CAPABILITY) offers the W4A8 kernel neither AVX2 nor AVX-512 VNNI"
    return problem_here


def pack(q: Tensor, scale: Tensor, zero: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Int4Weight's fields (q uint8 [N, K] in 0..15, scale and zero float32 [N, K / group]) in the
    kernel's layout (w4a8.cpp): (uint8 [N / 16, K / 32, 256], float16 [N / 16, K / group, 2, 16]:
    each group's scale and zero - 8 * scale), N padded to whole tiles with rows whose every term is
    zero. `scales_problem` says whether float16 holds the scales."""
    n, k = q.shape
    if k % BLOCK or group % BLOCK or k % group:
        raise ValueError(f"W4A8 needs K ({k}) and the group size ({group}) in whole blocks of {BLOCK}")
    tiles = -(-n // TILE)
    pad = tiles * TILE - n
    if pad:
        q = torch.cat([q, q.new_full((pad, k), 8)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
    # [tile, row, block, part, half, j] -> [tile, block, part, row, j, half]
    parts = q.view(tiles, TILE, k // BLOCK, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    packed = (parts[..., 0] | (parts[..., 1] << 4)).contiguous().view(tiles, k // BLOCK, 8 * BLOCK)
    mins = zero - 8.0 * scale
    sm = torch.stack([scale, mins]).view(2, tiles, TILE, k // group).permute(1, 3, 0, 2).contiguous()
    return packed, sm.half()


def scales_problem(scale: Tensor, zero: Tensor) -> str | None:
    """None where float16 holds a weight's scales and mins (zero - 8 * scale) to 2**-10 of its
    groups' ranges (16 steps), else why not. A group's allowance is 2**-10 of its own range (of
    its min, where that is larger), and never less than 2**-20 of its row's largest range or
    min: a constant group's scale (quantization clamps it to ~1e-38) may round to 0."""
    scale, mins = scale.float(), (zero - 8.0 * scale).float()
    ranges = 16 * scale.abs()
    floor = 2.0**-10 * torch.maximum(ranges, mins.abs()).amax(dim=-1, keepdim=True)
    allowed = 2.0**-10 * torch.maximum(ranges, floor)
    scale_error = 16 * (scale.half().float() - scale).abs()  # what it moves a group's top weight by
    min_error = (mins.half().float() - mins).abs()
    if not (
        (scale_error <= allowed).all() and (min_error <= torch.maximum(allowed, 2.0**-10 * mins.abs())).all()
    ):
        smallest, largest = float(scale.abs().min()), float(scale.abs().max())
        return f"its scales (from {smallest:.3g} to {largest:.3g}) are beyond float16"
    return None


def dequantize(packed: Tensor, sm: Tensor, out_features: int, group: int) -> Tensor:
    """The weight `pack` holds, float32 [out_features, K]: (q - 8) * scale + zero, as the kernel
    multiplies it (scale * q + (zero - 8 * scale))."""
    tiles, blocks, _ = packed.shape
    k = blocks * BLOCK
    parts = packed.view(tiles, blocks, 4, TILE, 4)  # [tile, block, part, row, j]
    q = torch.stack([parts & 0x0F, parts >> 4], dim=-2)  # [tile, block, part, row, half, j]
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(tiles * TILE, k).float()
    scale, mins = (sm[:, :, i].permute(0, 2, 1).reshape(tiles * TILE, k // group) for i in (0, 1))
    weight = q.view(-1, k // group, group) * scale[..., None].float() + mins[..., None].float()
    return weight.view(-1, k)[:out_features]


def linear(x: Tensor, packed: Tensor, sm: Tensor, group: int, out_features: int) -> Tensor:
    """x [M, K] (float32 or bf16) @ W.T -> [M, out_features] in x's dtype."""
    out: Tensor = torch.ops.nim_cpu.w4a8_linear(x, packed, sm, group, out_features)
    return out


def reference(x: Tensor, packed: Tensor, sm: Tensor, group: int, out_features: int) -> Tensor:
    """What the kernel computes, in float64: the inputs as the kernel rounds them
    (`quantize.rounded_activations`) times the dequantized weight."""
    return rounded_activations(x) @ dequantize(packed, sm, out_features, group).double().t()


# The start-up check: a layer of these shapes, inputs of every sign and scale, a zero row.
_CHECK_SHAPE = (72, 256, 64)  # out_features (a partial tile), in_features, group
_CHECK_ROWS = 40
_CHECK_PROBED = (1, 2, 3, 4, 5, 7, 8, 9, 17, 33)
_CHECK_TOLERANCE = 1e-5  # relative to the row's largest output: float32 rounding of the sums


def check() -> str | None:
    """None where the loaded kernel computes `reference` (to float32 rounding) for float32 and
    bf16 inputs and every row alike at any batch size and place, and the MoE op what the layers
    it stands for compute (`_moe_problem`); else what it got wrong."""
    generator = torch.Generator().manual_seed(0)
    n, k, group = _CHECK_SHAPE
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=generator) * 0.05
    zero = torch.randn(n, k // group, generator=generator) * 0.05
    packed, sm = pack(q, scale, zero, group)
    x = torch.randn(_CHECK_ROWS, k, generator=generator) * torch.logspace(-3, 3, _CHECK_ROWS)[:, None]
    x[0] = 0
    for dtype in (torch.float32, torch.bfloat16):
        inputs = x.to(dtype)
        with torch.inference_mode():
            out = linear(inputs, packed, sm, group, n)
            expected = reference(inputs, packed, sm, group, n)
            scale = expected.abs().amax(-1).clamp_min(1e-30)
            error = ((out.double() - expected).abs().amax(-1) / scale).max()
            if dtype == torch.float32 and not error <= _CHECK_TOLERANCE:
                return f"the W4A8 kernel is {float(error):.2g} off its float64 reference"
            for rows in _CHECK_PROBED:
                for offset in (0, 1, _CHECK_ROWS - rows):
                    part = linear(inputs[offset : offset + rows], packed, sm, group, n)
                    if not torch.equal(part, out[offset : offset + rows]):
                        return f"the W4A8 kernel computes a row differently at batch {rows} ({dtype})"
    return _moe_problem()


# The MoE op's check: experts, hidden, intermediate, top-k, tokens.
_MOE_CHECK = (4, 64, 96, 2, 12)


def _moe_problem() -> str | None:
    """None where w4a8_moe gives each token its experts' SiLU-gated MLPs through `linear`,
    weighted and summed (float32, to the last bits of the exponential), alike at any batch."""
    experts, hidden, inter, top_k, tokens = _MOE_CHECK
    generator = torch.Generator().manual_seed(1)

    def layer(n: int, k: int) -> tuple[Tensor, Tensor]:
        q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
        scale = torch.rand(n, k // BLOCK, generator=generator) * 0.05 + 0.002
        return pack(q, scale, torch.randn(n, k // BLOCK, generator=generator) * scale, BLOCK)

    gate_up = [layer(2 * inter, hidden) for _ in range(experts)]
    down = [layer(hidden, inter) for _ in range(experts)]
    stacked = [torch.stack([t[i] for t in layers]) for layers in (gate_up, down) for i in (0, 1)]
    x = torch.randn(tokens, hidden, generator=generator)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)

    def moe(rows: slice) -> Tensor:
        out: Tensor = torch.ops.nim_cpu.w4a8_moe(
            x[rows], ids[rows], weights[rows], *stacked, BLOCK, BLOCK, inter
        )
        return out

    with torch.inference_mode():
        out = moe(slice(None))
        for t in range(tokens):
            want = torch.zeros(hidden)
            for c in range(top_k):
                g = linear(x[t : t + 1], *gate_up[int(ids[t, c])], BLOCK, 2 * inter)
                activated = torch.nn.functional.silu(g[:, :inter]) * g[:, inter:]
                want += linear(activated, *down[int(ids[t, c])], BLOCK, hidden)[0] * weights[t, c]
            if not torch.allclose(out[t], want, rtol=1e-4, atol=1e-5 * float(want.abs().max())):
                return "the W4A8 MoE op is off the layers it stands for"
        for rows in (1, 2, 5):
            for start in (0, 3, tokens - rows):
                if not torch.equal(moe(slice(start, start + rows)), out[start : start + rows]):
                    return f"the W4A8 MoE op computes a token differently at batch {rows}"
    return None
