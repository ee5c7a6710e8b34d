"""Weights quantized at load are cached per (source, precision, settings), verified, and rebuilt
when corrupt (service.engine.models.quant_cache)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from service.engine.models import quant_cache
from service.engine.models.loader import build_model, load_hf_dir, quantizes_at_load
from service.engine.models.quant_linear import Int4Linear
from tests.test_quantization import _our_logits, _prompt, _tiny_hf_model, write_int4_gguf


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bf16")
    _tiny_hf_model(seed=3).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    return directory


def _load(weights_dir: Path, weights):  # the model built from a weight stream, and its logits
    config, _ = load_hf_dir(weights_dir, "int4_wo")
    model = build_model(config, weights, torch.float32, "cpu")
    return model, _our_logits(model, _prompt())


def test_what_counts_as_quantizing_at_load(bf16_dir: Path, tmp_path: Path) -> None:
    assert quantizes_at_load(bf16_dir, "hf_dir", "int4_wo")
    assert quantizes_at_load(bf16_dir, "hf_dir", "fp8")
    assert not quantizes_at_load(bf16_dir, "hf_dir", "bf16")
    q4 = tmp_path / "q4.gguf"
    write_int4_gguf(_tiny_hf_model(seed=7), q4, gguf.GGMLQuantizationType.Q4_1)
    assert not quantizes_at_load(q4, "gguf", "int4_wo")  # Q4_1 blocks are read as they are
    assert quantizes_at_load(q4, "gguf", "int8_wo")


def test_second_load_reads_the_cache_and_matches(bf16_dir: Path, tmp_path: Path) -> None:
    entry = tmp_path / quant_cache.cache_key(bf16_dir, "int4_wo", {"group": 128})
    assert quant_cache.read(entry) is None  # nothing cached yet
    writer = quant_cache.Writer(entry, bf16_dir, "int4_wo")
    _, weights = load_hf_dir(bf16_dir, "int4_wo")
    first, first_logits = _load(bf16_dir, writer.wrap(weights))
    writer.commit()
    assert (entry / quant_cache.WEIGHTS_FILE).is_file() and (entry / quant_cache.ENTRY_FILE).is_file()

    cached = quant_cache.read(entry)
    assert cached is not None
    second, second_logits = _load(bf16_dir, cached)
    assert any(isinstance(m, Int4Linear) for m in second.modules())
    assert torch.equal(first_logits, second_logits)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_servers_sharing_the_cache_keep_each_others_entries(bf16_dir: Path, tmp_path: Path) -> None:
    """Replicas on one cache volume: a second server quantizing the same source at the same time
    keeps the entry the first wrote (never replaces it under a reader), and a reader that opened
    an entry loads from it even when it is evicted meanwhile."""
    entry = tmp_path / quant_cache.cache_key(bf16_dir, "int8_wo", {"group": 128})
    writers = [quant_cache.Writer(entry, bf16_dir, "int8_wo") for _ in range(2)]
    built = []
    for writer in writers:  # both find no entry and quantize
        _, weights = load_hf_dir(bf16_dir, "int8_wo")
        built.append(_load(bf16_dir, writer.wrap(weights))[1])
    writers[0].commit()
    inode = (entry / quant_cache.WEIGHTS_FILE).stat().st_ino
    reading = quant_cache.read(entry)
    assert reading is not None
    writers[1].commit()  # the entry exists: kept, this copy dropped
    assert (entry / quant_cache.WEIGHTS_FILE).stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry.name]  # no staging directory left
    shutil.rmtree(entry)  # evicted (or discarded) by another server while this one loads
    _, logits = _load(bf16_dir, reading)
    assert torch.equal(logits, built[0]) and torch.equal(built[0], built[1])


def test_a_corrupt_entry_is_detected_and_discarded(bf16_dir: Path, tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    writer = quant_cache.Writer(entry, bf16_dir, "int8_wo")
    _, weights = load_hf_dir(bf16_dir, "int8_wo")
    _load(bf16_dir, writer.wrap(weights))
    writer.commit()
    weights_file = entry / quant_cache.WEIGHTS_FILE
    data = bytearray(weights_file.read_bytes())
    data[-10] ^= 0xFF  # one flipped byte in the tensor data
    weights_file.write_bytes(bytes(data))
    assert quant_cache.read(entry) is None
    assert not entry.exists()  # rebuilt on the next load

    writer = quant_cache.Writer(entry, bf16_dir, "int8_wo")
    _, weights = load_hf_dir(bf16_dir, "int8_wo")
    _load(bf16_dir, writer.wrap(weights))
    writer.commit()
    (entry / quant_cache.ENTRY_FILE).unlink()  # a partial entry (no manifest) is discarded too
    assert quant_cache.read(entry) is None and not entry.exists()


def test_an_abandoned_stream_writes_nothing(bf16_dir: Path, tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    writer = quant_cache.Writer(entry, bf16_dir, "int4_wo")
    _, weights = load_hf_dir(bf16_dir, "int4_wo")
    stream = writer.wrap(weights)
    next(stream)  # a load that fails after the first tensor
    with pytest.raises(RuntimeError, match="not consumed"):
        writer.commit()
    assert not entry.exists()
    assert not any(tmp_path.iterdir())  # no staging directory left behind


def test_the_key_follows_source_precision_and_settings(bf16_dir: Path, tmp_path: Path) -> None:
    key = quant_cache.cache_key(bf16_dir, "int4_wo", {"group": 128})
    assert key == quant_cache.cache_key(bf16_dir, "int4_wo", {"group": 128})
    assert key != quant_cache.cache_key(bf16_dir, "int8_wo", {"group": 128})
    assert key != quant_cache.cache_key(bf16_dir, "int4_wo", {"group": 64})
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in bf16_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    before = quant_cache.cache_key(copy, "int4_wo", {"group": 128})
    config = copy / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a new revision
    assert quant_cache.cache_key(copy, "int4_wo", {"group": 128}) != before


def test_a_new_revision_evicts_the_entry_it_supersedes(bf16_dir: Path, tmp_path: Path) -> None:
    old, new, other = tmp_path / "old", tmp_path / "new", tmp_path / "other"
    for entry, precision in ((old, "int8_wo"), (other, "int4_wo"), (new, "int8_wo")):
        writer = quant_cache.Writer(entry, bf16_dir, precision)
        _, weights = load_hf_dir(bf16_dir, precision)
        _load(bf16_dir, writer.wrap(weights))
        writer.commit()
    assert new.exists() and other.exists()  # another precision of the same source stays
    assert not old.exists()
