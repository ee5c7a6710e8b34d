"""The torch engine's entry in the registry: an EngineConfig in, a ready-to-start engine out."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import torch

from service.engine.config import EngineConfig, UnsupportedConfigError
from service.engine.guided.specs import xgrammar_available
from service.engine.lora_store import LoraStore
from service.engine.models.loader import (
    quantizes_at_load,
)
from service.engine.models.tensor_parallel import TPLayout
from service.engine.precision import FLOAT_PRECISIONS
from service.engine.protocol import EngineFeatures, EngineInfo, LoadedEngine
from service.engine.torch.core import TorchEngineConfig, TorchEngineCore
from service.engine.torch.engine import TorchEngine
from service.engine.torch.rank_loading import (
    PRECISION_NAMES,
    load_rank,
    read_weights,
    resolve_device,
    resolve_step_limits,
)
from service.engine.torch.rank_loading import context_length as context_length  # tests import it here
from service.engine.torch.speculative.draft import check_draft, load_draft
from service.engine.torch.tp_group import RankSetup, TPGroup
from service.host import available_cpu_count
from service.logs import JSONLinesFormatter
from service.model.config import UnsupportedModelError
from service.model.quantization import QuantizationError

log = logging.getLogger(__name__)


def load(config: EngineConfig, on_fatal: Callable[[BaseException], None] | None = None) -> LoadedEngine:
    """The registry's hook: load weights and tokenizer (blocking: call from a worker thread)."""
    engine = build_engine(config, on_fatal)
    return LoadedEngine(engine=engine, info=engine.info, tokenizer=engine.tokenizer, adapters=engine.adapters)


def load_core(config: EngineConfig) -> TorchEngineCore:
    """The registry's hook for the engine process, which drives the core itself."""
    return build_core(config)


def build_engine(
    config: EngineConfig, on_fatal: Callable[[BaseException], None] | None = None
) -> TorchEngine:
    """The core, served in this process (started by the caller: `await engine.start()`)."""
    return TorchEngine(build_core(config), on_fatal)


def check_guided(config: EngineConfig) -> None:
    """NIM_GUIDED_DECODING_BACKEND: xgrammar is this engine's; it must be installed when named."""
    backend = config.guided_decoding_backend
    if backend is None:
        return
    if backend != "xgrammar":
        raise UnsupportedConfigError(
            f"NIM_GUIDED_DECODING_BACKEND={backend}: the torch engine constrains output with xgrammar only"
        )
    if not xgrammar_available():
        raise UnsupportedConfigError(
            "NIM_GUIDED_DECODING_BACKEND=xgrammar, but xgrammar is not installed "
            "(pip install 'nim-torch[structured]')"
        )


def check_lora(config: EngineConfig) -> None:
    """Refuse LoRA settings this engine cannot honour, before anything loads."""
    lora = config.lora
    if lora is None:
        return
    if lora.source is None and not lora.modules:
        raise UnsupportedConfigError(
            f"profile {config.profile_name} serves LoRA adapters: set NIM_PEFT_SOURCE to their directory"
        )


def check_experts(config: EngineConfig) -> None:
    """Mixture-of-experts models run float weights and int8_wo, int4_wo and fp8 experts quantized
    at load from a float checkpoint (on one rank or tensor-parallel; LoRA on their attention
    projections, lora.py refuses adapters on experts): refuse nvfp4 and ModelOpt-quantized
    checkpoints in one line, before anything loads (a dense model passes)."""
    if config.model_format != "hf_dir":
        return  # GGUF: ModelConfig.from_gguf refuses the MoE architectures (none is registered)
    try:
        model_config, _ = read_weights(config)  # the weights are not read
    except (QuantizationError, UnsupportedModelError) as error:
        raise UnsupportedConfigError(f"profile {config.profile_name}: {error}") from error
    if model_config.num_experts == 0 or config.precision in FLOAT_PRECISIONS:
        return
    why = None
    if config.precision == "nvfp4":
        why = "nvfp4 experts are not supported"
    elif not quantizes_at_load(config.checkpoint, config.model_format, config.precision):
        why = "a ModelOpt-quantized checkpoint of one is not supported"
    if why is not None:
        raise UnsupportedConfigError(
            f"profile {config.profile_name}: {model_config.architecture} is a mixture-of-experts model; "
            f"{why}: its experts run int8_wo, int4_wo or fp8 quantized at load from a float checkpoint"
        )


