"""Batched LoRA over a mixed batch: rows with different adapters, and rows with none, in one step.

An adapted projection (one of the model's linear layers; a fused one such as qkv_proj covers
several of the checkpoint's projections, its "parts", as row slices of its output) keeps every
device slot's adapter in preallocated stacks, zero-padded to the largest rank R the engine serves
(zero rows of A and columns of B add exact zeros):

    a:       [S, P * R, in]     the parts' lora_A side by side (P parts)
    b[p]:    [S, out_p, R]      part p's lora_B, its scale folded in

A step's rows are grouped by slot once (`LoraBatch`, shared by every layer); each projection then
gathers the adapted rows, runs one shrink matmul per slot present in the step and one expand per
part (a loop over adapters, never over rows), and adds the result to the base layer's output:

    out[row, part p] += (x[row] @ a[s].T)[:, p*R:(p+1)*R] @ b[p][s].T    for each row using slot s

in the activation dtype, as the base layer computes (the weights are stored in it too: scale * B
is rounded once when a slot is filled). The adapted layer equals the merged weight
W + scale * B @ A up to that rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

NO_ADAPTER = -1

# (lora_A [r, in], lora_B [out, r], scale) of one checkpoint projection
LoraPiece = tuple[Tensor, Tensor, float]


@dataclass(frozen=True)
class LoraBatch:
    """Which rows of a step's flat batch use which adapter slot."""

    rows: Tensor  # [R] int64: the adapted rows, grouped by slot
    segments: tuple[tuple[int, int, int], ...]  # (slot, start, stop): rows[start:stop] use slot

    @classmethod
    def from_slots(cls, slots: Sequence[int], device: torch.device | None = None) -> LoraBatch:
        """slots[i]: the adapter slot of row i, or NO_ADAPTER."""
        return cls.from_sequences(slots, [1] * len(slots), device)

    @classmethod
    def from_sequences(
        cls, slots: Sequence[int], lengths: Sequence[int], device: torch.device | None = None
    ) -> LoraBatch:
        """Sequence i covers the next lengths[i] rows of the flat batch and uses slots[i]."""
        by_slot: dict[int, list[int]] = {}
        offset = 0
        for slot, length in zip(slots, lengths, strict=True):
            if slot != NO_ADAPTER:
                by_slot.setdefault(slot, []).extend(range(offset, offset + length))
            offset += length
        rows: list[int] = []
        segments = []
        for slot in sorted(by_slot):
            segments.append((slot, len(rows), len(rows) + len(by_slot[slot])))
            rows.extend(by_slot[slot])
        return cls(torch.tensor(rows, dtype=torch.long, device=device), tuple(segments))


class LoraStack:
    """One projection's adapter slots: its parts' LoRA weights for every slot, rank-padded."""

    def __init__(
        self,
        in_features: int,
        parts: Sequence[tuple[str, int]],  # (checkpoint projection name, its output rows), in row order
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        self.parts = tuple(parts)
        self.max_rank = max_rank
        self.a = torch.zeros(num_slots, len(parts) * max_rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(num_slots, out, max_rank, dtype=dtype, device=device) for _, out in parts]
        bounds, start = [], 0
        for _, out in parts:
            bounds.append((start, start + out))
            start += out
        self.columns = tuple(bounds)  # each part's output columns
        self.out_features = start

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, *self.b))

    def fill(self, slot: int, pieces: Mapping[str, LoraPiece]) -> None:
        """Slot `slot` now holds these parts' weights (parts absent: zero, the base layer alone)."""
        unknown = set(pieces) - {name for name, _ in self.parts}
        if unknown:
            raise ValueError(f"no part {sorted(unknown)} in this projection ({[n for n, _ in self.parts]})")
        self.a[slot].zero_()
        for index, (name, _) in enumerate(self.parts):
            b = self.b[index][slot]
            b.zero_()
            piece = pieces.get(name)
            if piece is None:
                continue
            lora_a, lora_b, scale = piece
            rank = lora_a.shape[0]
            if rank > self.max_rank:
                raise ValueError(f"{name}: rank {rank} is above the slots' {self.max_rank}")
            first = index * self.max_rank
            self.a[slot, first : first + rank] = lora_a.to(self.a.dtype)
            b[:, :rank] = (lora_b.float() * scale).to(b.dtype)

    def apply(self, out: Tensor, x: Tensor, batch: LoraBatch) -> Tensor:
        """out [T, out] (the base layer's output for x [T, in]) plus each adapted row's LoRA
        term, in place; returns out."""
        if not batch.segments:
            return out
        rows = batch.rows
        xs = x.index_select(0, rows)  # [R, in]
        delta = torch.empty(rows.shape[0], self.out_features, dtype=out.dtype, device=out.device)
        rank = self.max_rank
        for slot, start, stop in batch.segments:
            shrunk = xs[start:stop] @ self.a[slot].T  # [n, P * R]
            for index, (first, last) in enumerate(self.columns):
                part = shrunk[:, index * rank : (index + 1) * rank]
                delta[start:stop, first:last] = part @ self.b[index][slot].T
        return out.index_add_(0, rows, delta)


@dataclass
class LoraContext:
    """The current step's LoRA rows, shared by every adapted layer of a model (set per step)."""

    batch: LoraBatch | None = None


class AdaptedLinear(nn.Module):
    """A linear layer (any of the engine's: float, quantized, prepacked) plus the LoRA term of the
    step's adapted rows."""

    def __init__(self, base: nn.Module, stack: LoraStack, context: LoraContext) -> None:
        super().__init__()
        self.base = base
        self.stack = stack  # plain attributes: not parameters, never in a state dict
        self.context = context

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.base.forward(x)
        batch = self.context.batch
        return out if batch is None else self.stack.apply(out, x, batch)
