"""What an engine is asked to run: one typed value built once from the settings and the profile.

The entry point (service.serving) turns Settings (the environment) and the selected Profile into
an `EngineConfig`; engines read nothing else. Every field is honoured or refused: an engine that
cannot run what the config asks for (a tensor-parallel size, a precision, LoRA) raises
`UnsupportedConfigError` at start, with one line saying what and why, instead of running
something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from service.engine.precision import SPECS

if TYPE_CHECKING:
    from service.store.checkpoint import Checkpoint

# The vocabularies shared by Settings, profiles and engines; each is defined here only.
DType = Literal["auto", "bfloat16", "float16", "float32"]
KVCacheDType = Literal["auto", "bfloat16", "float16", "float32", "int8", "fp8"]
DeviceKind = Literal["auto", "cpu", "cuda"]
ModelFormat = Literal["gguf", "hf_dir"]

# Profile precision tags of the unquantized dtypes, and back (NIM_DTYPE names dtypes).
PRECISION_DTYPES: dict[str, DType] = {s.name: cast(DType, s.dtype) for s in SPECS if s.dtype is not None}
PRECISION_TAGS: dict[DType, str] = {dtype: tag for tag, dtype in PRECISION_DTYPES.items()}


class UnsupportedConfigError(ValueError):
    """The engine cannot honour a configured setting; the message names it and says what to do."""


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int  # requests generating at once
    max_num_batched_tokens: int  # token budget of one step


@dataclass(frozen=True)
class KVCacheConfig:
    dtype: KVCacheDType
    block_size: int  # tokens per block: the unit of allocation and prefix reuse
    memory_fraction: float | None  # share of free memory after weights; None: the engine's default
    max_tokens: int | None  # cap in tokens (the smaller of this and the share wins)
    enable_prefix_caching: bool


DEFAULT_MAX_LORA_RANK = 32
DEFAULT_MAX_GPU_LORAS = 8
DEFAULT_MAX_CPU_LORAS = 16


@dataclass(frozen=True)
class LoraConfig:
    source: Path | None  # NIM_PEFT_SOURCE; None: a LoRA profile serving with no adapter source set
    max_rank: int = DEFAULT_MAX_LORA_RANK
    max_gpu_loras: int = DEFAULT_MAX_GPU_LORAS  # adapters resident on the device (slots)
    max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS  # adapters kept read in host memory
    refresh_interval_s: float | None = None  # rescan period of the source; None: at start only

    @classmethod
    def with_defaults(
        cls,
        source: Path | None,
        max_rank: int | None = None,
        max_gpu_loras: int | None = None,
        max_cpu_loras: int | None = None,
        refresh_interval_s: float | None = None,
    ) -> LoraConfig:
        """Unset limits take the defaults (host memory keeps at least the device's adapters)."""
        gpu = max_gpu_loras or DEFAULT_MAX_GPU_LORAS
        return cls(
            source,
            max_rank or DEFAULT_MAX_LORA_RANK,
            gpu,
            max_cpu_loras or max(DEFAULT_MAX_CPU_LORAS, gpu),
            refresh_interval_s,
        )


DEFAULT_MAX_GUIDED_SPEC_BYTES = 64 * 1024
DEFAULT_GUIDED_COMPILE_TIMEOUT_S = 10.0
DEFAULT_GUIDED_COMPILE_WORKERS = 2
DEFAULT_GUIDED_CACHE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class GuidedLimits:
    """What compiling one structured-output constraint may cost (the NIM_*GUIDED* settings)."""

    max_spec_bytes: int = DEFAULT_MAX_GUIDED_SPEC_BYTES  # a schema, regex, grammar or choice list
    compile_timeout_s: float = DEFAULT_GUIDED_COMPILE_TIMEOUT_S  # one compile, in its worker
    compile_workers: int = DEFAULT_GUIDED_COMPILE_WORKERS  # compiles at once (worker processes)
    cache_bytes: int = DEFAULT_GUIDED_CACHE_BYTES  # compiled grammars kept for reuse


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs to load and serve one model under one profile."""

    engine: str  # the profile's llm_engine: the registry key
    model_path: Path  # the checkpoint's: its .gguf file or Hugging Face directory
    model_format: ModelFormat  # the checkpoint's
    checkpoint: Checkpoint  # what the model's files hold, inspected once (service.store.checkpoint)
    served_name: str
    profile_name: str
    precision: str  # the profile's weight precision tag (bf16, fp8, int4_wo, ...)
    dtype: DType  # activation dtype; "auto" lets the engine pick for the device
    device: DeviceKind
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_model_len: int | None  # None: the model's own context
    scheduler: SchedulerLimits
    kv_cache: KVCacheConfig
    lora: LoraConfig | None = None
    enforce_eager: bool = False  # no CUDA graphs or compiled steps (debugging)
    fused_kernels: bool = False  # CUDA: Triton kernels for norms, SiLU-mul and RoPE
    num_threads: int | None = None  # CPU threads; None: every core the container may use
    collective_timeout_s: float | None = None  # tensor parallelism: the longest a collective waits
    weight_cache_dir: Path | None = None  # where weights quantized at load are kept; None: nowhere
    build_engine: bool = False  # tensorrt_llm: build a TensorRT engine (cached) rather than load
    guided_decoding_backend: str | None = None  # NIM_GUIDED_DECODING_BACKEND; None: the engine's own
    guided: GuidedLimits = GuidedLimits()  # structured output: compile limits
    engine_cache_dir: Path | None = None  # tensorrt_llm: this profile's slot for built engines
