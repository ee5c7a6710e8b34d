"""The building blocks of a Llama-family decoder layer: RMSNorm, attention (fused q/k/v, optional
q/k norms, RoPE), the gated MLP (fused gate/up), and the layer that joins them by residual connections.

Numerics follow transformers' implementation operation for operation (RMSNorm in float32 then
cast back, SiLU(gate) * up), so outputs match it to float rounding. For speed q/k/v and gate/up
are each one fused Linear; `LINEAR_ROLES` names which checkpoint projections each one holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.engine.models import triton_ops
from service.engine.models.attention import Attention
from service.engine.models.base import BuildOptions
from service.engine.models.rope import Rope
from service.engine.native import fused_ops
from service.model.config import ModelConfig

# A tensor-parallel model's all-reduce after each row-parallel projection (None: one process).
Reduce = Callable[[Tensor], Tensor]


def all_reduce_of(options: BuildOptions) -> Reduce | None:
    """The all-reduce after a row-parallel projection under tensor parallelism; None on one rank."""
    return options.tensor_parallel.collectives.all_reduce if options.tensor_parallel is not None else None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False, native: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused  # the Triton kernel where the tensor is on CUDA
        self.native = native  # the fused CPU op where the tensor is on the CPU (BuildOptions.cpu_fused_ops)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and x.dim() == 2 and triton_ops.runs_on(x):
            return triton_ops.rms_norm(x, self.weight, self.eps)
        if self.native and x.device.type == "cpu":
            return fused_ops.rms_norm(x, self.weight, self.eps)
        # HF's LlamaRMSNorm: normalise in float32 (x * rsqrt(mean(x^2) + eps)), cast back, then
        # scale. PyTorch's rms_norm computes in float32 for 16-bit inputs and rounds once: bitwise
        # the upcast, normalise, cast of HF's separate ops (tests/test_model_numerics.py holds it).
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(RMSNorm(x + residual), x + residual): a residual connection and the next norm."""
        if self.fused and triton_ops.runs_on(x):
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if self.native and x.device.type == "cpu":
            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self.forward(summed), summed


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, reduce: Reduce | None = None, native: bool = False
    ) -> None:
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
            self.q_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps, native=native)
            self.k_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps, native=native)
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
        reduce, fused, native = all_reduce_of(options), options.fused_kernels, options.cpu_fused_ops
        self.self_attn = LlamaAttention(config, layer_idx, reduce, native)
        self.mlp = LlamaMLP(config, reduce, fused)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused, native)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused, native)

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


# role (base.LinearLayer) -> (block, module name, the checkpoint projections it holds in row order)
LINEAR_ROLES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "qkv": ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "o": ("self_attn", "o_proj", ("o_proj",)),
    "gate_up": ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    "down": ("mlp", "down_proj", ("down_proj",)),
}

# Every checkpoint projection a Llama decoder layer holds, in forward order (what LoRA may adapt).
PROJECTIONS: tuple[str, ...] = tuple(part for _, _, parts in LINEAR_ROLES.values() for part in parts)
