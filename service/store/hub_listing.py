"""Asking the Hub: a revision resolved to its commit with every file's size and blob id (one API call),
and any error from the Hub turned into one actionable `DownloadError`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import httpx2
from huggingface_hub import DatasetInfo, HfApi, ModelInfo, constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)

from service.store.download_types import AccessDeniedError, ArtifactSpec, DownloadError, OfflineError
from service.store.hub_cache import COMMIT_RE
from service.util import one_line

# Failures that mean "the Hub cannot be asked right now": fall back to the cache if it is complete.
UNREACHABLE = (httpx2.TransportError, OfflineModeIsEnabled)


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    etag: str  # blob name in the cache: the LFS sha256, else the git blob id (what the Hub sends as ETag)


def list_remote(
    spec: ArtifactSpec, *, token: str | None, endpoint: str | None
) -> tuple[str, list[RemoteFile]]:
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
    if not info.sha or not COMMIT_RE.fullmatch(info.sha):
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
        files.append(RemoteFile(sibling.rfilename, int(size), etag))
    return info.sha, files


def _check_relative(path: str, spec: ArtifactSpec) -> None:
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or "\\" in path or not path:
        raise DownloadError(f"the hub listed an unsafe file name {path!r} in {spec.label}; refusing it")


def hub_error(exc: BaseException, spec: ArtifactSpec, endpoint: str | None, cache_dir: Path) -> DownloadError:
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
    if isinstance(exc, UNREACHABLE):
        return OfflineError(
            f"cannot reach {hub} ({type(exc).__name__}) and {spec.label} is not fully cached at {cache_dir}: "
            "check network/HF_ENDPOINT, or pre-fill the cache and run offline"
        )
    return DownloadError(f"fetching {spec.label} failed: {one_line(exc, with_type=True, limit=300)}")
