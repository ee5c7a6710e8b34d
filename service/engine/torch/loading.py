"""Build a ready-to-start TorchEngine from a resolved model source."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import torch

from service.config import Settings
from service.engine.models.config import ModelConfig
from service.engine.models.cpu_linear import prepacking_supported
from service.engine.models.loader import build_model, load_gguf, load_safetensors_dir
from service.engine.torch.engine import EngineConfig, TorchEngine
from service.engine.torch.kv_pool import KVCacheSpec
from service.hardware import available_cpu_count, choose_device, choose_dtype, free_memory_bytes
from service.metrics import Metrics
from service.model_store import ModelSource
from service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Share of free memory (after weights are loaded) the KV cache takes by default.
DEFAULT_KV_FRACTION = {"cuda": 0.9, "cpu": 0.1}


class KVCacheTooSmallError(ValueError):
    """The configured KV cache cannot hold even one full-context sequence."""


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
    if prepacking_supported(dtype, device):
        model.prepack_for_cpu()
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
    kv_spec = KVCacheSpec(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=settings.kv_block_size,
        cache_dtype=settings.kv_cache_dtype,
        model_dtype=dtype,
    )
    num_blocks = size_kv_cache(kv_spec, settings, device, max_model_len)
    config = EngineConfig(
        max_model_len=max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        num_blocks=num_blocks,
        kv_spec=kv_spec,
        enable_prefix_caching=settings.enable_kv_cache_reuse,
        device=device,
        dtype=dtype,
    )
    return TorchEngine(model, model_config, tokenizer, config, metrics=metrics, on_fatal=on_fatal)


def size_kv_cache(spec: KVCacheSpec, settings: Settings, device: torch.device, max_model_len: int) -> int:
    """Number of KV blocks: a share of free memory, capped by an explicit token count and by
    what max_num_seqs full-context sequences could ever use. Logged, since it bounds concurrency.
    """
    fraction = settings.kv_cache_fraction
    if fraction is None:
        fraction = DEFAULT_KV_FRACTION[device.type]
    budget_tokens = int(free_memory_bytes(device) * fraction) // spec.bytes_per_token()
    caps = [budget_tokens, settings.max_num_seqs * max_model_len]
    if settings.kv_cache_max_tokens is not None:
        caps.append(settings.kv_cache_max_tokens)
    num_blocks = min(caps) // spec.block_size
    max_len_blocks = -(-max_model_len // spec.block_size)
    if num_blocks < max_len_blocks:
        raise KVCacheTooSmallError(
            f"the KV cache holds {num_blocks * spec.block_size} tokens, fewer than one {max_model_len}-token "
            "sequence: lower NIM_MAX_MODEL_LEN, raise NIM_KV_CACHE_PERCENT / NIM_KV_CACHE_MAX_TOKENS, "
            "or use NIM_KV_CACHE_DTYPE=int8"
        )
    tokens = num_blocks * spec.block_size
    log.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%s, %d bytes/token, %.2f GiB); "
        "%d sequences of the full %d-token context fit",
        num_blocks,
        spec.block_size,
        tokens,
        spec.name,
        spec.bytes_per_token(),
        tokens * spec.bytes_per_token() / 2**30,
        tokens // max_model_len,
        max_model_len,
    )
    return num_blocks
