"""Fused CUDA kernels (Triton) for the model's elementwise work: one launch where PyTorch takes many.

A decode step of a small model is launch-bound even inside a CUDA graph: each of the ~37 kernels
of a decoder layer costs the GPU a couple of microseconds however little it computes. These
kernels do the same arithmetic in fewer launches:

- rms_norm / add_rms_norm: (residual add +) RMSNorm in one pass per row;
- silu_mul: SiLU(gate) * up from the fused gate/up projection;
- rotary: rotate-half RoPE on the q and k heads of the fused qkv projection, in place.

Each reproduces PyTorch's numerics for the op sequence it replaces: arithmetic in float32, and a
rounding to the activation dtype exactly where the eager ops round (after every elementwise op
in bf16/fp16, as PyTorch's opmath does). Adds and RoPE therefore agree with the eager ops to the
bit; RMSNorm (a row's sum of squares reduced in another order) and SiLU (exp computed another way)
agree within a few float32 ulps before the final rounding. All arithmetic is float32 (converted
to and from the storage dtype), which is also what lets Triton's interpreter run them on a CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from service.engine.triton_support import available, tl, triton

__all__ = ["add_rms_norm", "available", "rms_norm", "rotary_", "runs_on", "silu_mul"]


def runs_on(x: torch.Tensor) -> bool:
    """Whether these kernels can take `x`: a CUDA tensor, with triton installed."""
    return x.is_cuda and triton is not None


if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
    def _rms_norm_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        residual_ptr,
        weight_ptr,
        out_ptr,
        residual_out_ptr,
        n_cols,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dtype = x.dtype
        x = x.to(tl.float32)
        if HAS_RESIDUAL:
            # hidden = x + residual, rounded to the activation dtype (the eager add's result).
            x = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            x = x.to(dtype).to(tl.float32)
            tl.store(residual_out_ptr + row * stride_ro + cols, x.to(dtype), mask=mask)
        variance = tl.sum(x * x, axis=0) / n_cols
        normed = (x * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(dtype), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def _silu_mul_kernel(  # type: ignore[no-untyped-def]
        gate_up_ptr, out_ptr, n_cols, stride_in, stride_out, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
        dtype = gate.dtype
        gate = gate.to(tl.float32)
        up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def _rotary_kernel(  # type: ignore[no-untyped-def]
        x_ptr,  # [T, heads, D], rotated in place
        positions_ptr,
        cos_ptr,  # [max_positions, D/2] float32
        sin_ptr,
        stride_t,
        stride_h,
        stride_p,
        HALF: tl.constexpr,
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, HALF)
        position = tl.load(positions_ptr + token * stride_p)
        base = x_ptr + token * stride_t + head * stride_h
        x1 = tl.load(base + dims)
        dtype = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = tl.load(base + HALF + dims).to(tl.float32)
        # The tables are cast to the activation dtype first, as the eager lookup does.
        cos = tl.load(cos_ptr + position * HALF + dims).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + position * HALF + dims).to(dtype).to(tl.float32)
        # x1*cos - x2*sin and x2*cos + x1*sin, each product and sum rounded as eager ops round.
        first = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
        second = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
        tl.store(base + dims, first.to(dtype))
        tl.store(base + HALF + dims, second.to(dtype))


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    if triton is None:
        raise RuntimeError("fused kernels need triton, which is not installed")
    kernel[grid](*args, **meta)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> RMSNorm(x) * weight, as the model's RMSNorm computes it."""
    out = torch.empty_like(x)
    _launch(
        _rms_norm_kernel, (x.shape[0],), x, x, weight, out, out, x.shape[1], x.stride(0), 0,
        out.stride(0), 0, eps, HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(x.shape[1]),
    )  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (RMSNorm(x + residual) * weight, x + residual)."""
    out = torch.empty_like(x)
    summed = torch.empty_like(x)
    _launch(
        _rms_norm_kernel, (x.shape[0],), x, residual, weight, out, summed, x.shape[1], x.stride(0),
        residual.stride(0), out.stride(0), summed.stride(0), eps, HAS_RESIDUAL=True,
        BLOCK=triton.next_power_of_2(x.shape[1]),
    )  # fmt: skip
    return out, summed


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate then up) -> SiLU(gate) * up: [T, I]."""
    rows, width = gate_up.shape
    inner = width // 2
    out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
    _launch(
        _silu_mul_kernel, (rows, triton.cdiv(inner, SILU_BLOCK)), gate_up, out, inner, gate_up.stride(0),
        out.stride(0), BLOCK=SILU_BLOCK,
    )  # fmt: skip
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place. x: [T, heads, D] (head rows contiguous); positions: [T];
    cos, sin: the float32 [max_positions, D/2] tables."""
    tokens, heads, dim = x.shape
    if x.stride(2) != 1:
        raise ValueError("rotary_ needs each head's values contiguous")
    _launch(
        _rotary_kernel, (tokens, heads), x, positions, cos, sin, x.stride(0), x.stride(1),
        positions.stride(0), HALF=dim // 2,
    )  # fmt: skip
