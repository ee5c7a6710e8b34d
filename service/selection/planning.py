"""From Settings to a plan: the system, the model's manifest, the selected profile, and its files.

Shared by `serve`, `list-model-profiles`, `download-to-cache` and `create-model-store`, so every
command explains and acts on the same decision.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from service.config import Settings
from service.engine.config import PRECISION_TAGS, UnsupportedConfigError
from service.engine.registry import ENGINES, available_engines
from service.model.config import ModelConfig, UnsupportedModelError
from service.model.quantization import HF_QUANT_CONFIG, QuantizationError
from service.selection.hardware import detect_system
from service.selection.manifests import (
    Architecture,
    Manifest,
    Profile,
    ProfileError,
    find_manifest,
    generic_manifest,
    load_manifests,
)
from service.selection.profiles import Policy, Selection, Verdict, assess, select
from service.selection.system_info import SystemInfo, load_system
from service.store.checkpoint import (
    CONFIG_FILE,
    Checkpoint,
    ModelSource,
    inspect_hub_config,
    inspect_local,
    with_local_weights,
)
from service.store.model_download import DEFAULT_ALLOW_PATTERNS, ArtifactSpec, download_artifact
from service.store.model_store import (
    EMBEDDED_MODEL_NAME,
    ModelNotFoundError,
    default_served_name,
    embedded_model_path,
    looks_like_hub_id,
    read_store_descriptor,
)

log = logging.getLogger(__name__)

# What planning fetches of a hub checkpoint without a shipped manifest (the safetensors headers are
# then read over HTTP ranges).
HUB_INSPECTION_FILES = (CONFIG_FILE, HF_QUANT_CONFIG)


def current_system(settings: Settings) -> SystemInfo:
    if settings.system_info is not None:
        return load_system(settings.system_info)
    return detect_system(settings.cuda_visible_devices)


def policy_for(settings: Settings, config: ModelConfig | None = None) -> Policy:
    """The operator's policy; with the model's `config` known, tensor-parallel profiles its shape
    cannot be sharded into are incompatible (the check the engine makes when it loads)."""
    engines = available_engines()
    return Policy(
        tensor_parallel_refusal=config.tensor_parallel_refusal if config is not None else None,
        engines=frozenset(name for name, state in engines.items() if state.available),
        engine_notes=tuple((name, state.reason) for name, state in engines.items() if not state.available),
        engine_support={name: entry.support for name, entry in ENGINES.items()},
        profile_type=settings.profile_type,
        max_model_len=settings.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size,
        precision=settings.quantization
        or (None if settings.dtype == "auto" else PRECISION_TAGS[settings.dtype]),
        w4a8_int4=settings.cpu_int4_kernel == "auto",
    )


def manifest_for(settings: Settings) -> Manifest:
    """The model's shipped manifest, or generic profiles derived from its local config."""
    return _manifest_and_checkpoint(settings)[0]


def assess_profiles(settings: Settings, system: SystemInfo) -> tuple[Manifest, list[Verdict]]:
    """The model's manifest and every profile's verdict on `system`, as selection sees them."""
    manifest, checkpoint = _manifest_and_checkpoint(settings)
    return manifest, assess(manifest, system, policy_for(settings, _known_config(settings, checkpoint)))


def _known_config(settings: Settings, checkpoint: Checkpoint | None) -> ModelConfig | None:
    """The model's config where planning has it without fetching anything: an inspected
    checkpoint's, or the embedded GGUF's header; None for a shipped manifest's hub model (its
    tensor-parallel shapes are then checked when the engine loads)."""
    if checkpoint is not None:
        return checkpoint.config
    if settings.model is None and settings.tensor_parallel_size not in (None, 1):
        try:
            return inspect_local(embedded_model_path()).config
        except (ModelNotFoundError, UnsupportedModelError, QuantizationError, OSError):
            return None
    return None


def _manifest_and_checkpoint(settings: Settings) -> tuple[Manifest, Checkpoint | None]:
    """The manifest, and the checkpoint inspected on the way where one was (a local path, a model
    store, or a hub id without a shipped manifest); None: inspected once its files are fetched."""
    model = settings.model
    manifests = load_manifests()
    if model is None:
        found = find_manifest("embedded", manifests)
        assert found is not None, "profiles/ must ship the embedded model's manifest"
        return found, None
    name = model.name
    path = model.local_path
    store = read_store_descriptor(path) if path is not None and path.is_dir() else None  # a model store?
    if path is not None and store is not None:
        return _store_manifest(store, path, manifests), _inspect(lambda: inspect_local(path, store))
    # A pinned revision is served as generic profiles of that revision: a shipped manifest's
    # profiles name their own repositories and revisions.
    found = find_manifest(name, manifests) if model.revision is None else None
    if found is not None:
        return found, None
    served = settings.served_model_name or default_served_name(name)
    if path is not None:
        checkpoint = _inspect(lambda: inspect_local(path))
        return _generic_for_checkpoint(served, str(path), checkpoint), checkpoint
    if looks_like_hub_id(name):
        # No manifest and nothing local: generic torch profiles sized from the config and the
        # safetensors headers (read over HTTP ranges; no weight is downloaded).
        revision = model.revision or "main"
        config_dir = download_artifact(
            ArtifactSpec(name, revision, allow_patterns=HUB_INSPECTION_FILES),
            settings.cache_path / "hub",
            token=_token(settings),
            offline=settings.hf_hub_offline,
        )
        checkpoint = _inspect(
            lambda: inspect_hub_config(
                config_dir, name, token=_token(settings), offline=settings.hf_hub_offline
            )
        )
        return _at_revision(_generic_for_checkpoint(served, name, checkpoint), revision), checkpoint
    variable = "NIM_MODEL_PATH" if settings.model_path else "NIM_MODEL_NAME"
    raise ModelNotFoundError(
        f"{variable}={name!r} is not an existing .gguf file, model directory or hub id (org/name)"
    )


