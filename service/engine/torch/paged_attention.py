"""Attention over the paged KV cache for one mixed step (decodes and prefill chunks).

The flat token batch is ordered decodes first (one token each), then each prefill chunk's
tokens. Every layer first writes the new tokens' keys/values into their cache slots, then reads
every query's context back from the cache, padded to whole blocks, as one contiguous [L, D]
matrix per (kv head, request) (the pool is head-major), and attends with PyTorch's fused
attention (`scaled_dot_product_attention`: on the CPU its flash kernel, float32 scores and
softmax, keys past a row's context masked out). Decodes pass each kv head's group of query heads
as that head's queries, so one call covers the batch without copying keys/values per head;
prefill chunks use its grouped-query mode. On the CPU this is 2-4x faster than the bmm, softmax,
bmm sequence it replaced, for single-token decodes and prompts alike.

Batch invariance: every query row is computed from that row's inputs alone, and masked or
padded keys contribute exact zeros, so a token's attention output is bitwise the same whatever
the batch size, the padding, the prefill chunk boundaries or a prefix-cache hit. Greedy and
seeded outputs therefore do not depend on what else shares the batch (the linear layers are
row-independent as well). Block sizes are multiples of 16 so a row is never shorter than one
AVX-512 vector, which would switch the softmax reduction to a different summation order.

The fused kernel is not row-invariant by itself: on the CPU it cuts the queries into tiles
whose size depends on how many there are, and its matrix products round a row differently in
a tile of another height (about one prompt in twenty changed a bfloat16 output somewhere, so a
seeded sample differed with 16 rather than 32 cached prompt tokens). So prefill queries are
cut into tiles of PREFILL_TILE positions aligned to absolute positions (padded with zero rows),
passed as the batch dimension: a token is always computed in the same tile, of the same
height, whatever the chunk holds. tests/test_engine.py holds this; a faster kernel must keep it.

On CUDA, a step with prefill chunks may instead attend through one Triton kernel for the whole
step (`unified` metadata; service.engine.torch.triton_unified_attention): decodes and chunks in one
launch per layer, keys and values read in place through the block tables, nothing gathered. The
decode path decides whether it runs (decode_path.py, after a check against this module's gathered
attention at start). It is not bitwise batch-invariant across launch shapes (its docstring says
where), so on CUDA a greedy token may depend on whether its step held a prefill.

Sliding-window layers (a call with `window`) attend over the same gathered context with the
step's masks narrowed to each query's window (built once per step and window, shared by the
layers that use it), and through the Triton kernel with its window argument. Every block stays
in the cache, out-of-window ones included: the prefix cache and preemption work unchanged, and
the window saves compute where the kernel skips whole tiles, but no memory yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from service.engine.models.attention import check_window
from service.engine.native import fused_ops
from service.engine.torch.kv_pool import KVPool
from service.engine.torch.triton_attention import paged_decode_attention
from service.engine.torch.triton_unified_attention import paged_unified_attention

# Query positions per attention tile (tiles start at multiples of it): the CPU kernel's own query
# block for short queries, so a tile is one block of its matrix products.
PREFILL_TILE = 32


@dataclass(frozen=True)
class PrefillChunk:
    query_start: int  # row of the chunk's first token in the flat batch
    num_query: int
    context_len: int  # tokens with keys/values after this chunk (cached before + the chunk)
    block_ids: torch.Tensor  # pool rows (KVPool.head_block_ids) of the blocks covering the context
    # [tiles, PREFILL_TILE, N * block_size] additive, q's dtype: 0 where visible (causal); tile t
    # holds positions (first_position // PREFILL_TILE + t) * PREFILL_TILE + [0, PREFILL_TILE).
    mask: torch.Tensor

    @property
    def tile_offset(self) -> int:
        """Padding rows before the chunk's first query in its first tile."""
        return (self.context_len - self.num_query) % self.mask.shape[1]


