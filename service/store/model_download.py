"""Fetch a model's files from the Hugging Face Hub into the shared cache: resumable, verified, locked.

Why not a bare ``snapshot_download``:

- huggingface_hub 2.x downloads each file into a process-unique ``<etag>.<uuid>.incomplete`` and deletes it
  when the download fails, so a replica killed mid-way (OOM, pre-emption, rollout) starts a 10 GB shard
  from zero. Here each file streams into ``blobs/<etag>.incomplete`` (a stable name) through the library's
  own ``http_get``, which resumes with a Range request on the next call and on dropped connections within
  a call.
- Air-gapped starts must not need the network or a token: a pinned commit that is fully cached is served
  without any request, and ``offline=True`` (or ``HF_HUB_OFFLINE``) never touches the endpoint.
- A half-written or corrupt safetensors file must fail at start-up with its name, not as an obscure error
  (or silent garbage) at load time; it is removed so the next start downloads it again.
- Replicas sharing one cache volume take a per-artifact file lock, so one downloads while the others wait.
- Pickled checkpoints (``*.bin``, ``*.pt``, ...) are never fetched, whatever the patterns say.

The cache layout is the Hub's own (``models--org--name/{blobs,snapshots/<commit>,refs}``), so files placed
here are visible to any huggingface_hub user of the same cache, and caches filled by ``hf download`` are
usable here offline. This module adds ``locks/`` (artifact locks) and ``manifests/`` (the file listing
of each commit, which makes completeness checkable offline) under ``cache_dir``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import filelock
import httpx2
from huggingface_hub import DatasetInfo, HfApi, ModelInfo, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get, repo_folder_name
from huggingface_hub.utils import build_hf_headers, filter_repo_objects
from huggingface_hub.utils import tqdm as hf_tqdm

from service.store.model_store import PICKLE_SUFFIXES
from service.util import one_line

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_ALLOW_PATTERNS",
    "AccessDeniedError",
    "ArtifactSpec",
    "DownloadError",
    "InsufficientDiskError",
    "OfflineError",
    "download_artifact",
]

DEFAULT_ALLOW_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.json", "*.jinja", "tokenizer.model")
REPO_TYPES = ("model", "dataset")

GIB = 1024**3
# Head-room kept free after the download: logs, engine caches and other writers share the volume.
DISK_MARGIN_MIN_BYTES = 256 * 1024**2
DISK_MARGIN_FRACTION = 0.05
MAX_WORKERS = 8
PROGRESS_LOG_INTERVAL_S = 30.0
# The safetensors library refuses headers above 100 MB; a larger length field means a corrupt file.
SAFETENSORS_MAX_HEADER = 100_000_000
MANIFEST_FORMAT = 1

_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_SAFE_ETAG = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # becomes a file name under blobs/
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
# Failures that mean "the Hub cannot be asked right now": fall back to the cache if it is complete.
_UNREACHABLE = (httpx2.TransportError, OfflineModeIsEnabled)


class DownloadError(RuntimeError):
    """A model artifact could not be made available locally; the message says what to do."""


class InsufficientDiskError(DownloadError):
    """The cache volume has too little free space for the files still to download."""


class OfflineError(DownloadError):
    """Offline (or the Hub unreachable) and the requested revision is not fully cached."""


class AccessDeniedError(DownloadError):
    """The Hub refused access: gated or private repo, missing or invalid token."""


@dataclass(frozen=True)
class ArtifactSpec:
    """What to fetch: a repo at a revision, restricted to the files a profile needs."""

    repo_id: str
    revision: str  # pinned commit or tag/branch
    allow_patterns: tuple[str, ...] = DEFAULT_ALLOW_PATTERNS  # only the files a profile needs
    repo_type: str = "model"

    def __post_init__(self) -> None:
        if not self.repo_id or self.repo_id.count("/") > 1 or self.repo_id.startswith(("/", ".")):
            raise ValueError(f"repo_id {self.repo_id!r} is not a hub id (org/name)")
        if not self.revision:
            raise ValueError("revision must name a commit, tag or branch")
        if self.repo_type not in REPO_TYPES:
            raise ValueError(f"repo_type {self.repo_type!r} is not one of {', '.join(REPO_TYPES)}")
        if isinstance(self.allow_patterns, str):
            object.__setattr__(self, "allow_patterns", (self.allow_patterns,))
        else:
            object.__setattr__(self, "allow_patterns", tuple(self.allow_patterns))

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class _RemoteFile:
    path: str
    size: int
    etag: str  # blob name in the cache: the LFS sha256, else the git blob id (what the Hub sends as ETag)


@dataclass(frozen=True)
class _Layout:
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
class _SnapshotState:
    expected: dict[str, int | None]  # path -> size (None when unknown)
    missing: list[str]
    corrupt: list[tuple[str, str]]  # (path, why); already removed from the cache

    @property
    def complete(self) -> bool:
        return bool(self.expected) and not self.missing and not self.corrupt


def download_artifact(
    spec: ArtifactSpec,
    cache_dir: Path,
    *,
    token: str | None = None,
    offline: bool = False,
    endpoint: str | None = None,
    progress: bool = True,
    lock_timeout: float = 3600,
) -> Path:
    """Make ``spec``'s files available under ``cache_dir`` and return the local snapshot directory.

    ``token`` None means huggingface_hub's own lookup (HF_TOKEN, then the stored login). ``endpoint`` None
    means HF_ENDPOINT or huggingface.co. ``offline`` (or HF_HUB_OFFLINE) resolves from the cache only and
    never contacts the endpoint or looks for a token.
    """
    cache_dir = Path(cache_dir).expanduser().resolve()
    offline = offline or constants.is_offline_mode()
    layout = _Layout(cache_dir, spec)
    endpoint = endpoint.rstrip("/") if endpoint else None
    with _artifact_lock(layout, lock_timeout, offline=offline):
        if offline:
            return _from_cache(layout, reason="offline mode is on")
        if _COMMIT_RE.fullmatch(spec.revision):
            # A commit's content never changes: when it is complete here, the Hub has nothing to add.
            state = _inspect_snapshot(layout, spec.revision, allow_scan=False)
            if state.complete:
                log.info("%s is complete in %s; not contacting the hub", spec.label, cache_dir)
                return layout.snapshot(spec.revision)
        try:
            commit, files = _list_remote(spec, token=token, endpoint=endpoint)
        except RevisionNotFoundError:
            raise DownloadError(
                f"revision {spec.revision!r} does not exist in {spec.repo_id}: "
                "pin an existing commit, tag or branch"
            ) from None
        except (*_UNREACHABLE, HfHubHTTPError) as exc:
            cached = _cached_snapshot_or_none(layout)
            if cached is not None:
                log.warning(
                    "hub unavailable (%s); using the cached %s at %s",
                    one_line(exc, with_type=True, limit=300),
                    spec.label,
                    cached,
                )
                return cached
            raise _hub_error(exc, spec, endpoint, cache_dir) from None
        return _download(
            layout,
            commit,
            files,
            token=token,
            endpoint=endpoint,
            progress=progress,
            lock_timeout=lock_timeout,
        )


# --- locking ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _artifact_lock(layout: _Layout, timeout: float, *, offline: bool) -> Iterator[None]:
    """Serialise work on one repo@revision across processes sharing the cache (replicas on one volume)."""
    path = layout.artifact_lock
    lock: filelock.FileLock | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(path)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            log.info(
                "another process is fetching %s; waiting up to %gs for %s", layout.spec.label, timeout, path
            )
            lock.acquire(timeout=timeout)
    except filelock.Timeout:
        raise DownloadError(
            f"timed out after {timeout:g}s waiting for lock {path} held by another process fetching "
            f"{layout.spec.label}; wait for it to finish or raise lock_timeout"
        ) from None
    except OSError as exc:
        if not offline:
            raise DownloadError(
                f"cannot create lock file {path} ({exc.strerror or exc}); make {layout.cache_dir} writable"
            ) from None
        # A read-only cache (a common air-gapped set-up) cannot be written by anyone: no lock needed.
        log.debug("no lock at %s (%s); read-only cache, continuing without", path, exc)
        lock = None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


# --- cache side --------------------------------------------------------------------------------------------


def _from_cache(layout: _Layout, *, reason: str) -> Path:
    """The snapshot for the spec's revision, from the cache alone; OfflineError when it is incomplete."""
    spec = layout.spec
    commit = _local_commit(layout)
    where = f"the cache at {layout.cache_dir}"
    advice = "run once with network access to the same cache, or copy a filled cache there"
    if commit is None or not layout.snapshot(commit).is_dir():
        raise OfflineError(f"{spec.label} is not in {where} and {reason}: {advice}")
    state = _inspect_snapshot(layout, commit, allow_scan=True)
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


