"""What NIM_MODEL_NAME and NIM_MODEL_PATH may say, parsed once into a `ModelRef`.

NIM 2.x names the model to serve in NIM_MODEL_PATH (its "model-free" image); NIM 1.x's multi-LLM
image in NIM_MODEL_NAME. Both are read here the same way:

- `hf://org/name` or `hf://org/name@revision`: a Hugging Face Hub repository (a branch, tag or
  commit; unset = main), downloaded into NIM_CACHE_PATH;
- `file:///path`, or a path (absolute, relative, `~`): a local model directory or `.gguf` file;
- `org/name`: a hub id, unless a local path of that name exists (as NIM_MODEL_NAME always read it).

Sources this server cannot fetch are refused with why: `ngc://` (NGC downloads need NVIDIA's NGC
client and an NGC API key), `modelscope://`, and object stores or URLs (`s3://`, `gs://`, `http://`).
Given both, the two variables must name the same model (the same hub id, or paths resolving to the
same file); otherwise the start stops, since one of them would be silently ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

HF_SCHEME = "hf://"
FILE_SCHEME = "file://"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_REFUSED_SCHEMES = {
    "ngc": "NGC downloads need NVIDIA's NGC client and an NGC API key, which this server does not "
    "have: download the model with the NGC CLI and name its directory, or name it on the Hugging "
    "Face Hub as hf://org/name",
    "modelscope": "ModelScope downloads are not supported: download the model and name its "
    "directory, or name it on the Hugging Face Hub as hf://org/name",
}


class ModelRefError(ValueError):
    """A model name this server cannot serve from; the message names the variable and says why."""


@dataclass(frozen=True)
class ModelRef:
    """The model to serve: a hub id or a local path, and a hub revision (None: main)."""

    name: str  # "org/name", or a local path as given (`~` expanded)
    revision: str | None = None
    hub: bool = False  # named as hf://: always the hub, even where a local path of that name exists

    @property
    def local_path(self) -> Path | None:
        """The local file or directory it names (None: a hub id, or nothing there)."""
        if self.hub:
            return None
        path = Path(self.name).expanduser()
        return path if path.exists() else None

    def same_model(self, other: ModelRef) -> bool:
        """Whether two refs name the same model: paths resolving to the same file, or the same hub
        id (case-insensitive) at revisions that do not contradict each other."""
        mine, theirs = self.local_path, other.local_path
        if mine is not None or theirs is not None:
            return mine is not None and theirs is not None and mine.resolve() == theirs.resolve()
        if self.name.lower() != other.name.lower():
            return False
        return self.revision is None or other.revision is None or self.revision == other.revision


def parse_model_ref(variable: str, value: str) -> ModelRef:
    """`value` of `variable` (NIM_MODEL_NAME or NIM_MODEL_PATH) as a ModelRef; ModelRefError (one
    line naming the variable) for a source this server cannot fetch."""
    value = value.strip()
    scheme = _SCHEME.match(value)
    if scheme is None:
        return ModelRef(str(Path(value).expanduser()) if value.startswith("~") else value)
    kind = scheme.group(1).lower()
    rest = value[scheme.end() :]
    if kind == "hf":
        repo, _, revision = rest.partition("@")
        repo = repo.strip("/")
        if not _HUB_ID.fullmatch(repo):
            raise ModelRefError(
                f"{variable}={value!r}: a Hugging Face id is hf://org/name or hf://org/name@revision"
            )
        if "@" in rest and not revision:
            raise ModelRefError(f"{variable}={value!r}: the revision after '@' is empty")
        return ModelRef(repo, revision or None, hub=True)
    if kind == "file":
        if not rest.startswith("/"):
            raise ModelRefError(f"{variable}={value!r}: a file:// path is absolute (file:///models/x)")
        return ModelRef(rest)
    why = _REFUSED_SCHEMES.get(
        kind,
        "this server reads models from the Hugging Face Hub (hf://org/name) or a local directory "
        "or .gguf file: download it and name the directory",
    )
    raise ModelRefError(f"{variable}={value!r}: {kind}:// is not supported: {why}")


def resolve_model_ref(name: str | None, path: str | None) -> ModelRef | None:
    """The model NIM_MODEL_NAME (`name`) and NIM_MODEL_PATH (`path`) name together (None: neither
    is set, the embedded model). ModelRefError when either cannot be served from, or when both are
    set and name different models."""
    by_name = parse_model_ref("NIM_MODEL_NAME", name) if name else None
    by_path = parse_model_ref("NIM_MODEL_PATH", path) if path else None
    if by_name is None or by_path is None:
        return by_path or by_name
    if not by_name.same_model(by_path):
        raise ModelRefError(
            f"NIM_MODEL_NAME={name!r} and NIM_MODEL_PATH={path!r} name different models: set one "
            "(NIM_MODEL_PATH, as NIM 2.x names it) or make them agree"
        )
    return by_path if by_path.revision is not None or by_name.revision is None else by_name
