"""A checkpoint's declared quantization: NVIDIA ModelOpt exports (FP8, NVFP4) as published on the
Hugging Face Hub carry it in ``hf_quant_config.json`` (``{"producer": ..., "quantization":
{"quant_algo": ..., ...}}``) or in config.json's ``quantization_config`` (``quant_method:
modelopt``). Read here from the files alone; service.engine.models.modelopt reads the weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class QuantizationError(ValueError):
    """A quantized tensor or checkpoint is malformed or cannot be used; the message names it."""


HF_QUANT_CONFIG = "hf_quant_config.json"
# quant_algo -> the profile precision tag it serves.
SUPPORTED_ALGOS = {"FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8", "NVFP4": "nvfp4"}


@dataclass(frozen=True)
class CheckpointQuantization:
    quant_algo: str
    precision: str  # fp8 | nvfp4
    kv_cache_quant_algo: str | None = None
    group_size: int | None = None


def checkpoint_quantization(path: Path, config: dict[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's quantization (None for an unquantized one); unsupported methods raise."""
    settings: dict[str, Any] | None = None
    quant_file = path / HF_QUANT_CONFIG
    if quant_file.is_file():
        settings = json.loads(quant_file.read_text()).get("quantization")
        if not isinstance(settings, dict):
            raise QuantizationError(f"{quant_file}: no 'quantization' object")
    elif isinstance(config.get("quantization_config"), dict):
        settings = config["quantization_config"]
        method = str(settings.get("quant_method", "")).lower()
        if method != "modelopt":
            raise QuantizationError(
                f"{path / 'config.json'}: quantization method {method or '(none)'!r} is not supported; "
                "this engine reads NVIDIA ModelOpt checkpoints (FP8, FP8_PER_CHANNEL_PER_TOKEN, NVFP4) "
                "and unquantized ones"
            )
    if settings is None:
        return None
    algo = str(settings.get("quant_algo") or "")
    if algo not in SUPPORTED_ALGOS:
        raise QuantizationError(
            f"{path}: ModelOpt quant_algo {algo or '(none)'!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ALGOS)}"
        )
    group = settings.get("group_size")
    if algo == "NVFP4" and group not in (None, 16):
        raise QuantizationError(f"{path}: NVFP4 with group_size {group} is not supported (16 is)")
    kv_algo = settings.get("kv_cache_quant_algo")
    return CheckpointQuantization(algo, SUPPORTED_ALGOS[algo], kv_algo, group)