def _cached_snapshot_or_none(layout: _Layout) -> Path | None:
    commit = _local_commit(layout)
    if commit is None:
        return None
    state = _inspect_snapshot(layout, commit, allow_scan=True)
    return layout.snapshot(commit) if state.complete else None


def _local_commit(layout: _Layout) -> str | None:
    revision = layout.spec.revision
    if _COMMIT_RE.fullmatch(revision):
        return revision
    try:
        commit = layout.ref(revision).read_text().strip()
    except OSError:
        return None
    return commit if _COMMIT_RE.fullmatch(commit) else None


def _expected_files(layout: _Layout, commit: str, *, allow_scan: bool) -> dict[str, int | None] | None:
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
    return {path: listing[path] for path in _select(listing, layout.spec.allow_patterns)}


def _hub_tree_cache(layout: _Layout, commit: str) -> dict[str, int | None] | None:
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


def _inspect_snapshot(layout: _Layout, commit: str, *, allow_scan: bool) -> _SnapshotState:
    """Which expected files are present and sound; corrupt ones are removed so a retry re-fetches them."""
    expected = _expected_files(layout, commit, allow_scan=allow_scan)
    if expected is None:
        return _SnapshotState({}, [], [])
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
    return _SnapshotState(expected, missing, corrupt)


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


