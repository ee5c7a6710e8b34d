"""fp8 weights times activations for steps of a few rows (Triton): the e4m3 weights read once,
converted in registers, multiplied by the activations as they are.

At batch 1 a decode step is its weight reads, and fp8 holds half of bf16's bytes; yet on an H200
(2026-11-28, 8B shape) the fp8 profile decoded at 0.72x bf16's speed: `torch._scaled_mm` needs its
activations in e4m3 too, and quantizing each row (absolute value, maximum, scale, divide, clamp,
cast) adds about eight small kernels to every linear layer of the step. For steps of at most
ROWS_MAX rows this kernel skips that: one launch per layer, each program reading a block of
output channels' weights across the whole input, accumulating in float32 and applying the
per-channel scale (and bias) at the end. Weight-only, as the emulated path, so it agrees with it
to float32 accumulation order; it is checked against it at start
(service.engine.torch.startup_checks.check_fp8_rows_kernel) before any step uses it.

Under TRITON_INTERPRET=1 (tests without a GPU), which has no bfloat16 arithmetic, the products
are taken in float32 (IN_FP32).
"""

from __future__ import annotations

import torch

from service.engine.triton_support import tl, triton

__all__ = ["ROWS_MAX", "fp8_rows_linear"]

ROWS_MAX = 16  # the rows one program holds (tl.dot's smallest tile): steps of up to 16 tokens
BLOCK_N = 16  # output channels per program: N / 16 programs keep every SM reading at N = 4096
BLOCK_K = 256

if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
    def _fp8_rows_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        IN_FP32: tl.constexpr,
    ):  # fmt: skip
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x_mask = (rows[:, None] < M) & (ks[None, :] < K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
            w_mask = (cols[:, None] < N) & (ks[None, :] < K)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
            if IN_FP32:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:  # e4m3 -> bf16 is exact (3 mantissa bits into 7)
                acc += tl.dot(x, tl.trans(w.to(tl.bfloat16)))
        acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out_mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=out_mask)  # fmt: skip


def fp8_rows_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [M, K] (M <= ROWS_MAX, bf16 on CUDA) times q: [N, K] e4m3 with per-row `scale` [N] (float32)
    -> [M, N] in x's dtype, plus `bias`."""
    if triton is None:
        raise RuntimeError("the fp8 rows kernel needs triton, which is not installed")
    rows, inner = x.shape
    if rows > ROWS_MAX:
        raise ValueError(f"the fp8 rows kernel takes at most {ROWS_MAX} rows, not {rows}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(rows, q.shape[0], dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(q.shape[0], BLOCK_N),)
    _fp8_rows_kernel[grid](
        x, q, scale, scale if bias is None else bias, out, rows, q.shape[0], inner, x.stride(0),
        q.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=ROWS_MAX, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, IN_FP32=x.device.type == "cpu", num_warps=4, num_stages=4,
    )  # fmt: skip
    return out
