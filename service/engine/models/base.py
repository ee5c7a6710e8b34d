"""What the engine needs of a model: the `CausalLM` protocol every architecture implements.

The engine (runner, CUDA graphs, scripted CPU decode, LoRA slots, loading) sees a model only
through this protocol; a model's attribute paths (``model.layers.N.self_attn...``) stay inside its
own file. Linear layers are named by where they sit, ``(layer index, role)``, with the checkpoint
projections each holds, so LoRA wrapping and quantization-aware paths never spell a path.

A model is an ``nn.Module`` (parameters, ``to``, ``eval``) with HF-named parameters; building one
goes through service.engine.models.registry, which maps a checkpoint's architecture to its class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, Self, runtime_checkable

import torch
from torch import Tensor, nn

from service.engine.models.attention import Attention
from service.engine.models.quant import QuantizedWeight
from service.engine.models.tensor_parallel import Collectives, TPLayout
from service.model.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This rank's shard of the model (built from `layout.local_config()`) and the collectives that
    join it to the other ranks'."""

    collectives: Collectives
    layout: TPLayout


LogitsFormat = Literal["float", "w8a8", "int8", "fp16", "q8"]  # BuildOptions.logits_format


@dataclass(frozen=True)
class BuildOptions:
    """How a model computes, fixed when it is built (never switched on afterwards)."""

    tensor_parallel: TensorParallel | None = None  # None: the whole model in this process
    fused_kernels: bool = False  # CUDA: norms, SiLU-mul and RoPE as Triton kernels (triton_ops)
    prepack_cpu: bool = False  # the CPU: linear layers held in oneDNN's packed layout once loaded
    # The CPU, weight-only int profiles: the logits projection held in fewer bytes, made from the
    # float weights once they are loaded (rank_loading._logits_path says where and why). "w8a8":
    # the projection and the embedding as int8, one scale per row, the projection's input rows
    # quantized to int8 too and multiplied in integers (w8a8.W8A8Linear); "int8" (bf16
    # activations): the same tables, the input kept in bf16 (aten's weight-only kernel); "fp16"
    # (float32 activations): the projection as float16 in fbgemm's packed layout, computed in
    # float32 (cpu_linear.HalfPackedLinear); "q8" (float32 activations): int8 with a scale per
    # block of 32, input rows rounded to int8 per block of 32, integer sums (native/q8.py's
    # Q8Linear); "float": as loaded.
    logits_format: LogitsFormat = "float"
    # The CPU under float32 activations: native int4/int8 layers compute in bf16 (quant_linear.
    # CPU_INT_KERNEL_DTYPE), their input and output cast; off, they compute in float32 (exactly).
    int_kernels_in_bf16: bool = False
    # The CPU, native int4 layers: "w4a8" moves them to the W4A8 kernel once loaded (activations
    # rounded to int8 per block of 32, integer dot products: native/w4a8.py); "aten", aten's.
    int4_kernel: Literal["aten", "w4a8"] = "aten"
    # The CPU: RMSNorm (with its residual add) and MoE routing as one native op each (native/
    # fused_ops.py), in eager modules and the scripted decode alike; off, aten's op sequences.
    cpu_fused_ops: bool = False


ONE_PROCESS = BuildOptions()  # the whole model here, PyTorch's ops: what a model is built with by default


@dataclass(frozen=True)
class LinearPart:
    """One checkpoint projection inside a (possibly fused) linear layer, in its row order."""

    name: str  # the projection as checkpoints and LoRA adapters name it: "q_proj", "gate_proj", ...
    weight_name: str  # its checkpoint weight: "model.layers.0.self_attn.q_proj.weight"
    rows: int  # output rows it fills (this rank's, under tensor parallelism)


@dataclass(frozen=True)
class LinearLayer:
    """One linear layer of a decoder layer, as the model holds it now (float, quantized, packed
    or LoRA-wrapped)."""

    layer: int  # decoder layer index
    role: str  # "qkv", "o", "gate_up", "down": the fused projections as the model holds them
    in_features: int
    parts: tuple[LinearPart, ...]  # what its output rows are, in order
    module: nn.Module


