"""Which checkpoint architectures this server runs, and where the model class that runs each lives.

One line per Hugging Face ``architectures`` name; every other table (the names ModelConfig accepts
from a config.json, the GGUF ``general.architecture`` values, the refusal that lists them) is
derived from `ARCHITECTURES`. This table imports no model code (nor torch): the engine's
service.engine.models.registry imports a family's class when it builds one.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this server cannot run faithfully."""


@dataclass(frozen=True)
class ModelEntry:
    family: str  # ModelConfig.architecture: the family its config is read as
    module: str  # where the model class lives, imported on lookup
    class_name: str
    gguf: str | None = None  # the GGUF `general.architecture` llama.cpp writes for it, if its own
    model_type: str | None = None  # config.json's model_type, where it is not the family's name


_LLAMA = "service.engine.models.llama"
_MOE = "service.engine.models.moe"
_GEMMA3 = "service.engine.models.gemma3"

ARCHITECTURES: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry("llama", _LLAMA, "LlamaForCausalLM", gguf="llama"),
    "MistralForCausalLM": ModelEntry("mistral", _LLAMA, "LlamaForCausalLM"),  # GGUF writes it as llama
    "Qwen2ForCausalLM": ModelEntry("qwen2", _LLAMA, "LlamaForCausalLM", gguf="qwen2"),
    "Qwen3ForCausalLM": ModelEntry("qwen3", _LLAMA, "LlamaForCausalLM", gguf="qwen3"),
    "Qwen3MoeForCausalLM": ModelEntry("qwen3_moe", _MOE, "MoeForCausalLM"),
    "MixtralForCausalLM": ModelEntry("mixtral", _MOE, "MoeForCausalLM"),
    "Gemma3ForCausalLM": ModelEntry("gemma3", _GEMMA3, "Gemma3ForCausalLM", model_type="gemma3_text"),
}

# Architectures recognised but not run, each with why: the refusal names the reason.
REFUSED: dict[str, str] = {
    "Gemma3ForConditionalGeneration": (
        "Gemma3ForConditionalGeneration (Gemma 3 with vision, gemma-3-4b and up) is not supported: its "
        "text weights are named language_model.*, which the loader's quantization and tensor-parallel "
        "sharding do not map yet; serve a text-only Gemma3ForCausalLM checkpoint (gemma-3-1b, or a "
        "text-only conversion)"
    ),
}

# HF architectures name -> family
HF_FAMILIES: dict[str, str] = {name: entry.family for name, entry in ARCHITECTURES.items()}
# config.json model_type -> family (read where a config names no architectures)
HF_MODEL_TYPES: dict[str, str] = {
    entry.model_type or entry.family: entry.family for entry in ARCHITECTURES.values()
}
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(e.gguf for e in ARCHITECTURES.values() if e.gguf is not None)


def unsupported(described: str) -> str:
    """The one-line refusal of an architecture the registry lacks (its reason, where known)."""
    if described in REFUSED:
        return REFUSED[described]
    return f"architecture {described} is not supported; supported: {', '.join(ARCHITECTURES)}"
