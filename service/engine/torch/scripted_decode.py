"""CPU decode steps as one TorchScript call: the whole decoder stack without Python per op.

A CPU decode step of a small model is mostly per-op cost, not arithmetic: the embedded 30-layer
model issues ~40 Python-level tensor calls per layer (~1,200 a step), each parsing its arguments
and dispatching before its kernel runs. For a decode-only step (every sequence one token, no
prefill chunk) `ScriptedDecoder` runs every decoder layer in one `torch.jit.script` function: the
TorchScript interpreter dispatches the same ATen ops from C++ (and without the GIL, so the HTTP
thread runs beside it). At batch 1 this takes 20-40% off the step, depending on the run
(bench/README.md).

Two stacks: `_decode_stack` here for Llama-shaped models (Llama, Qwen, Mistral: LlamaStack),
routed layers included (Qwen3-MoE, Mixtral: `_routed_mlp`), and scripted_gemma.py's for Gemma 3
(GemmaStack), both built of scripted_ops.py's linear, RoPE and attention.

Invariant: the scripted stack calls the same ops, in the same order, on the same tensors as the
eager path (LlamaDecoderLayer, SparseMoeBlock or Gemma3DecoderLayer and their linears, KVPool.write /
gather_pair / run_pair and PagedAttention._decode), so its hidden states are bitwise the eager
ones (two exceptions, bitwise too: a one-token routed MLP runs its chosen experts without the
grouped path's sort, their SiLU-mul as one call, `_routed_mlp`; Qwen3's q and k norms and RoPE
run as one call each over the adjacent q and k heads, as the eager layer rotates them without
norms, where it calls each twice; both are row-wise): batch invariance and the numerics against
transformers hold unchanged (tests/test_scripted_decode.py holds the two together; a change to
either side must keep it).
Steps with prefill chunks run eagerly. A step whose other sequences verify drafts (speculative
decoding) is a decode-only step too: the model runner lays each verified token out as a decode row
of its own, attending to its sequence's context up to itself (model_runner._verify_rows).

Where it does not apply the engine runs decode steps eagerly and says why once at start-up:
tensor parallelism, LoRA, a quantized KV cache, or a linear layer other than the CPU's native
ones (float, oneDNN-packed, int4 and int8 weight-only). NIM_ENFORCE_EAGER=1 turns it off.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.engine.models.base import (
    CausalLM,
    GemmaStack,
    HasGemmaStack,
    HasLlamaStack,
    LlamaStack,
    RoutedMlp,
)
from service.engine.models.lora_ops import AdaptedLinear
from service.engine.native import fused_ops as _fused_ops  # noqa: F401  (declares the ops the stack calls)
from service.engine.torch.kv_pool import KVPool
from service.engine.torch.paged_attention import AttentionMetadata, windowed_decode_mask
from service.engine.torch.scripted_gemma import scripted_gemma_stack, window_of
from service.engine.torch.scripted_ops import (
    FLOAT,
    LinearArgs,
    attend,
    attend_in_place,
    linear,
    linear_args,
    rotate_,
)

# The linear layers of a decoder layer (CausalLM.linear_layers roles), in the stack's order.
_ROLES = ("qkv", "o", "gate_up", "down")
# Elements aten's elementwise kernels run unsplit by threads (at::internal::GRAIN_SIZE).
_SERIAL_ELEMENTS = 32768  # written out in _routed_mlp: TorchScript takes no module constants


def _expert_mlp(
    rows: Tensor,  # [n, hidden], every row routed to this expert
    i: int,  # the index of the expert's gate_up linear; its down follows
    kinds: list[int],
    weights: list[Tensor],
    auxes: list[Tensor],
    biases: list[Tensor | None],
    groups: list[int],
    outs: list[int],
    pads: list[int],
    intermediate: int,
) -> Tensor:
    """Experts.expert: one expert's gated MLP over its rows."""
    gate_up = linear(rows, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
    activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    i += 1
    return linear(activated, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])


