"""From Settings to a plan: the system, the model's manifest, the selected profile, and its files.

Shared by `serve`, `list-model-profiles`, `download-to-cache` and `create-model-store`, so every
command explains and acts on the same decision.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import gguf

from service.config import Settings
from service.engine.config import PRECISION_TAGS
from service.engine.models.config import ModelConfig
from service.engine.models.modelopt import HF_QUANT_CONFIG, checkpoint_quantization
from service.engine.models.quant import QuantizationError
from service.engine.registry import ENGINES, available_engines
from service.selection.hardware import SystemInfo, detect_system, load_system
from service.selection.profiles import (
    Architecture,
    Manifest,
    Policy,
    Profile,
    ProfileError,
    Selection,
    find_manifest,
    generic_manifest,
    load_manifests,
    select,
)
from service.store.model_download import DEFAULT_ALLOW_PATTERNS, ArtifactSpec, download_artifact
from service.store.model_store import (
    EMBEDDED_MODEL_NAME,
    ModelNotFoundError,
    ModelSource,
    check_model_dir,
    check_model_file,
    default_served_name,
    embedded_model_path,
    looks_like_hub_id,
    read_store_descriptor,
    source_in_directory,
)

log = logging.getLogger(__name__)


def current_system(settings: Settings) -> SystemInfo:
    if settings.system_info is not None:
        return load_system(settings.system_info)
    return detect_system(settings.cuda_visible_devices)


def policy_for(settings: Settings) -> Policy:
    engines = available_engines()
    return Policy(
        engines=frozenset(name for name, state in engines.items() if state.available),
        engine_notes=tuple((name, state.reason) for name, state in engines.items() if not state.available),
        engine_support={name: entry.support for name, entry in ENGINES.items()},
        profile_type=settings.profile_type,
        max_model_len=settings.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size,
        precision=None if settings.dtype == "auto" else PRECISION_TAGS[settings.dtype],
    )


def manifest_for(settings: Settings) -> Manifest:
    """The model's shipped manifest, or generic profiles derived from its local config."""
    name = settings.model_name
    manifests = load_manifests()
    if name is None:
        found = find_manifest("embedded", manifests)
        assert found is not None, "profiles/ must ship the embedded model's manifest"
        return found
    path = Path(name).expanduser()
    store = read_store_descriptor(path) if path.is_dir() else None
    if store is not None:
        return _store_manifest(store, path, manifests)
    found = find_manifest(name, manifests)
    if found is not None:
        return found
    served = settings.served_model_name or default_served_name(name)
    if path.is_file():
        check_model_file(path)  # refuses pickles and anything but .gguf
        config = ModelConfig.from_gguf(gguf.GGUFReader(str(path)))
        return generic_manifest(served, str(path), _architecture(config), path.stat().st_size * 4)
    if path.is_dir():
        check_model_dir(path)
        raw_config = json.loads((path / "config.json").read_text())
        config = ModelConfig.from_hf_config(raw_config)
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return _generic_for_checkpoint(served, str(path), path, raw_config, config, weights, measured=True)
    if looks_like_hub_id(name):
        # No manifest and nothing local: generic torch profiles sized once the config is fetched.
        config_dir = download_artifact(
            ArtifactSpec(name, "main", allow_patterns=("config.json", HF_QUANT_CONFIG)),
            settings.cache_path / "hub",
            token=_token(settings),
            offline=settings.hf_hub_offline,
        )
        raw_config = json.loads((config_dir / "config.json").read_text())
        config = ModelConfig.from_hf_config(raw_config)
        weights = _estimate_weights_bytes(config)
        return _generic_for_checkpoint(served, name, config_dir, raw_config, config, weights, measured=False)
    raise ModelNotFoundError(
        f"NIM_MODEL_NAME={name!r} is not an existing .gguf file, model directory or hub id (org/name)"
    )


