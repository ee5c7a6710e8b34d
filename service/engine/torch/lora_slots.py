"""A model's LoRA device slots: every decoder projection wrapped once with its slot stacks.

`LoraSlots.attach` wraps each of the model's linear layers (`CausalLM.linear_layers`; for the
Llama family qkv with parts q/k/v, o, gate_up with parts gate/up, and down) in an AdaptedLinear
whose stacks hold `num_slots` adapters of rank up to `max_rank`
(service.engine.models.lora_ops). Memory is taken once, at start, before the KV cache
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

from service.engine.lora import LoraAdapter
from service.engine.models.base import CausalLM, LinearPart
from service.engine.models.lora_ops import (
    NO_ADAPTER,
    AdaptedLinear,
    LoraBatch,
    LoraContext,
    LoraPiece,
    LoraStack,
)
from service.engine.models.tensor_parallel import TPLayout


class LoraSlots:
    def __init__(self, num_slots: int, max_rank: int, layout: TPLayout | None = None) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.layout = layout  # this rank's shard of every projection (None: the whole model)
        self.context = LoraContext()
        # (layer, role) -> the linear's stack, and the checkpoint projections its rows hold
        self.stacks: dict[tuple[int, str], tuple[LoraStack, tuple[LinearPart, ...]]] = {}
        self.names: list[str | None] = [None] * num_slots  # what each slot holds (for logs)

    @classmethod
    def attach(
        cls, model: CausalLM, num_slots: int, max_rank: int, layout: TPLayout | None = None
    ) -> LoraSlots:
        """Wrap `model`'s projections (after its weights are loaded and prepacked); `model` is
        `layout`'s shard under tensor parallelism."""
        slots = cls(num_slots, max_rank, layout)
        device = model.device
        # float32 on the CPU (small bfloat16 matmuls are slow there), the activation dtype on GPUs
        dtype = torch.float32 if device.type == "cpu" else model.activation_dtype
        for linear in model.linear_layers():  # this rank's sizes
            parts = [(part.name, part.rows) for part in linear.parts]
            stack = LoraStack(linear.in_features, parts, num_slots, max_rank, dtype, device)
            model.set_linear(linear.layer, linear.role, AdaptedLinear(linear.module, stack, slots.context))
            slots.stacks[(linear.layer, linear.role)] = (stack, linear.parts)
        return slots

    @property
    def nbytes(self) -> int:
        return sum(stack.nbytes for stack, _ in self.stacks.values())

    def fill(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into `slot` (whatever the slot held is gone)."""
        for (layer, _), (stack, parts) in self.stacks.items():
            pieces = {}
            for part in parts:
                weights = adapter.modules.get((layer, part.name))
                if weights is not None:
                    pieces[part.name] = self._shard(part, (weights.a, weights.b, weights.scale))
            stack.fill(slot, pieces)
        self.names[slot] = adapter.name

    def _shard(self, part: LinearPart, piece: LoraPiece) -> LoraPiece:
        """This rank's share of one projection's adapter weights."""
        if self.layout is None:
            return piece
        a, b, scale = piece
        split = self.layout.split_of(part.weight_name)
        assert split is not None, part.weight_name
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
        self.context.batch = LoraBatch.from_sequences(slots, lengths, device, self.num_slots)
        return True
