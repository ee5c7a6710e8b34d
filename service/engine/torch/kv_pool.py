"""The paged KV cache's memory: one tensor per layer holding keys and values by block.

Layout per layer: `[2 (k|v), num_kv_heads, num_blocks, block_size, head_dim]`, head-major: the
keys of token slot `s = block_id * block_size + offset` are `data[0].view(H, -1, D)[:, s]`.
Gathering a batch's blocks yields `[H, B * N * block_size, D]`, one contiguous [L, D] matrix per
(head, request), copied a block (not a token) at a time; attention runs as batched matmuls on it
without another copy.

Quantized caches (int8, fp8 e4m3) store each (token, head) vector scaled to the format's range,
with one float16 scale per (token, head): `x ~= q * scale`. fp8 values are stored as raw bytes
(uint8) because CPU index kernels do not cover float8 dtypes; they are reinterpreted, not
converted, on the way in and out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.config import KVCacheDType

_QMAX = {"int8": 127.0, "fp8": 448.0}
_SCALE_DTYPE = torch.float16
_MIN_SCALE = 1e-5  # representable in float16; smaller vectors are ~0 anyway


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cache_dtype: KVCacheDType
    model_dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.cache_dtype in _QMAX

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.cache_dtype == "auto":
            return self.model_dtype
        if self.cache_dtype == "int8":
            return torch.int8
        if self.cache_dtype == "fp8":
            return torch.uint8
        dtype: torch.dtype = getattr(torch, self.cache_dtype)
        return dtype

    @property
    def name(self) -> str:
        """The cache dtype as reported in logs and metrics."""
        if self.cache_dtype == "auto":
            return str(self.model_dtype).removeprefix("torch.")
        return "fp8_e4m3" if self.cache_dtype == "fp8" else self.cache_dtype

    def bytes_per_token(self) -> int:
        """2 (k and v) x layers x kv_heads x (head_dim x bytes(dtype) [+ one scale when quantized])."""
        element = torch.empty((), dtype=self.storage_dtype).element_size()
        scale = torch.empty((), dtype=_SCALE_DTYPE).element_size() if self.quantized else 0
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * element + scale)

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size


class KVPool:
    """`num_blocks` blocks for requests, plus one scratch block (`scratch_block`, the last) that
    is never allocated: padding rows of a fixed-size batch write their keys and values there."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.scratch_block = num_blocks
        self.num_blocks = num_blocks + 1  # as allocated: the scratch block included
        shape = (2, spec.num_kv_heads, self.num_blocks, spec.block_size, spec.head_dim)
        layers = range(spec.num_layers)
        self.data = [torch.zeros(shape, dtype=spec.storage_dtype, device=device) for _ in layers]
        self.scales = None
        if spec.quantized:
            self.scales = [torch.zeros(shape[:-1], dtype=_SCALE_DTYPE, device=device) for _ in layers]

    def clear(self, block_ids: tuple[int, ...]) -> None:
        """Zero these blocks in every layer. Attention reads a block's unwritten tail as masked
        keys and values, which contribute exact zeros only while they are finite (0 * NaN is NaN):
        blocks a request left non-finite are cleared before anyone else can use them."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data[0].device)
        for layer in range(self.spec.num_layers):
            self.data[layer].index_fill_(2, index, 0)
            if self.scales is not None:
                self.scales[layer].index_fill_(2, index, 0)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T] int64; k, v: [T, Hkv, D] (any strides)."""
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        data = self.data[layer].view(2, heads, -1, dim)  # [2, H, S, D]
        if self.scales is None:
            # Keys and values in one copy: [2, T, H, D] -> [2, H, T, D] at the slots (index_copy_:
            # a plain copy per slot, where index_put's general path took 25 us at one token).
            pair = torch.stack((k, v)).transpose(1, 2)
            data.index_copy_(2, slots, pair if pair.dtype == data.dtype else pair.to(data.dtype))
            return
        scales = self.scales[layer].view(2, heads, -1)  # [2, H, S]
        for i, x in enumerate((k, v)):
            codes, scale = self._quantize(x.transpose(0, 1))
            data[i][:, slots] = codes
            scales[i][:, slots] = scale

    def head_block_ids(self, block_ids: torch.Tensor) -> torch.Tensor:
        """[M] block ids -> [2 * H * M] rows of the (k|v, head, block)-flattened pool, for `gather`.

        Computed once per step and shared by every layer: one dim-0 index_select over the flat
        pool fetches a layer's keys and values together, several times faster on CPU than
        selecting along the block dimension, and half the calls of fetching them apart.
        """
        planes = 2 * self.spec.num_kv_heads  # k and v of each head
        starts = torch.arange(planes, device=block_ids.device)[:, None] * self.num_blocks
        return (starts + block_ids[None, :]).reshape(-1)

    def gather(
        self, layer: int, head_block_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """head_block_ids (from `head_block_ids`, M blocks) -> keys, values [Hkv, M * block_size, D]."""
        keys, values = self.gather_pair(layer, head_block_ids, dtype).unbind(0)
        return keys, values

    def gather_pair(self, layer: int, head_block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """As `gather`, keys and values stacked: [2, Hkv, M * block_size, D] (fewest ops: decode)."""
        heads, block, dim = self.spec.num_kv_heads, self.spec.block_size, self.spec.head_dim
        data = self.data[layer].view(-1, block, dim)  # [2*H*NB, bs, D]
        both = data.index_select(0, head_block_ids).view(2, heads, -1, dim)  # [2, H, M*bs, D]
        if self.scales is None:
            return both if both.dtype == dtype else both.to(dtype)
        scales = self.scales[layer].view(-1, block).index_select(0, head_block_ids).view(2, heads, -1)
        return self._dequantize(both, scales, dtype)

    def run_pair(self, layer: int, first: int, count: int) -> torch.Tensor:
        """Keys and values of blocks first..first+count-1 as they lie in the pool: a view
        [2, Hkv, count * block_size, D], no copy (16-bit caches only: quantized ones dequantize)."""
        assert self.scales is None, "a quantized cache is read through gather_pair"
        heads, block, dim = self.spec.num_kv_heads, self.spec.block_size, self.spec.head_dim
        planes = self.data[layer].view(2, heads, self.num_blocks, block, dim)
        return planes[:, :, first : first + count].reshape(2, heads, count * block, dim)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [H, T, D] -> codes [H, T, D] in storage dtype, scales [H, T]
        qmax = _QMAX[self.spec.cache_dtype]
        x32 = x.float()
        # Round the scale to its stored precision first, so codes and scale agree exactly.
        scale = (x32.abs().amax(dim=-1) / qmax).clamp_min(_MIN_SCALE).to(_SCALE_DTYPE)
        # Clamp: a scale rounded down can push |x / scale| past qmax, and out-of-range fp8 casts give NaN.
        scaled = (x32 / scale.float().unsqueeze(-1)).clamp_(-qmax, qmax)
        if self.spec.cache_dtype == "int8":
            codes = scaled.round_().to(torch.int8)
        else:
            codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        return codes, scale

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        values = codes.view(torch.float8_e4m3fn) if self.spec.cache_dtype == "fp8" else codes
        return values.to(dtype) * scale.to(dtype).unsqueeze(-1)
