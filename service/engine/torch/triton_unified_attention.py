"""Attention for one whole step (prefill chunks and decodes together) straight from the paged KV
cache, as one Triton kernel per layer (CUDA).

The step's queries lie back to back in one flat `[T, Hq, D]` tensor: sequence s owns rows
`query_start_loc[s] .. query_start_loc[s + 1] - 1`, a decode being a sequence of one query. Its
keys and values (this step's included: the caller writes them into the pool first) are read where
they lie in the pool through its block table, dequantized in registers for int8/fp8 caches with
their per-token scales, exactly as the decode kernel in triton_attention.py does; nothing is
gathered. Query i of sequence s sits at absolute position `seq_lens[s] - query_len + i` and sees
the keys at positions up to and including its own (with `window`, only the last `window` of them).

Work split. A program handles one *query block* (up to BLOCK_Q consecutive queries of one
sequence) for one kv head: the GROUP query heads that share that kv head, for each of those
queries, are the rows of one tl.dot (row m is the query at position block_start + m // GROUP_PAD,
head m % GROUP_PAD of the group), so keys and values are read once per kv head per query block.
Query blocks are aligned to absolute positions (block_start is a multiple of BLOCK_Q), so a
token's row within its block does not depend on where its prefill chunk began. The program walks
the key positions a TILE at a time from position 0 (or, with a window, from the tile holding the
block's earliest visible key) to the block's last query, keeping an online softmax in float32 per
row: running max `m`, running sum `l`, accumulator `acc`, rescaled by exp(m_old - m_new) when a
tile raises the max. A tile that shows a row nothing leaves that row's state exactly as it was
(p = 0, alpha = 1; while m is still -inf, p and alpha are computed against 0 instead, giving exact
zeros, never exp(-inf - -inf)).

A static grid. A run of n queries touches at most n // BLOCK_Q + 2 aligned blocks (n + 1 when
BLOCK_Q is 1), so sequence s's blocks are numbered from `query_start_loc[s] // BLOCK_Q + SLACK * s`
(SLACK 2, or 1 for BLOCK_Q 1: strictly increasing in s, leaving room for all of its blocks) and
`T // BLOCK_Q + SLACK * S` programs per kv head cover every step of T query rows and S sequences
whatever the query lengths are. Each program finds its sequence by binary search over
query_start_loc and returns at once when its block holds no query. The grid therefore depends on
(T, S, BLOCK_Q) only, and a step can be captured in a CUDA graph per token bucket with
query_start_loc, seq_lens and block tables in static buffers.

Padding. A padding sequence (query length 0: query_start_loc repeats a value) costs one or two
programs that return at once; its block table row is never read. Rows past `query_start_loc[S]`
(token padding up to the bucket) belong to no sequence: the programs of grid block 0 write zeros
there, so they hold finite values whatever `out` held before.

Precision. Scores, softmax statistics and the accumulator are float32; matmul inputs are the
model's dtype (float32 matmuls with DOT_PRECISION "ieee", no tf32). On CPU tensors the kernel runs
only under TRITON_INTERPRET=1 (tests without a GPU), which has no bfloat16 arithmetic: it then
computes in float32 throughout (COMPUTE_F32), as the decode kernel does. Quantized caches are read
as stored, this step's own keys and values included, unless the launcher is given them as computed
(`new_kv`, OWN_KV): then this step's positions are read from there, as the gathered prefill path in
paged_attention.py attends a chunk to its own keys before quantization.

Batch invariance. Within one launch shape (BLOCK_Q and TILE, which the launcher picks from
`max_query_len` unless `block_q` and `tile` are given), a row is computed from its own query and
its sequence's keys, in a block row fixed by its absolute position, over key tiles aligned to
absolute positions; keys it cannot see and the tiles it visits only because of other rows add
exact zeros. So its output does not depend on the other sequences, the padding or the chunk
boundaries, provided the matmul gives a row the same result whatever the other rows hold (true of
numpy under the interpreter, tested; expected of the GPU's MMA, to be checked there). Across launch
shapes it is not: a decode in a decode-only step (BLOCK_Q 1) and in a mixed step (BLOCK_Q up to
64) go through matmuls of different shapes and may round differently. Pin `block_q` and `tile` for
every step where bitwise invariance matters (decode-only steps then waste rows). With `new_kv` over
a quantized cache, which keys are exact depends on where the chunks begin, so a prompt chunked
differently gives different (not only differently rounded) keys, as on the gathered path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.torch.triton_attention import QUANT_CODES
from service.engine.triton_support import tl, triton

DOT_MIN = 16  # tl.dot's smallest dimension on a GPU

if triton is not None:
    # Triton ships no type information, and a kernel's parameters stay unannotated: triton.jit reads
    # annotations (tl.constexpr) to decide how to compile each argument.
    @triton.jit  # type: ignore[untyped-decorator]
    def _find_sequence(  # type: ignore[no-untyped-def]
        qsl_ptr, stride_qsl, num_seqs, block_index, BLOCK_Q: tl.constexpr, SLACK: tl.constexpr
    ):
        """The last sequence s whose first query block (query_start_loc[s] // BLOCK_Q + SLACK * s)
        is at or before `block_index`."""
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first_block = tl.load(qsl_ptr + mid * stride_qsl) // BLOCK_Q + SLACK * mid
            if first_block <= block_index:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit  # type: ignore[untyped-decorator]
    def _load_kv_tile(  # type: ignore[no-untyped-def]
        k_base,  # the pool's keys of this kv head; its values lie kv_stride further
        kv_stride,
        scale_base,  # the keys' scales of this kv head (quantized caches); values' scale_kv_stride further
        scale_kv_stride,
        table,  # this sequence's block table row
        new_k,  # this step's keys of this kv head (OWN_KV)
        new_v,
        stride_nt,
        pos,  # [TILE] key positions
        in_range,  # [TILE] positions to read (the rest load as zeros)
        cached,  # positions before this step's queries
        query_start,  # this sequence's first row in the step
        dims,
        dim_ok,
        compute_dtype: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        QUANT: tl.constexpr,
        OWN_KV: tl.constexpr,
    ):
        """Keys and values [TILE, D] at `pos`, in compute_dtype: read in place through the block
        table and dequantized with their per-token scales, or, with OWN_KV, taken as computed
        for this step's positions (pos >= cached)."""
        from_pool = in_range
        if OWN_KV:
            from_pool = in_range & (pos < cached)
        block = tl.load(table + pos // BLOCK_SIZE, mask=from_pool, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [TILE]
        offsets = slot[:, None] * HEAD_DIM + dims[None, :]
        pool_mask = from_pool[:, None] & dim_ok[None, :]
        k = tl.load(k_base + offsets, mask=pool_mask, other=0)
        v = tl.load(k_base + kv_stride + offsets, mask=pool_mask, other=0)
        if QUANT != 0:
            k_scale = tl.load(scale_base + slot, mask=from_pool, other=0.0).to(tl.float32)
            v_scale = tl.load(scale_base + scale_kv_stride + slot, mask=from_pool, other=0.0).to(tl.float32)
            if QUANT == 2:
                k = k.to(tl.float8e4nv, bitcast=True)
                v = v.to(tl.float8e4nv, bitcast=True)
            k = (k.to(tl.float32) * k_scale[:, None]).to(compute_dtype)
            v = (v.to(tl.float32) * v_scale[:, None]).to(compute_dtype)
        else:
            k = k.to(compute_dtype)
            v = v.to(compute_dtype)
        if OWN_KV:
            own = in_range & (pos >= cached)
            rows = (query_start + pos - cached).to(tl.int64)
            new_offsets = rows[:, None] * stride_nt + dims[None, :]
            new_mask = own[:, None] & dim_ok[None, :]
            k_own = tl.load(new_k + new_offsets, mask=new_mask, other=0).to(compute_dtype)
            v_own = tl.load(new_v + new_offsets, mask=new_mask, other=0).to(compute_dtype)
            k = tl.where(own[:, None], k_own, k)
            v = tl.where(own[:, None], v_own, v)
        return k, v

    @triton.jit  # type: ignore[untyped-decorator]
    def _unified_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr,  # [T, Hq, D]
        cache_ptr,  # [2, Hkv, NB, BS, D] (k then v)
        scale_ptr,  # [2, Hkv, NB, BS] (quantized caches only)
        tables_ptr,  # [S, W] integer block ids
        qsl_ptr,  # [S + 1] integer: query_start_loc
        lens_ptr,  # [S] integer: context length after this step
        out_ptr,  # [T, Hq, D]
        new_k_ptr,  # [T, Hkv, D]: this step's keys as computed (read only when OWN_KV)
        new_v_ptr,  # [T, Hkv, D]: this step's values as computed (read only when OWN_KV)
        sm_scale,
        window,  # keys visible to a query, its own included (read only when WINDOWED)
        num_seqs,
        num_tokens,  # T: rows of q and out (padding rows included)
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_tb,
        stride_nt,  # new keys/values: elements between tokens
        stride_nh,  # new keys/values: elements between kv heads
        stride_qsl,
        stride_lens,
        kv_stride,  # elements between k and v (Hkv * NB * BS * D)
        head_stride,  # elements between kv heads (NB * BS * D)
        scale_kv_stride,  # Hkv * NB * BS
        scale_head_stride,  # NB * BS
        GROUP: tl.constexpr,  # query heads per kv head
        GROUP_PAD: tl.constexpr,  # next power of two of GROUP
        BLOCK_Q: tl.constexpr,  # query positions per program (blocks aligned to multiples of it)
        SLACK: tl.constexpr,  # grid blocks per sequence beyond T // BLOCK_Q: 1 when BLOCK_Q is 1, else 2
        BLOCK_M: tl.constexpr,  # matmul rows: max(16, BLOCK_Q * GROUP_PAD)
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,  # next power of two of HEAD_DIM
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        TILE: tl.constexpr,  # key positions per iteration (>= 16, a power of two)
        QUANT: tl.constexpr,  # 0: plain cache, 1: int8 codes, 2: fp8 e4m3 codes stored as bytes
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 models (no tf32 shortcuts)
        COMPUTE_F32: tl.constexpr,  # matmuls in float32 (the interpreter has no bf16 arithmetic)
        WINDOWED: tl.constexpr,  # a sliding-window layer
        OWN_KV: tl.constexpr,  # this step's keys/values from new_k/new_v, not from the pool
    ):
        block_index = tl.program_id(0)
        kv_head = tl.program_id(1)

        rows = tl.arange(0, BLOCK_M)
        row_query = rows // GROUP_PAD  # query within the block
        row_head = kv_head * GROUP + rows % GROUP_PAD
        row_in_group = (rows % GROUP_PAD < GROUP) & (row_query < BLOCK_Q)
        dims = tl.arange(0, HEAD_PAD)
        dim_ok = dims < HEAD_DIM

        if block_index == 0:
            # Token padding past the last sequence: zeros, so no row of `out` is left unwritten.
            end = tl.load(qsl_ptr + num_seqs * stride_qsl)
            zeros = tl.zeros([BLOCK_M, HEAD_PAD], dtype=out_ptr.dtype.element_ty)
            for start in range(end, num_tokens, BLOCK_Q):
                token = start + row_query
                ok = row_in_group & (token < num_tokens)
                tl.store(
                    out_ptr + token[:, None] * stride_ot + row_head[:, None] * stride_oh + dims[None, :],
                    zeros,
                    mask=ok[:, None] & dim_ok[None, :],
                )

        seq = _find_sequence(qsl_ptr, stride_qsl, num_seqs, block_index, BLOCK_Q, SLACK)
        query_start = tl.load(qsl_ptr + seq * stride_qsl)
        query_len = tl.load(qsl_ptr + (seq + 1) * stride_qsl) - query_start
        seq_len = tl.load(lens_ptr + seq * stride_lens)
        cached = seq_len - query_len  # positions before this step's first query
        local_block = block_index - (query_start // BLOCK_Q + SLACK * seq)
        block_start = (cached // BLOCK_Q + local_block) * BLOCK_Q  # absolute position of row 0
        if (query_len == 0) | (block_start >= seq_len):
            return  # a block past this sequence's queries, or a padding sequence

        position = block_start + row_query  # [M] absolute position of each row's query
        query = position - cached  # [M] query index within the sequence
        row_ok = row_in_group & (query >= 0) & (query < query_len)
        token = query_start + query

        q = tl.load(
            q_ptr + token[:, None] * stride_qt + row_head[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [M, D]
        compute_dtype = tl.float32 if COMPUTE_F32 else q.dtype
        q = q.to(compute_dtype)

        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

        kv_head_64 = kv_head.to(tl.int64)  # a large pool's offsets pass 2**31
        keys = tl.arange(0, TILE)
        # Keys past the block's last query are seen by no row of it.
        key_end = tl.minimum(block_start + BLOCK_Q, seq_len)
        first_key = 0
        if WINDOWED:
            first_key = tl.maximum(block_start - window + 1, 0)
        for start in range(first_key // TILE * TILE, key_end, TILE):
            pos = start + keys  # [TILE]
            in_range = pos < key_end
            k, v = _load_kv_tile(
                cache_ptr + kv_head_64 * head_stride,
                kv_stride,
                scale_ptr + kv_head_64 * scale_head_stride,
                scale_kv_stride,
                tables_ptr + seq * stride_tb,
                new_k_ptr + kv_head * stride_nh,
                new_v_ptr + kv_head * stride_nh,
                stride_nt,
                pos,
                in_range,
                cached,
                query_start,
                dims,
                dim_ok,
                compute_dtype,
                HEAD_DIM,
                BLOCK_SIZE,
                QUANT,
                OWN_KV,
            )  # [TILE, D] each

            visible = (pos[None, :] <= position[:, None]) & row_ok[:, None]  # causal, [M, TILE]
            if WINDOWED:
                visible = visible & (pos[None, :] > position[:, None] - window)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # [M, TILE] float32
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            # A row that has seen nothing yet keeps m = -inf; measuring against 0 then gives p = 0
            # and alpha = 0 (its state stays exactly zero) instead of exp(-inf - -inf) = NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_ref)
            p = tl.exp(scores - m_ref[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(compute_dtype), v, input_precision=DOT_PRECISION)
            m = m_new

        # Every real row sees its own position (l >= 1); rows outside the block are not stored.
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + row_head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@dataclass(frozen=True)
class LaunchShape:
    block_q: int  # query positions per program (a power of two)
    block_m: int  # matmul rows: block_q x the padded query group, at least 16
    tile: int  # key positions per iteration (a power of two, at least 16)
    num_warps: int


def launch_shape(
    max_query_len: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: str,
    block_q: int | None = None,
    tile: int | None = None,
) -> LaunchShape:
    """The kernel's block shape for a step whose longest query run is `max_query_len`: one query
    per block when every sequence decodes, else about 64 matmul rows (32 for float32); `block_q`
    and `tile` pin it. Tiles of 64 keys for decodes over a 16-bit cache, of 32 otherwise (16 for
    float32), and eight warps from 4096-element operands up: shapes that compile for sm_90
    without register spills (checked with ptxas; float32's exact dots are the costliest, used for
    correctness rather than speed). Not timed: tune on a GPU."""
    float32 = dtype == torch.float32
    group_pad = _next_power_of_2(group)
    if block_q is None:
        rows = 32 if float32 else 64
        block_q = 1 if max_query_len <= 1 else min(_next_power_of_2(max_query_len), max(1, rows // group_pad))
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"block_q {block_q} must be a power of two")
    block_m = max(DOT_MIN, block_q * group_pad)
    if tile is None:
        tile = _default_tile(block_m, float32, cache_dtype in QUANT_CODES)
    if tile < DOT_MIN or tile & (tile - 1):
        raise ValueError(f"tile {tile} must be a power of two of at least {DOT_MIN}")
    widest = max(block_m, tile) * _next_power_of_2(head_dim)
    return LaunchShape(block_q, block_m, tile, 8 if float32 or widest >= 64 * 64 else 4)


def _default_tile(block_m: int, float32: bool, quantized: bool) -> int:
    if float32:
        return 16
    return 64 if block_m <= DOT_MIN and not quantized else 32


def kernel_constexprs(
    shape: LaunchShape,
    *,
    group: int,
    head_dim: int,
    block_size: int,
    cache_dtype: str,
    dtype: torch.dtype,
    windowed: bool,
    own_kv: bool,
    interpreted: bool,
) -> dict[str, int | bool | str]:
    """The kernel's compile-time arguments for one launch (the launcher's, and what a test
    compiles ahead of time for a GPU)."""
    return {
        "GROUP": group,
        "GROUP_PAD": _next_power_of_2(group),
        "BLOCK_Q": shape.block_q,
        "SLACK": grid_slack(shape.block_q),
        "BLOCK_M": shape.block_m,
        "HEAD_DIM": head_dim,
        "HEAD_PAD": _next_power_of_2(head_dim),
        "BLOCK_SIZE": block_size,
        "TILE": shape.tile,
        "QUANT": QUANT_CODES.get(cache_dtype, 0),
        "DOT_PRECISION": "ieee" if dtype == torch.float32 or interpreted else "tf32",
        "COMPUTE_F32": interpreted,
        "WINDOWED": windowed,
        "OWN_KV": own_kv,
    }


def grid_slack(block_q: int) -> int:
    """Query blocks per sequence the grid holds beyond T // block_q: a run of n queries starting
    anywhere touches at most n // block_q + 2 aligned blocks (n // block_q + 1 for block_q 1)."""
    return 1 if block_q == 1 else 2


def grid_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Query blocks the grid holds per kv head: an upper bound on the aligned blocks a step's
    sequences touch that depends on its sizes only (so a captured graph can replay any step of
    them)."""
    return num_tokens // block_q + grid_slack(block_q) * num_seqs


def paged_unified_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    cache_dtype: str,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    max_query_len: int,
    window: int | None = None,
    out: torch.Tensor | None = None,
    block_q: int | None = None,
    tile: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of a step's queries over their sequences' paged keys and values.

    q: [T, Hq, D], the sequences' queries back to back (rows past query_start_loc[-1] are
    padding: they get zeros); cache: one layer's [2, Hkv, NB, BS, D], this step's keys and values
    already written; block_tables: [S, W] integer, each row's ids contiguous; query_start_loc:
    [S + 1] integer, starting at 0, non-decreasing, at most T; seq_lens: [S] integer, each
    sequence's context length after this step (>= its query length). The three may be views of
    static buffers; none is read on the host.
    `max_query_len` (host-known) picks the block shape only: any value gives the same attention
    (to rounding), the right one the fastest shape; `block_q` and `tile` pin the shape.
    `cache_dtype` is the KV cache spec's ("int8" and "fp8" read `scales` [2, Hkv, NB, BS]).
    `window`: each query sees only the last `window` positions up to its own. `new_kv`: this
    step's keys and values as computed, [T, Hkv, D] each with q's rows (the same strides): a query
    then attends to them rather than to their stored copies (what a quantized cache rounds), as the
    gathered prefill path does. Returns [T, Hq, D].
    """
    if triton is None:
        raise RuntimeError("paged_unified_attention needs triton, which is not installed")
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, num_blocks, block_size, cache_dim = cache.shape
    num_seqs = seq_lens.shape[0]
    _check_shapes(q, cache_dim, num_kv_heads, block_tables, query_start_loc, num_seqs)
    if window is not None and window < 1:
        raise ValueError(f"attention window {window} must be at least 1")
    if cache_dtype in QUANT_CODES and scales is None:
        raise ValueError(f"a {cache_dtype} cache needs its scales")
    if max_query_len < 1:
        raise ValueError(f"max_query_len {max_query_len} must be at least 1")
    if out is None:
        out = torch.empty_like(q)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be [T, Hq, D] {tuple(q.shape)}, contiguous in the head dimension")
    new_k, new_v = new_kv if new_kv is not None else (q, q)  # unused without new_kv
    if new_kv is not None:
        _check_new_kv(new_k, new_v, (num_tokens, num_kv_heads, head_dim))
    group = num_heads // num_kv_heads
    shape = launch_shape(max_query_len, group, head_dim, q.dtype, cache_dtype, block_q, tile)
    # CPU tensors reach a Triton kernel only in Triton's interpreter (tests without a GPU), which
    # runs in numpy without bfloat16 arithmetic: the kernel then computes in float32 throughout.
    constexprs = kernel_constexprs(
        shape,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        cache_dtype=cache_dtype,
        dtype=q.dtype,
        windowed=window is not None,
        own_kv=new_kv is not None,
        interpreted=q.device.type == "cpu",
    )
    head_stride = num_blocks * block_size * head_dim
    grid = (grid_blocks(num_tokens, num_seqs, shape.block_q), num_kv_heads)
    if grid[0] == 0:
        return out  # an empty step
    _unified_attention_kernel[grid](
        q,
        cache,
        scales if scales is not None else cache,  # unused when the cache is not quantized
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        new_k,
        new_v,
        sm_scale,
        0 if window is None else window,
        num_seqs,
        num_tokens,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        new_k.stride(0),
        new_k.stride(1),
        query_start_loc.stride(0),
        seq_lens.stride(0),
        num_kv_heads * head_stride,
        head_stride,
        num_kv_heads * num_blocks * block_size,
        num_blocks * block_size,
        num_warps=shape.num_warps,
        **constexprs,
    )
    return out


def _check_shapes(
    q: torch.Tensor,
    cache_dim: int,
    num_kv_heads: int,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_seqs: int,
) -> None:
    """Host-side shape checks only: nothing here reads a device value."""
    _, num_heads, head_dim = q.shape
    if head_dim != cache_dim:
        raise ValueError(f"queries have head size {head_dim}, the cache {cache_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} kv heads")
    if q.stride(2) != 1:
        raise ValueError("queries must be contiguous in the head dimension")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block tables must be [S, W] with each row's block ids contiguous")
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{num_seqs} sequences need query_start_loc [{num_seqs + 1}] and {num_seqs} block table rows, "
            f"got {tuple(query_start_loc.shape)} and {block_tables.shape[0]}"
        )


def _check_new_kv(new_k: torch.Tensor, new_v: torch.Tensor, shape: tuple[int, int, int]) -> None:
    if new_k.shape != shape or new_v.shape != shape:
        raise ValueError(f"new keys and values must be [T, Hkv, D] {shape}, got {tuple(new_k.shape)}")
    if new_k.stride() != new_v.stride() or new_k.stride(2) != 1:
        raise ValueError("new keys and values must share strides, contiguous in the head dimension")


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
