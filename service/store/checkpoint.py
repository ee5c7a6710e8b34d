"""One inspection of a checkpoint: what it is, read once and carried from planning to the engine.

A `Checkpoint` says what a model's files hold without loading a weight: the format (a Hugging Face
safetensors directory or a GGUF file), its config.json as parsed (a GGUF file's scalar metadata), the
`ModelConfig`, its quantization (a ModelOpt export, or none), the bytes and elements of every tensor
counted from the tensor headers (safetensors headers, GGUF tensor infos: a mixture of experts counts
every expert, a tied head once), and whether the directory is a model store made by
`create-model-store`.

Planning inspects a local checkpoint (`inspect_local`), or a hub checkpoint's config files plus its
safetensors headers read over HTTP ranges (`inspect_hub_config`), and hands the result through
`ModelSource` to `EngineConfig.checkpoint`; the loaders read it instead of parsing config.json again.
This module is the one reader of config.json on the way to a running engine.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.model.config import ModelConfig, ModelFormat, UnsupportedModelError
from service.model.gguf_file import gguf_reader
from service.model.quantization import CheckpointQuantization, checkpoint_quantization
from service.store.model_store import (
    PICKLE_SUFFIXES,
    check_model_dir,
    check_model_file,
)

if TYPE_CHECKING:
    from huggingface_hub import HfApi

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
_HEADER_LENGTH = struct.Struct("<Q")  # a safetensors file starts with its JSON header's length
_STRING_LENGTH = struct.Struct("<Q")  # a GGUF string's length prefix
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_COMMIT = re.compile(r"[0-9a-f]{40}")


class CheckpointError(ValueError):
    """A checkpoint file cannot be inspected (unreadable header, missing shard)."""


@dataclass(frozen=True)
class TensorSizes:
    """What the tensor headers say: stored bytes, and elements (packed formats count storage units)."""

    nbytes: int
    elements: int

    def __add__(self, other: TensorSizes) -> TensorSizes:
        return TensorSizes(self.nbytes + other.nbytes, self.elements + other.elements)


NO_TENSORS = TensorSizes(0, 0)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint, inspected once (see the module doc). Picklable: it travels to tensor-parallel
    workers inside EngineConfig."""

    path: Path  # the .gguf file, or the Hugging Face directory
    model_format: ModelFormat
    config: ModelConfig
    metadata: dict[str, Any]  # config.json as parsed; a GGUF file's scalar metadata
    quantization: CheckpointQuantization | None  # a ModelOpt export's; None: unquantized (or GGUF)
    tensors: TensorSizes | None  # from the headers; None: a hub checkpoint whose headers were unreadable
    weight_files: tuple[Path, ...] = ()  # safetensors files in load order; () for GGUF and hub configs
    store: dict[str, Any] | None = None  # the model store's descriptor (nim_model_store.json)

    @property
    def is_model_store(self) -> bool:
        return self.store is not None


def inspect_local(path: Path, store: dict[str, Any] | None = None) -> Checkpoint:
    """A local .gguf file or Hugging Face directory, or the model store whose descriptor is `store`
    (planning reads it: service.store.model_store.read_store_descriptor); refuses pickles and anything
    else with the messages of service.store.model_store."""
    if path.is_file():
        return _inspect_gguf(check_model_file(path))
    ggufs = sorted(path.glob("*.gguf"))
    if store is not None and len(ggufs) == 1 and not (path / CONFIG_FILE).exists():
        return _inspect_gguf(ggufs[0], store)  # a model store made from a GGUF profile
    return _inspect_hf_dir(check_model_dir(path), store)


def with_local_weights(checkpoint: Checkpoint) -> Checkpoint:
    """A hub checkpoint inspected from its config files, once its weights have been downloaded into
    the same snapshot: the weight files listed and counted from their headers, config.json not re-read."""
    files = weight_files(check_model_dir(checkpoint.path))
    return replace(checkpoint, weight_files=files, tensors=_sum_sizes(files))


def inspect_hub_config(
    config_dir: Path, repo: str, *, token: str | None, offline: bool, endpoint: str | None = None
) -> Checkpoint:
    """A hub checkpoint from its config files (`config_dir`: a snapshot holding config.json, and
    hf_quant_config.json where the repo has one), its tensors counted from the safetensors headers
    read over HTTP ranges (the index, where there is one, and no weight downloaded). Offline, or when a header
    cannot be read, `tensors` is None and the caller estimates from the shapes."""
    metadata = read_config(config_dir)
    tensors = None if offline else _hub_tensor_sizes(config_dir, repo, token, endpoint)
    return Checkpoint(
        path=config_dir,
        model_format="hf_dir",
        config=ModelConfig.from_hf_config(metadata),
        metadata=metadata,
        quantization=checkpoint_quantization(config_dir, metadata),
        tensors=tensors,
    )


def read_config(directory: Path) -> dict[str, Any]:
    """config.json of a Hugging Face directory, parsed (the one place it is read)."""
    file = directory / CONFIG_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return data


