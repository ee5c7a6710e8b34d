"""CPU decode steps as one TorchScript call: the whole decoder stack without Python per op.

A CPU decode step of a small model is mostly per-op cost, not arithmetic: the embedded 30-layer
model issues ~40 Python-level tensor calls per layer (~1,200 a step), each parsing its arguments
and dispatching before its kernel runs. For a decode-only step (every sequence one token, no
prefill chunk) `ScriptedDecoder` runs every decoder layer in one `torch.jit.script` function: the
TorchScript interpreter dispatches the same ATen ops from C++ (and without the GIL, so the HTTP
thread runs beside it). At batch 1 this takes 20-40% off the step, depending on the run
(bench/README.md).

Invariant: the scripted stack calls the same ops, in the same order, on the same tensors as the
eager path (LlamaDecoderLayer and its linears, KVPool.write / gather_pair / run_pair and
PagedAttention._decode), so its hidden states are bitwise the eager ones: batch invariance and the
numerics against transformers hold unchanged (tests/test_scripted_decode.py holds the two
together; a change to either side must keep it). Steps with prefill chunks run eagerly.

Where it does not apply the engine runs decode steps eagerly and says why once at start-up:
tensor parallelism, LoRA, a quantized KV cache, or a linear layer other than the CPU's native
ones (float, oneDNN-packed, int4 and int8 weight-only). NIM_ENFORCE_EAGER=1 turns it off.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.engine.models.base import CausalLM, HasLlamaStack
from service.engine.models.cpu_linear import MIN_ROWS, PackedLinear
from service.engine.models.lora_ops import AdaptedLinear
from service.engine.models.quant_linear import Int4Linear, Int8Linear
from service.engine.torch.kv_pool import KVPool
from service.engine.torch.paged_attention import AttentionMetadata

# How a linear layer computes, as the scripted stack branches on it (each mirrors its module's forward).
FLOAT: Final = 0  # nn.Linear: F.linear
PACKED: Final = 1  # PackedLinear: oneDNN's packed matmul, small batches padded where it says so
INT4: Final = 2  # Int4Linear (native): aten's CPU int4 kernel, padded output rows cut
INT8: Final = 3  # Int8Linear (native): aten's int8 weight-only kernel

# The linear layers of a decoder layer (CausalLM.linear_layers roles), in the stack's order.
_ROLES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class LinearArgs:
    """One linear layer as the scripted stack takes it."""

    kind: int
    weight: Tensor  # the weight as the kernel takes it (packed for PACKED and INT4)
    aux: Tensor  # INT4: scales and zeros; INT8: scales; else an empty tensor
    bias: Tensor | None
    group: int  # INT4: the group size; else 0
    out_features: int
    pad_rows: int  # PACKED: batches of fewer rows are padded to this many; else 0


def linear_args(module: nn.Module) -> LinearArgs | None:
    """`module` as the scripted stack runs it; None where only its own forward can."""
    none = torch.empty(0)
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


def _linear(
    x: Tensor,
    kind: int,
    weight: Tensor,
    aux: Tensor,
    bias: Tensor | None,
    group: int,
    out_features: int,
    pad_rows: int,
) -> Tensor:
    if kind == 2:  # INT4, as Int4Linear.forward (the kernel computes in its scales' dtype)
        out = torch._weight_int4pack_mm_for_cpu(x.to(aux.dtype), weight, group, aux).to(x.dtype)
        if out.shape[-1] != out_features:
            out = out[..., :out_features]
        return out if bias is None else out + bias
    if kind == 3:  # INT8, as Int8Linear.forward
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


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """TableRope, in place."""
    rotated = x.roll(x.shape[-1] // 2, -1).mul_(sin)
    return x.mul_(cos).add_(rotated)


def _decode_stack(
    hidden: Tensor,  # [B, hidden]: the embedded tokens
    cos: Tensor,  # [B, 1, D] (RotaryEmbedding.lookup_full)
    sin: Tensor,
    slots: Tensor,  # [B] cache slots of the new tokens
    mask: Tensor,  # [B, 1, 1, L] additive
    pools: list[Tensor],  # KVPool.data: one per layer
    block_ids: Tensor | None,  # gathered pool rows, or
    run_first: int,  # a lone decode's ascending block run, read in place (block_ids None)
    run_count: int,
    block_size: int,
    norms: list[Tensor],  # per layer: input, post-attention
    qk_norms: list[Tensor],  # per layer: q, k (empty: the model has none)
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
    width = hidden.shape[1]
    q_size = num_heads * head_dim
    kv_size = num_kv_heads * head_dim
    residual = hidden
    normed = hidden
    for layer in range(len(pools)):
        # LlamaDecoderLayer: the residual connection is added by the next norm.
        residual = hidden if layer == 0 else hidden + residual
        normed = norms[2 * layer] * torch.rms_norm(residual, [width], None, eps)
        i = 4 * layer
        qkv = _linear(normed, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
        v = qkv[:, q_size + kv_size :].view(batch, num_kv_heads, head_dim)
        if len(qk_norms) > 0:
            q = qk_norms[2 * layer] * torch.rms_norm(
                qkv[:, :q_size].view(batch, num_heads, head_dim), [head_dim], None, eps
            )
            k = qk_norms[2 * layer + 1] * torch.rms_norm(
                qkv[:, q_size : q_size + kv_size].view(batch, num_kv_heads, head_dim), [head_dim], None, eps
            )
            q = _rope(q, cos, sin)
            k = _rope(k, cos, sin)
        else:
            qk = _rope(qkv[:, : q_size + kv_size].view(batch, num_heads + num_kv_heads, head_dim), cos, sin)
            split = qk.split([num_heads, num_kv_heads], 1)  # type: ignore[no-untyped-call]
            q, k = split[0], split[1]
        # KVPool.write (a cache in the activations' dtype), then PagedAttention._decode.
        data = pools[layer].view(2, num_kv_heads, -1, head_dim)
        data[:, :, slots] = torch.stack((k, v)).transpose(1, 2)
        if block_ids is None:
            both = (
                pools[layer]
                .view(2, num_kv_heads, -1, block_size, head_dim)[:, :, run_first : run_first + run_count]
                .reshape(2, num_kv_heads, run_count * block_size, head_dim)
            )
        else:
            both = pools[layer].view(-1, block_size, head_dim).index_select(0, block_ids)
            both = both.view(2, num_kv_heads, -1, head_dim)
        kv = both.view(2, num_kv_heads, batch, mask.shape[-1], head_dim).transpose(1, 2).unbind(0)
        queries = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(queries, kv[0], kv[1], attn_mask=mask, scale=scale)
        i += 1
        attended = _linear(
            out.reshape(batch, q_size), kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i]
        )
        residual = attended + residual
        normed = norms[2 * layer + 1] * torch.rms_norm(residual, [width], None, eps)
        i += 1
        gate_up = _linear(normed, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
        activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        i += 1
        hidden = _linear(activated, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
    summed = hidden + residual
    return final_norm * torch.rms_norm(summed, [width], None, eps)


@functools.cache
def _scripted_stack() -> Any:
    """`_decode_stack` compiled by TorchScript (once a process, with `_linear` and `_rope`).

    torch.jit.script warns that it is deprecated in favour of torch.compile; on this path
    torch.compile measured slower (its int4 kernel swap and per-call wrappers, bench/README.md)
    and rounds differently from the eager ops, which breaks the invariant above. Should a torch
    release drop TorchScript, `ScriptedDecoder.build` catches the failure and decodes eagerly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        return torch.jit.script(_decode_stack)


