"""Prompt rows through dense bf16 weights on the CPU: an int4_wo model's prefill at bf16 speed.

aten's CPU int4 kernel computes a matmul in blocks of 4 rows, dequantizing the weight again for
each block: a prompt chunk of 160 rows costs 40 times a 4-row decode (the embedded model's gate_up:
3.61 ms), where oneDNN's bf16 matmul of the same layer takes 0.48 ms with AMX (bench/README.md).
So, where this is chosen (service/engine/torch/dense_prompts.py: bf16 activations, no tensor
parallelism, the probe below, NIM_DENSE_PROMPT_ROWS), each decoder layer's native int4 projection
also holds its weight dequantized to bf16 (Int4Linear.attach_dense: 2 bytes a weight beside the
int4's ~0.6), and the rows of a step that are tokens of their request's own prompt go through it;
every other row (decodes, verified drafts, a preempted request's recomputed output) stays on the
int4 kernel. A token is therefore
always computed by one kind of row, whatever else shares its step or however its prompt is
chunked: a prompt token dense, an output token int4.

Batch invariance: oneDNN's AMX kernels block by the number of rows, so a row's result depends on
how many rows share the call; within calls of one shape it does not depend on the other rows or
on its position (probed at start-up: `tile_problem`). So prompt rows go through in calls of
exactly TILE rows, the last one padded with zeros.

The prefix cache keeps the kinds apart: a block holding any output token is hashed with
block_pool.OUTPUT_TAG (Request.tag_outputs), so a later prompt that continues it (a chat's next
turn holds the last answer) does not find the int4-computed block and computes its own, dense, as
it would with nothing cached; a preempted request finds its own output blocks again.

The runner names a step's prompt rows (`split`) around the model's forward; a projection with a
dense weight (`DenseWeight`, Int4Linear.dense) reads them when its input has the step's rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from service.engine.models.cpu_linear import order_sensitive_rows

# aten's CPU int4 layout packs output rows in blocks of 64 (its AVX-512 kernel) or 32 (AVX2).
PACK_BLOCKS = (64, 32)
UNPACK_ROWS = 512  # output rows dequantized at a time (a multiple of each block)
TILE = 64  # rows of every dense call: one shape, so one blocking for every row (see above)
# Positions in a tile the probe puts the same row at (among different other rows).
PROBED_POSITIONS = (0, 1, 7, 31, 63)


@dataclass(frozen=True)
class RowSplit:
    num_tokens: int  # the step's rows: a projection whose input has another count is not split
    dense: Tensor  # [D] indices of the prompt rows
    rest: Tensor  # [T - D] indices of the others
    all_dense: bool


_split: RowSplit | None = None


@contextmanager
def split(num_tokens: int, dense_rows: list[int]) -> Iterator[None]:
    """Within the block, projections with a dense weight send `dense_rows` (of `num_tokens`) through it."""
    global _split
    chosen = set(dense_rows)
    rest = [row for row in range(num_tokens) if row not in chosen]
    outer, _split = _split, RowSplit(num_tokens, torch.tensor(dense_rows), torch.tensor(rest), not rest)
    try:
        yield
    finally:
        _split = outer


def current(num_rows: int) -> RowSplit | None:
    """The step's split, where an input of `num_rows` rows is the step's rows."""
    found = _split
    return found if found is not None and found.num_tokens == num_rows else None


class DenseWeight:
    """A projection's weight in bf16, oneDNN-packed for TILE-row calls."""

    def __init__(self, weight: Tensor) -> None:  # [N, K] bf16
        self.out_features = weight.shape[0]
        self.nbytes = weight.numel() * weight.element_size()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), TILE)
        self._linear = torch.ops.mkldnn._linear_pointwise.default

    def matmul(self, x: Tensor) -> Tensor:
        """x [R, K] bf16 -> [R, N]: TILE rows a call, the last padded."""
        outs = []
        for start in range(0, x.shape[0], TILE):
            tile = x[start : start + TILE]
            rows = tile.shape[0]
            if rows < TILE:
                tile = torch.cat([tile, tile.new_zeros(TILE - rows, tile.shape[1])])
            out: Tensor = self._linear(tile, self.packed, None, "none", [], "")
            outs.append(out[:rows])
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def unpack_int4(packed: Tensor, out_features: int, in_features: int, block: int) -> Tensor:
    """aten's CPU int4 packing undone: uint8 [N, K] nibble values. Within each block of `block`
    output rows the bytes run k-major, byte (k, j) holding row j's value in its low nibble and row
    j + block / 2's in its high one (what `_convert_weight_to_int4pack_for_cpu` writes: blocks of
    64 for its AVX-512 kernel, 32 for AVX2; `dense_int4` checks the result against the kernel)."""
    blocks = packed.reshape(out_features // block, in_features, block // 2)
    values = torch.cat([blocks & 0x0F, blocks >> 4], dim=2)  # [blocks, K, block]
    return values.permute(0, 2, 1).reshape(out_features, in_features)


def dense_int4(
    packed: Tensor, scales_zeros: Tensor, group: int, out_features: int, in_features: int
) -> Tensor | str:
    """The int4 kernel's weight as bf16 [N, K] ((q - 8) * scale + zero, rounded once), or why not:
    each known layout is checked against the kernel on one input column of every group (one-hot
    rows give W.T), and the first that matches is taken. Built UNPACK_ROWS output rows at a time,
    so its float32 temporaries stay small beside the result."""
    rows = packed.shape[0]  # the output rows as packed (padded to the kernel's multiple)
    if packed.shape[1] * 2 != in_features:
        return f"its packed shape {tuple(packed.shape)} is not [N, K / 2]"
    columns = torch.arange(0, in_features, group) + torch.arange(0, in_features, group) // group % group
    one_hot = torch.zeros(len(columns), in_features, dtype=scales_zeros.dtype)
    one_hot[torch.arange(len(columns)), columns] = 1
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(one_hot, packed, group, scales_zeros)
    for block in PACK_BLOCKS:
        if rows % block:
            continue
        weight = torch.empty(rows, in_features, dtype=torch.bfloat16)
        for start in range(0, rows, UNPACK_ROWS):  # a multiple of every block: whole blocks
            end = min(start + UNPACK_ROWS, rows)
            chunk = scales_zeros[:, start:end]  # [K / group, n, 2]
            scale = chunk[..., 0].t().float().repeat_interleave(group, dim=1)
            zero = chunk[..., 1].t().float().repeat_interleave(group, dim=1)
            values = unpack_int4(packed[start:end], end - start, in_features, block).float()
            weight[start:end] = torch.addcmul(zero, values - 8, scale)
        if torch.equal(kernel.to(torch.bfloat16), weight[:, columns].t()):
            return weight[:out_features]
    return f"its packed layout ({rows} rows) is none this unpacks to the kernel's weights"


def tile_problem(in_features: int, out_features: int) -> str | None:
    """Why TILE-row dense calls would not compute every row alike (None: they do): a row's result
    must not depend on the rows beside it or on its position in the tile. Checked on a layer of
    this shape with weights of ones and an input whose sum depends on the order of summation
    (cpu_linear.order_sensitive_rows, as PackedLinear.needs_padding probes)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU's oneDNN has no bf16 matmul"
    generator = torch.Generator().manual_seed(0)  # the other rows of each probed tile
    dense = DenseWeight(torch.ones(out_features, in_features, dtype=torch.bfloat16))
    probe = order_sensitive_rows(1, in_features)[0].to(torch.bfloat16)
    with torch.inference_mode():
        reference = None
        for position in PROBED_POSITIONS:
            others = torch.randn(TILE, in_features, generator=generator).to(torch.bfloat16)
            others[position] = probe
            row = dense.matmul(others)[position]
            if reference is None:
                reference = row
            elif not torch.equal(row, reference):
                return f"oneDNN's bf16 matmul computed a row differently at position {position} of a tile"
    return None
