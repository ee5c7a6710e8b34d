"""The torch engine's entry in the registry: an EngineConfig in, a ready-to-start engine out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from service.engine import triton_support
from service.engine.config import EngineConfig, KVCacheConfig, UnsupportedConfigError
from service.engine.models import quant_cache
from service.engine.models.config import ModelConfig
from service.engine.models.cpu_linear import prepacking_supported
from service.engine.models.loader import (
    DEFAULT_INT4_GROUP,
    build_model,
    load_gguf,
    load_hf_dir,
    quantizes_at_load,
)
from service.engine.models.quant import QuantizationError
from service.engine.precision import FLOAT_PRECISIONS, precision_mode
from service.engine.protocol import EngineFeatures, EngineInfo, LoadedEngine
from service.engine.torch.engine import TorchEngine, TorchEngineConfig
from service.engine.torch.kv_pool import KVCacheSpec
from service.hardware import available_cpu_count, choose_device, choose_dtype, free_memory_bytes
from service.tokenizer import Tokenizer
from service.util import cdiv

log = logging.getLogger(__name__)

PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Share of free memory (after weights are loaded) the KV cache takes by default.
DEFAULT_KV_FRACTION = {"cuda": 0.9, "cpu": 0.1}


class KVCacheTooSmallError(UnsupportedConfigError):
    """The configured KV cache cannot hold even one full-context sequence."""


def load(config: EngineConfig, on_fatal: Callable[[BaseException], None] | None = None) -> LoadedEngine:
    """The registry's hook: load weights and tokenizer (blocking: call from a worker thread)."""
    engine = build_engine(config, on_fatal)
    return LoadedEngine(engine=engine, info=engine.info, tokenizer=engine.tokenizer)


def build_engine(
    config: EngineConfig, on_fatal: Callable[[BaseException], None] | None = None
) -> TorchEngine:
    device = choose_device(config.device)
    dtype = choose_dtype(config.dtype, device)
    if config.fused_kernels and (device.type != "cuda" or not triton_support.available()):
        raise UnsupportedConfigError(
            "NIM_FUSED_KERNELS=1 needs a CUDA device and triton; unset it to run PyTorch's ops"
        )
    if device.type == "cpu":
        torch.set_num_threads(config.num_threads or available_cpu_count())
    started = time.monotonic()
    quantized = config.precision not in FLOAT_PRECISIONS
    if quantized and config.precision == "fp8" and device.type == "cuda" and dtype == torch.float32:
        raise UnsupportedConfigError("fp8 profiles compute in bf16 or fp16 on CUDA; unset NIM_DTYPE=float32")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    mode = precision_mode(config.precision, device.type, capability)
    try:
        if config.model_format == "gguf":
            model_config, weights = load_gguf(config.model_path, config.precision)
            tokenizer = Tokenizer.from_gguf(config.model_path)
        else:
            model_config, weights = load_hf_dir(config.model_path, config.precision)
            tokenizer = Tokenizer.from_directory(config.model_path)
        max_model_len = context_length(model_config, config.max_model_len)
        writer = None
        if config.weight_cache_dir is not None and quantizes_at_load(
            config.model_path, config.model_format, config.precision
        ):
            entry = config.weight_cache_dir / quant_cache.cache_key(
                config.model_path, config.precision, {"int4_group": DEFAULT_INT4_GROUP, "gguf_group": 32}
            )
            cached = quant_cache.read(entry)
            if cached is not None:
                weights = cached
            else:
                writer = quant_cache.Writer(entry, config.model_path, config.precision)
                weights = writer.wrap(weights)
        model = build_model(model_config, weights, dtype, device)
        if writer is not None:
            writer.commit()
    except QuantizationError as error:
        raise UnsupportedConfigError(f"profile {config.profile_name}: {error}") from error
    if config.fused_kernels:
        model.use_fused_kernels()
    if prepacking_supported(dtype, device):
        model.prepack_for_cpu()
    log.info(
        "loaded %s (%s, %d layers) on %s, %s weights (%s, %.0f MB read per step), %s activations, "
        "context %d, in %.1f s",
        config.model_path,
        model_config.architecture,
        model_config.num_layers,
        device,
        config.precision if quantized else PRECISION_NAMES[dtype],
        mode,
        model.weight_nbytes() / 1e6,
        dtype,
        max_model_len,
        time.monotonic() - started,
    )
    kv_spec = KVCacheSpec(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=config.kv_cache.block_size,
        cache_dtype=config.kv_cache.dtype,
        model_dtype=dtype,
    )
    num_blocks = size_kv_cache(kv_spec, config.kv_cache, config.scheduler.max_num_seqs, device, max_model_len)
    decode_kernel = device.type == "cuda" and decode_kernel_supported(kv_spec)
    engine_config = TorchEngineConfig(
        max_model_len=max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        num_blocks=num_blocks,
        kv_spec=kv_spec,
        enable_prefix_caching=config.kv_cache.enable_prefix_caching,
        device=device,
        dtype=dtype,
        decode_kernel=decode_kernel,
        cuda_graphs=decode_kernel and not config.enforce_eager,
    )
    info = EngineInfo(
        engine="torch",
        architecture=model_config.architecture,
        max_model_len=max_model_len,
        vocab_size=model_config.vocab_size,
        weight_precision=config.precision if quantized else PRECISION_NAMES[dtype],
        precision_mode=mode,
        kv_cache_dtype=kv_spec.name,
        kv_block_size=kv_spec.block_size,
        kv_num_blocks=num_blocks,
        device=str(device),
        tensor_parallel_size=1,
        features=EngineFeatures(prefix_caching=config.kv_cache.enable_prefix_caching),
    )
    return TorchEngine(model, model_config, tokenizer, engine_config, info, on_fatal=on_fatal)