def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse a tensor-parallel size the model does not divide into, before any rank starts."""
    try:
        model_config, _ = read_weights(config)  # the weights are not read
        TPLayout(model_config, 0, config.tensor_parallel_size)
    except (QuantizationError, UnsupportedModelError) as error:
        raise UnsupportedConfigError(f"profile {config.profile_name}: {error}") from error


def build_core(config: EngineConfig) -> TorchEngineCore:
    device, dtype = resolve_device(config)
    check_draft(config.speculative, config.tensor_parallel_size)
    config = resolve_step_limits(config, device)  # unset NIM_MAX_NUM_SEQS etc.: this device's defaults
    check_lora(config)
    check_guided(config)
    check_experts(config)
    size = config.tensor_parallel_size
    threads = config.num_threads or available_cpu_count()
    if device.type == "cpu":
        # Tensor-parallel ranks on one host share its cores.
        torch.set_num_threads(max(1, threads // size))
    group = None
    if size > 1:
        check_tensor_parallel(config)
        root = logging.getLogger()
        setup = RankSetup(
            config=config,
            size=size,
            rendezvous_port=free_local_port(),
            threads=max(1, threads // size),
            log_level=root.getEffectiveLevel(),
            jsonl_logs=any(isinstance(h.formatter, JSONLinesFormatter) for h in root.handlers),
        )
        group = TPGroup(setup, device)
    try:
        if group is not None:
            group.join()
        loaded = load_rank(config, device, dtype, 0, size)
        tokenizer = config.load_tokenizer()
        draft = None
        if config.speculative is not None and config.speculative.method == "draft_model":
            # before the KV cache is sized: the draft's weights take their memory first
            draft = load_draft(config, device, dtype, loaded.model_config, tokenizer, loaded.max_model_len)
        adapters = None
        if loaded.lora is not None and config.lora is not None:
            adapters = LoraStore.open(config.lora, loaded.model_config, config.served_name)
            log.info("LoRA device slots: %.1f MB", loaded.lora.nbytes / 1e6)
        num_blocks = loaded.propose_blocks(config, size)
        if group is not None:
            num_blocks = group.agree_blocks(num_blocks)
    except BaseException:
        if group is not None:
            group.shutdown()
        raise
    engine_config = TorchEngineConfig(
        max_model_len=loaded.max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        num_blocks=num_blocks,
        kv_spec=loaded.kv_spec,
        enable_prefix_caching=config.kv_cache.enable_prefix_caching,
        device=device,
        dtype=dtype,
        decode_kernel=loaded.decode_kernel,
        enforce_eager=config.enforce_eager,  # the engine's decode path decides the rest, once
        unified_attention=config.unified_attention,
        guided=config.guided,
        record_kv_events=config.kv_cache.record_events,
        speculative=config.speculative,
    )
    quantized = config.precision not in FLOAT_PRECISIONS
    info = EngineInfo(
        engine="torch",
        architecture=loaded.model_config.architecture,
        max_model_len=loaded.max_model_len,
        vocab_size=loaded.model_config.vocab_size,
        weight_precision=config.precision if quantized else PRECISION_NAMES[dtype],
        precision_mode=loaded.mode,
        kv_cache_dtype=loaded.kv_spec.name,
        kv_block_size=loaded.kv_spec.block_size,
        kv_num_blocks=num_blocks,
        device=str(device),
        tensor_parallel_size=size,
        features=EngineFeatures(
            prefix_caching=config.kv_cache.enable_prefix_caching,
            lora=adapters is not None,
            guided_decoding=xgrammar_available(),
        ),
        max_loras=loaded.lora.num_slots if loaded.lora is not None else 0,
        max_num_seqs=config.scheduler.max_num_seqs,
        activation_dtype=str(dtype).removeprefix("torch."),
        paths=loaded.paths,  # the engine adds its decode path's
    )
    return TorchEngineCore(
        loaded.model,
        loaded.model_config,
        tokenizer,
        engine_config,
        info,
        tp_group=group,
        adapters=adapters,
        lora_slots=loaded.lora,
        draft=draft,
    )


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
