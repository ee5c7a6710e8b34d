"""Attention over the paged KV cache for one mixed step (decodes and prefill chunks).

The flat token batch is ordered decodes first (one token each), then each prefill chunk's
tokens. Every layer first writes the new tokens' keys/values into their cache slots, then:
- decodes: gathers every request's blocks into one padded [H, B * L, D] batch (head-major,
  so each (head, request) is a contiguous [L, D] matrix) and attends with two batched matmuls;
  grouped-query heads are handled by reshaping queries, never by copying keys/values per head;
- a chunk that starts a request (nothing cached before it) attends over its own k/v with
  causal SDPA, without reading the cache back;
- any other chunk (continuing a long prompt, or after a prefix-cache hit) gathers its blocks
  and attends with a causal mask offset by what was cached before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from service.engine.torch.kv_pool import KVPool


@dataclass(frozen=True)
class PrefillChunk:
    query_start: int  # row of the chunk's first token in the flat batch
    num_query: int
    context_len: int  # tokens with keys/values after this chunk (cached before + the chunk)
    block_ids: torch.Tensor  # pool rows (KVPool.head_block_ids) of the blocks covering the context

    @property
    def starts_request(self) -> bool:
        return self.context_len == self.num_query


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every token in the batch
    num_decodes: int  # rows [0, num_decodes) are decode tokens
    decode_block_ids: torch.Tensor | None  # pool rows of each decode's first N blocks (padded with 0)
    decode_mask: torch.Tensor | None  # [1, B, 1, N * block_size] additive: 0 where visible, else -inf
    prefills: tuple[PrefillChunk, ...]


class PagedAttention:
    def __init__(self, pool: KVPool, meta: AttentionMetadata, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.meta = meta
        self.num_heads = num_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        meta = self.meta
        self.pool.write(layer, meta.slot_mapping, k, v)
        if not meta.prefills:
            return self._decode(layer, q)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(layer, q[: meta.num_decodes])
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.num_query)
            out[rows] = self._prefill(layer, chunk, q[rows], k[rows], v[rows])
        return out

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        # q: [B, Hq, D]
        meta = self.meta
        assert meta.decode_block_ids is not None and meta.decode_mask is not None
        keys, values = self.pool.gather(layer, meta.decode_block_ids, q.dtype)  # [Hkv, B*L, D]
        batch, length = meta.decode_mask.shape[1], meta.decode_mask.shape[3]
        num_kv_heads, _, head_dim = keys.shape
        group = self.num_heads // num_kv_heads
        keys = keys.view(num_kv_heads * batch, length, head_dim)
        values = values.view(num_kv_heads * batch, length, head_dim)
        # [B, Hq, D] -> [Hkv * B, G, D], matching the (head, request) order of the gathered cache.
        qh = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1).reshape(-1, group, head_dim)
        scores = torch.bmm(qh, keys.transpose(1, 2)).view(num_kv_heads, batch, group, length)
        scores = scores.float().mul_(self.scale).add_(meta.decode_mask)
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(-1, group, length)
        out = torch.bmm(probs, values)  # [Hkv * B, G, D]
        return out.view(num_kv_heads, batch, group, head_dim).transpose(0, 1).reshape(batch, -1, head_dim)

    def _prefill(
        self, layer: int, chunk: PrefillChunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [S, Hq, D]; k, v: [S, Hkv, D]
        if chunk.starts_request:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
            )
            return out.transpose(0, 1)
        keys, values = self.pool.gather(layer, chunk.block_ids, q.dtype)  # [Hkv, N*bs, D]
        keys, values = keys[:, : chunk.context_len], values[:, : chunk.context_len]  # [Hkv, C, D]
        # Query i sits at position (context_len - num_query + i) and sees keys up to it.
        first = chunk.context_len - chunk.num_query
        key_pos = torch.arange(chunk.context_len, device=q.device)
        query_pos = torch.arange(first, chunk.context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [S, C]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)


def decode_mask(context_lens: torch.Tensor, padded_len: int) -> torch.Tensor:
    """[B] -> additive float mask [1, B, 1, padded_len]: 0 for keys < context_len, else -inf."""
    positions = torch.arange(padded_len, device=context_lens.device)
    visible = positions[None, :] < context_lens[:, None]
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=context_lens.device)
    mask.masked_fill_(~visible, float("-inf"))
    return mask[None, :, None, :]
