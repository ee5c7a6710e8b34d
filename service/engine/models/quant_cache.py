"""Weights quantized at load, kept in the model store so the next start skips the work.

One entry per (source files, precision, quantization settings): a directory holding
``weights.safetensors`` (every tensor the loader produced: float tensors as they are, each
quantized weight as its format's tensors ``<name>::<field>``) and ``entry.json`` (the formats and
the file's SHA-256). An entry is written atomically (a temporary directory renamed into place)
and only after the model loaded from the stream completely; reading checks the checksum first,
and an entry that is missing, partial or corrupt is deleted and rebuilt from the source. Servers
may share the cache (replicas on one volume): an entry is never replaced once written (a server
that finds one written meanwhile keeps it), and a reader maps its file before loading from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from service.engine.models.quant import FORMATS, QuantizedWeight

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when a format's fields or meaning change
WEIGHTS_FILE = "weights.safetensors"
ENTRY_FILE = "entry.json"
# An entry names each weight's format by its class (the precision spec's storage_format).
_FORMATS: dict[str, type[QuantizedWeight]] = {kind.__name__: kind for kind in FORMATS.values()}
_SEPARATOR = "::"

Weight = torch.Tensor | QuantizedWeight


def cache_key(source: Path, precision: str, settings: dict[str, Any]) -> str:
    """Identifies the source files (name, size, modification time: a new revision or a changed file
    is a new key), the precision and the quantization settings."""
    source = source.resolve()
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    described = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    content = json.dumps(
        {"version": FORMAT_VERSION, "source": str(source), "files": described, "precision": precision,
         "settings": settings},
        sort_keys=True,
    )  # fmt: skip
    return hashlib.sha256(content.encode()).hexdigest()[:32]


def read(directory: Path) -> Iterator[tuple[str, Weight]] | None:
    """The entry's weights, or None (after deleting it) when it is absent, partial or corrupt."""
    entry_file, weights_file = directory / ENTRY_FILE, directory / WEIGHTS_FILE
    if not entry_file.is_file() or not weights_file.is_file():
        if directory.exists():
            _discard(directory, "incomplete")
        return None
    try:
        entry = json.loads(entry_file.read_text())
        valid = entry.get("version") == FORMAT_VERSION and entry.get("sha256") == _sha256(weights_file)
    except (OSError, ValueError) as error:
        log.warning("quantized weights cache %s unreadable (%s)", directory, error)
        valid = False
    if not valid:
        _discard(directory, "checksum or version mismatch")
        return None
    try:
        # Opened (mapped) now, not when the load first iterates: the open file stays readable
        # should another server sharing the cache replace or evict the entry meanwhile.
        handle = safe_open(str(weights_file), framework="pt", device="cpu")
    except OSError as error:  # gone since the checksum: another server's; this one quantizes
        log.warning("quantized weights cache %s went away while read (%s); quantizing", directory, error)
        return None
    log.info("quantized weights from the cache %s (checksum verified)", directory)
    return _read_entry(handle, entry["formats"], entry["order"])


def _read_entry(
    handle: Any, formats: dict[str, dict[str, Any]], order: list[str]
) -> Iterator[tuple[str, Weight]]:
    with handle:
        for name in order:
            spec = formats.get(name)
            if spec is None:
                yield name, handle.get_tensor(name)
                continue
            kind = _FORMATS[spec["format"]]
            values: dict[str, Any] = dict(spec.get("values", {}))
            for field in spec["tensors"]:
                values[field] = handle.get_tensor(f"{name}{_SEPARATOR}{field}")
            yield name, kind(**values)


class Writer:
    """Keeps a host copy of every weight a stream passes on; `commit` writes the entry once the
    model built from the stream has loaded (a failed load writes nothing)."""

    def __init__(self, directory: Path, source: Path, precision: str) -> None:
        self.directory = directory
        self.origin = {"source": str(source.resolve()), "precision": precision}
        self.tensors: dict[str, torch.Tensor] = {}
        self.formats: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.complete = False

    def wrap(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        for name, weight in weights:
            self._keep(name, weight)
            yield name, weight
        self.complete = True

    def _keep(self, name: str, weight: Weight) -> None:
        self.order.append(name)
        if isinstance(weight, torch.Tensor):
            self.tensors[name] = weight.detach().to("cpu").contiguous()
            return
        spec: dict[str, Any] = {"format": type(weight).__name__, "tensors": [], "values": {}}
        for field in dataclasses.fields(weight):  # type: ignore[arg-type]
            value = getattr(weight, field.name)
            if isinstance(value, torch.Tensor):
                self.tensors[f"{name}{_SEPARATOR}{field.name}"] = value.detach().to("cpu").contiguous()
                spec["tensors"].append(field.name)
            else:
                spec["values"][field.name] = value
        self.formats[name] = spec

    def commit(self) -> None:
        if not self.complete:
            raise RuntimeError("the weight stream was not consumed to its end")
        try:
            _write(self.directory, self.tensors, self.formats, self.order, self.origin)
        except Exception as error:  # a full or read-only store costs the next start time, nothing else
            log.warning("could not cache the quantized weights at %s: %s", self.directory, error)
        else:
            _evict_older(self.directory, self.origin)
        finally:
            self.tensors.clear()


def _write(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    formats: dict[str, dict[str, Any]],
    order: list[str],
    origin: dict[str, str],
) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        staging.chmod(0o755)  # readable like the rest of the model store (mkdtemp makes it private)
        save_file(tensors, str(staging / WEIGHTS_FILE))
        (staging / WEIGHTS_FILE).chmod(0o644)
        entry = {"version": FORMAT_VERSION, "sha256": _sha256(staging / WEIGHTS_FILE), "formats": formats,
                 "order": order, **origin}  # fmt: skip
        (staging / ENTRY_FILE).write_text(json.dumps(entry))
        try:
            os.replace(staging, directory)
        except OSError:
            # The entry exists: another server sharing the cache wrote it first, from the same
            # source and settings (the key). It may be loading from it: keep it, drop this copy.
            if not (directory / ENTRY_FILE).is_file():
                raise
            log.info("quantized weights cache %s was written meanwhile by another server; kept", directory)
            return
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    size = (directory / WEIGHTS_FILE).stat().st_size
    log.info("cached the quantized weights at %s (%.0f MB)", directory, size / 1e6)


def _evict_older(directory: Path, origin: dict[str, str]) -> None:
    """Remove the entries an earlier revision of the same source and precision left beside this one."""
    for sibling in directory.parent.iterdir():
        if sibling == directory or not (sibling / ENTRY_FILE).is_file():
            continue
        try:
            entry = json.loads((sibling / ENTRY_FILE).read_text())
        except (OSError, ValueError):
            continue
        if all(entry.get(key) == value for key, value in origin.items()):
            log.info("removing the superseded quantized weights cache %s", sibling)
            shutil.rmtree(sibling, ignore_errors=True)


def _discard(directory: Path, why: str) -> None:
    log.warning("quantized weights cache %s discarded (%s); quantizing again", directory, why)
    shutil.rmtree(directory, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
