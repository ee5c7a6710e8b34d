"""One Llama-family decoder: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

The model works on a flat batch of T tokens (any mix of sequences, prefill or decode): it embeds
them, runs the decoder layers and hands each layer's q/k/v to an ``Attention`` object, which alone
knows which earlier keys each token may see. The model holds no KV state.

Submodules are called through ``.forward`` inside the model: nn.Module.__call__'s hook handling
costs about 2 µs a call, a few hundred calls a CPU decode step; nothing registers hooks on it.

Numerics follow transformers' implementation operation for operation (RMSNorm in float32 then
cast back, rotate-half RoPE with cos/sin computed in float32 then cast to the activation dtype,
SiLU(gate) * up), so logits match it to float rounding. For speed q/k/v and gate/up are each one
fused Linear; ``load_weights`` writes the checkpoint's separate shards into row slices of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.engine.models import triton_ops
from service.engine.models.attention import Attention
from service.engine.models.base import (
    ONE_PROCESS,
    BuildOptions,
    CausalLM,
    LinearLayer,
    LinearPart,
    LlamaStack,
)
from service.engine.models.cpu_linear import PackedLinear, prepack_linears
from service.engine.models.quant import QuantizedWeight, concat_rows
from service.engine.models.quant_linear import make_linear
from service.engine.models.tensor_parallel import Collectives
from service.model.config import ModelConfig, UnsupportedModelError
from service.model.quantization import QuantizationError

# A tensor-parallel model's all-reduce after each row-parallel projection (None: one process).
Reduce = Callable[[Tensor], Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused  # the Triton kernel where the tensor is on CUDA

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and x.dim() == 2 and triton_ops.runs_on(x):
            return triton_ops.rms_norm(x, self.weight, self.eps)
        # HF's LlamaRMSNorm: normalise in float32 (x * rsqrt(mean(x^2) + eps)), cast back, then
        # scale. PyTorch's rms_norm computes in float32 for 16-bit inputs and rounds once: bitwise
        # the upcast, normalise, cast of HF's separate ops (tests/test_model_numerics.py holds it).
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(RMSNorm(x + residual), x + residual): a residual connection and the next norm."""
        if self.fused and triton_ops.runs_on(x):
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self.forward(summed), summed


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

    def __init__(self, config: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.config = config
        self.fused = fused  # the Triton kernel where the positions are on CUDA
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
        return TableRope(cos, sin)


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

    def __call__(self, x: Tensor) -> Tensor:
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


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, reduce: Reduce | None = None) -> None:
        super().__init__()
        self.reduce = reduce  # tensor parallelism: the all-reduce after the row-parallel o_proj
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        # Rows: [q (Hq*D) | k (Hkv*D) | v (Hkv*D)].
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_output_bias)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None

    def forward(self, hidden: Tensor, rope: Rope, attention: Attention) -> Tensor:
        # hidden: [T, hidden]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)  # [T, (Hq + 2*Hkv) * D]
        v = qkv[:, self.q_size + self.kv_size :].view(
            num_tokens, self.num_kv_heads, self.head_dim
        )  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm.forward(qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm.forward(
                qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, -1)
            )
            q = rope(q)  # [T, Hq, D]
            k = rope(k)  # [T, Hkv, D]
        else:
            # q and k are adjacent in qkv: rotate them with one call.
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
            qk = rope(qk)  # [T, Hq + Hkv, D]
            # torch leaves Tensor.split unannotated.
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # type: ignore[no-untyped-call]
        out = attention(self.layer_idx, q, k, v)  # [T, Hq, D]
        projected: Tensor = self.o_proj.forward(out.reshape(num_tokens, self.q_size))
        return projected if self.reduce is None else self.reduce(projected)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, reduce: Reduce | None = None, fused: bool = False) -> None:
        super().__init__()
        self.reduce = reduce  # tensor parallelism: the all-reduce after the row-parallel down_proj
        self.fused = fused  # SiLU-mul as a Triton kernel where the tensor is on CUDA
        self.intermediate_size = config.intermediate_size
        # Rows: [gate (I) | up (I)].
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj.forward(x)  # [T, 2I]
        if self.fused and triton_ops.runs_on(gate_up):
            activated = triton_ops.silu_mul(gate_up)
        else:
            size = self.intermediate_size
            activated = F.silu(gate_up[:, :size]) * gate_up[:, size:]
        down: Tensor = self.down_proj.forward(activated)
        return down if self.reduce is None else self.reduce(down)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, options: BuildOptions) -> None:
        super().__init__()
        reduce, fused = all_reduce_of(options), options.fused_kernels
        self.self_attn = LlamaAttention(config, layer_idx, reduce)
        self.mlp = LlamaMLP(config, reduce, fused)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)

    def forward(
        self, hidden: Tensor, residual: Tensor | None, rope: Rope, attention: Attention
    ) -> tuple[Tensor, Tensor]:
        """(this layer's MLP output, the residual stream before it): the residual connection is
        added by the next norm (the next layer's, or the final one), fused with it on CUDA."""
        if residual is None:
            residual = hidden
            normed = self.input_layernorm.forward(hidden)
        else:
            normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attended = self.self_attn.forward(normed, rope, attention)
        normed, residual = self.post_attention_layernorm.add_forward(attended, residual)
        mlp_out: Tensor = self.mlp.forward(normed)
        return mlp_out, residual


