"""Decode attention straight from the paged KV cache, as one Triton kernel per layer (CUDA).

One program per (request, kv head) walks that request's block table a tile of tokens at a time,
loads keys and values where they lie in the pool (no gathered copy), dequantizes int8/fp8
caches with their per-token scales in registers, and keeps an online softmax in float32: the
running max `m`, the running sum `l` and the output accumulator `acc` are rescaled by
exp(m_old - m_new) whenever a tile raises the max, so the result equals softmax(q k^T) v over
the whole context. The grouped query heads that share a kv head are processed together (rows of
one tl.dot), so keys and values are read once per kv head.

A sliding-window layer (`window`: the query, at position context - 1, sees the last `window`
positions) starts its walk at the tile holding the window's first position and masks the positions
before it within that tile, so every tile it visits holds at least one visible key (the running max
never stays -inf) and the keys it never visits cost nothing. WINDOWED is a compile-time switch:
full-attention layers run the kernel exactly as before.

Every shape the kernel sees is static for a batch size (block tables padded to the longest
possible context, context lengths in a tensor), so it runs inside a captured CUDA graph.

Pool layout (kv_pool.py): per layer `[2, Hkv, NB, block_size, D]`; scales `[2, Hkv, NB, block_size]`.
On CPU the same kernel runs under TRITON_INTERPRET=1, which is how tests check it against the
dense reference without a GPU.
"""

from __future__ import annotations

import torch

from service.engine.triton_support import tl, triton

if triton is not None:
    # Triton ships no type information, and a kernel's parameters stay unannotated: triton.jit reads
    # annotations (tl.constexpr) to decide how to compile each argument.
    @triton.jit  # type: ignore[untyped-decorator]
    def _paged_decode_kernel(  # type: ignore[no-untyped-def]
        q_ptr,  # [B, Hq, D]
        cache_ptr,  # [2, Hkv, NB, BS, D] (k then v)
        scale_ptr,  # [2, Hkv, NB, BS] (quantized caches only)
        tables_ptr,  # [B, W] int32
        lens_ptr,  # [B] int32
        out_ptr,  # [B, Hq, D]
        sm_scale,
        window,  # keys visible to the query, its own included (read only when WINDOWED)
        stride_qb,
        stride_qh,
        stride_tb,
        stride_lb,
        stride_ob,
        stride_oh,
        kv_stride,  # elements between k and v (Hkv * NB * BS * D)
        head_stride,  # elements between kv heads (NB * BS * D)
        scale_kv_stride,  # Hkv * NB * BS
        scale_head_stride,  # NB * BS
        GROUP: tl.constexpr,  # query heads per kv head
        GROUP_PAD: tl.constexpr,  # >= 16 and a power of two (tl.dot's minimum)
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        TILE: tl.constexpr,  # tokens per iteration, a multiple of BLOCK_SIZE
        QUANT: tl.constexpr,  # 0: plain cache, 1: int8 codes, 2: fp8 e4m3 codes stored as bytes
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 models (no tf32 shortcuts)
        COMPUTE_F32: tl.constexpr,  # matmuls in float32 (the interpreter has no bf16 arithmetic)
        WINDOWED: tl.constexpr,  # a sliding-window layer: keys before context - window are not seen
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        context = tl.load(lens_ptr + seq * stride_lb)

        groups = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + groups
        group_ok = groups < GROUP
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=group_ok[:, None],
            other=0.0,
        )  # [G, D]
        compute_dtype = tl.float32 if COMPUTE_F32 else q.dtype
        q = q.to(compute_dtype)

        m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

        k_base = cache_ptr + kv_head * head_stride
        v_base = k_base + kv_stride
        tokens = tl.arange(0, TILE)
        first = 0
        if WINDOWED:
            first = tl.maximum(context - window, 0)
        for start in range(first // TILE * TILE, context, TILE):
            pos = start + tokens
            valid = pos < context
            if WINDOWED:
                valid = valid & (pos >= first)
            block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [TILE]
            offsets = slot[:, None] * HEAD_DIM + dims[None, :]  # [TILE, D]
            k = tl.load(k_base + offsets, mask=valid[:, None], other=0)
            v = tl.load(v_base + offsets, mask=valid[:, None], other=0)
            if QUANT != 0:
                scale_base = scale_ptr + kv_head * scale_head_stride
                k_scale = tl.load(scale_base + slot, mask=valid, other=0.0).to(tl.float32)
                v_scale = tl.load(scale_base + scale_kv_stride + slot, mask=valid, other=0.0).to(tl.float32)
                if QUANT == 2:
                    k = k.to(tl.float8e4nv, bitcast=True)
                    v = v.to(tl.float8e4nv, bitcast=True)
                k = (k.to(tl.float32) * k_scale[:, None]).to(compute_dtype)
                v = (v.to(tl.float32) * v_scale[:, None]).to(compute_dtype)
            else:
                k = k.to(compute_dtype)
                v = v.to(compute_dtype)

            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # [G, TILE] float32
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(compute_dtype), v, input_precision=DOT_PRECISION)
            m = m_new

        out = acc / l_sum[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=group_ok[:, None],
        )


QUANT_CODES = {"int8": 1, "fp8": 2}


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    cache_dtype: str,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    tile: int = 64,
    window: int | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D]; cache: one layer's [2, Hkv, NB, BS, D]; block_tables: [B, W] integer (rows
    padded with any valid block id); context_lens: [B] integer, each >= 1; both may be strided
    views (of the CUDA graphs' input buffer). Returns [B, Hq, D].

    `cache_dtype` is the KV cache spec's ("int8" and "fp8" read `scales` [2, Hkv, NB, BS]).
    `window`: each query sees only its context's last `window` positions (None: all of them).
    """
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton, which is not installed")
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, num_blocks, block_size, _ = cache.shape
    group = num_heads // num_kv_heads
    quant = QUANT_CODES.get(cache_dtype, 0)
    if window is not None and window < 1:
        raise ValueError(f"attention window {window} must be at least 1")
    if quant and scales is None:
        raise ValueError(f"a {cache_dtype} cache needs its scales")
    if out is None:
        out = torch.empty_like(q)
    tile = max(block_size, tile // block_size * block_size)
    # CPU tensors reach a Triton kernel only in Triton's interpreter (tests without a GPU), which
    # runs in numpy without bfloat16 arithmetic: the kernel then computes in float32 throughout.
    interpreted = q.device.type == "cpu"
    head_stride = num_blocks * block_size * head_dim
    scale_arg = scales if scales is not None else cache  # unused when QUANT == 0
    _paged_decode_kernel[(batch, num_kv_heads)](
        q,
        cache,
        scale_arg,
        block_tables,
        context_lens,
        out,
        sm_scale,
        0 if window is None else window,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        context_lens.stride(0),
        out.stride(0),
        out.stride(1),
        num_kv_heads * head_stride,
        head_stride,
        num_kv_heads * num_blocks * block_size,
        num_blocks * block_size,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=tile,
        QUANT=quant,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or interpreted else "tf32",
        COMPUTE_F32=interpreted,
        WINDOWED=window is not None,
    )
    return out
