"""The seam between model code and KV-cache management.

Model code computes q, k and v (rotary embedding already applied) and hands them to an
``Attention`` object; the object owns where keys and values are stored (nowhere, a dense
per-sequence cache, or a paged block pool) and returns the attention output. Models therefore
know nothing about caches, and engines can change cache layouts without touching model code.

Each call may narrow what a query sees and how its scores are scaled: ``window`` (a sliding-window
layer: the query at position p sees keys at positions p - window < j <= p; None: every earlier
key) and ``scale`` (the factor on q·k; None: head_dim ** -0.5). Every implementation honours both.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Attention(Protocol):
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
        """Attend the new tokens' queries over the keys the context holds (the last `window`
        positions, the query's own included, when a window is given).

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T new tokens,
        in the flat token order the model was called with. Returns [T, num_heads, head_dim].
        """
        ...


def check_window(window: int | None) -> None:
    """Refuse a window that sees nothing (a query always sees at least its own key)."""
    if window is not None and window < 1:
        raise ValueError(f"attention window {window} must be at least 1")


class CausalAttention:
    """One sequence, no cache: plain causal self-attention over the tokens given."""

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
        check_window(window)
        # [T, H, D] -> [H, T, D] for SDPA; enable_gqa broadcasts kv heads over query groups.
        queries, keys, values = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if window is None:
            out = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            key_pos = torch.arange(q.shape[0], device=q.device)
            query_pos = key_pos[:, None]
            visible = (key_pos[None, :] <= query_pos) & (key_pos[None, :] > query_pos - window)  # [T, T]
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=visible, scale=scale, enable_gqa=True
            )
        return out.transpose(0, 1)