def _embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding; built on 'meta' (the loader's case, weights come next) without its random
    init, whose `normal_` on meta imports torch._dynamo: 3 s of every start, for nothing."""
    if torch.empty(0).device.type == "meta":
        return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
    return nn.Embedding(num_embeddings, embedding_dim)


def all_reduce_of(options: BuildOptions) -> Reduce | None:
    """The all-reduce after a row-parallel projection under tensor parallelism; None on one rank."""
    return options.tensor_parallel.collectives.all_reduce if options.tensor_parallel is not None else None


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__()
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, options) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, options.fused_kernels)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """The layers, typed (an nn.ModuleList yields plain Modules)."""
        return [cast(LlamaDecoderLayer, layer) for layer in self.layers]


# role (base.LinearLayer) -> (block, module name, the checkpoint projections it holds in row order)
_LINEAR_ROLES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "qkv": ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "o": ("self_attn", "o_proj", ("o_proj",)),
    "gate_up": ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    "down": ("mlp", "down_proj", ("down_proj",)),
}

# Every checkpoint projection a Llama decoder layer holds, in forward order (what LoRA may adapt).
PROJECTIONS: tuple[str, ...] = tuple(part for _, _, parts in _LINEAR_ROLES.values() for part in parts)

# checkpoint projection name -> (fused module name, shard index within it)
_FUSED_SHARDS: dict[str, tuple[str, int]] = {
    part: (module, index)
    for _, module, parts in _LINEAR_ROLES.values()
    if len(parts) > 1
    for index, part in enumerate(parts)
}


def _checkpoint_name(param_name: str, shard: int | None) -> str:
    """The HF checkpoint name that fills (param_name, shard)."""
    if shard is None:
        return param_name
    prefix, fused_name, suffix = param_name.rsplit(".", 2)
    shard_name = next(n for n, (f, s) in _FUSED_SHARDS.items() if f == fused_name and s == shard)
    return f"{prefix}.{shard_name}.{suffix}"


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF's (``model.layers.N.self_attn.o_proj.weight``, ...), except the
    fused ``qkv_proj`` and ``gate_up_proj``. With tied embeddings there is no ``lm_head``: logits use
    ``model.embed_tokens.weight``.
    """

    def __init__(self, config: ModelConfig, options: BuildOptions = ONE_PROCESS) -> None:
        """`config` is this rank's (`layout.local_config()`) under tensor parallelism: its shard then
        joins the others' through all-reduces after each row-parallel projection and the
        vocab-parallel embedding, and an all-gather of logits."""
        super().__init__()
        parallel = options.tensor_parallel
        if parallel is not None and config != parallel.layout.local_config():
            raise ValueError("a tensor-parallel model is built from its layout's local config")
        self.config = config
        self.model = LlamaModel(config, options)
        self.rotary = RotaryEmbedding(config, options.fused_kernels)
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.tp: Collectives | None = None
        self.vocab_start = 0  # this rank's first vocabulary row
        self.full_vocab_size = config.vocab_size
        if parallel is not None:
            self.tp = parallel.collectives
            self.vocab_start = parallel.layout.vocab_start
            self.full_vocab_size = parallel.layout.config.vocab_size

    def forward(self, input_ids: Tensor, positions: Tensor, attention: Attention) -> Tensor:
        """input_ids, positions: [T] int64, a flat token batch. Returns final-norm hidden states [T, hidden].

        Positions index the RoPE tables, so each must be < max_position_embeddings.
        """
        hidden = self._embed(input_ids)  # [T, hidden]
        rope = self.rotary.for_positions(positions, hidden.dtype)
        residual: Tensor | None = None
        for layer in self.model.layers:
            hidden, residual = layer.forward(hidden, residual, rope, attention)
        assert residual is not None, "a model has at least one layer"
        normed, _ = self.model.norm.add_forward(hidden, residual)
        return normed

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def tensor_parallel(self) -> bool:
        return self.tp is not None

    def linear_layers(self) -> list[LinearLayer]:
        """Per layer: qkv, o, gate_up, down (base.CausalLM)."""
        config = self.config
        hidden, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
        rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
        rows |= {"gate_proj": inter, "up_proj": inter, "down_proj": hidden}
        inputs = {"qkv": hidden, "o": q, "gate_up": hidden, "down": inter}
        linears = []
        for index, layer in enumerate(self.model.decoder_layers()):
            for role in self._linear_roles(index):
                block, module_name, parts = _LINEAR_ROLES[role]
                prefix = f"model.layers.{index}.{block}"
                linears.append(
                    LinearLayer(
                        layer=index,
                        role=role,
                        in_features=inputs[role],
                        parts=tuple(LinearPart(p, f"{prefix}.{p}.weight", rows[p]) for p in parts),
                        module=getattr(getattr(layer, block), module_name),
                    )
                )
        return linears

    def _linear_roles(self, layer: int) -> tuple[str, ...]:
        """The roles of decoder layer `layer`'s linear layers, in forward order (a subclass whose
        layers differ, e.g. routed experts in place of the MLP, names fewer)."""
        return tuple(_LINEAR_ROLES)

    def set_linear(self, layer: int, role: str, module: nn.Module) -> None:
        if role not in self._linear_roles(layer):
            raise ValueError(f"decoder layer {layer} has no {role!r} linear layer")
        block, module_name, _ = _LINEAR_ROLES[role]
        setattr(getattr(self.model.decoder_layers()[layer], block), module_name, module)

    def llama_stack(self) -> LlamaStack:
        layers = self.model.decoder_layers()
        norms = [
            n.weight for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        qk_norms: list[Tensor] = []
        for layer in layers:
            attn = layer.self_attn
            if attn.q_norm is not None and attn.k_norm is not None:
                qk_norms += [attn.q_norm.weight, attn.k_norm.weight]
        return LlamaStack(
            embedding=self.model.embed_tokens,
            rope_tables=self.rotary.lookup_full,
            norms=norms,
            qk_norms=qk_norms,
            final_norm=self.model.norm.weight,
        )

    def _embed(self, input_ids: Tensor) -> Tensor:
        if self.tp is None:
            embedded: Tensor = self.model.embed_tokens(input_ids)
            return embedded
        # Vocab-parallel: each rank looks up the ids in its rows, zeros elsewhere; the sum is the lookup.
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.config.vocab_size)
        embedded = self.model.embed_tokens(torch.where(mine, local, 0))
        return self.tp.all_reduce(embedded * mine[:, None].to(embedded.dtype))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> [N, vocab] float32 (matmul in the model dtype, as HF does, then upcast)."""
        if self.lm_head is None:
            logits: Tensor = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.tp is not None:  # vocab-parallel: every rank's slice, then the padding cut
            logits = self.tp.all_gather_last(logits)[..., : self.full_vocab_size]
        return logits.float()

    def prepack_for_cpu(self) -> None:
        """Hold every linear layer, the logits projection included, in oneDNN's packed layout.

        Inference-only and irreversible (packed weights cannot be loaded into or trained); call
        after `load_weights` where `prepacking_supported` says so.
        """
        if self.lm_head is None:  # tied: the embedding stays a plain tensor for lookups
            self.lm_head = PackedLinear(self.model.embed_tokens.weight, None)
            self.lm_head.pad_small = self.lm_head.needs_padding()
        prepack_linears(self)

    def _shard_rows(self, fused_name: str, shard: int) -> tuple[int, int]:
        config = self.config
        if fused_name == "qkv_proj":
            sizes: tuple[int, ...] = (config.q_size, config.kv_size, config.kv_size)
        else:
            sizes = (config.intermediate_size, config.intermediate_size)
        start = sum(sizes[:shard])
        return start, sizes[shard]

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, Tensor | QuantizedWeight]], device: torch.device | None = None
    ) -> None:
        """Write HF-named checkpoint weights into this model (casting float tensors' dtype/device).

        Float tensors are copied into their parameters; a parameter still on 'meta' is allocated
        on ``device`` (in its own dtype) when first written. A quantized weight replaces its linear
        layer with a QuantLinear (for fused layers, once every shard has arrived; shards must share
        a format); a quantized embedding is dequantized (it is looked up, and the logits layer
        stays in the activation dtype: see loader.target_format).

        Strict: every parameter (every shard of a fused one) must be written exactly once; unknown
        names, duplicates and shape mismatches raise. Rotary ``inv_freq`` buffers are ignored, and so
        is ``lm_head.weight`` when embeddings are tied (HF ties it to the embedding regardless).
        Also rebuilds the RoPE tables, which a model materialised from 'meta' lacks.
        """
        params = dict(self.named_parameters())
        target_device = device if device is not None else next(iter(params.values())).device
        loaded: set[tuple[str, int | None]] = set()
        pending: dict[str, dict[int, QuantizedWeight]] = {}  # fused layer -> its quantized shards so far
        for checkpoint_name, tensor in weights:
            if checkpoint_name.endswith("rotary_emb.inv_freq"):
                continue
            if checkpoint_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target_name, shard = checkpoint_name, None
            parts = checkpoint_name.split(".")
            if len(parts) >= 3 and parts[-2] in _FUSED_SHARDS:
                fused_name, shard = _FUSED_SHARDS[parts[-2]]
                target_name = ".".join([*parts[:-2], fused_name, parts[-1]])
            if target_name not in params:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r} matches no parameter of this model")
            key = (target_name, shard)
            if key in loaded:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r} appears more than once")
            start, size = 0, params[target_name].shape[0]
            if shard is not None:
                start, size = self._shard_rows(target_name.split(".")[-2], shard)
            expected_shape = (size, *params[target_name].shape[1:])
            if tuple(tensor.shape) != expected_shape:
                raise ValueError(
                    f"checkpoint tensor {checkpoint_name!r} has shape {tuple(tensor.shape)}; "
                    f"expected {expected_shape}"
                )
            loaded.add(key)
            if not isinstance(tensor, Tensor):
                if target_name == "model.embed_tokens.weight":
                    tensor = tensor.dequantize()
                elif shard is None:
                    self._quantize_layer(target_name, tensor, params, target_device)
                    continue
                else:
                    shards = pending.setdefault(target_name, {})
                    shards[shard] = tensor
                    if len(shards) == (3 if target_name.endswith("qkv_proj.weight") else 2):
                        try:
                            fused = concat_rows([shards[i] for i in sorted(shards)])
                        except QuantizationError as error:
                            raise QuantizationError(f"{target_name}: {error}") from error
                        self._quantize_layer(target_name, fused, params, target_device)
                        del pending[target_name]
                    continue
            if target_name in pending:
                raise ValueError(f"{checkpoint_name!r} is float but other shards of its layer are quantized")
            destination = self._materialize(target_name, params, target_device).data
            destination.narrow(0, start, size).copy_(tensor)

        # The parameters left now (a subclass may have replaced some while the weights streamed in,
        # as quantized layers replace their nn.Linear).
        missing = self._expected_weights() - loaded
        if missing:
            names = sorted(_checkpoint_name(name, shard) for name, shard in missing)
            raise ValueError(f"checkpoint lacks {len(names)} parameter(s): {', '.join(names[:10])}")
        if pending:
            raise ValueError(f"fused layer(s) with quantized and float shards: {', '.join(sorted(pending))}")
        if self.rotary.cos_cached.is_meta:
            self.rotary.to_empty(device=target_device)
        self.rotary.reset_cache()

    def _expected_weights(self) -> set[tuple[str, int | None]]:
        """(parameter, shard of a fused one) for every parameter a checkpoint must write."""
        expected: set[tuple[str, int | None]] = set()
        for name, _ in self.named_parameters():
            module_name = name.rsplit(".", 2)[-2]
            if module_name in ("qkv_proj", "gate_up_proj"):
                shard_count = 3 if module_name == "qkv_proj" else 2
                expected.update((name, shard) for shard in range(shard_count))
            else:
                expected.add((name, None))
        return expected

    def _materialize(self, name: str, params: dict[str, nn.Parameter], device: torch.device) -> nn.Parameter:
        """The parameter `name`, allocated on `device` if it is still on 'meta'."""
        param = params[name]
        if not param.is_meta:
            return param
        module_name, _, attr = name.rpartition(".")
        real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
        self.get_submodule(module_name).register_parameter(attr, real)
        params[name] = real
        return real

    def _quantize_layer(
        self, weight_name: str, weight: QuantizedWeight, params: dict[str, nn.Parameter], device: torch.device
    ) -> None:
        """Replace the linear layer owning `weight_name` with one over `weight`."""
        module_name = weight_name.rpartition(".")[0]
        dtype = params[weight_name].dtype
        # The bias Parameter itself (maybe still on 'meta'): _materialize finds it on the new layer.
        bias = params.get(f"{module_name}.bias")
        parent_name, _, attr = module_name.rpartition(".")
        layer = make_linear(weight, bias, dtype, device)
        setattr(self.get_submodule(parent_name), attr, layer)

    def weight_nbytes(self) -> int:
        """Bytes of weights one decode step reads (the embedding table only where it is the logits
        layer too): the numerator of achieved weight bandwidth."""
        tensors: dict[int, Tensor] = {}
        for module in self.modules():
            if isinstance(module, nn.Embedding | RotaryEmbedding):
                continue
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if isinstance(module, PackedLinear):
                own += [module.packed] + ([] if module.bias is None else [module.bias])
            tensors.update((id(t), t) for t in own)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.lm_head is None:  # tied float logits read the embedding table
            table = self.model.embed_tokens.weight
            total += table.numel() * table.element_size()
        return total


if TYPE_CHECKING:
    _IMPLEMENTS: type[CausalLM] = LlamaForCausalLM  # mypy holds the class to the protocol
