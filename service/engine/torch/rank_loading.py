"""One rank's model and KV-cache sizing: what every rank builds, rank 0 in the engine's process
(service.engine.torch.loading) and the tensor-parallel worker ranks (service.engine.torch.tp_group).

Nothing here builds an engine, so tp_group imports it at module level and the engine's imports
stay a tree: engine -> tp_group -> rank_loading; loading -> engine, tp_group, rank_loading.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from service.engine import triton_support
from service.engine.config import EngineConfig, KVCacheConfig, UnsupportedConfigError, step_defaults
from service.engine.models import quant_cache, triton_fp8
from service.engine.models.base import BuildOptions, CausalLM, LogitsFormat, TensorParallel
from service.engine.models.cpu_linear import half_packing_problem
from service.engine.models.loader import (
    DEFAULT_INT4_GROUP,
    build_model,
    hf_dir_shards,
    load_gguf,
    load_hf_dir,
    quantizes_at_load,
)
from service.engine.models.tensor_parallel import ProcessGroupCollectives, TPLayout, Weight, shard_weights
from service.engine.models.w8a8 import OUTLIERS, w8a8_problem
from service.engine.native import q8
from service.engine.precision import FLOAT_PRECISIONS, PRECISION_SPECS, Mode, precision_mode
from service.engine.protocol import PathChoice
from service.engine.torch import cpu_fused_ops, int4_kernel
from service.engine.torch.cuda_graphs import batch_buckets
from service.engine.torch.decode_path import DecodeOptions, captures_graphs
from service.engine.torch.dense_prompts import dense_prompt_path
from service.engine.torch.device import choose_device, choose_dtype, free_memory_bytes
from service.engine.torch.kv_pool import KVCacheSpec
from service.engine.torch.lora_slots import LoraSlots
from service.engine.torch.memory_budget import CudaStepProbe, MemoryBudget, Reservations, budget, reserve
from service.engine.torch.startup_checks import (
    COMPACT_LOGITS_SETTING,
    FP8_ROWS_SETTING,
    FP8_SETTING,
    FUSED_SETTING,
    WEIGHT_ONLY_LOGITS_SETTING,
    check_fp8_rows_kernel,
    check_fp8_scaled_mm,
    check_fused_kernels,
    token_counts,
    use_emulated_fp8,
    use_fp8_rows_kernel,
)
from service.model.config import ModelConfig, UnsupportedModelError
from service.model.quantization import QuantizationError
from service.util import cdiv

log = logging.getLogger(__name__)

PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Share of free memory (after weights are loaded) the KV cache takes by default; on CUDA (one
# rank) the share holds the largest step's activations and the decode graphs too, measured and
# subtracted before the pool takes the rest (service.engine.torch.memory_budget).
DEFAULT_KV_FRACTION = {"cuda": 0.9, "cpu": 0.1}


class KVCacheTooSmallError(UnsupportedConfigError):
    """The configured KV cache cannot hold even one full-context sequence."""


def resolve_device(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and activation dtype `config` asks for, refusing combinations that cannot run."""
    device = choose_device(config.device)
    dtype = choose_dtype(config.dtype, device)
    if config.fused_kernels and (device.type != "cuda" or not triton_support.available()):
        raise UnsupportedConfigError(
            "NIM_FUSED_KERNELS=1 needs a CUDA device and triton; unset it to run PyTorch's ops"
        )
    if config.precision == "fp8" and device.type == "cuda" and dtype == torch.float32:
        raise UnsupportedConfigError("fp8 profiles compute in bf16 or fp16 on CUDA; unset NIM_DTYPE=float32")
    size = config.tensor_parallel_size
    if size == 1 and config.collective_timeout_s is not None:
        raise UnsupportedConfigError(
            f"NIM_COLLECTIVE_TIMEOUT_SECONDS applies to tensor parallelism; profile {config.profile_name} "
            "runs one rank: unset it"
        )
    if size > 1 and device.type == "cuda" and torch.cuda.device_count() < size:
        raise UnsupportedConfigError(
            f"tensor parallelism {size} needs {size} GPUs; {torch.cuda.device_count()} are visible"
        )
    return device, dtype


