"""How decode steps run, decided once when the engine is built and logged once with the reason.

A decode-only step (every sequence computes one token; on the CPU also a step whose other
sequences verify drafts, each verified token a decode row) runs one of three ways:
- cuda-graphs: a captured CUDA graph per batch-size bucket is replayed
  (service.engine.torch.cuda_graphs; CUDA, one rank, the Triton paged kernel);
- scripted: the decoder layers run as one TorchScript call (service.engine.torch.scripted_decode;
  CPU, a Llama-shaped model over an unquantized cache, no tensor parallelism, no LoRA);
- eager: the model's own forward over PagedAttention.
Steps that are not decode-only (prefills, mixed steps, prompt logprobs) and steps with LoRA
rows run eagerly whatever the path. Decodes attend one of three ways, also decided here:
`kernel` (the Triton paged kernel over block tables, CUDA), `native` (the CPU: the native op over
block tables, each row's blocks read in place, where the fused CPU ops run and the cache holds the
activations' dtype; in the scripted Llama-family step and eagerly, not in Gemma 3's scripted
step) or `gather` (the blocks gathered into one tensor; the rows of one sequence, a lone decode or
its draft verification, whose blocks form one ascending run read them in place when the cache
holds the activations' dtype unscaled: `in_place_runs`). On the CPU a step of decodes and draft
verifications is decode-only: each verified token is a decode row of its own
(model_runner._verify_rows).

Steps with prefill chunks attend, on CUDA with the kernel, through the unified Triton kernel (one
launch per layer for the whole step, nothing gathered: `unified_steps`) when a check at start
agrees with the gathered attention at every launch shape the server will use, on random steps
shaped like the model (service.engine.torch.startup_checks); otherwise (the check failed,
NIM_UNIFIED_ATTENTION=off, or the CPU) through gathered blocks, with the reason logged.

The runner holds the DecodePath and every place that used to decide reads it: the runner's
step (graphs or not), its forward (scripted or not), its attention metadata (kernel, gather,
in-place runs), and the tensor-parallel worker ranks (eager, the same attention as rank 0: native
where its fused CPU ops run, as rank 0's do).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, replace

import torch

from service.engine.models.base import CausalLM
from service.engine.protocol import PathChoice
from service.engine.torch.cuda_graphs import CudaGraphDecoder
from service.engine.torch.kv_pool import KVPool
from service.engine.torch.scripted_decode import ScriptedDecoder
from service.engine.torch.startup_checks import (
    GRAPHS_SETTING,
    UNIFIED_SETTING,
    check_unified_attention,
    unified_query_lens,
)

log = logging.getLogger(__name__)


class DecodeAttention(enum.Enum):
    KERNEL = "the Triton paged kernel over block tables"
    NATIVE = "the native CPU kernel over block tables, the cache read in place"
    GATHER = "gathered cache blocks"


@dataclass(frozen=True)
class DecodePath:
    kind: str  # "cuda-graphs", "scripted" or "eager"
    attention: DecodeAttention  # how eager decodes attend
    in_place_runs: bool  # one sequence's decode rows over one ascending run of blocks read it in place
    reason: str  # why this path (logged once, at build)
    graphs: CudaGraphDecoder | None = None  # kind "cuda-graphs": the decoder (captured at warm-up)
    scripted: ScriptedDecoder | None = None  # kind "scripted"
    unified_steps: bool = False  # steps with prefill chunks attend through the unified kernel
    unified_reason: str = "not decided"  # why they do, or why not

    @classmethod
    def eager(
        cls, pool: KVPool, model: CausalLM, kernel: bool, reason: str, native: bool = False
    ) -> DecodePath:
        attention = DecodeAttention.KERNEL if kernel else _cpu_attention(pool, model, native)
        return cls("eager", attention, _reads_in_place(pool, model), reason)

    def choices(self) -> tuple[PathChoice, PathChoice]:
        """The unified attention and CUDA graph decisions, as /v1/metadata reports them (the graphs'
        once captured: buckets whose capture or check failed are named)."""
        unified = PathChoice("unified_attention", self.unified_steps, self.unified_reason, UNIFIED_SETTING)
        if self.graphs is None:
            graphs = PathChoice("cuda_graphs", False, f"decode steps run {self.kind}: {self.reason}",
                                GRAPHS_SETTING)  # fmt: skip
        else:
            graphs = self.graphs.choice()
        return unified, graphs

    def describe(self) -> str:
        steps = "the unified Triton kernel" if self.unified_steps else "gathered cache blocks"
        return (
            f"decode steps: {self.kind} ({self.reason}); eager decodes attend through "
            f"{self.attention.value}; steps with prefill chunks through {steps}"
        )


@dataclass(frozen=True)
class DecodeOptions:
    """What the path is decided from: `kernel` (the Triton paged kernel runs here: CUDA graphs
    need it), `enforce_eager` (NIM_ENFORCE_EAGER: neither graphs nor the TorchScript step), the
    batch and context the graphs cover (the batch: max_num_seqs, or the token budget when that is
    smaller, since a decode step never holds more sequences than it has tokens), and whether
    tensor-parallel ranks run beside this one."""

    kernel: bool
    enforce_eager: bool
    max_num_seqs: int
    max_model_len: int
    tensor_parallel: bool = False
    unified: bool = True  # NIM_UNIFIED_ATTENTION: steps with prompt chunks may use the unified kernel
    max_num_batched_tokens: int = 0  # the step's token budget (the longest query run); 0: the context
    native_attention: bool = (
        False  # the CPU: decode rows may attend through the native op (NIM_CPU_FUSED_OPS)
    )


def choose_decode_path(
    model: CausalLM, pool: KVPool, device: torch.device, options: DecodeOptions
) -> DecodePath:
    """The engine's decode path, logged once with the reason."""
    path = _choose(model, pool, device, options)
    used, reason = _unified(model, pool, device, options, path)
    path = replace(path, unified_steps=used, unified_reason=reason)
    if path.kind == "scripted":
        log.info(
            "CPU decode steps run as one TorchScript call (%s; NIM_ENFORCE_EAGER=1 runs them eagerly)",
            path.reason,
        )
    elif device.type == "cpu":
        log.info("CPU decode steps run eagerly: %s", path.reason)
    else:
        log.info("%s", path.describe())
    return path