def _remove(local: Path, layout: _Layout) -> bool:
    """Drop a snapshot entry and, if it links into this repo's blobs, the blob itself (False: read-only)."""
    try:
        target = local.resolve()
        local.unlink()
        if target != local and target.is_relative_to(layout.blobs.resolve()):
            target.unlink(missing_ok=True)
    except OSError:
        return False
    return True


# --- hub side --------------------------------------------------------------------------------------------


def _list_remote(
    spec: ArtifactSpec, *, token: str | None, endpoint: str | None
) -> tuple[str, list[_RemoteFile]]:
    """Resolve the revision to a commit and list the repo's files with sizes (one API call)."""
    api = HfApi(endpoint=endpoint, token=token)
    info = api.repo_info(
        spec.repo_id,
        repo_type=spec.repo_type,
        revision=spec.revision,
        files_metadata=True,
        # The shared client has no timeout: without one, a firewall that drops packets hangs the start.
        timeout=constants.HF_HUB_ETAG_TIMEOUT,
    )
    if not info.sha or not _COMMIT_RE.fullmatch(info.sha):
        raise DownloadError(f"the hub returned no commit for {spec.label}; check that the endpoint is a Hub")
    # ArtifactSpec admits only model and dataset repos; repo_info's type also covers spaces and kernels.
    if not isinstance(info, ModelInfo | DatasetInfo):
        raise DownloadError(f"the hub described {spec.label} as a {type(info).__name__}, not a model repo")
    files = []
    for sibling in info.siblings or []:
        size = sibling.lfs.size if sibling.lfs is not None else sibling.size
        etag = sibling.lfs.sha256 if sibling.lfs is not None else sibling.blob_id
        if size is None or not etag:
            raise DownloadError(f"the hub listed {sibling.rfilename} of {spec.label} without size or id")
        _check_relative(sibling.rfilename, spec)
        files.append(_RemoteFile(sibling.rfilename, int(size), etag))
    return info.sha, files


