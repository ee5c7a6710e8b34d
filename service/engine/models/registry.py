"""Which checkpoint architectures this engine runs, and the model class that runs each.

One line per Hugging Face ``architectures`` name; every other table (the names ModelConfig accepts
from a config.json, the GGUF ``general.architecture`` values, the refusal that lists them) is
derived from `ARCHITECTURES`. Classes are imported on lookup, so reading the table imports no
model code (nor torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from service.engine.models.base import CausalLM
    from service.engine.models.config import ModelConfig

    ModelClass = Callable[[ModelConfig], CausalLM]


@dataclass(frozen=True)
class ModelEntry:
    family: str  # ModelConfig.architecture: the family its config is read as
    module: str  # where the model class lives, imported on lookup
    class_name: str
    gguf: str | None = None  # the GGUF `general.architecture` llama.cpp writes for it, if its own


_LLAMA = "service.engine.models.llama"
_MOE = "service.engine.models.moe"

ARCHITECTURES: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry("llama", _LLAMA, "LlamaForCausalLM", gguf="llama"),
    "MistralForCausalLM": ModelEntry("mistral", _LLAMA, "LlamaForCausalLM"),  # GGUF writes it as llama
    "Qwen2ForCausalLM": ModelEntry("qwen2", _LLAMA, "LlamaForCausalLM", gguf="qwen2"),
    "Qwen3ForCausalLM": ModelEntry("qwen3", _LLAMA, "LlamaForCausalLM", gguf="qwen3"),
    "Qwen3MoeForCausalLM": ModelEntry("qwen3_moe", _MOE, "MoeForCausalLM"),
    "MixtralForCausalLM": ModelEntry("mixtral", _MOE, "MoeForCausalLM"),
}

# HF architectures name -> family
HF_FAMILIES: dict[str, str] = {name: entry.family for name, entry in ARCHITECTURES.items()}
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(e.gguf for e in ARCHITECTURES.values() if e.gguf is not None)


def unsupported(described: str) -> str:
    """The one-line refusal of an architecture the registry lacks."""
    return f"architecture {described} is not supported; supported: {', '.join(ARCHITECTURES)}"


def model_class(family: str) -> ModelClass:
    """The class that runs `family` (a ModelConfig.architecture), imported now."""
    entry = next((e for e in ARCHITECTURES.values() if e.family == family), None)
    if entry is None:
        # Imported here: config reads this module's tables.
        from service.engine.models.config import UnsupportedModelError

        raise UnsupportedModelError(unsupported(repr(family)))
    return cast("ModelClass", getattr(importlib.import_module(entry.module), entry.class_name))