def _choose(model: CausalLM, pool: KVPool, device: torch.device, options: DecodeOptions) -> DecodePath:
    if device.type == "cpu":
        native = options.native_attention
        if options.enforce_eager:
            return DecodePath.eager(pool, model, False, "NIM_ENFORCE_EAGER=1", native)
        started = time.monotonic()
        built = ScriptedDecoder.build(model, pool)
        if isinstance(built, str):
            return DecodePath.eager(pool, model, False, built, native)
        reason = f"compiled in {time.monotonic() - started:.2f} s"
        attention = _cpu_attention(pool, model, native and built.native_attention)
        return DecodePath("scripted", attention, _reads_in_place(pool, model), reason, scripted=built)
    why_not = _why_no_graphs(options)
    if why_not is not None:
        return DecodePath.eager(pool, model, options.kernel, why_not)
    graphs = CudaGraphDecoder(model, pool, options.max_num_seqs, options.max_model_len, device)
    reason = f"batch sizes {graphs.buckets}, captured at warm-up"
    return DecodePath(
        "cuda-graphs", DecodeAttention.KERNEL, _reads_in_place(pool, model), reason, graphs=graphs
    )


def _unified(
    model: CausalLM, pool: KVPool, device: torch.device, options: DecodeOptions, path: DecodePath
) -> tuple[bool, str]:
    """Whether steps with prefill chunks attend through the unified kernel, and why (its start-up
    check over every launch shape runs here, before warm-up)."""
    if device.type != "cuda":
        return False, f"{device.type}: the unified kernel runs on CUDA only; steps with prompt chunks gather"
    if path.attention is not DecodeAttention.KERNEL:
        return False, "the Triton paged kernel cannot run here (see the warning)"
    if not options.unified:
        return False, "NIM_UNIFIED_ATTENTION=off: steps with prompt chunks gather the cache blocks"
    started = time.monotonic()
    budget = options.max_num_batched_tokens or options.max_model_len
    why_not = check_unified_attention(model, pool, device, budget)
    if why_not is not None:
        log.warning("%s; steps with prompt chunks gather the cache blocks (%s skips the check)",
                    why_not, UNIFIED_SETTING)  # fmt: skip
        return False, f"{why_not}; running the proven path instead"
    shapes = len(unified_query_lens(model, pool.spec.cache_dtype, budget))
    seconds = time.monotonic() - started
    reason = f"its start-up check agreed with gathered attention at {shapes} launch shapes"
    return True, f"{reason} ({seconds:.1f} s)"


def captures_graphs(device: torch.device, options: DecodeOptions) -> bool:
    """Whether the engine will capture decode graphs (the KV pool is sized around their memory)."""
    return device.type == "cuda" and _why_no_graphs(options) is None


def _why_no_graphs(options: DecodeOptions) -> str | None:
    """On CUDA: why decodes run eagerly; None: they run as CUDA graphs."""
    if not options.kernel:
        return "the Triton paged kernel cannot run here (see the warning)"
    if options.tensor_parallel:
        return "tensor parallelism: no CUDA graphs across ranks yet"
    if options.enforce_eager:
        return "NIM_ENFORCE_EAGER=1"
    return None


def _cpu_attention(pool: KVPool, model: CausalLM, native: bool) -> DecodeAttention:
    """How CPU decode rows attend: the native op (fused_ops.decode_attention) where the fused CPU
    ops run (`native`) and the cache holds the activations' dtype unscaled, else gathered blocks."""
    return DecodeAttention.NATIVE if native and _reads_in_place(pool, model) else DecodeAttention.GATHER


def _reads_in_place(pool: KVPool, model: CausalLM) -> bool:
    """Whether the cache holds the activations' dtype unscaled, so a run of blocks is read as is."""
    return pool.scales is None and pool.data[0].dtype == model.activation_dtype
