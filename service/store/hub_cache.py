"""The download cache on disk: the Hub's own layout (``models--org--name/{blobs,snapshots/<commit>,refs}``)
plus ``locks/`` and ``manifests/`` (the file listing of each commit, which makes completeness checkable
offline), and whether a snapshot is complete and sound.

A snapshot is sound when every file the spec selects is present at its listed size and every
safetensors file's header is consistent with its length; a corrupt file is removed (its blob too) so
the next attempt downloads it again. Writes are atomic (a temporary name, then a rename).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import filter_repo_objects

from service.store.download_types import ArtifactSpec, OfflineError
from service.store.model_store import PICKLE_SUFFIXES

log = logging.getLogger("service.store.model_download")  # one logger for the whole download layer

# The safetensors library refuses headers above 100 MB; a larger length field means a corrupt file.
SAFETENSORS_MAX_HEADER = 100_000_000
MANIFEST_FORMAT = 1

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class CacheLayout:
    """Paths of one repo inside the cache (the huggingface_hub layout, plus locks/ and manifests/)."""

    cache_dir: Path
    spec: ArtifactSpec
    folder: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "folder", repo_folder_name(repo_id=self.spec.repo_id, repo_type=self.spec.repo_type)
        )

    @property
    def storage(self) -> Path:
        return self.cache_dir / self.folder

    @property
    def blobs(self) -> Path:
        return self.storage / "blobs"

    def snapshot(self, commit: str) -> Path:
        return self.storage / "snapshots" / commit

    def ref(self, revision: str) -> Path:
        return self.storage / "refs" / revision

    def manifest(self, commit: str) -> Path:
        return self.cache_dir / "manifests" / self.folder / f"{commit}.json"

    @property
    def artifact_lock(self) -> Path:
        safe_revision = _UNSAFE_NAME_CHARS.sub("_", self.spec.revision)
        return self.cache_dir / "locks" / f"{self.folder}@{safe_revision}.lock"

    def blob_lock(self, etag: str) -> Path:
        # The very lock file huggingface_hub takes for this blob, so its own downloads queue behind ours.
        return self.cache_dir / ".locks" / self.folder / f"{etag}.lock"


@dataclass
class SnapshotState:
    expected: dict[str, int | None]  # path -> size (None when unknown)
    missing: list[str]
    corrupt: list[tuple[str, str]]  # (path, why); already removed from the cache

    @property
    def complete(self) -> bool:
        return bool(self.expected) and not self.missing and not self.corrupt


def from_cache(layout: CacheLayout, *, reason: str) -> Path:
    """The snapshot for the spec's revision, from the cache alone; OfflineError when it is incomplete."""
    spec = layout.spec
    commit = _local_commit(layout)
    where = f"the cache at {layout.cache_dir}"
    advice = "run once with network access to the same cache, or copy a filled cache there"
    if commit is None or not layout.snapshot(commit).is_dir():
        raise OfflineError(f"{spec.label} is not in {where} and {reason}: {advice}")
    state = inspect_snapshot(layout, commit, allow_scan=True)
    if state.corrupt:
        path, why = state.corrupt[0]
        raise OfflineError(f"cached {path} of {spec.label} is corrupt ({why}) and {reason}: {advice}")
    if state.missing:
        shown = ", ".join(state.missing[:3]) + (", ..." if len(state.missing) > 3 else "")
        raise OfflineError(
            f"{spec.label} is incomplete in {where} ({len(state.missing)} missing: {shown}) "
            f"and {reason}: {advice}"
        )
    if not state.expected:
        raise OfflineError(
            f"no cached file of {spec.label} matches {list(spec.allow_patterns)} in {where} "
            f"and {reason}: {advice}"
        )
    log.info("using cached %s at %s (%s)", spec.label, layout.snapshot(commit), reason)
    return layout.snapshot(commit)


def cached_snapshot_or_none(layout: CacheLayout) -> Path | None:
    commit = _local_commit(layout)
    if commit is None:
        return None
    state = inspect_snapshot(layout, commit, allow_scan=True)
    return layout.snapshot(commit) if state.complete else None


def _local_commit(layout: CacheLayout) -> str | None:
    revision = layout.spec.revision
    if COMMIT_RE.fullmatch(revision):
        return revision
    try:
        commit = layout.ref(revision).read_text().strip()
    except OSError:
        return None
    return commit if COMMIT_RE.fullmatch(commit) else None


