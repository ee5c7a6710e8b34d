"""What an engine is asked to run: one typed value built once from the settings and the profile.

The entry point (service.serving) turns Settings (the environment) and the selected Profile into
an `EngineConfig`; engines read nothing else. Every field is honoured or refused: an engine that
cannot run what the config asks for (a tensor-parallel size, a precision, LoRA) raises
`UnsupportedConfigError` at start, with one line saying what and why, instead of running
something else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, cast

from service.engine.precision import SPECS
from service.engine.speculative_config import SpeculativeConfig
from service.model.config import ModelFormat
from service.store.checkpoint import Checkpoint
from service.text.tokenizer import Tokenizer

# The vocabularies shared by Settings, profiles and engines; each is defined here only.
DType = Literal["auto", "bfloat16", "float16", "float32"]
KVCacheDType = Literal["auto", "bfloat16", "float16", "float32", "int8", "fp8"]
DeviceKind = Literal["auto", "cpu", "cuda"]

# Profile precision tags of the unquantized dtypes, and back (NIM_DTYPE names dtypes).
PRECISION_DTYPES: dict[str, DType] = {s.name: cast(DType, s.dtype) for s in SPECS if s.dtype is not None}
PRECISION_TAGS: dict[DType, str] = {dtype: tag for tag, dtype in PRECISION_DTYPES.items()}


class UnsupportedConfigError(ValueError):
    """The engine cannot honour a configured setting; the message names it and says what to do."""


GIB = 2**30

# The step's capacity when NIM_MAX_NUM_SEQS / NIM_MAX_NUM_BATCHED_TOKENS are unset, by device.
# CPU: the sizes the CPU throughput bars were measured with. CUDA: 256 sequences (vLLM's OpenAI
# server default below 70 GiB; it allows 1024 above) and vLLM's OpenAI-server token budgets:
# 8192 on GPUs of 70 GiB or more (H100, H200), 2048 on smaller ones, whose KV pool the larger
# step's activations would eat into. vLLM leaves A100s at 2048 too (8192 measured slower there).
CPU_MAX_NUM_SEQS = 64
CPU_MAX_NUM_BATCHED_TOKENS = 1024
GPU_MAX_NUM_SEQS = 256
LARGE_GPU_MAX_NUM_BATCHED_TOKENS = 8192
SMALL_GPU_MAX_NUM_BATCHED_TOKENS = 2048
LARGE_GPU_BYTES = 70 * GIB


@dataclass(frozen=True)
class StepDefaults:
    """The step capacity a device gets when the operator sets none, and why (for the log)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    device: str  # "CPU", "a CUDA GPU of 80 GiB", ...


CPU_DEFAULTS = StepDefaults(CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS, "CPU")
# What an engine that always runs on a large GPU reads before knowing which (TensorRT-LLM, whose
# own max_num_tokens default is also 8192).
GPU_DEFAULTS = StepDefaults(GPU_MAX_NUM_SEQS, LARGE_GPU_MAX_NUM_BATCHED_TOKENS, "a CUDA GPU")


def step_defaults(device_type: str, total_memory: int = 0, name: str = "") -> StepDefaults:
    """The unset limits' values on a device: `device_type` "cpu" or "cuda", with the GPU's total
    memory (bytes) and name."""
    if device_type != "cuda":
        return CPU_DEFAULTS
    large = total_memory >= LARGE_GPU_BYTES and "a100" not in name.lower()
    tokens = LARGE_GPU_MAX_NUM_BATCHED_TOKENS if large else SMALL_GPU_MAX_NUM_BATCHED_TOKENS
    shown = f"{name} " if name else ""
    return StepDefaults(GPU_MAX_NUM_SEQS, tokens, f"CUDA GPU {shown}({total_memory / GIB:.0f} GiB)")


