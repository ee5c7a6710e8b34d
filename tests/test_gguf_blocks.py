"""GGUF Q4_0 / Q4_1 / Q8_0 dequantized by PyTorch (service/engine/models/gguf_blocks.py) equal
gguf-py's own dequantization bit for bit: random blocks (every nibble and int8 value, float16
scales across their range, subnormals included) and every quantized tensor of the embedded model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from service.engine.models import gguf_blocks
from service.store.model_store import embedded_model_path

Q = gguf.GGMLQuantizationType


def _random_blocks(qtype: gguf.GGMLQuantizationType, count: int, seed: int) -> np.ndarray:
    """`count` blocks of random bytes whose float16 fields are finite (any sign and exponent)."""
    rng = np.random.default_rng(seed)
    size = gguf_blocks.BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    halves = 2 if qtype == Q.Q4_1 else 1
    for index in range(halves):
        exponents = rng.integers(-8, 4, count)  # float16 from subnormal to large
        values = rng.standard_normal(count).astype(np.float32) * np.float32(10.0) ** exponents
        blocks[:, 2 * index : 2 * index + 2] = values.astype(np.float16).view(np.uint8).reshape(count, 2)
    return blocks


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_random_blocks_dequantize_bitwise_as_gguf_py(qtype: gguf.GGMLQuantizationType) -> None:
    # More blocks than one chunk, and a row shape as the reader gives it ([rows, bytes per row]).
    count = gguf_blocks.CHUNK_BLOCKS + 72
    raw = _random_blocks(qtype, count, seed=int(qtype)).reshape(-1, 8 * gguf_blocks.BLOCK_BYTES[qtype])
    ours = gguf_blocks.dequantize(raw, qtype)
    theirs = gguf.quants.dequantize(raw, qtype).reshape(-1)
    assert ours is not None and ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_the_embedded_models_tensors_dequantize_bitwise_as_gguf_py() -> None:
    reader = gguf.GGUFReader(embedded_model_path())
    done = 0
    for tensor in reader.tensors:
        raw = np.asarray(tensor.data)
        ours = gguf_blocks.dequantize(raw, tensor.tensor_type)
        if ours is None:
            assert tensor.tensor_type not in gguf_blocks.BLOCK_BYTES
            continue
        theirs = gguf.quants.dequantize(raw, tensor.tensor_type).reshape(-1)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), tensor.name
        done += 1
    assert done >= 200  # the Q4_1 layers and the Q8_0 embedding


def test_other_types_are_left_to_gguf_py_and_torn_data_is_refused() -> None:
    assert gguf_blocks.dequantize(np.zeros(64, dtype=np.float32), Q.F32) is None
    assert gguf_blocks.dequantize(np.zeros(210, dtype=np.uint8), Q.Q6_K) is None
    with pytest.raises(ValueError, match="not whole 20-byte blocks"):
        gguf_blocks.dequantize(np.zeros(30, dtype=np.uint8), Q.Q4_1)
