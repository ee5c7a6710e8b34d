"""Quantized weight formats: what a checkpoint or load-time quantizer hands the model.

Each format holds one linear layer's weight [N out, K in] in its checkpoint-neutral form (values
plus scales, unpacked), so that shards of a fused layer (q/k/v, gate/up) concatenate along their
rows exactly, and can be packed once for a kernel afterwards (service.engine.models.quant_linear).
Every format states its dequantization formula once, here, and implements it in `dequantize`,
which is the reference the kernels and the tests are held to:

- ``Int4Weight`` (int4_wo): x = (q - 8) * scale + zero, q in 0..15, one scale and zero per group
  of ``group_size`` consecutive inputs of a row. GGUF Q4_0 (x = d * (q - 8)) and Q4_1 (x = d * q + m)
  map onto it exactly: scale = d, zero = 0 and scale = d, zero = m + 8d.
- ``Int8Weight`` (int8_wo): x = q * scale, q in -127..127, one scale per output row.
- ``FP8Weight`` (fp8): x = q * scale, q float8 e4m3, one scale per output row (a checkpoint's
  per-tensor scale is repeated over its rows, which is exact and lets shards with different
  scales concatenate); ``input_scale``: the checkpoint's static activation scale, if any.
- ``NVFP4Weight`` (nvfp4): x = e2m1(q) * block_scale * global_scale, two e2m1 values per byte (the
  low nibble first), one e4m3 block scale per 16 inputs, one fp32 global scale per row (a
  per-tensor scale repeated, as for FP8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch import Tensor

from service.engine.precision import PRECISION_SPECS, SPECS
from service.model.quantization import QuantizationError

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value
# e2m1 code (sign bit 3) -> value.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_BLOCK = 16
INT4_GROUP_SIZES = (32, 64, 128)  # group sizes int4_wo supports (a divisor of every K is needed)


class QuantizedWeight(Protocol):
    precision: ClassVar[str]  # the profile precision tag this format serves

    @property
    def shape(self) -> tuple[int, int]: ...

    def dequantize(self) -> Tensor:
        """float32 [N, K]: the weight this format represents."""
        ...

    def nbytes(self) -> int:
        """Bytes the format holds (what a matmul reads)."""
        ...

    def concat(self, parts: list[Any]) -> QuantizedWeight:
        """`parts` (this weight among them, all of its type) stacked by rows."""
        ...

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows [start, stop), copied (a tensor-parallel shard)."""
        ...

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Input columns [start, stop), copied, whole quantization groups only (per-row scales
        and static input scales apply to any columns as they are)."""
        ...


def _whole_groups(group: int, start: int, stop: int) -> None:
    if start % group or stop % group:
        raise QuantizationError(
            f"columns {start}..{stop} of a shard split its quantization groups of {group}"
        )


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose rows are the parts' rows in order (the shards of a fused layer)."""
    first = parts[0]
    if any(type(part) is not type(first) for part in parts):
        kinds = ", ".join(type(part).__name__ for part in parts)
        raise QuantizationError(f"cannot fuse shards of different formats ({kinds})")
    return first.concat(parts)


def _fused_input_scale(parts: list[Any], kind: str) -> Tensor | None:
    """Fused shards share one activation: quantize it with the largest of their static scales
    (no shard's activations clip), as vLLM does. All shards have one, or none."""
    scales = [p.input_scale for p in parts]
    if all(s is None for s in scales):
        return None
    if any(s is None for s in scales):
        raise QuantizationError(f"cannot fuse {kind} shards where only some have an input_scale")
    return torch.stack([s.reshape(()) for s in scales]).amax()


def _check(condition: bool, name: str, problem: str) -> None:
    if not condition:
        raise QuantizationError(f"{name}: {problem}")