@dataclass(frozen=True)
class SchedulerLimits:
    """NIM_MAX_NUM_SEQS (requests generating at once) and NIM_MAX_NUM_BATCHED_TOKENS (the token
    budget of one step) as the operator set them; None: unset, the device's default.

    An engine resolves the defaults once, when its device is known (`for_device`); until then an
    unset limit reads as a large GPU's default (GPU_DEFAULTS). An explicit setting always wins.
    """

    set_max_num_seqs: int | None = None
    set_max_num_batched_tokens: int | None = None
    defaults: StepDefaults = GPU_DEFAULTS

    @property
    def max_num_seqs(self) -> int:
        if self.set_max_num_seqs is not None:
            return self.set_max_num_seqs
        return self.defaults.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        if self.set_max_num_batched_tokens is not None:
            return self.set_max_num_batched_tokens
        return self.defaults.max_num_batched_tokens

    def for_device(self, defaults: StepDefaults) -> SchedulerLimits:
        """These limits with the unset ones taking `defaults` (a device's: `step_defaults`)."""
        return replace(self, defaults=defaults)

    def describe(self) -> str:
        """One line for the start-up log: the values, and which are the device's defaults."""

        def part(value: int, what: str, explicit: bool, variable: str) -> str:
            source = variable if explicit else f"default for {self.defaults.device}; {variable} sets it"
            return f"{value} {what} ({source})"

        seqs = part(self.max_num_seqs, "sequences", self.set_max_num_seqs is not None, "NIM_MAX_NUM_SEQS")
        tokens = part(
            self.max_num_batched_tokens,
            "tokens",
            self.set_max_num_batched_tokens is not None,
            "NIM_MAX_NUM_BATCHED_TOKENS",
        )
        return f"step capacity: {seqs}, {tokens} per step"


@dataclass(frozen=True)
class KVCacheConfig:
    dtype: KVCacheDType
    block_size: int  # tokens per block: the unit of allocation and prefix reuse
    memory_fraction: float | None  # share of free memory after weights; None: the engine's default
    max_tokens: int | None  # cap in tokens (the smaller of this and the share wins)
    enable_prefix_caching: bool
    # Record the prefix cache's stored / removed blocks for Engine.kv_events (a Dynamo worker
    # publishes them to its KV-aware router); off when nobody drains them.
    record_events: bool = False


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
    # NIM_LORA_MODULES (vLLM's --lora-modules): adapters named with their paths, served besides the
    # source's; each is read and checked at start, and one that fails stops the start
    modules: tuple[tuple[str, Path], ...] = ()

    @classmethod
    def with_defaults(
        cls,
        source: Path | None,
        max_rank: int | None = None,
        max_gpu_loras: int | None = None,
        max_cpu_loras: int | None = None,
        refresh_interval_s: float | None = None,
        modules: tuple[tuple[str, Path], ...] = (),
    ) -> LoraConfig:
        """Unset limits take the defaults (host memory keeps at least the device's adapters)."""
        gpu = max_gpu_loras or DEFAULT_MAX_GPU_LORAS
        return cls(
            source,
            max_rank or DEFAULT_MAX_LORA_RANK,
            gpu,
            max_cpu_loras or max(DEFAULT_MAX_CPU_LORAS, gpu),
            refresh_interval_s,
            modules,
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
    # CUDA paths checked at start against the proven path (and off when False): steps with prompt
    # chunks through the unified attention kernel; fp8 layers through torch._scaled_mm.
    unified_attention: bool = True
    fp8_scaled_mm: bool = True
    fp8_rows_kernel: bool = True  # and steps of at most 16 rows through the Triton rows kernel
    compact_logits: bool = True  # the CPU, weight-only int: an int8 or float16 head (NIM_COMPACT_LOGITS)
    w8a8_logits: bool = True  # and its input rows int8 too, where the start-up probe passes
    dense_prompt_rows: bool = True  # the CPU, int4 under bf16: prompt rows dense (NIM_DENSE_PROMPT_ROWS)
    w4a8_int4: bool = True  # the CPU, int4: activations rounded to int8, integer sums (NIM_CPU_INT4_KERNEL)
    cpu_fused_ops: bool = True  # the CPU: norms and MoE routing as native ops (NIM_CPU_FUSED_OPS)
    num_threads: int | None = None  # CPU threads; None: every core the container may use
    collective_timeout_s: float | None = None  # tensor parallelism: the longest a collective waits
    weight_cache_dir: Path | None = None  # where weights quantized at load are kept; None: nowhere
    build_engine: bool = False  # tensorrt_llm: build a TensorRT engine (cached) rather than load
    guided_decoding_backend: str | None = None  # NIM_GUIDED_DECODING_BACKEND; None: the engine's own
    guided: GuidedLimits = GuidedLimits()  # structured output: compile limits
    engine_cache_dir: Path | None = None  # tensorrt_llm: this profile's slot for built engines
    speculative: SpeculativeConfig | None = None  # NIM_SPECULATIVE_CONFIG / NIM_DRAFT_MODEL_PATH

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer in the model's files (every engine reads it here, and so does the API
        process beside an engine process)."""
        return Tokenizer.from_model_files(self.model_path, self.model_format, self.checkpoint.metadata)
