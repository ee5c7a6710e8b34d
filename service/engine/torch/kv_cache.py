"""Dense per-sequence KV caches and the attention backends that read and write them.

Each sequence owns one `SequenceKVCache` holding keys and values for every layer, grown by
doubling up to the model's context length. Invariant: positions [0, length) of every layer hold
the keys/values of the sequence's first `length` tokens; `length` advances only after a forward
pass has written all layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

INITIAL_CAPACITY = 256


class SequenceKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_len = max_len
        self.length = 0
        self._shape = (num_layers, 2, num_kv_heads, 0, head_dim)  # [L, k|v, Hkv, capacity, D]
        self._dtype, self._device = dtype, device
        self.kv = torch.empty(self._shape, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def reserve(self, new_len: int) -> None:
        """Make room for `new_len` tokens in total (amortized doubling, capped at max_len)."""
        if new_len > self.max_len:
            raise ValueError(f"sequence of {new_len} tokens exceeds the context of {self.max_len}")
        if new_len <= self.capacity:
            return
        capacity = min(self.max_len, max(INITIAL_CAPACITY, 2 * self.capacity, new_len))
        grown = torch.empty(
            (*self._shape[:3], capacity, self._shape[4]), dtype=self._dtype, device=self._device
        )
        grown[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        self.kv = grown

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [T, Hkv, D] -> cache[layer, :, :, start:start+T]
        end = start + k.shape[0]
        self.kv[layer, 0, :, start:end] = k.transpose(0, 1)
        self.kv[layer, 1, :, start:end] = v.transpose(0, 1)

    def keys_values(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, end, D] views of keys and values for positions [0, end)."""
        return self.kv[layer, 0, :, :end], self.kv[layer, 1, :, :end]


class PrefillAttention:
    """One sequence, T new tokens appended at `cache.length`, causal over the whole context."""

    def __init__(self, cache: SequenceKVCache, num_new: int) -> None:
        self.cache = cache
        self.start = cache.length
        self.num_new = num_new
        cache.reserve(self.start + num_new)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        num_new = q.shape[0]
        end = self.start + num_new
        self.cache.write(layer, self.start, k, v)
        keys, values = self.cache.keys_values(layer, end)  # [Hkv, end, D]
        if self.start == 0:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), keys, values, is_causal=True, enable_gqa=True
            )
        else:
            # Query i sits at absolute position start + i and may see keys 0..start+i.
            key_pos = torch.arange(end, device=q.device)
            query_pos = torch.arange(self.start, end, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [T, end]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True
            )
        return out.transpose(0, 1)

    def commit(self) -> None:
        self.cache.length = self.start + self.num_new


class DecodeAttention:
    """B sequences, one new token each (token b belongs to caches[b])."""

    def __init__(self, caches: Sequence[SequenceKVCache]) -> None:
        self.caches = caches
        for cache in caches:
            cache.reserve(cache.length + 1)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, Hq, D]; k, v: [B, Hkv, D]
        out = torch.empty_like(q)
        for b, cache in enumerate(self.caches):
            pos = cache.length
            cache.write(layer, pos, k[b : b + 1], v[b : b + 1])
            keys, values = cache.keys_values(layer, pos + 1)  # [Hkv, pos+1, D]
            # one query attends to all keys: no mask needed
            out[b] = F.scaled_dot_product_attention(q[b, :, None, :], keys, values, enable_gqa=True)[:, 0, :]
        return out

    def commit(self) -> None:
        for cache in self.caches:
            cache.length += 1