def _select(paths: Any, patterns: tuple[str, ...]) -> list[str]:
    """Paths matching the patterns (huggingface_hub's own matcher), never a pickle."""
    matched = filter_repo_objects(list(paths), allow_patterns=list(patterns))
    return sorted(p for p in matched if not p.lower().endswith(PICKLE_SUFFIXES))


def _check_relative(path: str, spec: ArtifactSpec) -> None:
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or "\\" in path or not path:
        raise DownloadError(f"the hub listed an unsafe file name {path!r} in {spec.label}; refusing it")


def _hub_error(
    exc: BaseException, spec: ArtifactSpec, endpoint: str | None, cache_dir: Path
) -> DownloadError:
    """One actionable line for an error from the Hub."""
    hub = endpoint or constants.ENDPOINT
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, GatedRepoError):
        return AccessDeniedError(
            f"{spec.repo_id} is gated ({status}): accept its terms at {hub}/{spec.repo_id} "
            "and set HF_TOKEN to a token of that account"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return AccessDeniedError(
            f"{spec.repo_id} was not found at {hub} ({status}): "
            "check the id, or set HF_TOKEN if it is private"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return DownloadError(f"a file of {spec.label} vanished from {hub} during the download; retry")
    if isinstance(exc, HfHubHTTPError) and status in (401, 403):
        return AccessDeniedError(
            f"{hub} refused {spec.repo_id} ({status}): set HF_TOKEN to a valid token with read access"
        )
    if isinstance(exc, HfHubHTTPError):
        return DownloadError(
            f"{hub} answered {status} for {spec.label}; retry later "
            f"({one_line(exc, with_type=True, limit=300)})"
        )
    if isinstance(exc, _UNREACHABLE):
        return OfflineError(
            f"cannot reach {hub} ({type(exc).__name__}) and {spec.label} is not fully cached at {cache_dir}: "
            "check network/HF_ENDPOINT, or pre-fill the cache and run offline"
        )
    return DownloadError(f"fetching {spec.label} failed: {one_line(exc, with_type=True, limit=300)}")


# --- downloading -----------------------------------------------------------------------------------------


def _download(
    layout: _Layout,
    commit: str,
    files: list[_RemoteFile],
    *,
    token: str | None,
    endpoint: str | None,
    progress: bool,
    lock_timeout: float,
) -> Path:
    spec = layout.spec
    _write_json_atomic(
        layout.manifest(commit),
        {
            "format": MANIFEST_FORMAT,
            "repo_id": spec.repo_id,
            "repo_type": spec.repo_type,
            "commit": commit,
            "files": {f.path: f.size for f in files},
        },
    )
    if spec.revision != commit:
        _write_text_atomic(layout.ref(spec.revision), commit)

    by_path = {f.path: f for f in files}
    selected = _select(by_path, spec.allow_patterns)
    if not selected:
        raise DownloadError(
            f"no file of {spec.label} matches {list(spec.allow_patterns)} (pickles are never downloaded); "
            "check the profile's patterns"
        )
    state = _inspect_snapshot(layout, commit, allow_scan=False)
    for path, why in state.corrupt:
        log.warning("cached %s of %s is corrupt (%s); downloading it again", path, spec.label, why)
    wanted = sorted({*state.missing, *(p for p, _ in state.corrupt)})
    unknown = [p for p in wanted if p not in by_path]
    if unknown:
        raise DownloadError(f"an index in {spec.label} names {unknown[0]}, which the repo does not contain")
    todo = [by_path[p] for p in wanted]
    if todo:
        _fetch_all(
            layout, commit, todo, token=token, endpoint=endpoint, progress=progress, lock_timeout=lock_timeout
        )

    final = _inspect_snapshot(layout, commit, allow_scan=False)
    if final.corrupt:
        path, why = final.corrupt[0]
        raise DownloadError(
            f"downloaded {path} of {spec.label} is corrupt ({why}); retry to download it again"
        )
    if final.missing:
        raise DownloadError(
            f"{spec.label} is still missing {', '.join(final.missing[:3])} after the download"
        )
    return layout.snapshot(commit)


def _fetch_all(
    layout: _Layout,
    commit: str,
    todo: list[_RemoteFile],
    *,
    token: str | None,
    endpoint: str | None,
    progress: bool,
    lock_timeout: float,
) -> None:
    spec = layout.spec
    partial = {f.path: _partial_size(layout, f) for f in todo}
    need = sum(f.size - partial[f.path] for f in todo)
    _check_disk(layout.cache_dir, need, spec)
    log.info(
        "downloading %d file(s) of %s (%.2f GiB) into %s", len(todo), spec.label, need / GIB, layout.cache_dir
    )

    started = time.monotonic()
    bar = _Progress(spec, total=sum(f.size for f in todo), initial=sum(partial.values()), enabled=progress)
    child_bar = _child_bar_class(bar)
    errors: list[BaseException] = []
    try:
        with ThreadPoolExecutor(max_workers=min(MAX_WORKERS, len(todo))) as pool:
            futures = [
                pool.submit(
                    _fetch_one,
                    layout,
                    commit,
                    f,
                    token=token,
                    endpoint=endpoint,
                    bar_class=child_bar,
                    lock_timeout=lock_timeout,
                )
                for f in todo
            ]
            for future in futures:
                exc = future.exception()
                if exc is not None:
                    errors.append(exc)
    finally:
        bar.close()
    if errors:
        first = errors[0]
        if isinstance(first, DownloadError):
            raise first
        raise _hub_error(first, spec, endpoint, layout.cache_dir) from None
    log.info("downloaded %s in %.1fs", spec.label, time.monotonic() - started)


def _fetch_one(
    layout: _Layout,
    commit: str,
    remote: _RemoteFile,
    *,
    token: str | None,
    endpoint: str | None,
    bar_class: type,
    lock_timeout: float,
) -> None:
    spec = layout.spec
    url = hf_hub_url(spec.repo_id, remote.path, repo_type=spec.repo_type, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, token=token, endpoint=endpoint, retry_on_errors=True)
    if meta.size is not None and meta.size != remote.size:
        raise DownloadError(
            f"the hub reports {meta.size} bytes for {remote.path} of {spec.label} "
            f"but listed {remote.size}; retry"
        )
    etag = meta.etag or remote.etag
    if not _SAFE_ETAG.fullmatch(etag):
        raise DownloadError(f"the hub sent an unusable ETag {etag!r} for {remote.path} of {spec.label}")
    blob = layout.blobs / etag
    lock_path = layout.blob_lock(etag)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    try:
        blob_lock = filelock.FileLock(lock_path, timeout=lock_timeout)
        blob_lock.acquire()
    except filelock.Timeout:
        raise DownloadError(
            f"timed out after {lock_timeout:g}s waiting for {lock_path}, held by another process fetching "
            f"{remote.path}; wait for it to finish or raise lock_timeout"
        ) from None
    try:
        if not (blob.is_file() and blob.stat().st_size == remote.size):
            blob.unlink(missing_ok=True)
            _resume_into(blob, meta.location, url, remote, spec, token=token, bar_class=bar_class)
        _link(blob, layout.snapshot(commit) / remote.path)
    finally:
        blob_lock.release()


def _resume_into(
    blob: Path,
    location: str,
    url: str,
    remote: _RemoteFile,
    spec: ArtifactSpec,
    *,
    token: str | None,
    bar_class: type,
) -> None:
    """Stream into ``<blob>.incomplete``, continuing whatever an earlier attempt left there."""
    incomplete = blob.with_name(blob.name + ".incomplete")
    headers = build_hf_headers(token=token, headers={"Accept-Encoding": "identity"})
    if _origin(location) != _origin(url):
        headers.pop("authorization", None)  # a signed CDN url: the token must not leave the Hub
    with incomplete.open("ab") as f:
        resume = f.tell()
        if resume > remote.size:
            f.truncate(0)
            f.seek(0)
            resume = 0
        if resume:
            log.info("resuming %s of %s at byte %d of %d", remote.path, spec.label, resume, remote.size)
        try:
            http_get(
                location,
                f,
                resume_size=resume,
                headers=headers,
                expected_size=remote.size,
                displayed_filename=remote.path,
                tqdm_class=bar_class,
            )
        except HfHubHTTPError:
            raise  # the bytes on disk are still good; the caller maps the error
        except httpx2.TransportError as exc:
            kept = f.tell()
            raise DownloadError(
                f"download of {remote.path} ({spec.label}) interrupted at {kept} of {remote.size} bytes "
                f"({type(exc).__name__}); rerun to resume"
            ) from None
        except OSError as exc:
            # errno set: the local write failed (disk full, ...) and what is on disk is still good.
            if exc.errno is not None:
                raise DownloadError(
                    f"writing {incomplete} failed ({exc.strerror}); fix the cache volume and rerun to resume"
                ) from None
            f.truncate(0)  # http_get's size check: what arrived is not the file
            raise DownloadError(
                f"download of {remote.path} ({spec.label}) is inconsistent "
                f"({one_line(exc, with_type=True, limit=300)}); retry"
            ) from None
        got = f.tell()
    if got != remote.size:
        incomplete.unlink(missing_ok=True)
        raise DownloadError(f"{remote.path} of {spec.label}: got {got} bytes, expected {remote.size}; retry")
    os.replace(incomplete, blob)


def _partial_size(layout: _Layout, remote: _RemoteFile) -> int:
    blob = layout.blobs / remote.etag
    for candidate in (blob, blob.with_name(blob.name + ".incomplete")):
        with contextlib.suppress(OSError):
            size = candidate.stat().st_size
            if size <= remote.size:
                return size
    return 0


def _check_disk(cache_dir: Path, need: int, spec: ArtifactSpec) -> None:
    """Refuse before the first byte when the volume cannot hold what is left to download."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache_dir).free
    margin = max(DISK_MARGIN_MIN_BYTES, int(need * DISK_MARGIN_FRACTION))
    if need + margin > free:
        raise InsufficientDiskError(
            f"{spec.label} needs {need / GIB:.2f} GiB (+{margin / GIB:.2f} GiB margin) but only "
            f"{free / GIB:.2f} GiB is free at {cache_dir}: free space or point the cache at a larger volume"
        )


def _link(blob: Path, pointer: Path) -> None:
    """Place ``pointer`` in the snapshot as a relative symlink to the blob (hard link or copy without)."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), tmp)
    except OSError:
        try:
            os.link(blob, tmp)
        except OSError:
            shutil.copyfile(blob, tmp)
    os.replace(tmp, pointer)


class _Progress:
    """One byte bar for the whole artifact (huggingface_hub's tqdm: HF_HUB_DISABLE_PROGRESS_BARS applies).

    Like the library's byte bars it only draws on a terminal; where none is attached (container logs) it
    logs a line every PROGRESS_LOG_INTERVAL_S instead, so a long download is not silent.
    """

    def __init__(self, spec: ArtifactSpec, *, total: int, initial: int, enabled: bool) -> None:
        self._bar = hf_tqdm(
            total=total,
            initial=initial,
            desc=f"Downloading {spec.repo_id}",
            unit="B",
            unit_scale=True,
            disable=None if enabled else True,  # None: tqdm decides (TTY), as huggingface_hub's byte bars
            name="huggingface_hub.snapshot_download",
        )
        self._label = spec.label
        self._log = enabled and bool(self._bar.disable)
        self._lock = threading.Lock()
        self._done = initial
        self._total = total
        self._last_log = time.monotonic()

    def update(self, n: float) -> None:
        with self._lock:
            self._bar.update(n)
            self._done += int(n)
            now = time.monotonic()
            if self._log and now - self._last_log >= PROGRESS_LOG_INTERVAL_S:
                self._last_log = now
                log.info("%s: %.2f of %.2f GiB", self._label, self._done / GIB, self._total / GIB)

    def close(self) -> None:
        self._bar.close()


def _child_bar_class(parent: _Progress) -> type:
    """A tqdm stand-in for ``http_get`` that adds every file's bytes into the artifact's progress."""

    class _ChildBar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> _ChildBar:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            parent.update(n or 0)

        def close(self) -> None:
            pass

    return _ChildBar


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    _write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def _write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
