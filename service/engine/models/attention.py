"""The seam between model code and KV-cache management.

Model code computes q, k and v (rotary embedding already applied) and hands them to an
``Attention`` object; the object owns where keys and values are stored (nowhere, a dense
per-sequence cache, or a paged block pool) and returns the attention output. Models therefore
know nothing about caches, and engines can change cache layouts without touching model code.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend the new tokens' queries over every key the context holds.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T new tokens,
        in the flat token order the model was called with. Returns [T, num_heads, head_dim].
        """
        ...


class CausalAttention:
    """One sequence, no cache: plain causal self-attention over the tokens given."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # [T, H, D] -> [H, T, D] for SDPA; enable_gqa broadcasts kv heads over query groups.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)
