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

Only what the engine computes is accepted: LoRA (not DoRA) on the decoder's q/k/v/o and
gate/up/down projections, no trained biases, no fully trained extra modules (modules_to_save), no
transposed (fan_in_fan_out) weights, ranks up to the configured maximum, shapes that match the
base model. Anything else is an AdapterError whose message names the adapter and the problem.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from service.engine.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

# The decoder projections an adapter may target, by their PEFT (Hugging Face) module names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# A name an adapter can be requested by: no path separators, no leading dot.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\."
    r"(?P<module>\w+)\.lora_(?P<part>[AB])\.weight"
)


class AdapterError(ValueError):
    """An adapter this engine cannot serve; the message names it and says why."""


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


def projection_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a base projection, as the checkpoint stores it."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (config.q_size, hidden),
        "k_proj": (config.kv_size, hidden),
        "v_proj": (config.kv_size, hidden),
        "o_proj": (hidden, config.q_size),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[module]


def scan_source(root: Path) -> tuple[dict[str, Path], list[str]]:
    """The adapters under `root` by name, and why any other entry was skipped (one line each).

    An entry is an adapter when it is a directory holding adapter_config.json. Its name must be
    a valid adapter name, and it must resolve inside `root` (a symlink leading out is refused).
    """
    found: dict[str, Path] = {}
    skipped: list[str] = []
    base = root.resolve()
    for entry in sorted(root.iterdir()):
        if not (entry / CONFIG_FILE).is_file():
            continue
        if not ADAPTER_NAME.fullmatch(entry.name):
            skipped.append(f"{entry.name!r}: not a valid adapter name (letters, digits, '.', '_', '-')")
            continue
        resolved = entry.resolve()
        if not resolved.is_relative_to(base):
            skipped.append(f"{entry.name}: resolves to {resolved}, outside {base}")
            continue
        found[entry.name] = resolved
    return found, skipped


def read_adapter(directory: Path, name: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check one adapter against the base model's config."""
    try:
        settings = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name}: unreadable {CONFIG_FILE}: {exc}") from exc
    if not isinstance(settings, dict):
        raise AdapterError(f"adapter {name}: {CONFIG_FILE} is not a JSON object")
    _check_settings(name, settings)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = [p for p in PICKLED_WEIGHTS if (directory / p).exists()]
        if pickled:
            raise AdapterError(
                f"adapter {name}: only pickled weights ({', '.join(pickled)}), which can run code when "
                f"loaded and are never opened; save it as {WEIGHTS_FILE}"
            )
        raise AdapterError(f"adapter {name}: no {WEIGHTS_FILE}")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt", device="cpu") as handle:
        for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
            match = _KEY.fullmatch(key)
            if match is None:
                raise AdapterError(
                    f"adapter {name}: tensor {key!r} is not a LoRA weight of a decoder projection"
                )
            layer, module = int(match["layer"]), match["module"]
            if module not in TARGETS:
                raise AdapterError(f"adapter {name}: targets {module}, which this engine does not adapt")
            if match["block"] != block_of(module):
                raise AdapterError(f"adapter {name}: tensor {key!r} puts {module} under {match['block']}")
            if layer >= config.num_layers:
                raise AdapterError(
                    f"adapter {name}: targets layer {layer}; the model has {config.num_layers}"
                )
            parts.setdefault((layer, module), {})[match["part"]] = handle.get_tensor(key)
    if not parts:
        raise AdapterError(f"adapter {name}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    for (layer, module), pair in sorted(parts.items()):
        where = f"adapter {name}: layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_{'A' if 'A' not in pair else 'B'} is missing")
        a, b = pair["A"], pair["B"]
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"{where}: weights must be floating point, not {a.dtype} / {b.dtype}")
        out_features, in_features = projection_shape(config, module)
        path = f"model.layers.{layer}.{block_of(module)}.{module}"
        rank = int(_pattern_value(settings.get("rank_pattern"), path, settings["r"]))
        alpha = float(_pattern_value(settings.get("alpha_pattern"), path, settings["lora_alpha"]))
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a rank-{rank} "
                f"adapter of a [{out_features}, {in_features}] projection"
            )
        if rank > max_rank:
            raise AdapterError(f"{where}: rank {rank} is above NIM_MAX_LORA_RANK={max_rank}")
        scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
        modules[(layer, module)] = LoraWeights(a, b, scale)
    return LoraAdapter(name, directory, modules)


def block_of(module: str) -> str:
    """The decoder block a projection belongs to, as its checkpoint names it."""
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def _check_settings(name: str, settings: dict[str, Any]) -> None:
    def refuse(why: str) -> AdapterError:
        return AdapterError(f"adapter {name}: {why}")

    if settings.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {settings.get('peft_type')!r}; only LORA adapters are served")
    for key in ("r", "lora_alpha"):
        value = settings.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise refuse(f"{CONFIG_FILE} needs a positive {key}, has {value!r}")
    if settings.get("use_dora"):
        raise refuse("DoRA (use_dora) is not served")
    if settings.get("bias", "none") != "none":
        raise refuse(f"trained biases (bias={settings['bias']!r}) are not served")
    if settings.get("modules_to_save"):
        raise refuse(f"fully trained modules (modules_to_save={settings['modules_to_save']}) are not served")
    if settings.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out weights (transposed, GPT-2 style) are not served")
    for key in ("rank_pattern", "alpha_pattern"):
        if settings.get(key) is not None and not isinstance(settings[key], dict):
            raise refuse(f"{key} must be an object")


def _pattern_value(patterns: dict[str, Any] | None, path: str, default: Any) -> Any:
    """PEFT's per-module override: the first pattern matching the module path or a dotted suffix."""
    for pattern, value in (patterns or {}).items():
        if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", path):
            return value
    return default