def decode_kernel_supported(spec: KVCacheSpec) -> bool:
    """Whether decodes can attend through the Triton kernel (and so run as CUDA graphs): it needs
    triton, and an fp8 cache needs a GPU that converts fp8 (compute capability 8.9+)."""
    if not triton_support.available():
        log.warning("triton is not installed: decodes gather the cache and run eagerly, without graphs")
        return False
    if spec.cache_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        log.warning("fp8 KV cache before compute capability 8.9: decodes gather the cache, no graphs")
        return False
    return True


def context_length(model: ModelConfig, requested: int | None) -> int:
    """The context served: the model's own (or NIM_MAX_MODEL_LEN when shorter), never past what
    its attention computes exactly.

    Sliding-window models (Mistral 7B v0.1: each token sees the last 4,096) are served with full
    attention, which is exact while the context fits the window: the default context is capped
    at the window, and a longer NIM_MAX_MODEL_LEN is refused.
    """
    context = model.max_position_embeddings
    if requested is not None:
        if requested > context:
            log.warning(
                "NIM_MAX_MODEL_LEN=%d exceeds the model's context of %d; using %d",
                requested,
                context,
                context,
            )
        context = min(requested, context)
    window = model.sliding_window
    if window is not None and context > window:
        if requested is not None:
            raise UnsupportedConfigError(
                f"NIM_MAX_MODEL_LEN={requested}: this model uses sliding-window attention over "
                f"{window} tokens, which this engine computes exactly only for contexts up to {window}; "
                f"set NIM_MAX_MODEL_LEN<={window}"
            )
        log.warning(
            "this model uses sliding-window attention over %d tokens; serving a context of %d "
            "(full attention is exact within the window) instead of %d",
            window,
            window,
            context,
        )
        context = window
    return context


def size_kv_cache(
    spec: KVCacheSpec, kv: KVCacheConfig, max_num_seqs: int, device: torch.device, max_model_len: int
) -> int:
    """Number of KV blocks: a share of free memory, capped by an explicit token count and by
    what max_num_seqs full-context sequences could ever use. Logged, since it bounds concurrency.
    """
    fraction = kv.memory_fraction
    if fraction is None:
        fraction = DEFAULT_KV_FRACTION[device.type]
    budget_tokens = int(free_memory_bytes(device) * fraction) // spec.bytes_per_token()
    caps = [budget_tokens, max_num_seqs * max_model_len]
    if kv.max_tokens is not None:
        caps.append(kv.max_tokens)
    num_blocks = min(caps) // spec.block_size
    max_len_blocks = cdiv(max_model_len, spec.block_size)
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
