"""The tensorrt_llm engine's loader: an EngineConfig in, a TrtllmEngine out.

Imported only when a selected profile names tensorrt_llm; tensorrt_llm itself is imported here,
lazily. What the profile and the environment ask for becomes the LLM's arguments, for the backend
that runs it: `llm_kwargs` for the PyTorch backend (`tensorrt_llm.LLM`), `engine_kwargs` for a
built TensorRT engine (`_tensorrt_engine.LLM`, whose arguments class refuses the PyTorch-only
ones). A setting TensorRT-LLM cannot honour is refused at start in one line.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

from service.engine.config import EngineConfig, UnsupportedConfigError
from service.engine.lora_store import LoraStore
from service.engine.protocol import EngineFeatures, EngineInfo, LoadedEngine
from service.engine.trtllm.api import TrtllmApi, TrtllmUnavailableError, import_api
from service.engine.trtllm.engine import TrtllmEngine
from service.engine.trtllm.engine_cache import load_or_build
from service.engine.trtllm.release import release

log = logging.getLogger(__name__)

# TensorRT-LLM's names for q/k/v/o and the MLP projections (its LoraConfig.lora_target_modules).
_LORA_MODULES = ("attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate")
# KV cache dtypes the PyTorch backend's KvCacheConfig.dtype takes ("auto": the model's).
_KV_DTYPES = {"auto": "auto", "fp8": "fp8"}


def load(config: EngineConfig, on_fatal: Callable[[BaseException], None] | None = None) -> LoadedEngine:
    try:
        api = import_api()
    except TrtllmUnavailableError as exc:
        raise UnsupportedConfigError(f"profile {config.profile_name}: {exc}") from exc
    check_config(config, api)
    model_config = config.checkpoint.config
    tokenizer = config.load_tokenizer()
    kwargs = engine_kwargs(config, api) if config.build_engine else llm_kwargs(config, api)
    adapters = None
    if config.lora is not None and (config.lora.source is not None or config.lora.modules):
        adapters = LoraStore.open(config.lora, model_config, config.served_name)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    sampler = release(api.version, built_engine=config.build_engine)
    log.info("%s", sampler.statement())
    info = EngineInfo(
        engine="tensorrt_llm",
        architecture=model_config.architecture,
        max_model_len=max_model_len,
        vocab_size=model_config.vocab_size,
        weight_precision=config.precision,
        precision_mode="native",
        kv_cache_dtype=config.kv_cache.dtype if config.kv_cache.dtype != "auto" else "auto",
        kv_block_size=config.kv_cache.block_size,
        kv_num_blocks=0,  # known from TensorRT-LLM's stats once it runs
        max_num_seqs=config.scheduler.max_num_seqs,  # max_batch_size
        device="cuda:0",
        tensor_parallel_size=config.tensor_parallel_size,
        features=EngineFeatures(
            # a built engine returns logprobs only when built to gather generation logits, which
            # slows every request: not offered there (a 400 says so)
            logprobs=not config.build_engine,
            prompt_logprobs=False,  # not offered through this adapter: refused with a 400
            prefix_caching=config.kv_cache.enable_prefix_caching,
            lora=adapters is not None,
            guided_decoding="guided_decoding_backend" in kwargs,
        ),
        max_loras=config.lora.max_gpu_loras if adapters is not None and config.lora else 0,
    )

    def make_llm() -> Any:
        return load_or_build(api, config, kwargs)

    engine = TrtllmEngine(api, make_llm, info, sampler, adapters=adapters, on_fatal=on_fatal)
    return LoadedEngine(engine=engine, info=info, tokenizer=tokenizer, adapters=adapters)


def check_config(config: EngineConfig, api: TrtllmApi) -> None:
    """Refuse what TensorRT-LLM cannot honour, in one line each."""

    def refuse(why: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(f"profile {config.profile_name} (tensorrt_llm): {why}")

    block = config.kv_cache.block_size
    if config.model_format != "hf_dir":
        raise refuse("TensorRT-LLM loads Hugging Face checkpoint directories, not GGUF files")
    if config.device == "cpu":
        raise refuse("TensorRT-LLM runs on NVIDIA GPUs only; unset NIM_DEVICE=cpu or choose a torch profile")
    if config.kv_cache.dtype not in _KV_DTYPES:
        raise refuse(f"NIM_KV_CACHE_DTYPE={config.kv_cache.dtype}: its KV cache is the model's dtype or fp8")
    if block <= 0 or block & (block - 1):
        raise refuse(
            f"NIM_KV_BLOCK_SIZE={block}: its KV cache blocks hold a power of two tokens (16, 32, ...)"
        )
    if config.guided_decoding_backend not in (None, "xgrammar", "llguidance"):
        raise refuse(
            f"NIM_GUIDED_DECODING_BACKEND={config.guided_decoding_backend}: it takes xgrammar or llguidance"
        )
    if config.fused_kernels:
        raise refuse("NIM_FUSED_KERNELS applies to the torch engine; unset it")
    if not config.unified_attention:
        raise refuse("NIM_UNIFIED_ATTENTION applies to the torch engine; unset it")
    if not (config.fp8_scaled_mm and config.fp8_rows_kernel):
        raise refuse("NIM_FP8_SCALED_MM applies to the torch engine; unset it")
    if not (config.compact_logits and config.w8a8_logits):
        raise refuse("NIM_COMPACT_LOGITS applies to the torch engine; unset it")
    if not config.dense_prompt_rows:
        raise refuse("NIM_DENSE_PROMPT_ROWS applies to the torch engine; unset it")
    if not config.w4a8_int4:
        raise refuse("NIM_CPU_INT4_KERNEL applies to the torch engine on the CPU; unset it")
    if not config.cpu_fused_ops:
        raise refuse("NIM_CPU_FUSED_OPS applies to the torch engine on the CPU; unset it")
    if config.speculative is not None:
        raise refuse(
            "NIM_SPECULATIVE_CONFIG / NIM_DRAFT_MODEL_PATH: speculative decoding is not passed to "
            "TensorRT-LLM yet (its NGramDecodingConfig is unchecked here); use a torch profile or unset them"
        )
    if config.num_threads is not None:
        raise refuse("NIM_NUM_THREADS applies to the torch engine on the CPU; unset it")
    if config.collective_timeout_s is not None:
        raise refuse("NIM_COLLECTIVE_TIMEOUT_SECONDS applies to the torch engine; unset it")
    if config.lora is not None and config.lora.source is None and not config.lora.modules:
        raise refuse("a LoRA profile needs NIM_PEFT_SOURCE")
    if config.lora is not None and api.LoraConfig is None:
        raise refuse(f"tensorrt_llm {api.version} has no LoraConfig this adapter can find")
    if not config.build_engine:
        return
    if not api.can_build_engines:
        raise refuse(
            f"the profile asks for a built TensorRT engine, but tensorrt_llm {api.version} cannot build "
            "engines (tensorrt_llm._tensorrt_engine is gone from 1.3 on); choose its PyTorch-backend profile"
        )
    if config.kv_cache.dtype == "fp8":
        raise refuse("an fp8 KV cache in a built engine needs a quantization config; use the PyTorch backend")
    if config.lora is not None:
        raise refuse("LoRA in a built engine needs a LoRA plugin built in; use its PyTorch-backend profile")
    if config.guided_decoding_backend == "llguidance":
        raise refuse(
            "a built engine runs structured output with xgrammar only; set NIM_GUIDED_DECODING_BACKEND to it"
        )


def guided_backend(config: EngineConfig) -> str | None:
    """The structured-output backend the LLM is started with, or None: the one asked for, else
    xgrammar where it is installed (the documented default). Without one, structured-output
    requests are a 400 rather than an LLM that compiled grammars support it never uses."""
    if config.guided_decoding_backend is not None:
        return config.guided_decoding_backend
    return "xgrammar" if importlib.util.find_spec("xgrammar") is not None else None


def _kv_cache_config(config: EngineConfig, api: TrtllmApi) -> Any:
    kv = config.kv_cache
    kv_config: dict[str, Any] = {
        "enable_block_reuse": kv.enable_prefix_caching,
        "tokens_per_block": kv.block_size,  # NIM_KV_BLOCK_SIZE (TensorRT-LLM's own default is 32)
    }
    if not config.build_engine:  # the TensorRT backend takes only "auto" (its build fixes the dtype)
        kv_config["dtype"] = _KV_DTYPES[kv.dtype]
    if kv.memory_fraction is not None:
        kv_config["free_gpu_memory_fraction"] = kv.memory_fraction
    if kv.max_tokens is not None:
        kv_config["max_tokens"] = kv.max_tokens
    return api.KvCacheConfig(**kv_config)


def _shared_kwargs(config: EngineConfig, api: TrtllmApi) -> dict[str, Any]:
    """Arguments of BaseLlmArgs that both backends take at run time."""
    kwargs: dict[str, Any] = {
        "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size,
        "dtype": config.dtype,  # the profile's (bf16 / fp16), or auto: the checkpoint's
        "trust_remote_code": False,  # never: only architectures TensorRT-LLM ships run
        "kv_cache_config": _kv_cache_config(config, api),
    }
    backend = guided_backend(config) if api.GuidedDecodingParams is not None else None
    if backend is not None:
        kwargs["guided_decoding_backend"] = backend
    return kwargs


def llm_kwargs(config: EngineConfig, api: TrtllmApi) -> dict[str, Any]:
    """The PyTorch-backend LLM's keyword arguments (everything but the model path)."""
    kwargs = _shared_kwargs(config, api)
    kwargs |= {
        "max_batch_size": config.scheduler.max_num_seqs,
        "max_num_tokens": config.scheduler.max_num_batched_tokens,
        "enable_chunked_prefill": True,
        "enable_iter_perf_stats": True,  # TorchLlmArgs only: the metrics read its iteration stats
    }
    if config.max_model_len is not None:
        kwargs["max_seq_len"] = config.max_model_len
    if config.enforce_eager:
        kwargs["cuda_graph_config"] = None  # TorchLlmArgs only: no CUDA graphs (debugging)
    if config.lora is not None and api.LoraConfig is not None:
        lora = config.lora
        kwargs["lora_config"] = api.LoraConfig(
            lora_dir=[],  # adapters arrive per request (LoRARequest with their path)
            max_lora_rank=lora.max_rank,
            max_loras=lora.max_gpu_loras,
            max_cpu_loras=lora.max_cpu_loras,
            lora_target_modules=list(_LORA_MODULES),
        )
    return kwargs


def engine_kwargs(config: EngineConfig, api: TrtllmApi) -> dict[str, Any]:
    """A built engine's run-time arguments: the shared ones only. Batch and sequence limits are
    the build's (`engine_cache.build_settings`); its iteration stats need no switch; CUDA graphs
    are off in the TensorRT runtime unless built in, so NIM_ENFORCE_EAGER has nothing to turn off."""
    return _shared_kwargs(config, api)
