"""A model's LoRA device slots: every decoder projection wrapped once with its slot stacks.

`LoraSlots.attach` wraps each layer's qkv_proj (parts q/k/v), o_proj, gate_up_proj (parts
gate/up) and down_proj in an AdaptedLinear whose stacks hold `num_slots` adapters of rank up to
`max_rank` (service.engine.models.lora_ops). Memory is taken once, at start, before the KV cache
is sized; filling a slot copies an adapter's weights into it (zeros where the adapter leaves a
projection alone). Each step the runner sets which rows use which slot; rows of the base model
(NO_ADAPTER) run the base layers alone.

Under tensor parallelism each rank's slots hold its shard, cut like the base layer's: lora_B's
rows of a column-parallel projection (q/k/v, gate/up), lora_A's columns of a row-parallel one
(o, down), whose partial LoRA terms the layer's all-reduce sums with the base output's
((sum_r x_r A_r^T) B^T = x A^T B^T).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.lora import LoraAdapter, block_of
from service.engine.models.llama import LlamaForCausalLM
from service.engine.models.lora_ops import (
    NO_ADAPTER,
    AdaptedLinear,
    LoraBatch,
    LoraContext,
    LoraPiece,
    LoraStack,
)
from service.engine.models.tensor_parallel import TPLayout

# fused module -> the checkpoint projections it holds, in row order
_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class LoraSlots:
    def __init__(self, num_slots: int, max_rank: int, layout: TPLayout | None = None) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.layout = layout  # this rank's shard of every projection (None: the whole model)
        self.context = LoraContext()
        self.stacks: dict[tuple[int, str], LoraStack] = {}  # (layer, fused module) -> stack
        self.names: list[str | None] = [None] * num_slots  # what each slot holds (for logs)

    @classmethod
    def attach(
        cls, model: LlamaForCausalLM, num_slots: int, max_rank: int, layout: TPLayout | None = None
    ) -> LoraSlots:
        """Wrap `model`'s projections (after its weights are loaded and prepacked); `model` is
        `layout`'s shard under tensor parallelism."""
        slots = cls(num_slots, max_rank, layout)
        config = model.config  # this rank's sizes
        device = model.model.embed_tokens.weight.device
        # float32 on the CPU (small bfloat16 matmuls are slow there), the activation dtype on GPUs
        dtype = torch.float32 if device.type == "cpu" else model.model.embed_tokens.weight.dtype
        sizes = {
            "q_proj": config.q_size,
            "k_proj": config.kv_size,
            "v_proj": config.kv_size,
            "o_proj": config.hidden_size,
            "gate_proj": config.intermediate_size,
            "up_proj": config.intermediate_size,
            "down_proj": config.hidden_size,
        }
        inputs = {
            "qkv_proj": config.hidden_size,
            "o_proj": config.q_size,
            "gate_up_proj": config.hidden_size,
            "down_proj": config.intermediate_size,
        }
        for index, layer in enumerate(model.model.layers):
            for owner in (layer.self_attn, layer.mlp):
                for fused, parts in _PARTS.items():
                    base = getattr(owner, fused, None)
                    if base is None:
                        continue
                    stack = LoraStack(
                        inputs[fused], [(p, sizes[p]) for p in parts], num_slots, max_rank, dtype, device
                    )
                    setattr(owner, fused, AdaptedLinear(base, stack, slots.context))
                    slots.stacks[(index, fused)] = stack
        return slots

    @property
    def nbytes(self) -> int:
        return sum(stack.nbytes for stack in self.stacks.values())

    def fill(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into `slot` (whatever the slot held is gone)."""
        for (layer, fused), stack in self.stacks.items():
            pieces = {}
            for part in _PARTS[fused]:
                weights = adapter.modules.get((layer, part))
                if weights is not None:
                    pieces[part] = self._shard(layer, part, (weights.a, weights.b, weights.scale))
            stack.fill(slot, pieces)
        self.names[slot] = adapter.name

    def _shard(self, layer: int, part: str, piece: LoraPiece) -> LoraPiece:
        """This rank's share of one projection's adapter weights."""
        if self.layout is None:
            return piece
        a, b, scale = piece
        split = self.layout.split_of(f"model.layers.{layer}.{block_of(part)}.{part}.weight")
        assert split is not None, part
        how, start, stop = split
        if how == "rows":  # column-parallel: this rank's output rows
            return a, b[start:stop], scale
        return a[:, start:stop], b, scale  # row-parallel: this rank's input columns

    def set_step(self, slots: Sequence[int], lengths: Sequence[int], device: torch.device) -> bool:
        """This step's rows: sequence i covers lengths[i] rows and uses slots[i]. Returns whether
        any row is adapted."""
        if all(slot == NO_ADAPTER for slot in slots):
            self.context.batch = None
            return False
        self.context.batch = LoraBatch.from_sequences(slots, lengths, device)
        return True