class ScriptedDecoder:
    """Runs a decode-only step's decoder layers as one `_decode_stack` call (see the module docstring)."""

    def __init__(self, model: CausalLM, pool: KVPool, layers: list[list[LinearArgs]]) -> None:
        self.model = model
        self.pool = pool
        config = model.config
        stack = model.llama_stack() if isinstance(model, HasLlamaStack) else None
        assert stack is not None, "build() decodes eagerly where the model is shaped otherwise"
        self._stack = stack
        self._norms: list[Tensor] = list(stack.norms)  # per layer: input, post-attention
        self._qk_norms: list[Tensor] = list(stack.qk_norms)  # per layer: q, k (empty: none)
        flat = [args for layer in layers for args in layer]
        self._linears: tuple[Any, ...] = (
            [a.kind for a in flat],
            [a.weight for a in flat],
            [a.aux for a in flat],
            [a.bias for a in flat],
            [a.group for a in flat],
            [a.out_features for a in flat],
            [a.pad_rows for a in flat],
        )
        self._dims = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.rms_norm_eps,
            1.0 / math.sqrt(config.head_dim),  # PagedAttention's scale
        )

    @classmethod
    def build(cls, model: CausalLM, pool: KVPool) -> ScriptedDecoder | str:
        """The decoder for `model` over `pool`, or why decode steps must run eagerly (the engine's
        decode path, service.engine.torch.decode_path, logs which)."""
        reason = cls._unsupported(model, pool)
        by_layer: dict[int, dict[str, nn.Module]] = {}
        for linear in model.linear_layers() if reason is None else []:
            by_layer.setdefault(linear.layer, {})[linear.role] = linear.module
        layers: list[list[LinearArgs]] = []
        for index, roles in by_layer.items():
            modules = {role: roles[role] for role in _ROLES}
            found = {name: linear_args(module) for name, module in modules.items()}
            missing = [name for name, args in found.items() if args is None]
            if missing:
                kind = type(modules[missing[0]]).__name__
                reason = f"layer {index}'s {missing[0]} ({kind}) runs only through its own forward"
                break
            layers.append([args for args in found.values() if args is not None])
        if reason is None:
            try:
                _scripted_stack()
            except Exception as error:  # a TorchScript that cannot compile it: eager still runs
                reason = f"TorchScript cannot compile the step ({type(error).__name__}: {error})"
        if reason is not None:
            return reason
        return cls(model, pool, layers)

    @staticmethod
    def _unsupported(model: CausalLM, pool: KVPool) -> str | None:
        if not isinstance(model, HasLlamaStack) or model.llama_stack() is None:
            return "the model's layers are not the Llama shape the scripted stack runs"
        if pool.scales is not None:
            return f"the {pool.spec.cache_dtype} KV cache is dequantized by the eager path"
        dtype = model.activation_dtype
        if pool.data[0].dtype != dtype:
            return f"the KV cache holds {pool.data[0].dtype}, the activations are {dtype}"
        if model.tensor_parallel:
            return "tensor parallelism all-reduces between the layers"
        if any(isinstance(linear.module, AdaptedLinear) for linear in model.linear_layers()):
            return "LoRA adapters wrap the projections"
        if model.device.type != "cpu":
            return "the model is not on the CPU"
        return None

    @staticmethod
    def can_run(meta: AttentionMetadata) -> bool:
        """Whether the step `meta` describes is one it runs: decodes only, attended on the CPU path."""
        return not meta.prefills and meta.decode_mask is not None and meta.decode_tables is None

    def __call__(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """input_ids, positions: [B] (one token per sequence) -> final-norm hidden states [B, hidden],
        bitwise `model(input_ids, positions, PagedAttention(pool, meta, ...))`."""
        assert self.can_run(meta) and meta.decode_mask is not None
        stack = self._stack
        hidden = stack.embedding(input_ids)
        cos, sin = stack.rope_tables(positions, hidden.dtype)
        run = meta.decode_block_run
        first, count = run if run is not None else (0, 0)
        result: Tensor = _scripted_stack()(
            hidden,
            cos,
            sin,
            meta.slot_mapping,
            meta.decode_mask,
            self.pool.data,
            meta.decode_block_ids if run is None else None,
            first,
            count,
            self.pool.spec.block_size,
            self._norms,
            self._qk_norms,
            *self._linears,
            stack.final_norm,
            *self._dims,
        )
        return result
