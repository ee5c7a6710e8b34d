"""Batched LoRA over a mixed batch: rows with different adapters, and rows with none, in one step.

An adapted projection (one of the model's linear layers; a fused one such as qkv_proj covers
several of the checkpoint's projections, its "parts", as column blocks of its output) keeps every
device slot's adapter in preallocated stacks, zero-padded to the largest rank R the engine serves
(zero rows of A and B^T add exact zeros):

    a:       [S, P * R, in]     the parts' lora_A, one above the other (P parts)
    bt[p]:   [S, R, out_p]      part p's lora_B transposed, its scale folded in

The k slots a step uses, the T' adapted rows and each one's slot are found once (`LoraBatch`,
shared by every layer). Each projection then runs, whatever the mix of adapters:

    xa = x[rows]                             [T', in]   the adapted rows (x itself when all are)
    shrunk = xa @ a[present].T               [T', k * P * R]   one matmul against the k slots
    shrunk = where(row's slot, shrunk, 0)    keep each row's own slot's block, zero the others
    out[rows, part p] += shrunk[.., p] @ bt[p][present]       one matmul per part

so a step costs one shrink and P expand matmuls per projection, never a loop over rows or slots
(each adapted row also meets the other present slots' weights: work of the order of k * P * R /
out of the base layer's, small at LoRA ranks). Isolation, the invariant: a row's output depends
only on its own activations and its own adapter. Rows of the base model are never read or
written, so their output is the base layer's bit for bit. Another slot's block of an adapted row
is selected away (`where`), never multiplied by a zero mask, since it may hold inf (0 * inf is
NaN); in the expand it meets the other slots' lora_B as exact zeros, which stay zeros because
the stacks hold only finite weights (service.engine.lora refuses any other). The arithmetic runs
in the stacks' dtype (float32 on the CPU, where small bfloat16 matmuls are several times slower;
the activation dtype on GPUs) and is added to the base output with one rounding: the adapted
layer equals the merged weight W + scale * B @ A up to that rounding and float summation order.

Batch invariance, as for the base model: a row's LoRA term must not depend on what else shares
the step. So the engine passes every slot as present (the matmuls keep one shape whichever
adapters a step holds; unused slots are zeros, selected away), and fewer than MIN_ROWS adapted
rows are padded with zero rows: the CPU's float32 matmul rounds a row differently when it has
fewer than 12 rows beside it (seen at 1-3, 5-7 and 9-11 rows, never from 12 up to 700).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

NO_ADAPTER = -1
MIN_ROWS = 16  # adapted rows are padded to at least this many (see "Batch invariance" above)

# (lora_A [r, in], lora_B [out, r], scale) of one checkpoint projection
LoraPiece = tuple[Tensor, Tensor, float]


@dataclass(frozen=True)
class LoraBatch:
    """Which rows of a step's flat batch use which adapter slot."""

    present: Tensor  # [k] int64: the slots in use (or every slot), ascending
    rows: Tensor | None  # [T'] int64: the adapted rows, ascending; None when every row is adapted
    # [max(T', MIN_ROWS), k, 1] bool: adapted row i uses present[j] (padding rows use none). None
    # when one slot is present.
    own: Tensor | None
    segments: tuple[tuple[int, int], ...]  # (slot, rows using it), for logs and tests

    @classmethod
    def from_slots(cls, slots: Sequence[int], device: torch.device | None = None) -> LoraBatch:
        """slots[i]: the adapter slot of row i, or NO_ADAPTER."""
        return cls.from_sequences(slots, [1] * len(slots), device)

    @classmethod
    def from_sequences(
        cls,
        slots: Sequence[int],
        lengths: Sequence[int],
        device: torch.device | None = None,
        num_slots: int | None = None,
    ) -> LoraBatch:
        """Sequence i covers the next lengths[i] rows of the flat batch and uses slots[i]. With
        `num_slots`, every slot counts as present (the engine's batch-invariant shapes)."""
        used = {slot for slot in slots if slot != NO_ADAPTER}
        present = list(range(num_slots)) if num_slots is not None and used else sorted(used)
        position = {slot: j for j, slot in enumerate(present)}
        counts = dict.fromkeys(present, 0)
        rows: list[int] = []  # the adapted rows
        row_slots: list[int] = []  # each adapted row's index into present
        first = 0
        for slot, length in zip(slots, lengths, strict=True):
            if slot != NO_ADAPTER:
                rows.extend(range(first, first + length))
                row_slots.extend([position[slot]] * length)
                counts[slot] += length
            first += length
        own = None
        if len(present) > 1:
            padding = [-1] * (MIN_ROWS - len(row_slots))  # no slot: padding rows keep zeros
            index = torch.tensor(row_slots + padding, dtype=torch.long)
            own = (index[:, None] == torch.arange(len(present))[None, :]).unsqueeze(-1).to(device)
        return cls(
            torch.tensor(present, dtype=torch.long, device=device),
            None if len(rows) == first else torch.tensor(rows, dtype=torch.long, device=device),
            own,
            tuple((slot, counts[slot]) for slot in present if counts[slot]),
        )