@dataclass(frozen=True)
class RankLoad:
    """One rank's model (the whole model when there is one rank) and what its KV pool holds."""

    model: CausalLM
    model_config: ModelConfig  # the whole model's
    kv_spec: KVCacheSpec  # this rank's kv heads
    max_model_len: int
    mode: Mode  # how the weight precision runs
    decode_kernel: bool  # decodes attend through the Triton paged kernel (CUDA)
    lora: LoraSlots | None = None  # the model's LoRA device slots (this rank's shards)
    paths: tuple[PathChoice, ...] = ()  # fp8 _scaled_mm and fused kernels: used, or why not

    def propose_blocks(self, config: EngineConfig, ranks: int) -> int:
        """KV blocks this rank can hold; on the CPU, `ranks` ranks share the host's memory. On
        CUDA with one rank, after what the largest step and the decode graphs need (measured)."""
        device = self.model.device
        share = ranks if device.type == "cpu" else 1
        return size_kv_cache(
            self.kv_spec,
            config.kv_cache,
            config.scheduler.max_num_seqs,
            device,
            self.max_model_len,
            share,
            self.reservations(config, ranks),
        )

    def reservations(self, config: EngineConfig, ranks: int) -> Callable[[], Reservations] | None:
        """What measures the memory set aside before the pool: CUDA with one rank only."""
        device = self.model.device
        if device.type != "cuda" or ranks > 1:
            return None
        limits = config.scheduler
        graphs = decode_graph_batches(config, device, self.decode_kernel, self.max_model_len)
        probe = CudaStepProbe(self.model, self.kv_spec, device, self.decode_kernel, self.lora)

        def measure() -> Reservations:
            return reserve(
                probe,
                limits.max_num_batched_tokens,
                limits.max_num_seqs,
                self.max_model_len,
                self.model_config.vocab_size,
                graphs,
            )

        return measure


def decode_graph_batches(
    config: EngineConfig, device: torch.device, kernel: bool, max_model_len: int, ranks: int = 1
) -> list[int]:
    """The batch sizes the engine will capture decode graphs for; [] where it captures none.
    The largest is max_num_seqs, or the token budget when smaller: a decode step never holds more
    sequences than it has tokens (the engine builds its DecodeOptions the same way)."""
    limits = config.scheduler
    decodes = min(limits.max_num_seqs, limits.max_num_batched_tokens)
    options = DecodeOptions(kernel, config.enforce_eager, decodes, max_model_len, ranks > 1)
    return batch_buckets(decodes) if captures_graphs(device, options) else []


