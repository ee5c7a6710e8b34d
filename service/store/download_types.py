"""What a hub download is asked for (`ArtifactSpec`: a repo at a revision, the files a profile needs)
and how it fails (`DownloadError` and its kinds, each message saying what to do)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ALLOW_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.json", "*.jinja", "tokenizer.model")
REPO_TYPES = ("model", "dataset")


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