@dataclass(frozen=True)
class Int4Weight:
    q: Tensor  # uint8 [N, K], values 0..15
    scale: Tensor  # float32 [N, K // group_size]
    zero: Tensor  # float32 [N, K // group_size]
    group_size: int
    precision: ClassVar[str] = "int4_wo"

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def validate(self, name: str) -> Int4Weight:
        n, k = self.shape
        _check(self.q.dtype == torch.uint8, name, f"int4 values must be uint8, got {self.q.dtype}")
        _check(
            self.group_size in INT4_GROUP_SIZES,
            name,
            f"int4 group size {self.group_size} not in {INT4_GROUP_SIZES}",
        )
        _check(k % self.group_size == 0, name, f"group size {self.group_size} does not divide {k} inputs")
        groups = (n, k // self.group_size)
        for label, t in (("scale", self.scale), ("zero", self.zero)):
            _check(tuple(t.shape) == groups, name, f"{label} has shape {tuple(t.shape)}, expected {groups}")
            _check(t.dtype == torch.float32, name, f"{label} must be float32, got {t.dtype}")
        return self

    def dequantize(self) -> Tensor:
        n, k = self.shape
        q = self.q.view(n, k // self.group_size, self.group_size).float() - 8.0
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def nbytes(self) -> int:
        return self.q.numel() // 2 + 2 * self.scale.numel() * 2  # packed nibbles, 16-bit scale/zero

    def concat(self, parts: list[Int4Weight]) -> Int4Weight:
        if any(p.group_size != self.group_size for p in parts):
            raise QuantizationError("cannot fuse int4 shards of different group sizes")
        return Int4Weight(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            self.group_size,
        )

    def rows(self, start: int, stop: int) -> Int4Weight:
        r = slice(start, stop)
        return Int4Weight(self.q[r].clone(), self.scale[r].clone(), self.zero[r].clone(), self.group_size)

    def columns(self, start: int, stop: int) -> Int4Weight:
        _whole_groups(self.group_size, start, stop)
        groups = slice(start // self.group_size, stop // self.group_size)
        return Int4Weight(
            self.q[:, start:stop].clone(),
            self.scale[:, groups].clone(),
            self.zero[:, groups].clone(),
            self.group_size,
        )

    @staticmethod
    def quantize(weight: Tensor, group_size: int) -> Int4Weight:
        """Asymmetric min/max quantization per group (round to nearest)."""
        n, k = weight.shape
        groups = weight.float().reshape(n, k // group_size, group_size)
        low = groups.amin(-1)
        high = groups.amax(-1)
        scale = ((high - low) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return Int4Weight(q.reshape(n, k), scale, low + 8.0 * scale, group_size)


@dataclass(frozen=True)
class Int8Weight:
    q: Tensor  # int8 [N, K]
    scale: Tensor  # float32 [N]
    precision: ClassVar[str] = "int8_wo"

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def validate(self, name: str) -> Int8Weight:
        _check(self.q.dtype == torch.int8, name, f"int8 values must be int8, got {self.q.dtype}")
        _check(
            tuple(self.scale.shape) == (self.shape[0],), name, f"scale has shape {tuple(self.scale.shape)}"
        )
        _check(self.scale.dtype == torch.float32, name, f"scale must be float32, got {self.scale.dtype}")
        return self

    def dequantize(self) -> Tensor:
        return self.q.float() * self.scale[:, None]

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 2

    def concat(self, parts: list[Int8Weight]) -> Int8Weight:
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))

    def rows(self, start: int, stop: int) -> Int8Weight:
        return Int8Weight(self.q[start:stop].clone(), self.scale[start:stop].clone())

    def columns(self, start: int, stop: int) -> Int8Weight:
        return Int8Weight(self.q[:, start:stop].clone(), self.scale)

    @staticmethod
    def quantize(weight: Tensor) -> Int8Weight:
        """Symmetric per-row quantization (round to nearest, -127..127)."""
        w = weight.float()
        scale = (w.abs().amax(1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        return Int8Weight(q, scale)


@dataclass(frozen=True)
class FP8Weight:
    q: Tensor  # float8_e4m3fn [N, K]
    scale: Tensor  # float32 [N]
    input_scale: Tensor | None = None  # float32 scalar: static activation scale, x_fp8 = x / input_scale
    precision: ClassVar[str] = "fp8"

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def validate(self, name: str) -> FP8Weight:
        _check(
            self.q.dtype == torch.float8_e4m3fn,
            name,
            f"fp8 weights must be float8_e4m3fn, got {self.q.dtype}",
        )
        _check(
            tuple(self.scale.shape) == (self.shape[0],),
            name,
            f"weight_scale has shape {tuple(self.scale.shape)}",
        )
        _check(
            self.scale.dtype == torch.float32, name, f"weight_scale must be float32, got {self.scale.dtype}"
        )
        _check(
            bool(torch.isfinite(self.scale).all()) and bool((self.scale > 0).all()),
            name,
            "weight_scale holds non-positive or non-finite values",
        )
        if self.input_scale is not None:
            _check(
                self.input_scale.numel() == 1,
                name,
                f"input_scale must be one value, got {tuple(self.input_scale.shape)}",
            )
            _check(float(self.input_scale) > 0, name, "input_scale must be positive")
        return self

    def dequantize(self) -> Tensor:
        return self.q.float() * self.scale[:, None]

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def concat(self, parts: list[FP8Weight]) -> FP8Weight:
        q = torch.cat([p.q for p in parts])
        return FP8Weight(q, torch.cat([p.scale for p in parts]), _fused_input_scale(parts, "fp8"))

    def rows(self, start: int, stop: int) -> FP8Weight:
        return FP8Weight(self.q[start:stop].clone(), self.scale[start:stop].clone(), self.input_scale)

    def columns(self, start: int, stop: int) -> FP8Weight:
        return FP8Weight(self.q[:, start:stop].clone(), self.scale, self.input_scale)

    @staticmethod
    def quantize(weight: Tensor) -> FP8Weight:
        """Per-row scales (amax / 448); activations are then scaled per token at run time."""
        w = weight.float()
        scale = (w.abs().amax(1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return FP8Weight((w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale)


@dataclass(frozen=True)
class NVFP4Weight:
    packed: Tensor  # uint8 [N, K // 2]: element 2j in the low nibble, 2j + 1 in the high one
    block_scale: Tensor  # float8_e4m3fn [N, K // 16]
    global_scale: Tensor  # float32 [N]
    input_scale: Tensor | None = None  # float32 scalar (ModelOpt's activation global scale)
    precision: ClassVar[str] = "nvfp4"

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.packed.shape[0]), int(self.packed.shape[1]) * 2

    def validate(self, name: str) -> NVFP4Weight:
        n, k = self.shape
        _check(
            self.packed.dtype == torch.uint8,
            name,
            f"nvfp4 weights must be packed uint8, got {self.packed.dtype}",
        )
        _check(
            k % NVFP4_BLOCK == 0, name, f"{k} inputs are not a multiple of the {NVFP4_BLOCK}-element block"
        )
        blocks = (n, k // NVFP4_BLOCK)
        _check(
            tuple(self.block_scale.shape) == blocks,
            name,
            f"weight_scale has shape {tuple(self.block_scale.shape)}, expected {blocks}",
        )
        _check(
            self.block_scale.dtype == torch.float8_e4m3fn,
            name,
            f"weight_scale must be float8_e4m3fn, got {self.block_scale.dtype}",
        )
        _check(
            tuple(self.global_scale.shape) == (n,),
            name,
            f"weight_scale_2 has shape {tuple(self.global_scale.shape)}",
        )
        _check(
            self.global_scale.dtype == torch.float32,
            name,
            f"weight_scale_2 must be float32, got {self.global_scale.dtype}",
        )
        return self

    def dequantize(self, table: Tensor | None = None) -> Tensor:
        """`table`: E2M1_VALUES as a float32 tensor on the weights' device (layers keep one, so a
        CUDA graph capture never copies it from the host)."""
        n, k = self.shape
        if table is None:
            table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=self.packed.device)
        codes = torch.stack([self.packed & 0x0F, self.packed >> 4], dim=-1).view(n, k)
        values = table[codes.long()].view(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
        scales = self.block_scale.float() * self.global_scale[:, None]
        return (values * scales[..., None]).view(n, k)

    def nbytes(self) -> int:
        return self.packed.numel() + self.block_scale.numel() + self.global_scale.numel() * 4

    def concat(self, parts: list[NVFP4Weight]) -> NVFP4Weight:
        return NVFP4Weight(
            torch.cat([p.packed for p in parts]),
            torch.cat([p.block_scale for p in parts]),
            torch.cat([p.global_scale for p in parts]),
            _fused_input_scale(parts, "nvfp4"),
        )

    def rows(self, start: int, stop: int) -> NVFP4Weight:
        r = slice(start, stop)
        return NVFP4Weight(
            self.packed[r].clone(),
            self.block_scale[r].clone(),
            self.global_scale[r].clone(),
            self.input_scale,
        )

    def columns(self, start: int, stop: int) -> NVFP4Weight:
        _whole_groups(NVFP4_BLOCK, start, stop)
        blocks = slice(start // NVFP4_BLOCK, stop // NVFP4_BLOCK)
        return NVFP4Weight(
            self.packed[:, start // 2 : stop // 2].clone(),
            self.block_scale[:, blocks].clone(),
            self.global_scale,
            self.input_scale,
        )


def int4_group_size(k: int, preferred: int) -> int:
    """The largest supported group size up to `preferred` that divides k."""
    for size in sorted(INT4_GROUP_SIZES, reverse=True):
        if size <= preferred and k % size == 0:
            return size
    raise QuantizationError(f"no int4 group size in {INT4_GROUP_SIZES} divides {k} inputs")


# Each quantized precision's storage format (its spec names the class), by precision tag.
FORMATS: dict[str, type[QuantizedWeight]] = {
    spec.name: globals()[spec.storage_format] for spec in SPECS if spec.storage_format is not None
}


def quantize(weight: Tensor, precision: str, name: str, int4_group: int = 128) -> QuantizedWeight:
    """Quantize a float [N, K] weight at load into `precision`'s format (its `quantize`)."""
    if weight.dim() != 2:
        raise QuantizationError(f"{name}: only 2-D weights are quantized, got shape {tuple(weight.shape)}")
    spec = PRECISION_SPECS.get(precision)
    if spec is None or not spec.quantized_at_load:
        raise QuantizationError(f"{name}: weights are not quantized to {precision} at load")
    kind: Any = FORMATS[precision]
    if kind is Int4Weight:  # the one format with a group size to choose
        return Int4Weight.quantize(weight, int4_group_size(weight.shape[1], int4_group))
    quantized: QuantizedWeight = kind.quantize(weight)
    return quantized


# GGUF block layouts (ggml-common.h): 32 weights per block, fp16 scale(s) first.
GGUF_BLOCK = 32


def gguf_q4_0(raw: np.ndarray, n: int, k: int) -> Int4Weight:
    """Q4_0 rows ([n, k/32 * 18] bytes: d, 16 bytes of nibbles) as Int4Weight, exactly."""
    blocks = raw.reshape(n, k // GGUF_BLOCK, 18)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = _gguf_nibbles(blocks[..., 2:], n, k)
    return Int4Weight(q, torch.from_numpy(d), torch.zeros(d.shape, dtype=torch.float32), GGUF_BLOCK)


def gguf_q4_1(raw: np.ndarray, n: int, k: int) -> Int4Weight:
    """Q4_1 rows ([n, k/32 * 20] bytes: d, m, 16 bytes of nibbles) as Int4Weight, exactly."""
    blocks = raw.reshape(n, k // GGUF_BLOCK, 20)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = _gguf_nibbles(blocks[..., 4:], n, k)
    return Int4Weight(q, torch.from_numpy(d), torch.from_numpy(m + 8.0 * d), GGUF_BLOCK)


def _gguf_nibbles(qs: np.ndarray, n: int, k: int) -> Tensor:
    # Byte j of a block holds weight j in its low nibble and weight j + 16 in its high one.
    low = qs & 0x0F
    high = qs >> 4
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([low, high], axis=-1).reshape(n, k)))