def _at_revision(manifest: Manifest, revision: str) -> Manifest:
    """The manifest with its profiles' hub sources pinned to `revision` (their ids change with it)."""
    if revision == "main":
        return manifest
    profiles = tuple(
        dataclasses.replace(p, source=dataclasses.replace(p.source, revision=revision))
        for p in manifest.profiles
    )
    return dataclasses.replace(manifest, profiles=profiles)


def _inspect(inspection: Callable[[], Checkpoint]) -> Checkpoint:
    """A checkpoint this release cannot serve is a ProfileError (one line), as selection reports it."""
    try:
        return inspection()
    except QuantizationError as error:
        raise ProfileError(str(error)) from error


def _generic_for_checkpoint(served: str, repo: str, checkpoint: Checkpoint) -> Manifest:
    """Generic profiles for a checkpoint nobody wrote a manifest for; a ModelOpt one serves its own
    precision only. Sized from the tensor headers: an unquantized checkpoint (or a GGUF file, whose
    blocks are dequantized) at bf16 for every element, a ModelOpt one at its stored bytes; a hub
    checkpoint whose headers could not be read at bf16 from the config's shapes."""
    arch = _architecture(checkpoint.config)
    quantized = checkpoint.quantization
    tensors = checkpoint.tensors
    if tensors is None:
        weights, measured = _estimate_weights_bytes(checkpoint.config), False
    elif quantized is None:
        weights, measured = tensors.elements * 2, True
    else:
        weights, measured = tensors.nbytes, True
    if checkpoint.model_format == "gguf":
        return generic_manifest(served, repo, arch, weights)
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
    checkpoint: Checkpoint | None = None  # inspected in planning; None: once its files are fetched

    @property
    def profile(self) -> Profile:
        return self.selection.chosen.profile


def make_plan(settings: Settings) -> Plan:
    system = current_system(settings)
    manifest, checkpoint = _manifest_and_checkpoint(settings)
    policy = policy_for(settings, _known_config(settings, checkpoint))
    selection = select(manifest, system, policy, settings.model_profile)
    return Plan(system, manifest, selection, checkpoint)


def fetch_profile(profile: Profile, settings: Settings, *, progress: bool = True) -> Path:
    """The profile's files on local disk (downloaded into NIM_CACHE_PATH unless already there)."""
    path = settings.model.local_path if settings.model is not None else None
    if path is not None and path.is_dir() and read_store_descriptor(path) is not None:
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
    """What the engine loads for the plan's profile: its files fetched, the checkpoint inspected
    once (in planning where it could be, else here)."""
    planned = plan.checkpoint
    if planned is not None and planned.is_model_store:
        checkpoint = planned  # everything is here already
    else:
        path = fetch_profile(plan.profile, settings)
        try:
            checkpoint = _checkpoint_at(path, planned)
        except (QuantizationError, UnsupportedModelError) as error:
            raise UnsupportedConfigError(f"profile {plan.profile.name}: {error}") from error
    served = settings.served_model_name or (
        EMBEDDED_MODEL_NAME
        if plan.profile.source.repo == "embedded" or settings.model is None
        else default_served_name(settings.model.name)
    )
    return ModelSource(checkpoint, served)


def _checkpoint_at(path: Path, planned: Checkpoint | None) -> Checkpoint:
    """The planned inspection where it describes `path` (a hub checkpoint's config snapshot gains
    its downloaded weight files), else an inspection of `path`."""
    if planned is None or planned.path != path:
        return inspect_local(path)
    if planned.model_format == "hf_dir" and not planned.weight_files:
        return with_local_weights(planned)
    return planned


def served_name(settings: Settings) -> str:
    """The name the API reports and accepts, known before anything is loaded."""
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model is None:
        return EMBEDDED_MODEL_NAME
    path = settings.model.local_path
    store = read_store_descriptor(path) if path is not None and path.is_dir() else None
    if store is not None and store.get("model"):
        return str(store["model"])
    return default_served_name(settings.model.name)
