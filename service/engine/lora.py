"""LoRA adapters in Hugging Face PEFT format: finding them, reading them, refusing bad ones.

An adapter source (NIM_PEFT_SOURCE) is a directory with one subdirectory per adapter; the
subdirectory's name is the adapter's name. An adapter holds `adapter_config.json` and
`adapter_model.safetensors` (pickled `adapter_model.bin` files are refused, never opened).

What an adapter adds to a base linear layer y = x W^T (W: [out, in]) is, per PEFT's LoRA,

    y += scale * (x A^T) B^T        A: [r, in] (lora_A), B: [out, r] (lora_B)
    scale = lora_alpha / r          (lora_alpha / sqrt(r) with use_rslora)

so the adapted layer equals the merged weight W + scale * B @ A. `rank_pattern` and
`alpha_pattern` override r and lora_alpha per module, matched as PEFT matches them (a pattern
matches a module path or any dotted suffix of it).

Only what the engine computes is accepted: LoRA (not DoRA) on the projections the model's linear
layers hold (`CausalLM.linear_layers`: a Llama decoder layer's q/k/v/o and gate/up/down; in a
mixture-of-experts model's routed layers only attention's q/k/v/o, so an adapter on an expert or
the router is refused with that reason), no trained biases, no fully trained extra modules
(modules_to_save), no transposed (fan_in_fan_out) weights, ranks up to the configured maximum,
shapes that match the base model. Anything else is an AdapterError whose message names the
adapter and the problem.

An adapter is checked in full when it is read, since what it holds reaches every request of a
batch it runs in: both files resolve inside the source (a symlink leading out is refused), each
is read once into memory (what is checked is what is used; a file changed meanwhile cannot fault
a mapping), the safetensors header matches the file's size (a truncated or half-copied file is
refused), r and rank_pattern values are positive integers, lora_alpha and alpha_pattern values
finite positive numbers, every pattern compiles, and every weight, scale included, is finite.
Anything wrong with an adapter's files is an AdapterError, never another exception.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeGuard, TypeVar

import safetensors.torch
import torch

from service.engine.models.base import ONE_PROCESS
from service.engine.models.llama_layers import PROJECTIONS
from service.engine.models.registry import model_class
from service.engine.protocol import AdapterError
from service.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

# The projections of a Llama decoder layer, by their PEFT (Hugging Face) module names: what an
# adapter of a dense model may target (`adaptable` says which a given model holds, layer by layer).
TARGETS = PROJECTIONS

# A name an adapter can be requested by: no path separators, no leading dot.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

_MAX_CONFIG_BYTES = 16 << 20  # adapter_config.json (PEFT writes a few KB, more with per-module patterns)
_MAX_HEADER_BYTES = 16 << 20  # a safetensors header (an adapter of 80 layers needs about 200 KB)
_LARGEST_WEIGHT = float(torch.finfo(torch.bfloat16).max)  # finite in bfloat16 and float32 alike

_T = TypeVar("_T")

_KEY = re.compile(
    r"base_model\.model\.(?P<path>model\.layers\.(?P<layer>\d+)\.(?P<module>[\w.]+))\.lora_(?P<part>[AB])\.weight"
)


@dataclass(frozen=True)
class LoraWeights:
    """One adapted projection: y += scale * (x @ a.T) @ b.T."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def delta(self) -> torch.Tensor:
        """scale * B @ A: what merging adds to the base weight [out, in] (float32)."""
        return self.scale * (self.b.float() @ self.a.float())


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    modules: dict[tuple[int, str], LoraWeights]  # (layer, projection name) -> weights

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.modules.values())


@dataclass(frozen=True)
class Projection:
    """One projection an adapter may target."""

    layer: int
    name: str  # as PEFT names the module: "q_proj", ...
    shape: tuple[int, int]  # (out, in) of the whole model's weight, as the checkpoint stores it


