"""Build a ready-to-start TorchEngine from a resolved model source."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import torch

from service.config import Settings
from service.engine.models.config import ModelConfig
from service.engine.models.loader import build_model, load_gguf, load_safetensors_dir
from service.engine.torch.engine import EngineConfig, TorchEngine
from service.hardware import available_cpu_count, choose_device, choose_dtype
from service.metrics import Metrics
from service.model_store import ModelSource
from service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def load_torch_engine(
    source: ModelSource,
    settings: Settings,
    metrics: Metrics | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> TorchEngine:
    """Load weights and tokenizer (blocking: call from a worker thread, not the event loop)."""
    device = choose_device(settings.device)
    dtype = choose_dtype(settings.dtype, device)
    if device.type == "cpu":
        torch.set_num_threads(settings.num_threads or available_cpu_count())
    started = time.monotonic()
    if source.kind == "gguf":
        model_config, weights = load_gguf(source.path)
        tokenizer = Tokenizer.from_gguf(source.path)
    else:
        model_config = ModelConfig.from_hf_config(json.loads((source.path / "config.json").read_text()))
        weights = load_safetensors_dir(source.path)
        tokenizer = Tokenizer.from_directory(source.path)
    model = build_model(model_config, weights, dtype, device)
    max_model_len = model_config.max_position_embeddings
    if settings.max_model_len is not None:
        if settings.max_model_len > max_model_len:
            log.warning(
                "NIM_MAX_MODEL_LEN=%d exceeds the model's context of %d; using %d",
                settings.max_model_len,
                max_model_len,
                max_model_len,
            )
        max_model_len = min(settings.max_model_len, max_model_len)
    log.info(
        "loaded %s (%s, %d layers) on %s in %s, context %d, in %.1f s",
        source.path,
        model_config.architecture,
        model_config.num_layers,
        device,
        dtype,
        max_model_len,
        time.monotonic() - started,
    )
    config = EngineConfig(
        max_model_len=max_model_len, max_num_seqs=settings.max_num_seqs, device=device, dtype=dtype
    )
    return TorchEngine(model, model_config, tokenizer, config, metrics=metrics, on_fatal=on_fatal)
