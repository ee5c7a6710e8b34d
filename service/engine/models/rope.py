"""Rotary position embedding (RoPE) for the Llama family: the inverse frequencies (plain, linear,
Llama 3 scaling), the cos/sin tables indexed by position, and what rotates a step's q and k.

Rotate-half RoPE with cos/sin computed in float32 then cast to the activation dtype, as
transformers computes it, so rotated q/k match it to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from service.engine.models import triton_ops
from service.engine.native import fused_ops
from service.model.config import ModelConfig, UnsupportedModelError


def rope_inverse_frequencies(config: ModelConfig) -> Tensor:
    """float32 [head_dim // 2] inverse frequencies, computed exactly as transformers does (on CPU)."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    scaling = config.rope_scaling
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if scaling is None or rope_type in ("default", "dynamic"):
        # dynamic NTK only changes frequencies past max_position_embeddings, which the cos/sin cache
        # does not cover; within it HF uses the plain frequencies too.
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inverse_frequencies(inv_freq, scaling)
    else:
        raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported")
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq


def _llama3_inverse_frequencies(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    # Mirrors transformers' _compute_llama3_parameters.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_position_embeddings, indexed by position.

    The tables hold half the head dim: rotate-half RoPE uses the same angle for element i and
    i + D/2, so ``x1 * cos - x2 * sin`` / ``x2 * cos + x1 * sin`` on the halves is exactly HF's
    ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``, element by element.
    """

    cos_cached: Tensor
    sin_cached: Tensor

    def __init__(self, config: ModelConfig, fused: bool = False, native: bool = False) -> None:
        super().__init__()
        self.config = config
        self.fused = fused  # the Triton kernel where the positions are on CUDA
        self.native = native  # the CPU: TableRope as one native op (BuildOptions.cpu_fused_ops)
        half = config.head_dim // 2
        # Non-persistent: derived from the config, never part of a checkpoint.
        self.register_buffer(
            "cos_cached", torch.empty(config.max_position_embeddings, half), persistent=False
        )
        self.register_buffer(
            "sin_cached", torch.empty(config.max_position_embeddings, half), persistent=False
        )
        if self.cos_cached.device.type != "meta":
            self.reset_cache()

    def materialize(self, device: torch.device) -> None:
        """Real (not yet computed) tables on `device` in place of 'meta' ones, made directly:
        `Module.to_empty` goes through the meta tensors' Python kernel, whose first use imports
        sympy (0.65 s of every start)."""
        for name in ("cos_cached", "sin_cached"):
            table = getattr(self, name)
            setattr(self, name, torch.empty(table.shape, dtype=table.dtype, device=device))

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Recompute the tables in float32 on CPU (as HF computes inv_freq) into the buffers' dtype/device."""
        inv_freq = rope_inverse_frequencies(self.config)
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        self.cos_cached.copy_(freqs.cos())
        self.sin_cached.copy_(freqs.sin())

    def lookup(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin: [T, 1, D/2] in ``dtype``, broadcastable over heads."""
        cos = self.cos_cached[positions].to(dtype)
        sin = self.sin_cached[positions].to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def lookup_full(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """HF's full-width tables for ``positions``: cos = [cos, cos] and a signed sin = [-sin, sin],
        each [T, 1, D] in ``dtype``, so RoPE is x * cos + swap_halves(x) * sin."""
        cos, sin = self.lookup(positions, dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def for_positions(self, positions: Tensor, dtype: torch.dtype) -> Rope:
        """What rotates this batch's q and k: one lookup shared by every layer, or the fused kernel."""
        if self.fused and triton_ops.runs_on(positions) and self.config.head_dim in (64, 128, 256):
            return FusedRope(positions, self.cos_cached, self.sin_cached)
        cos, sin = self.lookup_full(positions, dtype)  # [T, 1, D] each
        return TableRope(cos, sin, self.native and positions.device.type == "cpu")


class Rope(Protocol):
    def __call__(self, x: Tensor) -> Tensor:
        """Rotate x: [T, H, D] by each token's position (possibly in place); returns the result."""
        ...


@dataclass(frozen=True)
class TableRope:
    """Rotate-half RoPE from full-width tables (RotaryEmbedding.lookup_full), shared by every
    layer of a step, in place: three ops and a copy per call, each element rounded as HF rounds it
    (x1 * cos + x2 * -sin is bitwise x1 * cos - x2 * sin)."""

    cos: Tensor  # [T, 1, D]: [cos, cos]
    sin: Tensor  # [T, 1, D]: [-sin, sin]
    native: bool = False  # the three ops as one (native/fused_ops.rope_: bitwise theirs)

    def __call__(self, x: Tensor) -> Tensor:
        if self.native:
            return fused_ops.rope_(x, self.cos, self.sin)
        rotated = x.roll(x.shape[-1] // 2, -1).mul_(self.sin)  # [x2, x1] * [-sin, sin]
        return x.mul_(self.cos).add_(rotated)


@dataclass(frozen=True)
class FusedRope:
    positions: Tensor  # [T]
    cos_table: Tensor  # [max_positions, D/2]
    sin_table: Tensor

    def __call__(self, x: Tensor) -> Tensor:
        triton_ops.rotary_(x, self.positions, self.cos_table, self.sin_table)
        return x
