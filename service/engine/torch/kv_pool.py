"""The paged KV cache's memory: one tensor per layer holding keys and values by block.

Layout per layer: `[2 (k|v), num_blocks, block_size, num_kv_heads, head_dim]`, so the keys of
token slot `s = block_id * block_size + offset` are `data[0].view(-1, H, D)[s]`.

Quantized caches (int8, fp8 e4m3) store each (token, head) vector scaled to the format's range,
with one float16 scale per (token, head): `x ~= q * scale`. fp8 values are stored as raw bytes
(uint8) because CPU index kernels do not cover float8 dtypes; they are reinterpreted, not
converted, on the way in and out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KVCacheDType = Literal["auto", "bfloat16", "float16", "float32", "int8", "fp8"]

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
        return getattr(torch, self.cache_dtype)

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
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.data = [
            torch.zeros(shape, dtype=spec.storage_dtype, device=device) for _ in range(spec.num_layers)
        ]
        self.scales = (
            [torch.zeros(shape[:-1], dtype=_SCALE_DTYPE, device=device) for _ in range(spec.num_layers)]
            if spec.quantized
            else None
        )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T] int64; k, v: [T, Hkv, D] (any strides)."""
        flat = self.data[layer].view(2, -1, self.spec.num_kv_heads, self.spec.head_dim)  # [2, S, H, D]
        if self.scales is None:
            flat[0, slots] = k.to(flat.dtype)
            flat[1, slots] = v.to(flat.dtype)
            return
        scales = self.scales[layer].view(2, -1, self.spec.num_kv_heads)  # [2, S, H]
        for i, x in enumerate((k, v)):
            q, scale = self._quantize(x)
            flat[i, slots] = q
            scales[i, slots] = scale

    def gather(
        self, layer: int, block_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids: [B, N] -> keys, values [B, N * block_size, Hkv, D] in `dtype`."""
        batch, num = block_ids.shape
        flat_ids = block_ids.reshape(-1)
        out_shape = (batch, num * self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        data = self.data[layer]
        keys = data[0].index_select(0, flat_ids)  # [B*N, bs, H, D]
        values = data[1].index_select(0, flat_ids)
        if self.scales is None:
            return keys.view(out_shape).to(dtype), values.view(out_shape).to(dtype)
        scales = self.scales[layer]
        k_scale = scales[0].index_select(0, flat_ids)  # [B*N, bs, H]
        v_scale = scales[1].index_select(0, flat_ids)
        return (
            self._dequantize(keys, k_scale, dtype).view(out_shape),
            self._dequantize(values, v_scale, dtype).view(out_shape),
        )

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H, D] -> codes [T, H, D] in storage dtype, scales [T, H]
        qmax = _QMAX[self.spec.cache_dtype]
        x32 = x.float()
        # Round the scale to its stored precision first, so codes and scale agree exactly.
        scale = (x32.abs().amax(dim=-1) / qmax).clamp_min(_MIN_SCALE).to(_SCALE_DTYPE)  # [T, H]
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