def resolve_step_limits(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with unset NIM_MAX_NUM_SEQS / NIM_MAX_NUM_BATCHED_TOKENS resolved for `device`
    (once, before any rank loads: worker ranks receive the result), logged."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        defaults = step_defaults("cuda", props.total_memory, props.name)
    else:
        defaults = step_defaults("cpu")
    limits = config.scheduler.for_device(defaults)
    log.info("%s", limits.describe())
    return replace(config, scheduler=limits)


def read_weights(config: EngineConfig) -> tuple[ModelConfig, Iterator[tuple[str, Weight]]]:
    """The checkpoint's config (as inspected in planning), and its weights in the profile's
    precision (read lazily)."""
    if config.model_format == "gguf":
        return load_gguf(config.checkpoint, config.precision)
    return load_hf_dir(config.checkpoint, config.precision)


def load_rank(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    rank: int = 0,
    size: int = 1,
) -> RankLoad:
    """Read this rank's weights (its shard, one checkpoint tensor at a time, when `size` > 1:
    the caller has joined the process group) and build its model."""
    started = time.monotonic()
    quantized = config.precision not in FLOAT_PRECISIONS
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    mode = precision_mode(config.precision, device.type, capability)
    try:
        model_config, weights = read_weights(config)
        max_model_len = context_length(model_config, config.max_model_len)
        layout = TPLayout(model_config, rank, size) if size > 1 else None
        shards = None
        if layout is not None and config.model_format == "hf_dir":
            shards = hf_dir_shards(config.checkpoint, config.precision, layout)
        writer = None
        if config.weight_cache_dir is not None and quantizes_at_load(
            config.checkpoint, config.model_format, config.precision
        ):
            entry = config.weight_cache_dir / quant_cache.cache_key(
                config.model_path, config.precision, {"int4_group": DEFAULT_INT4_GROUP, "gguf_group": 32}
            )
            cached = quant_cache.read(entry)
            if cached is not None:
                weights = cached
            elif layout is None:  # the writer keeps a whole copy: never under tensor parallelism
                writer = quant_cache.Writer(entry, config.model_path, config.precision)
                weights = writer.wrap(weights)
        local_config = model_config if layout is None else layout.local_config()
        fused = _fused_path(local_config, config, dtype, device)  # checked before the model is built
        parallel = TensorParallel(ProcessGroupCollectives(), layout) if layout is not None else None
        logits, logits_format = _logits_path(config, device, dtype, model_config.hidden_size)
        kernel, kernel_reason = int4_kernel.choose(config.precision, device, config.w4a8_int4)
        cpu_fused = cpu_fused_ops.choose(device, config.cpu_fused_ops)
        options = BuildOptions(
            tensor_parallel=parallel,
            fused_kernels=fused.used,
            prepack_cpu=True,
            logits_format=logits_format,
            int_kernels_in_bf16=device.type == "cpu" and dtype == torch.float32,
            int4_kernel=kernel,
            cpu_fused_ops=cpu_fused.used,
        )
        if layout is None:
            model = build_model(model_config, weights, dtype, device, options)
        else:
            # Only this rank's bytes where the files hold the weights as used; else one whole
            # tensor at a time, sliced (`weights`, a lazy stream, is then read instead).
            local = shards if shards is not None else shard_weights(weights, layout)
            model = build_model(local_config, local, dtype, device, options)
        if writer is not None:
            writer.commit()
    except QuantizationError as error:
        raise UnsupportedConfigError(f"profile {config.profile_name}: {error}") from error
    except UnsupportedModelError as error:
        raise UnsupportedConfigError(f"profile {config.profile_name}: {error}") from error
    fp8, mode = _fp8_path(model, config, mode)
    dense = dense_prompt_path(model, config.dense_prompt_rows, device, dtype, layout is not None)
    kernels = (int4_kernel.path(model, kernel, kernel_reason), cpu_fused_ops.path(model, cpu_fused))
    paths = (fp8, fused, logits, *kernels, dense)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what the checks allocated is free memory again for the KV cache
    log.info(
        "loaded %s (%s, %d layers)%s on %s, %s weights (%s, %.0f MB read per step), %s activations, "
        "context %d, in %.1f s",
        config.model_path,
        model_config.architecture,
        model_config.num_layers,
        "" if layout is None else f" rank {rank} of {size}",
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
        num_kv_heads=model.config.num_kv_heads,  # this rank's
        head_dim=model_config.head_dim,
        block_size=config.kv_cache.block_size,
        cache_dtype=config.kv_cache.dtype,
        model_dtype=dtype,
    )
    decode_kernel = device.type == "cuda" and decode_kernel_supported(kv_spec)
    lora = None
    if config.lora is not None:  # before the KV cache takes its share of memory
        lora = LoraSlots.attach(model, config.lora.max_gpu_loras, config.lora.max_rank, layout)
    return RankLoad(model, model_config, kv_spec, max_model_len, mode, decode_kernel, lora, paths)


def _fp8_path(model: CausalLM, config: EngineConfig, mode: Mode) -> tuple[PathChoice, Mode]:
    """Whether fp8 layers run torch._scaled_mm (checked against their emulation first), and the
    precision mode that leaves."""

    def chosen(used: bool, reason: str) -> PathChoice:
        return PathChoice("fp8_scaled_mm", used, reason, FP8_SETTING)

    if config.precision != "fp8":
        return chosen(False, f"the profile's weights are {config.precision}, not fp8"), mode
    if mode != "native":
        return chosen(False, "fp8 runs emulated here: _scaled_mm needs a CUDA GPU of compute capability "
                      "8.9+"), mode  # fmt: skip
    if not config.fp8_scaled_mm:
        use_emulated_fp8(model)
        return chosen(False, f"{FP8_SETTING}: fp8 weights are dequantized for each matmul"), "emulated"
    started = time.monotonic()
    budget = config.scheduler.max_num_batched_tokens
    why = check_fp8_scaled_mm(model, budget)
    if why is not None:
        use_emulated_fp8(model)
        log.warning("%s; fp8 layers run emulated (%s skips the check)", why, FP8_SETTING)
        return chosen(False, f"{why}; running the proven path (emulated) instead"), "emulated"
    seconds = time.monotonic() - started
    counts = token_counts(budget)
    rows = _fp8_rows_path(model, config)
    reason = (f"its start-up check agreed with the dequantized matmul for every layer shape at "
              f"{counts[0]} to {counts[-1]} tokens ({seconds:.1f} s); {rows}")  # fmt: skip
    return chosen(True, reason), mode


def _fp8_rows_path(model: CausalLM, config: EngineConfig) -> str:
    """Whether steps of at most triton_fp8.ROWS_MAX rows take the Triton fp8 rows kernel (checked
    against the emulated layers first), in a phrase for the fp8 path's reason."""
    if not config.fp8_rows_kernel:
        return f"{FP8_ROWS_SETTING}: _scaled_mm at every step size"
    if not triton_support.available():
        return "steps of every size through _scaled_mm (the fp8 rows kernel needs triton)"
    started = time.monotonic()
    why = check_fp8_rows_kernel(model)
    if why is not None:
        log.warning("%s; fp8 layers run _scaled_mm at every step size (%s skips the check)",
                    why, FP8_ROWS_SETTING)  # fmt: skip
        return f"{why}; _scaled_mm at every step size instead"
    use_fp8_rows_kernel(model)
    return (f"steps of at most {triton_fp8.ROWS_MAX} rows through the Triton fp8 rows kernel (weight-only, "
            f"no activation quantization; its check agreed, {time.monotonic() - started:.1f} s)")  # fmt: skip


def _logits_path(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, hidden_size: int
) -> tuple[PathChoice, LogitsFormat]:
    """How the logits projection is held (BuildOptions.logits_format), and why. Where the
    profile's layers are weight-only int on the CPU, read in half the bytes of the activation
    dtype or fewer at each step:
    - first choice under either activation dtype (NIM_COMPACT_LOGITS=auto): int8 with one float16
      scale per block of 32 weights, each input row rounded to int8 per block of 32, the products
      summed in integers (native/q8.py's Q8Linear, llama.cpp's Q8_0 head: 1.06 bytes a weight;
      where the native extension builds with AVX2 or AVX-512 VNNI and its start-up check passes).
      Under bf16 activations the embedding is held as int8 rows (one scale a row), as the next two
      hold it; under float32 it stays float32. Measured against the next (bench/README.md "The Q8
      head under bf16 activations"): faster at every batch size on an AVX-512 VNNI host without
      AMX, faster at 1 and 8 rows on an AMX host (oneDNN's AMX int8 leads there from ~32 rows, about
      1% of such a step), and closer to the float head (block scales);
    - else with bf16 activations: int8 with one scale per row, the embedding too, and each input
      row quantized to int8 but for its few largest values, the products summed in integers
      (w8a8.W8A8Linear: oneDNN's int8 matmul, which a start-up probe must find exact and
      batch-invariant on this CPU);
    - else with bf16 activations: the same int8 tables, the input kept in bf16 (aten's int8
      kernel; the logits were computed in bf16 anyway);
    - else float32 activations: float16 through fbgemm, computed and returned in float32. Not
      aten's int8 kernel: it computes in bf16 there (BuildOptions.int_kernels_in_bf16) and would
      round the logits to bf16 (steps of 0.125 at a logit of 20), which flips near-tied greedy
      tokens. Only where a start-up probe finds the kernel and finds it batch-invariant."""

    def chosen(used: bool, reason: str) -> PathChoice:
        return PathChoice("compact_logits", used, reason, COMPACT_LOGITS_SETTING)

    if not PRECISION_SPECS[config.precision].weight_only:
        return chosen(
            False, f"the profile's weights are {config.precision}: the logits stay in the activation dtype"
        ), "float"
    if device.type != "cpu":
        return chosen(False, "the CPU only (its int8 and fbgemm kernels); here the logits stay in the "
                      "activation dtype"), "float"  # fmt: skip
    if not config.compact_logits:
        off = f"off ({COMPACT_LOGITS_SETTING}): the logits stay in the activation dtype"
        return chosen(False, off), "float"
    instead = f"{WEIGHT_ONLY_LOGITS_SETTING}: the input rows are not quantized; "
    if config.w8a8_logits:
        try:
            problem = q8.serving_problem(hidden_size)
        except Exception as error:  # an op that raises (a stale build, say): the next choice instead
            problem = f"the Q8 kernel's check raised {type(error).__name__}: {error}"
        if problem is None:
            rest = (
                f"the embedding stays float32; {WEIGHT_ONLY_LOGITS_SETTING} keeps the input rows in float32 "
                "and the weights in float16"
                if dtype == torch.float32
                else f"the embedding as int8, one scale per row; {WEIGHT_ONLY_LOGITS_SETTING} keeps the "
                "input rows in bf16"
            )
            return chosen(True, "the logits projection as int8 with a float16 scale per block of 32 "
                          "weights, each input row rounded to int8 per block of 32, the products summed "
                          f"in integers (the native Q8 kernel, {q8.isa()}, checked at start; "
                          f"{rest})"), "q8"  # fmt: skip
        log.info("%s; the logits projection takes the next choice", problem)
        instead = f"{problem}, so "
        if dtype != torch.float32:
            w8a8 = w8a8_problem(hidden_size)
            if w8a8 is None:
                return chosen(True, f"{instead}the logits projection and the embedding as int8, one scale "
                              f"per row; each input row quantized to int8, its {OUTLIERS} largest values "
                              "apart (a row of their own), and the products summed in integers (oneDNN, "
                              f"probed exact and batch-invariant; {WEIGHT_ONLY_LOGITS_SETTING} keeps the "
                              "input rows in bf16)"), "w8a8"  # fmt: skip
            log.info("%s; the logits projection keeps its input in %s", w8a8, dtype)
            instead = f"{problem}; {w8a8}, so "
        instead += "the input rows are not quantized; "
    if dtype != torch.float32:
        return chosen(True, f"{instead}the logits projection and the embedding as int8, one scale per row, "
                      "the input in bf16"), "int8"  # fmt: skip
    problem = half_packing_problem(hidden_size)
    if problem is not None:
        log.warning("%s; the logits projection stays float32 (%s)", problem, COMPACT_LOGITS_SETTING)
        return chosen(False, f"{instead}{problem}; the logits projection stays float32"), "float"
    return chosen(True, f"{instead}the logits projection as float16, computed in float32 (fbgemm; the "
                  "embedding stays float32)"), "fp16"  # fmt: skip


def _fused_path(
    model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> PathChoice:
    """Whether the model is built with the fused Triton kernels (NIM_FUSED_KERNELS=1, each checked
    against the PyTorch ops it replaces at the model's shapes)."""
    if not config.fused_kernels:
        return PathChoice("fused_kernels", False, "off (NIM_FUSED_KERNELS=1 turns them on; experimental)",
                          FUSED_SETTING)  # fmt: skip
    why = check_fused_kernels(model_config, dtype, device)
    if why is not None:
        log.warning("%s; norms, SiLU-mul and RoPE run as PyTorch's ops (%s)", why, FUSED_SETTING)
        return PathChoice("fused_kernels", False, f"{why}; running PyTorch's ops instead", FUSED_SETTING)
    return PathChoice("fused_kernels", True, "its start-up check agreed with PyTorch's ops", FUSED_SETTING)


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
    spec: KVCacheSpec,
    kv: KVCacheConfig,
    max_num_seqs: int,
    device: torch.device,
    max_model_len: int,
    sharers: int = 1,
    reservations: Callable[[], Reservations] | None = None,
) -> int:
    """Number of KV blocks: a share of free memory (split between `sharers` pools on one device)
    less the `reservations` measured for what follows the pool (service.engine.torch.memory_budget),
    capped by an explicit token count and by what max_num_seqs full-context sequences could ever
    use. Logged with the numbers, since it bounds concurrency.
    """
    fraction = kv.memory_fraction
    if fraction is None:
        fraction = DEFAULT_KV_FRACTION[device.type]
    memory = budget(free_memory_bytes(device), fraction, sharers, reservations)
    if memory.reserved is not None or device.type == "cuda":
        log.info("KV cache memory on %s: %s", device, memory.describe())
    if device.type == "cuda" and memory.reserved is None:
        log.info("KV cache memory: tensor parallelism: the activations and graphs are not measured")
    return kv_cache_blocks(spec, kv, max_num_seqs, max_model_len, memory)


def kv_cache_blocks(
    spec: KVCacheSpec, kv: KVCacheConfig, max_num_seqs: int, max_model_len: int, memory: MemoryBudget
) -> int:
    """The pool's blocks within `memory`, capped (NIM_KV_CACHE_MAX_TOKENS, max_num_seqs full
    contexts); KVCacheTooSmallError when one full-context sequence does not fit."""
    budget_tokens = memory.pool_bytes // spec.bytes_per_token()
    caps = [budget_tokens, max_num_seqs * max_model_len]
    if kv.max_tokens is not None:
        caps.append(kv.max_tokens)
    num_blocks = min(caps) // spec.block_size
    max_len_blocks = cdiv(max_model_len, spec.block_size)
    if num_blocks < max_len_blocks:
        reserved = ""
        if memory.reserved is not None:
            reserved = f" ({memory.describe()})"
        step = ", NIM_MAX_NUM_BATCHED_TOKENS" if memory.reserved is not None else ""
        raise KVCacheTooSmallError(
            f"the KV cache holds {num_blocks * spec.block_size} tokens, fewer than one {max_model_len}-token "
            f"sequence{reserved}: lower NIM_MAX_MODEL_LEN{step}, raise NIM_KV_CACHE_PERCENT / "
            "NIM_KV_CACHE_MAX_TOKENS, or use NIM_KV_CACHE_DTYPE=int8"
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