@dataclass(frozen=True)
class UnifiedStep:
    """A whole step for the unified kernel: every sequence (decodes first, then prefill chunks, as
    the flat batch lies), by its queries' start rows, its context length after the step and its
    block table."""

    query_start_loc: torch.Tensor  # [S + 1] int32: sequence s owns rows [qsl[s], qsl[s + 1])
    seq_lens: torch.Tensor  # [S] int32: cached tokens plus this step's queries
    block_tables: torch.Tensor  # [S, W] block ids, padded with the scratch block
    max_query_len: int  # picks the kernel's block shape


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every token in the batch
    num_decodes: int  # rows [0, num_decodes) are decode tokens
    decode_block_ids: torch.Tensor | None  # pool rows of each decode's first N blocks (padded with 0)
    # [B, 1, 1, N * block_size] additive (q's dtype): 0 where visible, else -inf
    decode_mask: torch.Tensor | None
    prefills: tuple[PrefillChunk, ...]
    # Set instead of the two above where decodes attend through the Triton kernel (CUDA).
    decode_tables: torch.Tensor | None = None  # [B, N] block ids (padded with the scratch block)
    decode_lens: torch.Tensor | None = None  # [B] context lengths
    # Decode rows of one sequence (a lone decode, or its draft verification's rows) whose blocks are
    # one ascending run (first block, count): its keys and values are read in place, a view of the
    # pool, instead of gathered (set instead of decode_block_ids).
    decode_block_run: tuple[int, int] | None = None
    # Set (and nothing above but slot_mapping) where the whole step attends through the unified kernel.
    unified: UnifiedStep | None = None