@lru_cache(maxsize=8)
def adaptable(config: ModelConfig) -> Mapping[str, Projection]:
    """The projections of `config`'s model an adapter may target, by module path
    ("model.layers.0.self_attn.q_proj"): every checkpoint projection its linear layers hold
    (`CausalLM.linear_layers` of the model built on 'meta', which allocates nothing)."""
    with torch.device("meta"):
        model = model_class(config.architecture)(config, ONE_PROCESS)
    return MappingProxyType(
        {
            part.weight_name.removesuffix(".weight"): Projection(
                linear.layer, part.name, (part.rows, linear.in_features)
            )
            for linear in model.linear_layers()
            for part in linear.parts
        }
    )


def projection_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a base projection, as the checkpoint stores it (its first layer's, where layers
    differ)."""
    shape = next((p.shape for p in adaptable(config).values() if p.name == module), None)
    if shape is None:
        raise KeyError(f"no layer of this model holds a {module}")
    return shape


def scan_source(root: Path) -> tuple[dict[str, Path], list[str]]:
    """The adapters under `root` by name, and why any other entry was skipped (one line each).

    An entry is an adapter when it is a directory holding adapter_config.json. Its name must be
    a valid adapter name, and it must resolve inside `root` (a symlink leading out is refused).
    An entry that cannot be examined (no permission, a symlink loop) is skipped with the reason;
    only an unreadable `root` itself raises (OSError).
    """
    found: dict[str, Path] = {}
    skipped: list[str] = []
    base = root.resolve()
    for entry in sorted(root.iterdir()):
        try:
            if not (entry / CONFIG_FILE).is_file():
                continue
            if not ADAPTER_NAME.fullmatch(entry.name):
                skipped.append(f"{entry.name!r}: not a valid adapter name (letters, digits, '.', '_', '-')")
                continue
            resolved = entry.resolve()
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
            skipped.append(f"{entry.name!r}: cannot be examined: {exc}")
            continue
        if not resolved.is_relative_to(base):
            skipped.append(f"{entry.name}: resolves to {resolved}, outside {base}")
            continue
        found[entry.name] = resolved
    return found, skipped


def read_adapter(
    directory: Path, name: str, config: ModelConfig, max_rank: int, source: Path | None = None
) -> LoraAdapter:
    """Read and check one adapter against the base model's config.

    Every file is checked in full: both must resolve inside `source` (the adapter source; None:
    the adapter's own directory), the config's numbers and patterns must be valid, the weights
    file must be a complete safetensors file and every weight finite. Anything wrong with the
    adapter's files raises AdapterError, never another exception.
    """
    try:
        return _read_adapter(directory, name, config, max_rank, source)
    except OSError as exc:  # a file unreadable, or changed while it was read
        raise AdapterError(f"adapter {name}: unreadable: {exc}") from exc


def _read_adapter(
    directory: Path, name: str, config: ModelConfig, max_rank: int, source: Path | None
) -> LoraAdapter:
    root = (source if source is not None else directory).resolve()
    config_path = _inside(name, directory / CONFIG_FILE, root)
    try:
        settings = json.loads(_read_bounded(config_path, _MAX_CONFIG_BYTES, name))
    except (OSError, ValueError, RecursionError) as exc:
        raise AdapterError(f"adapter {name}: unreadable {CONFIG_FILE}: {exc}") from exc
    if not isinstance(settings, dict):
        raise AdapterError(f"adapter {name}: {CONFIG_FILE} is not a JSON object")
    checked = _check_settings(name, settings)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = [p for p in PICKLED_WEIGHTS if (directory / p).exists()]
        if pickled:
            raise AdapterError(
                f"adapter {name}: only pickled weights ({', '.join(pickled)}), which can run code when "
                f"loaded and are never opened; save it as {WEIGHTS_FILE}"
            )
        raise AdapterError(f"adapter {name}: no {WEIGHTS_FILE}")
    tensors = _read_tensors(name, _inside(name, weights_path, root), _largest_weights(config, max_rank))
    projections = adaptable(config)
    parts: dict[tuple[int, str], tuple[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterError(f"adapter {name}: tensor {key!r} is not a LoRA weight of a decoder projection")
        projection = projections.get(match["path"])
        if projection is None:
            raise AdapterError(f"adapter {name}: {_not_adaptable(key, match['path'], config)}")
        pair = parts.setdefault((projection.layer, projection.name), (match["path"], {}))[1]
        pair[match["part"]] = tensor
    if not parts:
        raise AdapterError(f"adapter {name}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    for (layer, module), (path, pair) in sorted(parts.items()):
        where = f"adapter {name}: layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_{'A' if 'A' not in pair else 'B'} is missing")
        a, b = pair["A"], pair["B"]
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"{where}: weights must be floating point, not {a.dtype} / {b.dtype}")
        out_features, in_features = projections[path].shape
        rank = _pattern_value(checked.rank_pattern, path, checked.rank)
        alpha = _pattern_value(checked.alpha_pattern, path, checked.alpha)
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a rank-{rank} "
                f"adapter of a [{out_features}, {in_features}] projection"
            )
        if rank > max_rank:
            raise AdapterError(f"{where}: rank {rank} is above NIM_MAX_LORA_RANK={max_rank}")
        scale = alpha / math.sqrt(rank) if checked.rslora else alpha / rank
        # Finite in every dtype the term is computed in (bfloat16 has the narrowest range), scale
        # folded in as the device slots hold it: a non-finite weight would turn the adapter's rows
        # (and any value multiplied by it) to NaN.
        for part, weight in (("lora_A", a.float()), ("lora_B", b.float() * scale)):
            if not bool((weight.abs() <= _LARGEST_WEIGHT).all()):  # False for NaN too
                bound = f"|w| > {_LARGEST_WEIGHT:.3g}{', scale included' if part == 'lora_B' else ''}"
                raise AdapterError(f"{where}: {part} holds NaN, infinite or too large values ({bound})")
        modules[(layer, module)] = LoraWeights(a, b, scale)
    return LoraAdapter(name, directory, modules)


def block_of(module: str) -> str:
    """The decoder block a projection belongs to, as its checkpoint names it."""
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def _not_adaptable(key: str, path: str, config: ModelConfig) -> str:
    """Why the module at `path` (model.layers.N.<...>), which the model's linear layers do not
    hold, cannot be adapted: one line."""
    layer = int(path.split(".")[2])
    block, _, rest = path.split(".", 3)[3].partition(".")
    module = path.rpartition(".")[2]
    if layer >= config.num_layers:
        return f"targets layer {layer}; the model has {config.num_layers}"
    if layer in config.sparse_layers and (".experts." in f".{rest}." or rest == "gate"):
        what = "the router" if rest == "gate" else "an expert"
        return (
            f"targets {path}, {what} of a mixture-of-experts layer; LoRA adapts only the attention "
            "projections (q/k/v/o) of a mixture-of-experts model's routed layers"
        )
    if module not in TARGETS:
        return f"targets {module}, which this engine does not adapt"
    if block != block_of(module):
        return f"tensor {key!r} puts {module} under {block}"
    return f"targets {path}, which this model does not have"


@dataclass(frozen=True)
class _Settings:
    """What adapter_config.json says about scales, checked: r and lora_alpha, their per-module
    overrides (compiled patterns, first match wins), use_rslora."""

    rank: int
    alpha: float
    rslora: bool
    rank_pattern: tuple[tuple[re.Pattern[str], int], ...]
    alpha_pattern: tuple[tuple[re.Pattern[str], float], ...]


def _check_settings(name: str, settings: dict[str, Any]) -> _Settings:
    def refuse(why: str) -> AdapterError:
        return AdapterError(f"adapter {name}: {why}")

    if settings.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {settings.get('peft_type')!r}; only LORA adapters are served")
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if not _is_rank(rank):
        raise refuse(f"{CONFIG_FILE} needs a positive r (an integer), has {rank!r}")
    if not _is_alpha(alpha):
        raise refuse(f"{CONFIG_FILE} needs a positive lora_alpha (a finite number), has {alpha!r}")
    if settings.get("use_dora"):
        raise refuse("DoRA (use_dora) is not served")
    if settings.get("bias", "none") != "none":
        raise refuse(f"trained biases (bias={settings['bias']!r}) are not served")
    if settings.get("modules_to_save"):
        raise refuse(f"fully trained modules (modules_to_save={settings['modules_to_save']}) are not served")
    if settings.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out weights (transposed, GPT-2 style) are not served")
    ranks = _patterns(name, settings, "rank_pattern", _is_rank, "a positive integer")
    alphas = _patterns(name, settings, "alpha_pattern", _is_alpha, "a finite positive number")
    return _Settings(rank, float(alpha), bool(settings.get("use_rslora")), ranks, alphas)


def _patterns(
    name: str, settings: dict[str, Any], key: str, valid: Callable[[object], TypeGuard[_T]], kind: str
) -> tuple[tuple[re.Pattern[str], _T], ...]:
    """A rank_pattern or alpha_pattern compiled, as PEFT matches it: a pattern matches a module
    path or any dotted suffix of it. Every key must compile and every value pass `valid`."""
    given = settings.get(key)
    if given is None:
        return ()
    if not isinstance(given, dict):
        raise AdapterError(f"adapter {name}: {key} must be an object")
    compiled = []
    for pattern, value in given.items():
        if not valid(value):
            raise AdapterError(f"adapter {name}: {key}[{pattern!r}] must be {kind}, not {value!r}")
        try:
            compiled.append((re.compile(rf"(?:.*\.)?(?:{pattern})"), value))
        except (re.error, OverflowError, RecursionError) as exc:
            raise AdapterError(
                f"adapter {name}: {key} key {pattern!r} is not a valid regular expression ({exc})"
            ) from exc
    return tuple(compiled)


def _is_rank(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_alpha(value: object) -> TypeGuard[int | float]:
    """A finite positive number (JSON as Python reads it admits NaN and Infinity)."""
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def _pattern_value(patterns: tuple[tuple[re.Pattern[str], _T], ...], path: str, default: _T) -> _T:
    """PEFT's per-module override: the first pattern matching the module path or a dotted suffix."""
    for pattern, value in patterns:
        if pattern.fullmatch(path):
            return value
    return default


def _inside(name: str, path: Path, root: Path) -> Path:
    """`path` resolved (links followed), refused when it leads out of `root`."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        raise AdapterError(f"adapter {name}: {path.name} cannot be resolved: {exc}") from exc
    if not resolved.is_relative_to(root):
        raise AdapterError(f"adapter {name}: {path.name} resolves to {resolved}, outside {root}")
    return resolved


def _read_bounded(path: Path, limit: int, name: str) -> bytes:
    """The whole file, refused above `limit` bytes (read once: what is checked is what is used)."""
    with path.open("rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise AdapterError(f"adapter {name}: {path.name} is larger than any valid one ({limit} bytes)")
    return data


def _largest_weights(config: ModelConfig, max_rank: int) -> int:
    """Bytes of the largest weights file a servable adapter can have: every projection of every
    layer at the rank limit in float64, plus a header."""
    elements = sum(max_rank * sum(projection.shape) for projection in adaptable(config).values())
    return 8 + _MAX_HEADER_BYTES + elements * 8


def _read_tensors(name: str, path: Path, limit: int) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file read whole into memory (a file changed while it is read
    cannot fault a mapping), its header checked against the bytes read."""
    data = _read_bounded(path, limit, name)
    where = f"adapter {name}: {WEIGHTS_FILE}"
    header_bytes = int.from_bytes(data[:8], "little") if len(data) >= 8 else None
    if header_bytes is None or 8 + header_bytes > len(data) or header_bytes > _MAX_HEADER_BYTES:
        raise AdapterError(f"{where} is truncated or not a safetensors file ({len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + header_bytes])
        described = max(
            (int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
            default=0,
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise AdapterError(f"{where} has a malformed header ({exc!r})") from exc
    if 8 + header_bytes + described != len(data):
        raise AdapterError(
            f"{where} is {len(data)} bytes but its header describes {8 + header_bytes + described}: "
            "truncated, still being copied, or corrupt"
        )
    try:
        return safetensors.torch.load(data)
    except Exception as exc:  # the library's checks (offsets, dtypes, shapes): any failure is the file's
        raise AdapterError(f"{where} is not a valid safetensors file ({exc})") from exc
