"""Gemma 3 (text): Gemma3ForCausalLM, as google/gemma-3-1b and text-only conversions hold it.

Built over llama.py's pieces (fused qkv and gate_up linears, RoPE tables, weight loading, the
linear layers by (layer, role) that LoRA, quantization at load and tensor parallelism use), with
Gemma's differences, following transformers' Gemma3 code operation for operation:

- embeddings scaled by sqrt(hidden_size), the factor rounded to the activation dtype first;
- Gemma RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + w) computed in float32 then cast back, four per
  layer (input, post-attention, pre-feedforward, post-feedforward: each sublayer's output is
  normed before the residual add) and per-head on q and k before RoPE;
- GeGLU: gelu(gate, tanh approximation) * up;
- attention scores scaled by query_pre_attn_scalar ** -0.5 (`ModelConfig.attention_scale`);
- sliding-window layers (`ModelConfig.layer_windows`) interleaved with full-attention ones: the
  window goes to the attention seam with each call; windowed layers rotate with the local base
  (rope_local_theta, unscaled), full ones with rope_theta and its (linear) scaling;
- tied embeddings: the logits are the embedding matrix's.

Logit and attention soft-capping (Gemma 2) and bidirectional attention are refused when the config
is read (config.py). CPU decode steps run as one TorchScript call of Gemma's own stack
(`gemma_stack`, service.engine.torch.scripted_gemma), bitwise this forward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.engine.models.attention import Attention
from service.engine.models.base import ONE_PROCESS, BuildOptions, CausalLM, GemmaStack
from service.engine.models.llama import LlamaForCausalLM
from service.engine.models.llama_layers import LlamaAttention, LlamaMLP, Reduce, all_reduce_of
from service.engine.models.quant import QuantizedWeight
from service.engine.models.rope import Rope, RotaryEmbedding
from service.model.config import ModelConfig, UnsupportedModelError


@functools.cache
def _embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) as transformers applies it: a float32 tensor cast to the activations'
    dtype. A Python number (exactly that value) multiplies the same in every dtype's op math, and
    adds no host-to-device copy to a CUDA graph."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype))


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from 1, and the scaling happens in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    """Llama's fused-qkv attention with Gemma norms on q and k, its own scale and, on sliding
    layers, a window."""

    def __init__(self, config: ModelConfig, layer_idx: int, reduce: Reduce | None = None) -> None:
        super().__init__(config, layer_idx, reduce)
        # setattr: LlamaAttention types its q/k norms as Llama's.
        setattr(self, "q_norm", GemmaRMSNorm(config.head_dim, config.rms_norm_eps))  # noqa: B010
        setattr(self, "k_norm", GemmaRMSNorm(config.head_dim, config.rms_norm_eps))  # noqa: B010
        self.window = config.layer_windows[layer_idx] if config.layer_windows else None
        self.scale = config.attention_scale

    def forward(self, hidden: Tensor, rope: Rope, attention: Attention) -> Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)  # [T, (Hq + 2*Hkv) * D]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q_norm, k_norm = cast(GemmaRMSNorm, self.q_norm), cast(GemmaRMSNorm, self.k_norm)
        q = q_norm.forward(qkv[:, :q_end].view(tokens, self.num_heads, self.head_dim))
        k = k_norm.forward(qkv[:, q_end:k_end].view(tokens, self.num_kv_heads, self.head_dim))
        v = qkv[:, k_end:].view(tokens, self.num_kv_heads, self.head_dim)
        out = attention(self.layer_idx, rope(q), rope(k), v, window=self.window, scale=self.scale)
        projected: Tensor = self.o_proj.forward(out.reshape(tokens, self.q_size))
        return projected if self.reduce is None else self.reduce(projected)


class Gemma3MLP(LlamaMLP):
    """GeGLU: down(gelu_tanh(gate) * up), gate and up one fused linear as in Llama's MLP."""

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj.forward(x)  # [T, 2I]
        size = self.intermediate_size
        activated = F.gelu(gate_up[:, :size], approximate="tanh") * gate_up[:, size:]
        down: Tensor = self.down_proj.forward(activated)
        return down if self.reduce is None else self.reduce(down)