def _inspect_hf_dir(path: Path, store: dict[str, Any] | None) -> Checkpoint:
    metadata = read_config(path)
    config = ModelConfig.from_hf_config(metadata)
    quantization = checkpoint_quantization(path, metadata)
    files = weight_files(path)
    return Checkpoint(path, "hf_dir", config, metadata, quantization, _sum_sizes(files), files, store)


def _inspect_gguf(path: Path, store: dict[str, Any] | None = None) -> Checkpoint:
    import gguf  # only GGUF checkpoints need it

    reader = gguf_reader(path)
    config = ModelConfig.from_gguf(reader)
    tensors = NO_TENSORS
    for tensor in reader.tensors:
        tensors += TensorSizes(int(tensor.n_bytes), int(tensor.n_elements))
    array = gguf.GGUFValueType.ARRAY
    metadata = {key: f.contents() for key, f in reader.fields.items() if f.types and f.types[0] != array}
    return Checkpoint(path, "gguf", config, metadata, None, tensors, (), store)


def weight_files(path: Path) -> tuple[Path, ...]:
    """The safetensors files of a directory: the shards its index names, else every *.safetensors."""
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        files = tuple(path / name for name in _index_shards(index))
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names missing shard(s): {', '.join(absent)}")
        return files
    files = tuple(sorted(path.glob("*.safetensors")))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise UnsupportedModelError(
            f"{path} holds only pickle checkpoint(s) ({', '.join(pickles)}); they can execute arbitrary code "
            "when loaded and are never unpickled here. Convert the model to safetensors."
        )
    raise FileNotFoundError(f"no *.safetensors files in {path}")


def _index_shards(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
    return sorted(set(weight_map.values()))


def safetensors_sizes(file: Path) -> TensorSizes:
    """Bytes and elements of every tensor in a safetensors file, from its header alone."""
    with file.open("rb") as handle:
        prefix = handle.read(_HEADER_LENGTH.size)
        if len(prefix) != _HEADER_LENGTH.size:
            raise CheckpointError(f"{file}: too short for a safetensors header")
        (length,) = _HEADER_LENGTH.unpack(prefix)
        if length > _MAX_HEADER_BYTES:
            raise CheckpointError(f"{file}: a {length}-byte header is not a safetensors header")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{file}: unreadable safetensors header ({exc})") from None
    return _header_sizes(header, file)


def _header_sizes(header: dict[str, Any], where: object) -> TensorSizes:
    sizes = NO_TENSORS
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = info["data_offsets"]
            sizes += TensorSizes(int(stop) - int(start), math.prod(int(d) for d in info["shape"]))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: tensor {name!r} has no readable shape and offsets") from None
    return sizes


def _sum_sizes(files: tuple[Path, ...]) -> TensorSizes:
    total = NO_TENSORS
    for file in files:
        total += safetensors_sizes(file)
    return total


def _hub_tensor_sizes(
    config_dir: Path, repo: str, token: str | None, endpoint: str | None
) -> TensorSizes | None:
    """The hub checkpoint's tensors counted from each safetensors file's header (a range request per
    file, as huggingface_hub's parse_safetensors_file_metadata makes); None when any is unreadable."""
    from huggingface_hub import HfApi  # deferred: local checkpoints never need it

    revision = config_dir.name if _COMMIT.fullmatch(config_dir.name) else None
    api = HfApi(endpoint=endpoint, token=token)
    total = NO_TENSORS
    try:
        for name in _hub_weight_files(api, repo, revision):
            info = api.parse_safetensors_file_metadata(repo, name, revision=revision)
            for tensor in info.tensors.values():
                start, stop = tensor.data_offsets
                total += TensorSizes(stop - start, tensor.parameter_count)
    except Exception as exc:  # any hub or parse failure: the caller estimates from the shapes instead
        log.info("%s: safetensors headers not read (%s); sizing from the config's shapes", repo, exc)
        return None
    return total


def _hub_weight_files(api: HfApi, repo: str, revision: str | None) -> list[str]:
    """The shards the repo's safetensors index names, else model.safetensors. The index is read
    through a scratch directory: in the download cache it would make the config files' snapshot
    incomplete without its shards."""
    from huggingface_hub.errors import EntryNotFoundError

    with tempfile.TemporaryDirectory(prefix="safetensors-index-") as scratch:
        try:
            index = api.hf_hub_download(repo, SAFETENSORS_INDEX, revision=revision, local_dir=scratch)
        except EntryNotFoundError:
            return [SAFETENSORS_SINGLE]
        return _index_shards(Path(index))


@dataclass(frozen=True)
class ModelSource:
    """What the engine loads: the checkpoint, inspected once (`inspect_local`, `inspect_hub_config`), and the
    name the API serves it under."""

    checkpoint: Checkpoint
    served_name: str

    @property
    def kind(self) -> ModelFormat:
        return self.checkpoint.model_format

    @property
    def path(self) -> Path:
        return self.checkpoint.path
