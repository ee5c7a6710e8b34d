"""Profile manifests: the prebuilt precision/parallelism variants of a model, as profiles/*.yaml
lists them (or as `generic_manifest` makes them for a model nobody wrote a manifest for), and the
stable id of each. Which of them runs here is service.selection.profiles' job."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml

from service.engine.precision import SPECS


def _profiles_dir() -> Path:
    """profiles/ of a source checkout, else the copy a wheel install puts in <prefix>/share."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return checkout / "profiles"
    return Path(sysconfig.get_path("data")) / "share" / "nim-torch" / "profiles"


PROFILES_DIR = _profiles_dir()

Engine = Literal["tensorrt_llm", "torch"]

PRECISIONS = tuple(spec.name for spec in SPECS)  # the order selection prefers, other things equal
WEIGHT_BYTES = {spec.name: spec.weight_bytes for spec in SPECS}


class ProfileError(ValueError):
    """A manifest is malformed, or a requested profile does not exist or cannot run here."""


@dataclass(frozen=True)
class Architecture:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int


@dataclass(frozen=True)
class ArtifactSource:
    repo: str  # hub repo id, or "embedded" for the packaged default model
    revision: str
    files: tuple[str, ...] = ()  # empty: every file a model needs (weights, config, tokenizer)


@dataclass(frozen=True)
class Profile:
    model: str
    llm_engine: Engine
    precision: str
    gpu: str  # a GPU family tag (hardware.GPUInfo.family) or "generic"
    tp: int
    pp: int
    profile: Literal["throughput", "latency"]
    kv_cache_dtype: str
    feat_lora: bool
    weights_gb: float
    source: ArtifactSource
    lora_max_rank: int | None = None
    # tensorrt_llm: build a TensorRT engine once (where the install can) and cache it in the model
    # store, instead of loading the checkpoint on the PyTorch backend
    trtllm_buildable: bool = False

    @cached_property
    def id(self) -> str:
        """SHA-256 of the canonical content: stable across runs, changes exactly when the profile does."""
        fields = asdict(self)
        if not self.trtllm_buildable:
            del fields["trtllm_buildable"]  # profiles written before the field keep their ids
        content = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(content.encode()).hexdigest()

    @property
    def name(self) -> str:
        base = f"{self.llm_engine}-{self.gpu}-{self.precision}-tp{self.tp}-pp{self.pp}-{self.profile}"
        if self.kv_cache_dtype not in ("auto", self.precision):
            base += f"-kv{self.kv_cache_dtype}"
        return base + ("-lora" if self.feat_lora else "")

    def tags(self) -> dict[str, Any]:
        return {
            "llm_engine": self.llm_engine,
            "precision": self.precision,
            "tp": self.tp,
            "pp": self.pp,
            "gpu": self.gpu,
            "profile": self.profile,
            "kv_cache_dtype": self.kv_cache_dtype,
            "feat_lora": self.feat_lora,
            **({"feat_lora_max_rank": self.lora_max_rank} if self.feat_lora else {}),
            **({"trtllm_buildable": True} if self.trtllm_buildable else {}),
        }


@dataclass(frozen=True)
class Manifest:
    model: str
    match: tuple[str, ...]
    architecture: Architecture
    profiles: tuple[Profile, ...]
    path: Path | None = None


def load_manifest(path: Path) -> Manifest:
    try:
        data = yaml.safe_load(path.read_text())
        arch = Architecture(**data["architecture"])
        defaults = data.get("defaults", {})
        profiles = []
        for entry in data["profiles"]:
            merged = {**defaults, **entry}
            raw_source = dict(merged.pop("source"))
            source = ArtifactSource(
                repo=raw_source["repo"],
                revision=str(raw_source["revision"]),
                files=tuple(raw_source.get("files", ())),
            )
            profile = Profile(model=data["model"], source=source, **merged)
            if profile.precision not in PRECISIONS:
                raise ValueError(f"unknown precision {profile.precision!r}")
            profiles.append(profile)
    except (KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
        raise ProfileError(f"{path}: invalid manifest ({exc})") from None
    return Manifest(data["model"], tuple(data.get("match", ())), arch, tuple(profiles), path)


def load_manifests(directory: Path = PROFILES_DIR) -> list[Manifest]:
    if not directory.is_dir():
        raise ProfileError(f"profile manifests not found at {directory}: the installation is incomplete")
    return [load_manifest(p) for p in sorted(directory.glob("*.yaml"))]


def find_manifest(name: str, manifests: Iterable[Manifest]) -> Manifest | None:
    """The manifest whose model name or `match` list names `name` (case-insensitive)."""
    wanted = name.lower()
    for manifest in manifests:
        if wanted == manifest.model.lower() or wanted in (m.lower() for m in manifest.match):
            return manifest
    return None


# What a float checkpoint can be served in: its float precisions, then those quantized at load.
GENERIC_PRECISIONS = tuple(
    spec.name
    for spec in sorted(SPECS, key=lambda spec: spec.quantized)
    if not spec.quantized or spec.quantized_at_load
)


def generic_manifest(
    model: str,
    repo: str,
    arch: Architecture,
    weights_bytes: int,
    precisions: tuple[str, ...] = GENERIC_PRECISIONS,
    bytes_precision: str = "bf16",
    trtllm_precisions: tuple[str, ...] = (),
) -> Manifest:
    """Profiles for a model nobody wrote a manifest for: torch in bf16 (fp16, fp32 fallbacks), and
    fp8, int8_wo and int4_wo quantized from them at load; a quantized checkpoint gets profiles of
    its own precision only (`precisions`). `weights_bytes` is the size in `bytes_precision`.
    Hugging Face checkpoints also get tensorrt_llm profiles (`trtllm_precisions`): its PyTorch
    backend loads them as they are."""
    weights_gb = weights_bytes / 1e9 / WEIGHT_BYTES[bytes_precision]
    source = ArtifactSource(repo=repo, revision="main")
    engines: list[tuple[Engine, str]] = [("tensorrt_llm", p) for p in trtllm_precisions]
    engines += [("torch", p) for p in precisions]
    profiles = tuple(
        Profile(
            model=model,
            llm_engine=engine,
            precision=precision,
            gpu="generic",
            tp=1,
            pp=1,
            profile="throughput",
            kv_cache_dtype="auto",
            feat_lora=False,
            weights_gb=round(weights_gb * WEIGHT_BYTES[precision], 3),
            source=source,
        )
        for engine, precision in engines
    )
    return Manifest(model, (repo,), arch, profiles)
