"""Gemma 3 CPU decode steps as one TorchScript call (the Llama-shaped stacks' is scripted_decode.py).

`_gemma_stack` runs every Gemma3DecoderLayer of a decode-only step as models/gemma3.py does, op for
op: Gemma RMSNorm (float32 norm times 1 + w, cast back) around each sublayer and on q and k, GeGLU
(tanh gelu), sliding-window layers rotating with the local RoPE table and attending under the
step's mask narrowed to their window (built once a step as PagedAttention._decode_window builds
it), the others with the full table and mask, each with the model's attention scale. Its hidden
states are bitwise the eager forward's (tests/test_scripted_decode.py runs both on every step).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from service.engine.models.base import GemmaStack
from service.engine.torch.scripted_ops import attend, linear, rotate_


def _norm(x: Tensor, plus_one: Tensor, eps: float) -> Tensor:
    """GemmaRMSNorm.forward, its 1 + w computed once (GemmaStack)."""
    return (torch.rms_norm(x.float(), [x.shape[-1]], None, eps) * plus_one).to(x.dtype)


def _gemma_stack(
    hidden: Tensor,  # [B, hidden]: the embedded tokens, scaled
    cos: Tensor,  # [B, 1, D]: full-attention layers' tables (RotaryEmbedding.lookup_full)
    sin: Tensor,
    local_cos: Tensor,  # sliding-window layers' tables
    local_sin: Tensor,
    slots: Tensor,  # [B] cache slots of the new tokens
    mask: Tensor,  # [B, 1, 1, L] additive
    window_mask: Tensor,  # the same narrowed to the window (empty: no windowed layer)
    windowed: list[bool],  # per layer
    pools: list[Tensor],  # KVPool.data: one per layer
    block_ids: Tensor | None,  # gathered pool rows, or
    run_first: int,  # one sequence's ascending block run, read in place (block_ids None)
    run_count: int,
    block_size: int,
    norms: list[Tensor],  # per layer: input, post-attention, pre-feedforward, post-feedforward
    qk_norms: list[Tensor],  # per layer: q, k
    kinds: list[int],  # per layer: qkv, o, gate_up, down (LinearArgs, field by field)
    weights: list[Tensor],
    auxes: list[Tensor],
    biases: list[Tensor | None],
    groups: list[int],
    outs: list[int],
    pads: list[int],
    final_norm: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate: int,
    eps: float,
    scale: float,
) -> Tensor:
    batch = hidden.shape[0]
    q_size = num_heads * head_dim
    kv_size = num_kv_heads * head_dim
    for layer in range(len(pools)):
        n, i = 4 * layer, 4 * layer
        normed = _norm(hidden, norms[n], eps)
        qkv = linear(normed, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
        q = _norm(qkv[:, :q_size].view(batch, num_heads, head_dim), qk_norms[2 * layer], eps)
        k = _norm(
            qkv[:, q_size : q_size + kv_size].view(batch, num_kv_heads, head_dim),
            qk_norms[2 * layer + 1],
            eps,
        )
        v = qkv[:, q_size + kv_size :].view(batch, num_kv_heads, head_dim)
        if windowed[layer]:
            q, k, layer_mask = rotate_(q, local_cos, local_sin), rotate_(k, local_cos, local_sin), window_mask
        else:
            q, k, layer_mask = rotate_(q, cos, sin), rotate_(k, cos, sin), mask
        out = attend(
            q, k, v, pools[layer], slots, layer_mask, block_ids, run_first, run_count, block_size, scale
        )
        i += 1
        attended = linear(out, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
        hidden = hidden + _norm(attended, norms[n + 1], eps)
        fed_in = _norm(hidden, norms[n + 2], eps)
        i += 1
        gate_up = linear(fed_in, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
        activated = F.gelu(gate_up[:, :intermediate], approximate="tanh") * gate_up[:, intermediate:]
        i += 1
        fed = linear(activated, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
        hidden = hidden + _norm(fed, norms[n + 3], eps)
    return _norm(hidden, final_norm, eps)


@functools.cache
def scripted_gemma_stack() -> Any:
    """`_gemma_stack` compiled by TorchScript, once a process (see scripted_decode._scripted_stack)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        return torch.jit.script(_gemma_stack)


def window_of(stack: GemmaStack) -> int | None:
    """The one window the stack's sliding layers share (None: no windowed layer); ValueError where
    they differ (the step builds one narrowed mask)."""
    windows = {window for window in stack.windows if window is not None}
    if len(windows) > 1:
        raise ValueError(f"sliding-window layers of different windows ({sorted(windows)})")
    return windows.pop() if windows else None
