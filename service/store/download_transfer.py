"""The transfer: the files still missing, fetched in parallel into the cache's blobs, each resumable.

Each file streams into ``blobs/<etag>.incomplete`` (a stable name) through huggingface_hub's own
``http_get``, which resumes with a Range request on the next call and on dropped connections within
a call; what arrived is kept when the connection or the local write fails, and dropped when it is not
the file (a size mismatch). The disk is checked before the first byte; a blob lock per file lets
huggingface_hub's own downloads queue behind ours; progress is one bar, or a log line every
PROGRESS_LOG_INTERVAL_S where no terminal is attached.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import filelock
import httpx2
from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers
from huggingface_hub.utils import tqdm as hf_tqdm

from service.store.download_types import ArtifactSpec, DownloadError, InsufficientDiskError
from service.store.hub_cache import CacheLayout
from service.store.hub_listing import RemoteFile, hub_error
from service.util import one_line

log = logging.getLogger("service.store.model_download")  # one logger for the whole download layer

GIB = 1024**3
# Head-room kept free after the download: logs, engine caches and other writers share the volume.
DISK_MARGIN_MIN_BYTES = 256 * 1024**2
DISK_MARGIN_FRACTION = 0.05
MAX_WORKERS = 8
PROGRESS_LOG_INTERVAL_S = 30.0

_SAFE_ETAG = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # becomes a file name under blobs/


def fetch_all(
    layout: CacheLayout,
    commit: str,
    todo: list[RemoteFile],
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
        raise hub_error(first, spec, endpoint, layout.cache_dir) from None
    log.info("downloaded %s in %.1fs", spec.label, time.monotonic() - started)


def _fetch_one(
    layout: CacheLayout,
    commit: str,
    remote: RemoteFile,
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
    remote: RemoteFile,
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


def _partial_size(layout: CacheLayout, remote: RemoteFile) -> int:
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