class Gemma3DecoderLayer(nn.Module):
    """Gemma's norms and GeGLU run as PyTorch's ops (the fused kernels are Llama's)."""

    def __init__(self, config: ModelConfig, layer_idx: int, options: BuildOptions) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx, all_reduce_of(options))
        self.mlp = Gemma3MLP(config, all_reduce_of(options))
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, hidden: Tensor, rope: Rope, attention: Attention) -> Tensor:
        attended = self.self_attn.forward(self.input_layernorm.forward(hidden), rope, attention)
        hidden = hidden + self.post_attention_layernorm.forward(attended)
        fed = self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden))
        return hidden + self.post_feedforward_layernorm.forward(fed)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's structure (``model.embed_tokens``, ``model.layers``, ``model.norm``, fused
    linears, tied logits) with Gemma 3 decoder layers and a second RoPE table for windowed layers."""

    def __init__(self, config: ModelConfig, options: BuildOptions = ONE_PROCESS) -> None:
        if config.architecture != "gemma3" or config.hidden_act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"Gemma3ForCausalLM cannot run a {config.architecture} config")
        if not config.tie_word_embeddings:
            raise UnsupportedModelError("gemma3 with untied embeddings is not supported")
        super().__init__(config, options)
        self.model.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, options) for i in range(config.num_layers)
        )
        setattr(self.model, "norm", GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))  # noqa: B010
        local = dataclasses.replace(
            config, rope_theta=config.rope_local_theta or config.rope_theta, rope_scaling=None
        )
        self.local_rotary = RotaryEmbedding(local, options.fused_kernels)

    def forward(self, input_ids: Tensor, positions: Tensor, attention: Attention) -> Tensor:
        """input_ids, positions: [T] int64, a flat token batch -> final-norm hidden states [T, hidden]."""
        hidden = self._embed(input_ids)  # [T, hidden]
        hidden = hidden * _embedding_scale(self.config.hidden_size, hidden.dtype)
        full = self.rotary.for_positions(positions, hidden.dtype)
        local = self.local_rotary.for_positions(positions, hidden.dtype)
        for layer in self._gemma_layers():
            hidden = layer.forward(hidden, full if layer.self_attn.window is None else local, attention)
        normed: Tensor = self._final_norm().forward(hidden)
        return normed

    def _gemma_layers(self) -> list[Gemma3DecoderLayer]:
        return [cast(Gemma3DecoderLayer, layer) for layer in self.model.layers]

    def _final_norm(self) -> GemmaRMSNorm:
        return cast(GemmaRMSNorm, self.model.norm)

    def llama_stack(self) -> None:  # type: ignore[override]
        """None: Gemma's norms, GeGLU and windows are not the Llama shape (`gemma_stack` is)."""
        return None

    def gemma_stack(self) -> GemmaStack:
        def plus_one(norm: GemmaRMSNorm) -> Tensor:  # what GemmaRMSNorm multiplies by, once
            return 1.0 + norm.weight.float()

        layers = self._gemma_layers()
        norms = [
            plus_one(norm)
            for layer in layers
            for norm in (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm,
            )
        ]
        qk_norms = [
            plus_one(cast(GemmaRMSNorm, norm))
            for layer in layers
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm)
        ]
        return GemmaStack(
            embedding=self.model.embed_tokens,
            embedding_scale=_embedding_scale(self.config.hidden_size, self.activation_dtype),
            rope_tables=self.rotary.lookup_full,
            local_rope_tables=self.local_rotary.lookup_full,
            windows=[layer.self_attn.window for layer in layers],
            norms=norms,
            qk_norms=qk_norms,
            final_norm=plus_one(self._final_norm()),
            attention_scale=self.config.attention_scale,
        )

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, Tensor | QuantizedWeight]], device: torch.device | None = None
    ) -> None:
        """LlamaForCausalLM.load_weights (strict); then the windowed layers' RoPE tables."""
        super().load_weights(weights, device)
        if self.local_rotary.cos_cached.is_meta:
            self.local_rotary.materialize(self.rotary.cos_cached.device)
        self.local_rotary.reset_cache()


if TYPE_CHECKING:
    _IMPLEMENTS: type[CausalLM] = Gemma3ForCausalLM  # mypy holds the class to the protocol
