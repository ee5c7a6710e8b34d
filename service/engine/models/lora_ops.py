"""Batched LoRA for one linear layer over a mixed batch: rows with different adapters, and rows
with none, in the same step.

Resident adapters occupy slots; per adapted layer their weights are stacked once, zero-padded
to the largest rank (zero rows of A and columns of B add exact zeros):

    a: [S, r_max, in]   b: [S, out, r_max]   scales: [S]

A step's rows are grouped by slot once (`LoraBatch`, shared by every layer); each layer then
gathers the adapted rows, runs one shrink and one expand matmul per slot present in the step
(a loop over adapters, never over rows), and adds the result to the base layer's output:

    out[row] += scale[s] * (x[row] @ a[s].T) @ b[s].T      for each row using slot s

in float32, rounded once into the output's dtype (as a merged weight W + scale * B @ A would
be applied, up to float32 summation order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

NO_ADAPTER = -1


@dataclass(frozen=True)
class LoraBatch:
    """Which rows of a step's flat batch use which adapter slot."""

    rows: Tensor  # [R] int64: the adapted rows, grouped by slot
    segments: tuple[tuple[int, int, int], ...]  # (slot, start, stop): rows[start:stop] use slot

    @classmethod
    def from_slots(cls, slots: Sequence[int], device: torch.device | None = None) -> LoraBatch:
        """slots[i]: the adapter slot of row i, or NO_ADAPTER."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot != NO_ADAPTER:
                by_slot.setdefault(slot, []).append(row)
        rows: list[int] = []
        segments = []
        for slot in sorted(by_slot):
            segments.append((slot, len(rows), len(rows) + len(by_slot[slot])))
            rows.extend(by_slot[slot])
        return cls(torch.tensor(rows, dtype=torch.long, device=device), tuple(segments))


@dataclass(frozen=True)
class StackedLora:
    """One layer's resident adapters, by slot."""

    a: Tensor  # [S, r_max, in]
    b: Tensor  # [S, out, r_max]
    scales: Tensor  # [S] float32; 0 for an empty slot

    @classmethod
    def stack(
        cls,
        weights: Sequence[tuple[Tensor, Tensor, float] | None],
        in_features: int,
        out_features: int,
        device: torch.device | None = None,
    ) -> StackedLora:
        """Slot s holds weights[s] = (a [r, in], b [out, r], scale), or nothing (None)."""
        max_rank = max((a.shape[0] for a, _, _ in filter(None, weights)), default=1)
        a_stack = torch.zeros(len(weights), max_rank, in_features, device=device)
        b_stack = torch.zeros(len(weights), out_features, max_rank, device=device)
        scales = torch.zeros(len(weights), device=device)
        for slot, entry in enumerate(weights):
            if entry is None:
                continue
            a, b, scale = entry
            rank = a.shape[0]
            a_stack[slot, :rank] = a.float()
            b_stack[slot, :, :rank] = b.float()
            scales[slot] = scale
        return cls(a_stack, b_stack, scales)


def add_lora(out: Tensor, x: Tensor, batch: LoraBatch, lora: StackedLora) -> Tensor:
    """out [T, out] (the base layer's output for x [T, in]) plus each adapted row's LoRA term, in
    place; returns out."""
    if not batch.segments:
        return out
    rows = batch.rows
    xs = x.index_select(0, rows).float()  # [R, in]
    delta = torch.empty(rows.shape[0], out.shape[1], dtype=torch.float32, device=out.device)
    for slot, start, stop in batch.segments:
        shrunk = xs[start:stop] @ lora.a[slot].T  # [n, r_max]
        delta[start:stop] = (shrunk @ lora.b[slot].T).mul_(lora.scales[slot])
    adapted = out.index_select(0, rows).float().add_(delta)
    return out.index_copy_(0, rows, adapted.to(out.dtype))
