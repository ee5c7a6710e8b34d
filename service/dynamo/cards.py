"""What a worker tells Dynamo about its model, and what this server's router reads back.

Two things travel in a worker's registration (Dynamo's model card, "MDC"):

- a model directory (config.json, tokenizer.json, tokenizer_config.json with the chat template):
  Dynamo requires one, and its own frontend tokenizes and templates with it. A Hugging Face
  directory is registered as it is; a GGUF checkpoint gets one written next to the cache
  (`card_directory`), from the same tokenizer the engine uses;
- `runtime_data["nim"]`: a `WorkerCard` (the engine's EngineInfo, the profile and why it was
  chosen, the adapters served), from which this server's router role describes the model at
  /v1/models and /v1/metadata and checks that its own tokenizer matches the workers'.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.engine.protocol import EngineFeatures, EngineInfo, PathChoice
from service.store.checkpoint import ModelSource
from service.text.tokenizer import Tokenizer

CARD_KEY = "nim"  # the key of a WorkerCard in the registration's runtime_data


def card_directory(source: ModelSource, tokenizer: Tokenizer, max_model_len: int, root: Path) -> Path:
    """The model directory to register: a Hugging Face checkpoint's own, else one written under
    `root` from the GGUF's tokenizer (rewritten each start, so it always matches the file)."""
    if source.kind == "hf_dir":
        return source.path
    config = source.checkpoint.config
    target = root / source.served_name
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(target / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **tokenizer.template_tokens,
    }
    if tokenizer.chat_template:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    eos = list(tokenizer.eos_token_ids)
    files = {
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos},
        "config.json": {
            # A description for Dynamo's frontend (context, special ids); no weights live here.
            "architectures": [f"{config.architecture.capitalize()}ForCausalLM"],
            "model_type": config.architecture,
            "vocab_size": config.vocab_size,
            "max_position_embeddings": max_model_len,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
        },
    }
    for name, content in files.items():
        (target / name).write_text(json.dumps(content, indent=2))
    return target


@dataclass(frozen=True)
class WorkerCard:
    """A worker's self-description in its registration's runtime_data (JSON-safe both ways)."""

    served_name: str
    info: EngineInfo
    profile_id: str
    profile_name: str
    profile_tags: dict[str, Any]
    selection: tuple[str, ...]
    adapters: tuple[str, ...]  # LoRA adapters served at registration (cards do not change)
    vocab_size: int  # the tokenizer's (the router's must match)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerCard:
        info = dict(data["info"])
        info["features"] = EngineFeatures(**info["features"])
        info["paths"] = tuple(PathChoice(**p) for p in info["paths"])
        return cls(
            served_name=data["served_name"],
            info=EngineInfo(**info),
            profile_id=data["profile_id"],
            profile_name=data["profile_name"],
            profile_tags=dict(data["profile_tags"]),
            selection=tuple(data["selection"]),
            adapters=tuple(data["adapters"]),
            vocab_size=int(data["vocab_size"]),
        )
