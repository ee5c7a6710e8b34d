"""Megatron-style tensor parallelism for the Llama family: which slice of each weight a rank holds,
and the collectives that join the slices.

Layout over `size` ranks (rank r of `size`):

| weight                         | split                   | joined by                     |
|--------------------------------|-------------------------|-------------------------------|
| q_proj (rows of whole heads)   | column-parallel         | -                             |
| k_proj, v_proj (kv heads)      | column-parallel (*)     | -                             |
| o_proj (columns of its heads)  | row-parallel            | all-reduce of the outputs     |
| gate_proj, up_proj (rows)      | column-parallel         | -                             |
| down_proj (columns)            | row-parallel            | all-reduce of the outputs     |
| each expert's gate, up (rows)  | column-parallel         | -                             |
| each expert's down (columns)   | row-parallel            | all-reduce of the routed sum  |
| router (mlp.gate)              | replicated              | -                             |
| embed_tokens (vocab rows)      | vocab-parallel          | all-reduce of the lookups     |
| lm_head (vocab rows)           | vocab-parallel          | all-gather of the logits      |
| norms                          | replicated              | -                             |

(*) With fewer kv heads than ranks, each rank holds the one kv head its query heads read
(replicated across the ranks that share it).

A mixture-of-experts layer (service.engine.models.moe) splits every expert over its intermediate
dimension, as a dense MLP is split: each rank holds all experts' slices, routes every token itself
(the router is replicated and sees the same all-reduced input on every rank, so every rank picks
the same experts), and sums its partial expert outputs, weighted; one all-reduce of that sum
completes the layer, as one all-reduce completes a dense MLP's down_proj.

Row-parallel biases are held by rank 0 only (zeros elsewhere), so the all-reduce adds them once. A
vocabulary that does not divide is padded to `size` equal slices with zero rows; their logits are
cut after the gather. A rank's model is an ordinary LlamaForCausalLM built from `local_config()`
(its share of heads, kv heads, intermediate size and vocabulary) over the weights `shard_weights`
yields, one checkpoint tensor at a time: no rank holds more than its shard plus the one tensor
being sliced. Quantized weights are sliced in their own format (whole quantization groups along
the input dimension).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from service.engine.models.quant import QuantizedWeight
from service.model.config import ModelConfig, UnsupportedModelError
from service.model.quantization import QuantizationError
from service.util import cdiv

Weight = Tensor | QuantizedWeight

_PROJECTION = re.compile(
    r"model\.layers\.\d+\.(?:self_attn\.(?P<attn>[qkvo])_proj|mlp\.(?P<mlp>gate|up|down)_proj"
    r"|(?:mlp|block_sparse_moe)\.experts\.\d+\.(?P<expert>gate_proj|up_proj|down_proj|w1|w3|w2))"
    r"\.(?P<kind>weight|bias)"
)
# An expert's projection -> its dense MLP counterpart (Mixtral's w1/w3/w2 are gate/up/down); the
# MoE model reads its checkpoints by the same table.
EXPERT_PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}


@dataclass(frozen=True)
class TPLayout:
    """Rank `rank` of `size` over a model of `config` (the whole model's)."""

    config: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.size}")
        refusal = self.config.tensor_parallel_refusal(self.size)
        if refusal is not None:
            raise UnsupportedModelError(refusal)

    @property
    def heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        """kv heads this rank holds: its share, or one (replicated) when there are fewer than ranks."""
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        config = self.config
        if config.num_kv_heads >= self.size:
            return self.rank * self.kv_heads
        # Fewer kv heads than ranks: this rank's query heads all read the same kv head.
        return (self.rank * self.heads) // (config.num_heads // config.num_kv_heads)

    @property
    def intermediate(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def moe_intermediate(self) -> int:
        return self.config.moe_intermediate_size // self.size

    @property
    def vocab(self) -> int:
        """Rows of the vocabulary this rank holds (the last ranks' padded with zero rows)."""
        return cdiv(self.config.vocab_size, self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def local_config(self) -> ModelConfig:
        return dataclasses.replace(
            self.config,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            moe_intermediate_size=self.moe_intermediate,
            vocab_size=self.vocab,
        )

    def split_of(self, name: str) -> tuple[str, int, int] | None:
        """("rows" or "columns", start, stop) of the checkpoint tensor `name` on this rank; None
        when it is replicated ("bias" for a row-parallel bias, held by rank 0)."""
        head_dim = self.config.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return "rows", self.vocab_start, self.vocab_start + self.vocab
        match = _PROJECTION.fullmatch(name)
        if match is None:
            return None  # norms (model.norm, input/post_attention_layernorm, q_norm/k_norm)
        attn, mlp, kind = match["attn"], match["mlp"], match["kind"]
        inter = self.intermediate
        if match["expert"] is not None:
            mlp, inter = EXPERT_PROJECTIONS[match["expert"]], self.moe_intermediate
        if attn == "q":
            start = self.rank * self.heads * head_dim
            return "rows", start, start + self.heads * head_dim
        if attn in ("k", "v"):
            start = self.kv_head_start * head_dim
            return "rows", start, start + self.kv_heads * head_dim
        if mlp in ("gate", "up"):
            start = self.rank * inter
            return "rows", start, start + inter
        # o_proj / down_proj: row-parallel (their input dimension is split)
        if kind == "bias":
            return "bias", 0, 0
        width = self.heads * head_dim if attn == "o" else inter
        start = self.rank * width
        return "columns", start, start + width

    def shard(self, name: str, tensor: Weight) -> Weight:
        """This rank's part of the checkpoint tensor `name`."""
        split = self.split_of(name)
        if split is None:
            return tensor
        how, start, stop = split
        if how == "bias":
            assert isinstance(tensor, Tensor)
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if how == "columns":
            return slice_columns(tensor, start, stop, name)
        if stop > tensor.shape[0]:  # the padded end of the vocabulary
            return pad_rows(slice_rows(tensor, start, min(stop, tensor.shape[0]), name), stop - start, name)
        return slice_rows(tensor, start, stop, name)


def shard_weights(weights: Iterable[tuple[str, Weight]], layout: TPLayout) -> Iterator[tuple[str, Weight]]:
    """A checkpoint's (name, tensor) stream -> this rank's shards, one tensor at a time."""
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            yield name, tensor
            continue
        yield name, layout.shard(name, tensor)


def slice_rows(weight: Weight, start: int, stop: int, name: str) -> Weight:
    """Output rows [start, stop) of a float or quantized [N, K] weight (or a bias)."""
    return weight[start:stop].clone() if isinstance(weight, Tensor) else weight.rows(start, stop)


def slice_columns(weight: Weight, start: int, stop: int, name: str) -> Weight:
    """Input columns [start, stop) of a float or quantized [N, K] weight (whole quantization
    groups only)."""
    if isinstance(weight, Tensor):
        return weight[:, start:stop].clone()
    try:
        return weight.columns(start, stop)
    except QuantizationError as error:
        raise QuantizationError(f"{name}: {error}") from error


def pad_rows(weight: Weight, rows: int, name: str) -> Weight:
    """`weight` followed by zero rows up to `rows` (the padded end of a split vocabulary)."""
    if not isinstance(weight, Tensor):
        raise QuantizationError(f"{name}: a quantized vocabulary must divide by the tensor-parallel size")
    padded = weight.new_zeros((rows, *weight.shape[1:]))
    padded[: weight.shape[0]] = weight
    return padded


class Collectives(Protocol):
    """What a tensor-parallel model needs from its process group."""

    rank: int
    size: int

    def all_reduce(self, x: Tensor) -> Tensor:
        """The elementwise sum of every rank's `x` (in place where possible); returns it."""
        ...

    def all_gather_last(self, x: Tensor) -> Tensor:
        """Every rank's `x` concatenated along the last dimension, rank order."""
        ...


class ProcessGroupCollectives:
    """Collectives over a torch.distributed process group (gloo on the CPU, NCCL on CUDA)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.bfloat16, torch.float16):
            # Sum the ranks' partial results in float32 and round once, as one rank's matmul
            # rounds its float32 accumulator once (a 16-bit sum rounds at every addition).
            wide = x.float()
            dist.all_reduce(wide, group=self.group)
            return x.copy_(wide)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)
