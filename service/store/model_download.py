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

This module runs the whole: the lock, the cache-or-hub decision, the download and its verification.
The parts: download_types.py (the spec and the errors), hub_listing.py (asking the Hub),
hub_cache.py (the cache layout, manifests, snapshot checks), download_transfer.py (the transfer).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import filelock
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError

from service.store.download_transfer import fetch_all
from service.store.download_types import (
    DEFAULT_ALLOW_PATTERNS,
    AccessDeniedError,
    ArtifactSpec,
    DownloadError,
    InsufficientDiskError,
    OfflineError,
)
from service.store.hub_cache import (
    COMMIT_RE,
    MANIFEST_FORMAT,
    CacheLayout,
    cached_snapshot_or_none,
    from_cache,
    inspect_snapshot,
    select_files,
    write_json_atomic,
    write_text_atomic,
)
from service.store.hub_listing import UNREACHABLE, RemoteFile, hub_error, list_remote
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
    layout = CacheLayout(cache_dir, spec)
    endpoint = endpoint.rstrip("/") if endpoint else None
    with _artifact_lock(layout, lock_timeout, offline=offline):
        if offline:
            return from_cache(layout, reason="offline mode is on")
        if COMMIT_RE.fullmatch(spec.revision):
            # A commit's content never changes: when it is complete here, the Hub has nothing to add.
            state = inspect_snapshot(layout, spec.revision, allow_scan=False)
            if state.complete:
                log.info("%s is complete in %s; not contacting the hub", spec.label, cache_dir)
                return layout.snapshot(spec.revision)
        try:
            commit, files = list_remote(spec, token=token, endpoint=endpoint)
        except RevisionNotFoundError:
            raise DownloadError(
                f"revision {spec.revision!r} does not exist in {spec.repo_id}: "
                "pin an existing commit, tag or branch"
            ) from None
        except (*UNREACHABLE, HfHubHTTPError) as exc:
            cached = cached_snapshot_or_none(layout)
            if cached is not None:
                log.warning(
                    "hub unavailable (%s); using the cached %s at %s",
                    one_line(exc, with_type=True, limit=300),
                    spec.label,
                    cached,
                )
                return cached
            raise hub_error(exc, spec, endpoint, cache_dir) from None
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
def _artifact_lock(layout: CacheLayout, timeout: float, *, offline: bool) -> Iterator[None]:
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


def _download(
    layout: CacheLayout,
    commit: str,
    files: list[RemoteFile],
    *,
    token: str | None,
    endpoint: str | None,
    progress: bool,
    lock_timeout: float,
) -> Path:
    spec = layout.spec
    write_json_atomic(
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
        write_text_atomic(layout.ref(spec.revision), commit)

    by_path = {f.path: f for f in files}
    selected = select_files(by_path, spec.allow_patterns)
    if not selected:
        raise DownloadError(
            f"no file of {spec.label} matches {list(spec.allow_patterns)} (pickles are never downloaded); "
            "check the profile's patterns"
        )
    state = inspect_snapshot(layout, commit, allow_scan=False)
    for path, why in state.corrupt:
        log.warning("cached %s of %s is corrupt (%s); downloading it again", path, spec.label, why)
    wanted = sorted({*state.missing, *(p for p, _ in state.corrupt)})
    unknown = [p for p in wanted if p not in by_path]
    if unknown:
        raise DownloadError(f"an index in {spec.label} names {unknown[0]}, which the repo does not contain")
    todo = [by_path[p] for p in wanted]
    if todo:
        fetch_all(
            layout, commit, todo, token=token, endpoint=endpoint, progress=progress, lock_timeout=lock_timeout
        )

    final = inspect_snapshot(layout, commit, allow_scan=False)
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
