"""The pieces every scripted CPU decode stack is made of (scripted_decode.py: Llama-shaped stacks;
scripted_gemma.py: Gemma 3): a linear layer of each native CPU kind, RoPE from full-width tables,
and a decode step's attention (the cache write, then attention over the gathered or in-place
blocks). Each mirrors, op for op, the eager code it stands in for (named at each), which keeps a
scripted step bitwise the eager one; TorchScript compiles them with the stack that calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.engine.models.cpu_linear import MIN_ROWS, PackedLinear
from service.engine.models.quant_linear import Int4Linear, Int8Linear

# How a linear layer computes, as the scripted stack branches on it (each mirrors its module's forward).
FLOAT: Final = 0  # nn.Linear: F.linear
PACKED: Final = 1  # PackedLinear: oneDNN's packed matmul, small batches padded where it says so
INT4: Final = 2  # Int4Linear (native): aten's CPU int4 kernel, padded output rows cut
INT8: Final = 3  # Int8Linear (native): aten's int8 weight-only kernel
W4A8: Final = 4  # Int4Linear on the W4A8 kernel (native/w4a8.py): any input dtype, exact output rows

# The linear layers of a decoder layer (CausalLM.linear_layers roles), in the stack's order.
_ROLES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class LinearArgs:
    """One linear layer as the scripted stack takes it."""

    kind: int
    weight: Tensor  # the weight as the kernel takes it (packed for PACKED and INT4)
    aux: Tensor  # INT4: scales and zeros; W4A8: scales and mins; INT8: scales; else an empty tensor
    bias: Tensor | None
    group: int  # INT4 and W4A8: the group size; else 0
    out_features: int
    pad_rows: int  # PACKED: batches of fewer rows are padded to this many; else 0


def linear_args(module: nn.Module) -> LinearArgs | None:
    """`module` as the scripted stack runs it; None where only its own forward can."""
    none = torch.empty(0)
    if isinstance(module, Int4Linear) and module.native and module.kernel == "w4a8":
        return LinearArgs(
            W4A8, module.packed, module.scales_zeros, module.bias, module.group_size, module.out_features, 0
        )
    if isinstance(module, Int4Linear) and module.native:
        return LinearArgs(
            INT4, module.packed, module.scales_zeros, module.bias, module.group_size, module.out_features, 0
        )
    if isinstance(module, Int8Linear) and module.native:
        return LinearArgs(INT8, module.q, module.scale, module.bias, 0, module.out_features, 0)
    if isinstance(module, PackedLinear):
        pad = MIN_ROWS if module.pad_small else 0
        return LinearArgs(PACKED, module.packed, none, module.bias, 0, module.out_features, pad)
    if type(module) is nn.Linear:
        return LinearArgs(FLOAT, module.weight, none, module.bias, 0, module.out_features, 0)
    return None


def linear(
    x: Tensor,
    kind: int,
    weight: Tensor,
    aux: Tensor,
    bias: Tensor | None,
    group: int,
    out_features: int,
    pad_rows: int,
) -> Tensor:
    # The int kernels compute in their scales' dtype; where it is the input's, the casts of
    # Int4Linear / Int8Linear.forward are no-ops, not dispatched here (two ops a linear fewer).
    if kind == 4:  # W4A8, as Int4Linear.forward
        w4a8: Tensor = torch.ops.nim_cpu.w4a8_linear(x, weight, aux, group, out_features)
        return w4a8 if bias is None else w4a8 + bias
    if kind == 2:  # INT4, as Int4Linear.forward
        if aux.dtype == x.dtype:
            out = torch._weight_int4pack_mm_for_cpu(x, weight, group, aux)
        else:
            out = torch._weight_int4pack_mm_for_cpu(x.to(aux.dtype), weight, group, aux).to(x.dtype)
        if out.shape[-1] != out_features:
            out = out[..., :out_features]
        return out if bias is None else out + bias
    if kind == 3:  # INT8, as Int8Linear.forward
        if aux.dtype == x.dtype:
            out = torch._weight_int8pack_mm(x, weight, aux)
        else:
            out = torch._weight_int8pack_mm(x.to(aux.dtype), weight, aux).to(x.dtype)
        return out if bias is None else out + bias
    if kind == 1:  # PACKED, as PackedLinear.forward
        rows = x.shape[0]
        if rows < pad_rows:
            padded = torch.cat([x, x.new_zeros(pad_rows - rows, x.shape[1])])
            packed: Tensor = torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [], "")
            return packed[:rows]
        packed = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return packed
    return F.linear(x, weight, bias)


def rotate_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """TableRope, in place."""
    rotated = x.roll(x.shape[-1] // 2, -1).mul_(sin)
    return x.mul_(cos).add_(rotated)


def attend_in_place(
    q: Tensor,  # [B, Hq, D], rotated
    k: Tensor,  # [B, Hkv, D], rotated
    v: Tensor,  # [B, Hkv, D]
    pool: Tensor,  # KVPool.data[layer]: [2, Hkv, blocks, block_size, D]
    slots: Tensor,  # [B] cache slots of the new tokens
    tables: Tensor,  # [B, N] each row's block table
    lens: Tensor,  # [B] each row's context length
    scale: float,
) -> Tensor:
    """KVPool.write (a cache in the activations' dtype), then PagedAttention._decode through the
    native kernel (DecodeAttention.NATIVE), in one op: [B, Hq * D]."""
    batch, num_heads, head_dim = q.shape
    out: Tensor = torch.ops.nim_cpu.decode_attention(q, pool, tables, lens, scale, 0, k, v, slots)
    return out.reshape(batch, num_heads * head_dim)


def attend(
    q: Tensor,  # [B, Hq, D], rotated
    k: Tensor,  # [B, Hkv, D], rotated
    v: Tensor,  # [B, Hkv, D]
    pool: Tensor,  # KVPool.data[layer]
    slots: Tensor,  # [B] cache slots of the new tokens
    mask: Tensor,  # [B, 1, 1, L] additive (narrowed to the layer's window, if any)
    block_ids: Tensor | None,  # gathered pool rows, or
    run_first: int,  # one sequence's ascending block run, read in place (block_ids None)
    run_count: int,
    block_size: int,
    scale: float,
) -> Tensor:
    """KVPool.write (a cache in the activations' dtype), then PagedAttention._decode: [B, Hq * D]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    data = pool.view(2, num_kv_heads, -1, head_dim)
    data.index_copy_(2, slots, torch.stack((k, v)).transpose(1, 2))
    if block_ids is None:
        both = pool.view(2, num_kv_heads, -1, block_size, head_dim)[
            :, :, run_first : run_first + run_count
        ].reshape(2, num_kv_heads, run_count * block_size, head_dim)
    else:
        both = pool.view(-1, block_size, head_dim).index_select(0, block_ids)
        both = both.view(2, num_kv_heads, -1, head_dim)
    if block_ids is None:  # every row reads the one run (a lone decode, or one sequence's verify rows)
        kv = both.unsqueeze(1).expand(2, batch, num_kv_heads, mask.shape[-1], head_dim).unbind(0)
    else:
        kv = both.view(2, num_kv_heads, batch, mask.shape[-1], head_dim).transpose(1, 2).unbind(0)
    queries = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(queries, kv[0], kv[1], attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads * head_dim)