def _routed_mlp(
    x: Tensor,  # [T, hidden]
    router: int,  # the index of the router's linear; expert e's gate_up and down follow at 2e + 1, 2e + 2
    kinds: list[int],
    weights: list[Tensor],
    auxes: list[Tensor],
    biases: list[Tensor | None],
    groups: list[int],
    outs: list[int],
    pads: list[int],
    num_experts: int,
    top_k: int,
    intermediate: int,
    normalize: bool,
    fused: list[Tensor],  # FusedExperts' four stacked tensors, or empty: one call per expert
    fused_groups: list[int],
    fused_route: bool,  # SparseMoeBlock.route's fused CPU op (the router then a FLOAT linear)
) -> Tensor:
    """SparseMoeBlock.forward with Experts.grouped (models/moe.py), op for op: each (token, choice)
    a row, the rows sorted by expert, one matmul per expert with rows.

    One token (a lone stream's decode step) skips the sort: its top_k experts are distinct, so each
    has one row, the token itself; they run in choice order and their outputs stack in the order
    the grouped loop scatters them to, the same matmuls on the same rows (bitwise the same), with
    one SiLU-mul over the experts' stacked gate_up rows where aten runs it in one piece."""
    i = router
    if fused_route:
        routing: tuple[Tensor, Tensor] = torch.ops.nim_cpu.route(x, weights[i], top_k, normalize)
        chosen, expert_ids = routing
    else:
        logits = linear(x, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        chosen, expert_ids = torch.topk(probs, top_k, dim=-1)
        if normalize:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        chosen = chosen.to(x.dtype)
    if len(fused) > 0:  # FusedExperts.__call__
        routed: Tensor = torch.ops.nim_cpu.w4a8_moe(
            x, expert_ids, chosen, fused[0], fused[1], fused[2], fused[3], fused_groups[0], fused_groups[1],
            intermediate,
        )  # fmt: skip
        return routed
    tokens = x.shape[0]
    if tokens == 1:
        choices: list[int] = expert_ids[0].tolist()
        gate_ups: list[Tensor] = []
        for expert in choices:
            i = router + 1 + 2 * expert
            gate_ups.append(linear(x, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i]))
        # Experts.expert op for op, but for the activation: one SiLU-mul over the chosen experts'
        # stacked gate_up rows, row for row the values of one call per expert while aten runs it in
        # one piece (a threaded split could fall mid-row and move that row's vector/scalar-tail
        # split); past _SERIAL_ELEMENTS one call per expert, as Experts.expert makes.
        if top_k * intermediate > 32768:  # _SERIAL_ELEMENTS
            activated = torch.cat([F.silu(g[:, :intermediate]) * g[:, intermediate:] for g in gate_ups])
        else:
            stacked = torch.cat(gate_ups)  # [top_k, 2I]
            activated = F.silu(stacked[:, :intermediate]) * stacked[:, intermediate:]
        per_choice: list[Tensor] = []
        for choice, expert in enumerate(choices):
            i = router + 2 + 2 * expert
            rows = activated[choice : choice + 1]
            down = linear(rows, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
            per_choice.append(down)
        weighted_choices = torch.cat(per_choice) * chosen.reshape(-1, 1)
        return weighted_choices.view(1, top_k, -1).sum(dim=1)
    expanded = x.repeat_interleave(top_k, dim=0)
    ids = expert_ids.reshape(-1)
    order = torch.argsort(ids, stable=True)
    counts: list[int] = torch.bincount(ids, minlength=num_experts).tolist()
    grouped = expanded[order]
    out = torch.empty_like(expanded)
    start = 0
    for expert in range(num_experts):
        count = counts[expert]
        if count == 0:
            continue
        i = router + 1 + 2 * expert
        rows = grouped[start : start + count]
        out[order[start : start + count]] = _expert_mlp(
            rows, i, kinds, weights, auxes, biases, groups, outs, pads, intermediate
        )
        start += count
    weighted = out * chosen.reshape(-1, 1)
    return weighted.view(tokens, top_k, -1).sum(dim=1)


def _decode_stack(
    hidden: Tensor,  # [B, hidden]: the embedded tokens
    cos: Tensor,  # [B, 1, D] (RotaryEmbedding.lookup_full)
    sin: Tensor,
    slots: Tensor,  # [B] cache slots of the new tokens
    mask: Tensor | None,  # [B, 1, 1, L] additive (None: the native kernel reads `tables`)
    pools: list[Tensor],  # KVPool.data: one per layer
    block_ids: Tensor | None,  # gathered pool rows, or
    run_first: int,  # one sequence's ascending block run, read in place (block_ids None)
    run_count: int,
    block_size: int,
    tables: Tensor | None,  # DecodeAttention.NATIVE: [B, N] block tables and [B] lengths
    lens: Tensor | None,
    norms: list[Tensor],  # per layer: input, post-attention
    qk_norms: list[Tensor],  # per layer: q's weight per q head, then k's per k head (empty: none)
    firsts: list[int],  # per layer: the index of its first linear in the lists below
    routed: list[bool],  # per layer: whether its MLP is routed
    kinds: list[int],  # per layer: qkv, o, then gate_up, down (dense) or the router and each
    weights: list[Tensor],  # expert's gate_up, down (routed) (LinearArgs, field by field)
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
    num_experts: int,
    top_k: int,
    expert_intermediate: int,
    normalize: bool,  # norm_topk_prob
    fused: list[Tensor],  # per layer 4 (RoutedMlp.fused; empty tensors where not fused)
    fused_groups: list[int],  # per layer 2
    fused_layers: list[bool],
    fused_ops: bool,  # LlamaStack.fused_ops: norms and routing through the fused CPU ops
) -> Tensor:
    batch = hidden.shape[0]
    width = hidden.shape[1]
    q_size = num_heads * head_dim
    kv_size = num_kv_heads * head_dim
    residual = hidden
    normed = hidden
    for layer in range(len(pools)):
        # LlamaDecoderLayer: the residual connection is added by the next norm.
        if fused_ops and layer == 0:
            residual = hidden
            normed = torch.ops.nim_cpu.rms_norm(hidden, norms[0], eps)
        elif fused_ops:
            normed, residual = torch.ops.nim_cpu.add_rms_norm(hidden, residual, norms[2 * layer], eps)
        else:
            residual = hidden if layer == 0 else hidden + residual
            normed = norms[2 * layer] * torch.rms_norm(residual, [width], None, eps)
        i = firsts[layer]
        qkv = linear(normed, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
        v = qkv[:, q_size + kv_size :].view(batch, num_kv_heads, head_dim)
        # q and k are adjacent in qkv: normed (Qwen3) and rotated in one call each, head by head.
        qk = qkv[:, : q_size + kv_size].view(batch, num_heads + num_kv_heads, head_dim)
        if len(qk_norms) > 0 and fused_ops:
            qk = torch.ops.nim_cpu.rms_norm(qk, qk_norms[layer], eps)
        elif len(qk_norms) > 0:
            qk = qk_norms[layer] * torch.rms_norm(qk, [head_dim], None, eps)
        # TableRope: one native op where the fused CPU ops run (bitwise the three aten ops)
        qk = torch.ops.nim_cpu.rope_(qk, cos, sin) if fused_ops else rotate_(qk, cos, sin)
        split = qk.split([num_heads, num_kv_heads], 1)
        q, k = split[0], split[1]
        if tables is not None and lens is not None:
            out = attend_in_place(q, k, v, pools[layer], slots, tables, lens, scale)
        else:
            assert mask is not None
            out = attend(
                q, k, v, pools[layer], slots, mask, block_ids, run_first, run_count, block_size, scale
            )
        i += 1
        attended = linear(out, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
        if fused_ops:
            normed, residual = torch.ops.nim_cpu.add_rms_norm(attended, residual, norms[2 * layer + 1], eps)
        else:
            residual = attended + residual
            normed = norms[2 * layer + 1] * torch.rms_norm(residual, [width], None, eps)
        i += 1
        if routed[layer]:
            layer_fused = fused[4 * layer : 4 * layer + 4] if fused_layers[layer] else []
            hidden = _routed_mlp(
                normed, i, kinds, weights, auxes, biases, groups, outs, pads,
                num_experts, top_k, expert_intermediate, normalize,
                layer_fused, fused_groups[2 * layer : 2 * layer + 2], fused_ops,
            )  # fmt: skip
            continue
        gate_up = linear(normed, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
        activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        i += 1
        hidden = linear(activated, kinds[i], weights[i], auxes[i], biases[i], groups[i], outs[i], pads[i])
    if fused_ops:
        final: tuple[Tensor, Tensor] = torch.ops.nim_cpu.add_rms_norm(hidden, residual, final_norm, eps)
        return final[0]
    summed = hidden + residual
    return final_norm * torch.rms_norm(summed, [width], None, eps)


@functools.cache
def _scripted_stack() -> Any:
    """`_decode_stack` compiled by TorchScript (once a process, with scripted_ops' functions).

    torch.jit.script warns that it is deprecated in favour of torch.compile; on this path
    torch.compile measured slower (its int4 kernel swap and per-call wrappers, bench/README.md)
    and rounds differently from the eager ops, which breaks the invariant above. Should a torch
    release drop TorchScript, `ScriptedDecoder.build` catches the failure and decodes eagerly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        return torch.jit.script(_decode_stack)


class ScriptedDecoder:
    """Runs a decode-only step's decoder layers as one scripted call (see the module docstring):
    `_decode_stack` for a Llama-shaped model, scripted_gemma's stack for Gemma 3."""

    def __init__(
        self, model: CausalLM, pool: KVPool, layers: list[list[LinearArgs]], stack: LlamaStack | GemmaStack
    ) -> None:
        self.model = model
        self.pool = pool
        config = model.config
        self._stack = stack
        self._window = window_of(stack) if isinstance(stack, GemmaStack) else None
        flat = [args for layer in layers for args in layer]
        firsts = [0, *itertools.accumulate(len(layer) for layer in layers)][: len(layers)]
        routed = list(stack.routed) if isinstance(stack, LlamaStack) else []
        self._routing = (firsts, [mlp is not None for mlp in routed] or [False] * len(layers))
        self._linears: tuple[Any, ...] = (
            [a.kind for a in flat],
            [a.weight for a in flat],
            [a.aux for a in flat],
            [a.bias for a in flat],
            [a.group for a in flat],
            [a.out_features for a in flat],
            [a.pad_rows for a in flat],
        )
        # Llama stacks: each layer's q and k norm weights, one row per head (the stack norms the
        # adjacent q and k heads in one call).
        self._qk_norms = (
            _qk_norm_rows(stack.qk_norms, config.num_heads, config.num_kv_heads)
            if isinstance(stack, LlamaStack)
            else list(stack.qk_norms)
        )
        scale = stack.attention_scale if isinstance(stack, GemmaStack) else None
        self._dims = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.rms_norm_eps,
            1.0 / math.sqrt(config.head_dim) if scale is None else scale,  # None: PagedAttention's
        )
        self._experts = (
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            config.norm_topk_prob,
            *_fused_experts(routed, len(layers)),
        )

    @classmethod
    def build(cls, model: CausalLM, pool: KVPool) -> ScriptedDecoder | str:
        """The decoder for `model` over `pool`, or why decode steps must run eagerly (the engine's
        decode path, service.engine.torch.decode_path, logs which)."""
        stack = _stack_of(model)
        reason = cls._unsupported(model, pool, stack)
        by_layer: dict[int, dict[str, nn.Module | Tensor]] = {}
        for layer in model.linear_layers() if reason is None else []:
            by_layer.setdefault(layer.layer, {})[layer.role] = layer.module
        layers: list[list[LinearArgs]] = []
        for index, roles in by_layer.items():
            routed = stack.routed[index] if isinstance(stack, LlamaStack) and stack.routed else None
            modules = {role: roles[role] for role in (_ROLES if routed is None else _ROLES[:2])}
            if routed is not None:
                modules["router"] = routed.router
                for expert, (gate_up, down) in enumerate(zip(routed.gate_up, routed.down, strict=True)):
                    modules[f"expert {expert}'s gate_up"] = gate_up
                    modules[f"expert {expert}'s down"] = down
            found = {name: _args_of(module) for name, module in modules.items()}
            router = found.get("router")
            if (
                router is not None
                and isinstance(stack, LlamaStack)
                and stack.fused_ops
                and router.kind != FLOAT
            ):
                reason = f"layer {index}'s router is not a plain float linear, which the fused routing reads"
                break
            missing = [name for name, args in found.items() if args is None]
            if missing:
                kind = type(modules[missing[0]]).__name__
                reason = f"layer {index}'s {missing[0]} ({kind}) runs only through its own forward"
                break
            layers.append([args for args in found.values() if args is not None])
        if reason is None:
            try:
                _scripted_stack() if isinstance(stack, LlamaStack) else scripted_gemma_stack()
            except Exception as error:  # a TorchScript that cannot compile it: eager still runs
                reason = f"TorchScript cannot compile the step ({type(error).__name__}: {error})"
        if reason is not None:
            return reason
        assert stack is not None, "_unsupported refuses a model without one"
        return cls(model, pool, layers, stack)

    @staticmethod
    def _unsupported(model: CausalLM, pool: KVPool, stack: LlamaStack | GemmaStack | None) -> str | None:
        if stack is None:
            return "the model's layers are not a shape the scripted stacks run (Llama, Gemma 3)"
        if isinstance(stack, GemmaStack):
            try:
                window_of(stack)
            except ValueError as error:
                return str(error)
        if pool.scales is not None:
            return f"the {pool.spec.cache_dtype} KV cache is dequantized by the eager path"
        dtype = model.activation_dtype
        if pool.data[0].dtype != dtype:
            return f"the KV cache holds {pool.data[0].dtype}, the activations are {dtype}"
        if model.tensor_parallel:
            return "tensor parallelism all-reduces between the layers"
        if any(isinstance(layer.module, AdaptedLinear) for layer in model.linear_layers()):
            return "LoRA adapters wrap the projections"
        if model.device.type != "cpu":
            return "the model is not on the CPU"
        return None

    @property
    def native_attention(self) -> bool:
        """Whether its steps may attend through the native CPU kernel (DecodeAttention.NATIVE):
        the Llama stack calls it; Gemma 3's gathers its cache blocks."""
        return isinstance(self._stack, LlamaStack)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whether the step `meta` describes is one it runs: decodes only, attended on a CPU path
        (gathered or in place through the native kernel's block tables, where it calls it)."""
        if meta.prefills:
            return False
        native = meta.decode_tables is not None and meta.decode_tables.device.type == "cpu"
        return meta.decode_mask is not None or (native and self.native_attention)

    def __call__(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """input_ids, positions: [B] (one token per decode row) -> final-norm hidden states [B, hidden],
        bitwise `model(input_ids, positions, PagedAttention(pool, meta, ...))`."""
        assert self.can_run(meta)
        stack = self._stack
        run = meta.decode_block_run
        first, count = run if run is not None else (0, 0)
        block_ids = meta.decode_block_ids if run is None else None
        cache = (self.pool.data, block_ids, first, count, self.pool.spec.block_size)
        hidden = stack.embedding(input_ids)
        if isinstance(stack, LlamaStack):
            cos, sin = stack.rope_tables(positions, hidden.dtype)
            tables = (meta.decode_tables, meta.decode_lens)
            llama: Tensor = _scripted_stack()(
                hidden, cos, sin, meta.slot_mapping, meta.decode_mask, *cache, *tables, list(stack.norms),
                self._qk_norms, *self._routing, *self._linears, stack.final_norm, *self._dims,
                *self._experts, stack.fused_ops,
            )  # fmt: skip
            return llama
        # Gemma3ForCausalLM.forward: the scaled embedding, two RoPE tables, a mask per window.
        hidden = hidden * stack.embedding_scale
        cos, sin = stack.rope_tables(positions, hidden.dtype)
        local_cos, local_sin = stack.local_rope_tables(positions, hidden.dtype)
        mask = meta.decode_mask
        assert mask is not None, "Gemma 3's stack gathers its blocks (never DecodeAttention.NATIVE)"
        window_mask = mask if self._window is None else windowed_decode_mask(mask, self._window)
        windowed = [window is not None for window in stack.windows]
        gemma: Tensor = scripted_gemma_stack()(
            hidden, cos, sin, local_cos, local_sin, meta.slot_mapping, mask, window_mask, windowed,
            *cache, list(stack.norms), self._qk_norms, *self._linears, stack.final_norm, *self._dims,
        )  # fmt: skip
        return gemma


def _fused_experts(
    routed: Sequence[RoutedMlp | None], num_layers: int
) -> tuple[list[Tensor], list[int], list[bool]]:
    """Per layer, its FusedExperts' four tensors and two group sizes (RoutedMlp.fused) and whether
    it has them: placeholders where not (TorchScript takes flat lists of one type)."""
    tensors: list[Tensor] = []
    groups: list[int] = []
    flags: list[bool] = []
    for layer in range(num_layers):
        mlp = routed[layer] if layer < len(routed) else None
        fused = mlp is not None and len(mlp.fused) == 4
        tensors += list(mlp.fused) if mlp is not None and fused else [torch.empty(0)] * 4
        groups += list(mlp.fused_groups) if mlp is not None and fused else [0, 0]
        flags.append(fused)
    return tensors, groups, flags


def _qk_norm_rows(norms: Sequence[Tensor], num_heads: int, num_kv_heads: int) -> list[Tensor]:
    """Per layer, [q's weight, k's weight] (LlamaStack.qk_norms) as one [Hq + Hkv, D] table: the
    weight of each head of the adjacent q and k heads in qkv. Elementwise, as the eager layer's two
    norms: the same values, bitwise."""
    pairs = zip(norms[0::2], norms[1::2], strict=True)
    return [torch.cat([q.expand(num_heads, -1), k.expand(num_kv_heads, -1)]) for q, k in pairs]


def _args_of(layer: nn.Module | Tensor) -> LinearArgs | None:
    """A linear layer as the stack takes it: a module (linear_args), or a float weight that
    F.linear takes as it is (RoutedMlp's float experts)."""
    if isinstance(layer, nn.Module):
        return linear_args(layer)
    return LinearArgs(FLOAT, layer, torch.empty(0), None, 0, layer.shape[0], 0)


def _stack_of(model: CausalLM) -> LlamaStack | GemmaStack | None:
    if isinstance(model, HasGemmaStack):
        return model.gemma_stack()
    if isinstance(model, HasLlamaStack):
        return model.llama_stack()
    return None