def _generic_for_checkpoint(
    served: str,
    repo: str,
    directory: Path,
    raw_config: dict,
    config: ModelConfig,
    weights: int,
    measured: bool,
) -> Manifest:
    """Generic profiles for an HF checkpoint; a ModelOpt one serves its own precision only.
    `weights`: the files' size when `measured`, else a bf16 estimate from the shapes."""
    try:
        quantized = checkpoint_quantization(directory, raw_config)
    except QuantizationError as error:
        raise ProfileError(str(error)) from error
    arch = _architecture(config)
    if quantized is None:
        return generic_manifest(served, repo, arch, weights, trtllm_precisions=("bf16",))
    size_precision = quantized.precision if measured else "bf16"
    own = (quantized.precision,)
    trtllm = own if quantized.precision in ("fp8", "nvfp4") else ()  # ModelOpt: loaded as published
    return generic_manifest(served, repo, arch, weights, own, size_precision, trtllm)


def _store_manifest(store: dict, path: Path, manifests: list[Manifest]) -> Manifest:
    """A model store serves the one profile it was made from (with its original id)."""
    shipped = find_manifest(store.get("model", ""), manifests)
    profile = (
        next((p for p in shipped.profiles if p.id == store.get("profile_id")), None) if shipped else None
    )
    if shipped is None or profile is None:
        raise ProfileError(
            f"{path}: made from profile {store.get('profile_name')!r} of {store.get('model')!r}, which this "
            "release does not ship; recreate the model store with this release"
        )
    return Manifest(shipped.model, (str(path),), shipped.architecture, (profile,), path)


def _architecture(config: ModelConfig) -> Architecture:
    return Architecture(
        config.num_layers, config.num_kv_heads, config.head_dim, config.max_position_embeddings
    )


def _estimate_weights_bytes(config: ModelConfig) -> int:
    """bf16 bytes from the shapes (embedding, attention, MLP or router and experts, untied head)
    when no file sizes are known."""
    hidden, inter = config.hidden_size, config.intermediate_size
    attn = (
        hidden * (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        + config.num_heads * config.head_dim * hidden
    )
    params = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    sparse = len(config.sparse_layers)
    experts = config.num_experts * (3 * hidden * config.moe_intermediate_size + hidden)  # + router rows
    params += config.num_layers * attn + (config.num_layers - sparse) * 3 * hidden * inter + sparse * experts
    return params * 2


def _token(settings: Settings) -> str | None:
    return settings.hf_token.get_secret_value() if settings.hf_token is not None else None


@dataclass(frozen=True)
class Plan:
    system: SystemInfo
    manifest: Manifest
    selection: Selection

    @property
    def profile(self) -> Profile:
        return self.selection.chosen.profile


def make_plan(settings: Settings) -> Plan:
    system = current_system(settings)
    manifest = manifest_for(settings)
    selection = select(manifest, system, policy_for(settings), settings.model_profile)
    return Plan(system, manifest, selection)


def fetch_profile(profile: Profile, settings: Settings, *, progress: bool = True) -> Path:
    """The profile's files on local disk (downloaded into NIM_CACHE_PATH unless already there)."""
    if settings.model_name is not None:
        path = Path(settings.model_name).expanduser()
        if path.is_dir() and read_store_descriptor(path) is not None:
            return path  # a model store: everything is here already
    source = profile.source
    if source.repo == "embedded":
        return embedded_model_path()
    local = Path(source.repo).expanduser()
    if local.exists():
        return local
    spec = ArtifactSpec(source.repo, source.revision, source.files or DEFAULT_ALLOW_PATTERNS)
    return download_artifact(
        spec,
        settings.cache_path / "hub",
        token=_token(settings),
        offline=settings.hf_hub_offline,
        progress=progress,
    )


def model_source(plan: Plan, settings: Settings) -> ModelSource:
    """What the engine loads for the plan's profile."""
    path = fetch_profile(plan.profile, settings)
    served = settings.served_model_name or (
        EMBEDDED_MODEL_NAME
        if plan.profile.source.repo == "embedded"
        else default_served_name(settings.model_name)
    )
    if path.is_file():
        return ModelSource("gguf", path, served)
    return source_in_directory(path, served)


def served_name(settings: Settings) -> str:
    """The name the API reports and accepts, known before anything is loaded."""
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model_name is None:
        return EMBEDDED_MODEL_NAME
    path = Path(settings.model_name).expanduser()
    store = read_store_descriptor(path) if path.is_dir() else None
    if store is not None and store.get("model"):
        return str(store["model"])
    return default_served_name(settings.model_name)