def _expected_files(layout: CacheLayout, commit: str, *, allow_scan: bool) -> dict[str, int | None] | None:
    """The files the spec needs at ``commit`` with their sizes, from what the cache recorded about it.

    Our manifest first, then huggingface_hub's own tree cache (``hf download`` with 2.4+ writes one);
    with ``allow_scan`` (offline), a cache filled by older tools is taken as what its snapshot holds.
    """
    listing: dict[str, int | None] | None = None
    try:
        data = json.loads(layout.manifest(commit).read_text())
        if data.get("format") == MANIFEST_FORMAT:
            listing = {path: int(size) for path, size in data["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        listing = None
    if listing is None:
        listing = _hub_tree_cache(layout, commit)
    if listing is None and allow_scan:
        root = layout.snapshot(commit)
        if root.is_dir():
            listing = {
                rel.as_posix(): None
                for rel in (p.relative_to(root) for p in root.rglob("*") if not p.is_dir())
                if not any(part.startswith(".") for part in rel.parts)
            }
    if listing is None:
        return None
    return {path: listing[path] for path in select_files(listing, layout.spec.allow_patterns)}


def _hub_tree_cache(layout: CacheLayout, commit: str) -> dict[str, int | None] | None:
    try:
        from huggingface_hub import get_cached_repo_tree
    except ImportError:  # huggingface_hub < 2.4 keeps no tree cache
        return None
    try:
        entries = get_cached_repo_tree(
            layout.spec.repo_id, repo_type=layout.spec.repo_type, revision=commit, cache_dir=layout.cache_dir
        )
    except Exception:  # absent or unreadable: the caller falls back
        return None
    return {entry.path: entry.size for entry in entries}


def inspect_snapshot(layout: CacheLayout, commit: str, *, allow_scan: bool) -> SnapshotState:
    """Which expected files are present and sound; corrupt ones are removed so a retry re-fetches them."""
    expected = _expected_files(layout, commit, allow_scan=allow_scan)
    if expected is None:
        return SnapshotState({}, [], [])
    root = layout.snapshot(commit)
    missing: list[str] = []
    corrupt: list[tuple[str, str]] = []
    for path, size in expected.items():
        local = root / path
        if not local.exists():  # also a dangling link
            missing.append(path)
            continue
        problem = _file_problem(local, size)
        if problem is not None:
            removed = _remove(local, layout)
            corrupt.append((path, f"{problem}; {'removed' if removed else 'could not remove it'}"))
        elif path.endswith(".safetensors.index.json"):
            # A sharded checkpoint is only complete with every shard its index names.
            missing.extend(s for s in _index_shards(local) if not (root / s).exists() and s not in missing)
    return SnapshotState(expected, missing, corrupt)


def _file_problem(path: Path, expected_size: int | None) -> str | None:
    """Why ``path`` is not a sound copy (size, then safetensors structure), or None."""
    size = path.stat().st_size
    if expected_size is not None and size != expected_size:
        return f"{size} bytes, the hub lists {expected_size}"
    if path.name.endswith(".safetensors"):
        return _safetensors_problem(path, size)
    return None


def _safetensors_problem(path: Path, size: int) -> str | None:
    """Check the header (u64 little-endian length + JSON) and that every tensor lies inside the file."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return f"{size} bytes, too short for a safetensors header"
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(size - 8, SAFETENSORS_MAX_HEADER):
            return f"header length {header_len} does not fit the {size}-byte file"
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return "header is not valid JSON"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    data_size = size - 8 - header_len
    end_max = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r} has a malformed header entry"
        if not 0 <= begin <= end <= data_size:
            return f"tensor {name!r} spans bytes {begin}-{end} beyond the {data_size}-byte data section"
        width = _DTYPE_BYTES.get(dtype)
        if width is not None and end - begin != math.prod(shape) * width:
            return f"tensor {name!r} ({dtype}{shape}) does not match its {end - begin}-byte span"
        end_max = max(end_max, end)
    if end_max != data_size:
        return f"data section is {data_size} bytes but tensors cover {end_max}"
    return None


def _index_shards(index: Path) -> list[str]:
    """The shard files a ``*.safetensors.index.json`` names (none if it is not a readable index)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _remove(local: Path, layout: CacheLayout) -> bool:
    """Drop a snapshot entry and, if it links into this repo's blobs, the blob itself (False: read-only)."""
    try:
        target = local.resolve()
        local.unlink()
        if target != local and target.is_relative_to(layout.blobs.resolve()):
            target.unlink(missing_ok=True)
    except OSError:
        return False
    return True


def select_files(paths: Any, patterns: tuple[str, ...]) -> list[str]:
    """Paths matching the patterns (huggingface_hub's own matcher), never a pickle."""
    matched = filter_repo_objects(list(paths), allow_patterns=list(patterns))
    return sorted(p for p in matched if not p.lower().endswith(PICKLE_SUFFIXES))


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