class LoraStack:
    """One projection's adapter slots: its parts' LoRA weights for every slot, rank-padded."""

    def __init__(
        self,
        in_features: int,
        parts: Sequence[tuple[str, int]],  # (checkpoint projection name, its output columns), in order
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,  # the compute dtype (see the module docstring)
        device: torch.device | None = None,
    ) -> None:
        self.parts = tuple(parts)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.a = torch.zeros(num_slots, len(parts) * max_rank, in_features, dtype=dtype, device=device)
        self.bt = [torch.zeros(num_slots, max_rank, out, dtype=dtype, device=device) for _, out in parts]
        bounds, start = [], 0
        for _, out in parts:
            bounds.append((start, start + out))
            start += out
        self.columns = tuple(bounds)  # each part's output columns
        self.out_features = start

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, *self.bt))

    def fill(self, slot: int, pieces: Mapping[str, LoraPiece]) -> None:
        """Slot `slot` now holds these parts' weights (parts absent: zero, the base layer alone)."""
        unknown = set(pieces) - {name for name, _ in self.parts}
        if unknown:
            raise ValueError(f"no part {sorted(unknown)} in this projection ({[n for n, _ in self.parts]})")
        self.a[slot].zero_()
        for index, (name, _) in enumerate(self.parts):
            bt = self.bt[index][slot]
            bt.zero_()
            piece = pieces.get(name)
            if piece is None:
                continue
            lora_a, lora_b, scale = piece
            rank = lora_a.shape[0]
            if rank > self.max_rank:
                raise ValueError(f"{name}: rank {rank} is above the slots' {self.max_rank}")
            first = index * self.max_rank
            self.a[slot, first : first + rank] = lora_a.to(self.a.dtype)
            bt[:rank] = (lora_b.float().T * scale).to(bt.dtype)

    def apply(self, out: Tensor, x: Tensor, batch: LoraBatch) -> Tensor:
        """out [T, out] (the base layer's output for x [T, in]) plus each adapted row's LoRA
        term, in place (rows of the base model are left alone); returns out."""
        present, rows = batch.present, batch.rows
        k, num_parts, rank = present.shape[0], len(self.parts), self.max_rank
        if k == 0:
            return out
        whole = k == self.num_slots  # every slot in use: no gather of the weights
        a = self.a if whole else self.a.index_select(0, present)  # [k, P*R, in]
        adapted = x if rows is None else x.index_select(0, rows)  # [T', in]
        num_rows = adapted.shape[0]
        if num_rows < MIN_ROWS:  # a fixed minimum height: see "Batch invariance" above
            adapted = torch.cat((adapted, adapted.new_zeros(MIN_ROWS - num_rows, adapted.shape[1])))
        shrunk = (adapted.to(a.dtype) @ a.view(k * num_parts * rank, -1).T).view(-1, k, num_parts * rank)
        if batch.own is not None:  # each row keeps its own slot's block: selected, not masked by 0 * x
            shrunk = torch.where(batch.own, shrunk, 0.0)
        parts = shrunk.view(-1, k, num_parts, rank)
        for index, (first, last) in enumerate(self.columns):
            bt = self.bt[index] if whole else self.bt[index].index_select(0, present)  # [k, R, out_p]
            delta = (parts[:, :, index, :].reshape(-1, k * rank) @ bt.view(k * rank, -1))[:num_rows]
            columns = out[:, first:last]
            if rows is None:
                columns.add_(delta)  # in the stacks' dtype, rounded once into out's dtype
            else:
                columns.index_copy_(0, rows, columns.index_select(0, rows).add_(delta))
        return out


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