def windowed_decode_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A decode mask [B, 1, 1, L] (0 over each request's context, a prefix of its row) narrowed to
    each request's last `window` keys."""
    visible = mask == 0
    lens = visible.sum(dim=-1, keepdim=True)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return mask.masked_fill(positions < lens - window, float("-inf"))


class PagedAttention:
    def __init__(self, pool: KVPool, meta: AttentionMetadata, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.meta = meta
        self.num_heads = num_heads
        self.scale = 1.0 / math.sqrt(head_dim)
        # Masks narrowed to a window, per (decode or prefill chunk index, window): built by the
        # first sliding-window layer of the step, reused by the others.
        self._windowed: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        check_window(window)
        meta = self.meta
        scale = self.scale if scale is None else scale
        self.pool.write(layer, meta.slot_mapping, k, v)
        if meta.unified is not None:
            return self._unified(layer, meta.unified, q, k, v, window, scale)
        if not meta.prefills:
            return self._decode(layer, q, window, scale)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(layer, q[: meta.num_decodes], window, scale)
        for index, chunk in enumerate(meta.prefills):
            rows = slice(chunk.query_start, chunk.query_start + chunk.num_query)
            mask = chunk.mask if window is None else self._prefill_window(index, chunk, window)
            out[rows] = self._prefill(layer, chunk, mask, scale, q[rows], k[rows], v[rows])
        return out

    def _unified(
        self,
        layer: int,
        step: UnifiedStep,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        pool = self.pool
        return paged_unified_attention(
            q, pool.data[layer], pool.scales[layer] if pool.scales is not None else None,
            pool.spec.cache_dtype, step.block_tables, step.query_start_loc, step.seq_lens, scale,
            max_query_len=step.max_query_len, window=window,
            # A quantized cache: each chunk sees its own keys as computed, as the gathered path does.
            new_kv=(k, v) if pool.spec.quantized else None,
        )  # fmt: skip

    def _decode(self, layer: int, q: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
        # q: [B, Hq, D]: one query per request, B requests side by side in the batch dimension.
        meta = self.meta
        if meta.decode_tables is not None and meta.decode_lens is not None and q.device.type == "cpu":
            # DecodeAttention.NATIVE: the cache read in place (fused_ops.decode_attention)
            return fused_ops.decode_attention(
                q, self.pool.data[layer], meta.decode_tables, meta.decode_lens, scale, window
            )
        if meta.decode_tables is not None and meta.decode_lens is not None:
            scales = self.pool.scales[layer] if self.pool.scales is not None else None
            return paged_decode_attention(
                q, self.pool.data[layer], scales, self.pool.spec.cache_dtype, meta.decode_tables,
                meta.decode_lens, scale, window=window,
            )  # fmt: skip
        mask = meta.decode_mask
        assert mask is not None
        if window is not None:
            mask = self._decode_window(mask, window)
        batch, length = mask.shape[0], mask.shape[-1]
        if meta.decode_block_run is not None:
            both = self.pool.run_pair(layer, *meta.decode_block_run)  # [2, Hkv, L, D], a view
            _, num_kv_heads, _, head_dim = both.shape
            # Every row reads the one run: [B, Hkv, L, D] views of it (stride 0 over the rows).
            keys, values = both.unsqueeze(1).expand(2, batch, num_kv_heads, length, head_dim).unbind(0)
        else:
            assert meta.decode_block_ids is not None
            both = self.pool.gather_pair(layer, meta.decode_block_ids, q.dtype)  # [2, Hkv, B*L, D]
            _, num_kv_heads, _, head_dim = both.shape
            # Each row's keys (values) as one [L, D] matrix per kv head: [B, Hkv, L, D] views.
            keys, values = both.view(2, num_kv_heads, batch, length, head_dim).transpose(1, 2).unbind(0)
        # Query head h attends with kv head h // group: [B, Hq, D] is [B, Hkv, G, D] as it lies.
        queries = q.view(batch, num_kv_heads, self.num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(batch, self.num_heads, head_dim)

    def _decode_window(self, mask: torch.Tensor, window: int) -> torch.Tensor:
        """The step's decode mask [B, 1, 1, L] narrowed to each request's last `window` keys."""
        key = (-1, window)
        if key not in self._windowed:
            self._windowed[key] = windowed_decode_mask(mask, window)
        return self._windowed[key]

    def _prefill_window(self, index: int, chunk: PrefillChunk, window: int) -> torch.Tensor:
        """Prefill chunk `index`'s tiled causal mask narrowed to each query's window. Padding rows
        past the chunk keep their causal mask (their output is discarded; a row that sees nothing
        would be NaN)."""
        key = (index, window)
        if key not in self._windowed:
            num_tiles, tile, length = chunk.mask.shape
            first_tile = (chunk.context_len - chunk.num_query) // tile
            device = chunk.mask.device
            queries = torch.arange(first_tile * tile, (first_tile + num_tiles) * tile, device=device)
            keys = torch.arange(length, device=device)
            outside = (keys[None, :] <= queries[:, None] - window) & (queries[:, None] < chunk.context_len)
            self._windowed[key] = chunk.mask.masked_fill(outside.view(num_tiles, tile, length), float("-inf"))
        return self._windowed[key]

    def _prefill(
        self,
        layer: int,
        chunk: PrefillChunk,
        mask: torch.Tensor,
        scale: float,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        # q: [S, Hq, D]: the chunk's queries against its whole context; k, v: [S, Hkv, D], its own.
        keys, values = self.pool.gather(layer, chunk.block_ids, q.dtype)  # [Hkv, L, D]
        if self.pool.spec.quantized:
            # The chunk's own keys/values as computed, not as stored: a quantized cache loses
            # precision only for what earlier steps wrote (so a prompt's first token never
            # depends on the cache dtype).
            start = chunk.context_len - chunk.num_query
            keys[:, start : chunk.context_len] = k.transpose(0, 1)
            values[:, start : chunk.context_len] = v.transpose(0, 1)
        num_tiles, tile, _ = mask.shape
        rows = slice(chunk.tile_offset, chunk.tile_offset + chunk.num_query)
        padded = q.new_zeros(num_tiles * tile, *q.shape[1:])  # [n * tile, Hq, D]
        padded[rows] = q
        queries = padded.view(num_tiles, tile, *q.shape[1:]).transpose(1, 2)  # [n, Hq, tile, D]
        out = F.scaled_dot_product_attention(
            queries,
            keys[None].expand(num_tiles, -1, -1, -1),  # [n, Hkv, L, D], one copy shared by the tiles
            values[None].expand(num_tiles, -1, -1, -1),
            attn_mask=mask[:, None],  # [n, 1, tile, L]
            scale=scale,
            enable_gqa=True,
        )  # [n, Hq, tile, D]
        return out.transpose(1, 2).reshape(num_tiles * tile, *q.shape[1:])[rows]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean visibility -> an additive mask in the attention's dtype: 0 where visible, -inf
    elsewhere (built once per step and shared by every layer; a boolean mask would be converted
    by every attention call)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def decode_mask(context_lens: torch.Tensor, padded_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[B] -> [B, 1, 1, padded_len] (broadcast over kv heads and query groups): keys before each
    request's context length are visible."""
    positions = torch.arange(padded_len, device=context_lens.device)
    return additive_mask(positions[None, None, None, :] < context_lens[:, None, None, None], dtype)


def prefill_mask(
    first_position: int, num_query: int, padded_len: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """[tiles, PREFILL_TILE, padded_len] causal mask for the aligned tiles that cover queries at
    positions first_position .. first_position + num_query - 1 (padding rows included)."""
    first_tile = first_position // PREFILL_TILE
    end_tile = -(-(first_position + num_query) // PREFILL_TILE)
    keys = torch.arange(padded_len, device=device)
    queries = torch.arange(first_tile * PREFILL_TILE, end_tile * PREFILL_TILE, device=device)
    visible = keys[None, :] <= queries[:, None]  # [tiles * tile, L]
    return additive_mask(visible, dtype).view(end_tile - first_tile, PREFILL_TILE, padded_len)