@dataclass(frozen=True)
class RoutedMlp:
    """A routed layer's MLP (models/moe.py's SparseMoeBlock) as code that runs it itself takes it:
    a router, then each token's `top_k` experts' SiLU-gated MLPs, weighted and summed. The sizes
    shared by every routed layer (experts, top-k, their width, renormalising) are the config's."""

    router: nn.Module  # [T, hidden] -> [T, num_experts] logits
    # Per expert: its fused gate_up and its down layer, a module (quantized) or the float weight
    # [rows, inputs] that F.linear takes.
    gate_up: Sequence[nn.Module | Tensor]
    down: Sequence[nn.Module | Tensor]
    # Every expert on the W4A8 kernel (moe.FusedExperts): its stacked gate_up, gate_up scales,
    # down and down scales, then the two group sizes; else empty: one call per expert.
    fused: Sequence[Tensor] = ()
    fused_groups: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class LlamaStack:
    """What code that runs a Llama-shaped decoder stack itself needs (the scripted CPU decode):
    pre-norm layers of fused qkv attention (optional per-head q/k RMSNorm, rotate-half RoPE) and a
    SiLU-gated MLP of fused gate_up, or a routed MLP (`routed`), RMSNorm with one eps throughout.
    The other linears come from `CausalLM.linear_layers`."""

    embedding: nn.Module  # token ids [T] -> [T, hidden]
    rope_tables: Callable[[Tensor, torch.dtype], tuple[Tensor, Tensor]]  # RotaryEmbedding.lookup_full
    norms: Sequence[Tensor]  # per layer: input, post-attention
    qk_norms: Sequence[Tensor]  # per layer: q, k (empty: the model has none)
    final_norm: Tensor
    routed: Sequence[RoutedMlp | None] = ()  # per layer (empty: every layer's MLP is dense)
    # Norms and routing through the fused CPU ops (BuildOptions.cpu_fused_ops), as the modules run them.
    fused_ops: bool = False


@dataclass(frozen=True)
class GemmaStack:
    """What the scripted CPU decode needs of a Gemma 3 stack (models/gemma3.py): Gemma RMSNorms
    (their weights held as 1 + w in float32, as GemmaRMSNorm multiplies) before and after each
    sublayer and on q and k, a GeGLU MLP of fused gate_up, the embedding scaled, and
    sliding-window layers rotating with their own RoPE table. The linears come from
    `CausalLM.linear_layers`."""

    embedding: nn.Module  # token ids [T] -> [T, hidden], before the scale
    embedding_scale: float  # sqrt(hidden_size), rounded to the activation dtype
    rope_tables: Callable[[Tensor, torch.dtype], tuple[Tensor, Tensor]]  # full-attention layers
    local_rope_tables: Callable[[Tensor, torch.dtype], tuple[Tensor, Tensor]]  # sliding-window layers
    windows: Sequence[int | None]  # per layer: its window (None: full attention)
    norms: Sequence[Tensor]  # per layer: input, post-attention, pre-feedforward, post-feedforward
    qk_norms: Sequence[Tensor]  # per layer: q, k
    final_norm: Tensor
    attention_scale: float | None  # None: PagedAttention's own, 1 / sqrt(head_dim)


class CausalLM(Protocol):
    """A decoder-only language model over a flat token batch; it holds no KV state."""

    config: ModelConfig  # this rank's sizes under tensor parallelism

    def __call__(self, input_ids: Tensor, positions: Tensor, attention: Attention) -> Tensor:
        """input_ids, positions: [T] int64, a flat batch of any mix of sequences; returns the final
        hidden states [T, hidden]. `attention` alone knows which keys each token sees."""
        ...

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> [N, vocab] float32 (the whole vocabulary under tensor parallelism)."""
        ...

    def load_weights(
        self, weights: Iterable[tuple[str, Tensor | QuantizedWeight]], device: torch.device | None = None
    ) -> None:
        """Write HF-named checkpoint weights (strict: every parameter exactly once)."""
        ...

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype hidden states (and attention masks) are computed in."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def tensor_parallel(self) -> bool:
        """Whether this is one rank's shard, joined to the others by collectives."""
        ...

    def linear_layers(self) -> list[LinearLayer]:
        """Every decoder layer's linear layers, layer by layer, each layer's in forward order."""
        ...

    def set_linear(self, layer: int, role: str, module: nn.Module) -> None:
        """Hold `module` as the `role` linear of decoder layer `layer` (e.g. a LoRA wrapper of it)."""
        ...

    def weight_nbytes(self) -> int:
        """Bytes of weights one decode step reads."""
        ...

    # The nn.Module methods the engine uses.
    def to(self, dtype: torch.dtype) -> Self: ...

    def eval(self) -> Self: ...

    def requires_grad_(self, requires_grad: bool = True) -> Self: ...


@runtime_checkable
class HasGemmaStack(Protocol):
    """A Gemma 3 model (the scripted CPU decode runs its stack)."""

    def gemma_stack(self) -> GemmaStack:
        """This model's tensors as the scripted decode takes them."""
        ...


@runtime_checkable
class HasLlamaStack(Protocol):
    """A model some of whose checkpoints are Llama-shaped stacks (the scripted CPU decode runs them)."""

    def llama_stack(self) -> LlamaStack | None:
        """This model's tensors as a Llama-shaped stack; None where its layers are shaped otherwise."""
        ...


@runtime_checkable
class CpuPrepackable(Protocol):
    """A model whose linear layers can be held in oneDNN's packed layout on the CPU."""

    def prepack_for_cpu(self) -> None:
        """Hold linear layers in oneDNN's packed layout (inference only, after loading)."""
        ...
