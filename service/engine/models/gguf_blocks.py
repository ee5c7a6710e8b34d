"""GGUF's simple block types (Q4_0, Q4_1, Q8_0) dequantized by PyTorch, bitwise as gguf-py does.

gguf-py (`gguf.quants.dequantize`) is the reference for every GGML type and stays the path for the
rest; for these three it runs numpy over groups of 16 rows, single-threaded: 1.3 s of the embedded
135M model's 3.3 s load, about a minute for an 8B Q4 file. Here the same float32 arithmetic runs as
PyTorch elementwise ops over large chunks on every intra-op thread:

- Q4_0 (18 bytes: d, 16 bytes of nibbles): d * (q - 8)
- Q4_1 (20 bytes: d, m, nibbles): (d * q) + m
- Q8_0 (34 bytes: d, 32 int8): x * d

with d and m float16 widened to float32 and byte j of a nibble block holding weight j in its low
nibble and weight j + 16 in its high one. Each element is one or two correctly rounded float32
operations in gguf-py's order, so the results are equal bit for bit (tests/test_gguf_blocks.py).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from torch import Tensor

BLOCK = 32  # weights per block, for all three
CHUNK_BLOCKS = 1 << 15  # blocks dequantized at once: 1M weights, 4 MB of float32 out (measured best)

Q = gguf.GGMLQuantizationType
# Bytes per block of each type done here.
BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}


def dequantize(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray | None:
    """`raw` (a GGUF tensor's bytes, any shape) as float32 weights, flat, in file order; None for a
    type not done here (gguf.quants.dequantize does those)."""
    size = BLOCK_BYTES.get(qtype)
    if size is None:
        return None
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if flat.size % size:
        raise ValueError(f"{qtype.name} data of {flat.size} bytes is not whole {size}-byte blocks")
    blocks = flat.reshape(-1, size)
    out = torch.empty(blocks.shape[0], BLOCK, dtype=torch.float32)
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        # A copy: the reader's memory map is read-only, which torch.from_numpy does not take.
        chunk = torch.from_numpy(blocks[start : start + CHUNK_BLOCKS].copy())
        _dequantize_into(out[start : start + chunk.shape[0]], chunk, qtype)
    return out.view(-1).numpy()


def _half(chunk: Tensor, at: int) -> Tensor:
    """The float16 at byte `at` of each block, widened: [blocks, 1]."""
    return chunk[:, at : at + 2].contiguous().view(torch.float16).float()


def _dequantize_into(out: Tensor, chunk: Tensor, qtype: gguf.GGMLQuantizationType) -> None:
    """out [blocks, 32] = the weights of `chunk` [blocks, bytes], each product and sum written in
    place (a uint8 or int8 operand is widened to float32 exactly by type promotion)."""
    d = _half(chunk, 0)
    if qtype == Q.Q8_0:
        torch.mul(chunk[:, 2:].contiguous().view(torch.int8), d, out=out)
        return
    half = BLOCK // 2
    low, high = out[:, :half], out[:, half:]
    qs = chunk[:, 2:] if qtype == Q.Q4_0 else chunk[:, 4:]
    if qtype == Q.Q4_0:
        torch.mul(d, (qs & 0x0F).to(torch.int8) - 8, out=low)
        torch.mul(d, (qs >> 4).to(torch.int8) - 8, out=high)
        return
    m = _half(chunk, 2)
    torch.mul(d, qs & 0x0F, out=low).add_(m)
    torch.mul(d, qs >> 4, out=high).add_(m)
