"""How much device memory the KV pool may take: what is free once the weights are loaded, less
what the engine's other allocations need at their peak.

CPU: a share of the free memory (0.1 by default, NIM_KV_CACHE_PERCENT), nothing subtracted.

CUDA, one rank: the share (0.9 by default) is what the engine may use beyond its weights, and
the pool gets what is left of it after three reservations, made before the pool exists:
- activations: the peak of one eager step at the full token budget, measured by running one on
  the real model over a one-block cache (prefill chunks at the end of a full context, as long as
  the budget and the context allow; their block tables all name that one block, so the gathered
  context and the attention over it are as large as in service, the cache is not);
- graphs: the decode graphs' private memory pool, which the caching allocator never shares with
  eager steps: the peak of one eager decode step of the largest batch bucket (measured the same
  way), its logits once more (the buffer every graph writes), and GRAPH_ALLOWANCE per graph for
  what CUDA keeps of each captured graph (cuda_graphs logs what capture really took);
- sampling: the sampler's temporaries over max_num_seqs rows of logits, estimated as
  SAMPLING_COPIES float32 copies of them (softmax, sorted values and their int64 indices).
The rest of the free memory (1 - share: 10% by default) is the headroom for what is not
measured: the allocator's fragmentation, prompt logprobs over a whole chunk's logits.

This is vLLM v1's accounting (gpu_worker.determine_available_memory: a profile run at
max_num_batched_tokens, its peak subtracted with the CUDA graph estimate from the memory the
utilization allows), applied to the share of free memory this engine's setting names.
Tensor-parallel ranks on CUDA run no profile (its collectives would have to run in step on
every rank) and size as before; the log says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from service.engine.config import UnsupportedConfigError
from service.engine.models.base import CausalLM
from service.engine.models.lora_ops import NO_ADAPTER
from service.engine.torch.decode_path import DecodePath
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.lora_slots import LoraSlots
from service.engine.torch.model_runner import ModelRunner
from service.engine.torch.step_plan import StepPlan
from service.util import cdiv

log = logging.getLogger(__name__)

GIB = 2**30
GRAPH_ALLOWANCE = 16 * 2**20  # bytes per captured graph beyond its activations (CUDA's own)
SAMPLING_COPIES = 5  # float32-sized copies of the sampled rows' logits the sampler may hold
LOGIT_BYTES = 4  # logits are float32


@dataclass(frozen=True)
class StepShape:
    """A step as the profile runs it: per sequence, tokens computed and context after the step."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def largest_step(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> StepShape:
    """The step with the largest activations the scheduler can make: the budget filled with
    prompt chunks as long as the context allows, each ending a full context."""
    chunk = min(max_num_batched_tokens, max_model_len)
    queries: list[int] = []
    left = max_num_batched_tokens
    while left > 0 and len(queries) < max_num_seqs:
        queries.append(min(chunk, left))
        left -= queries[-1]
    return StepShape(tuple(queries), (max_model_len,) * len(queries))


def decode_step(batch: int, max_model_len: int) -> StepShape:
    """`batch` decodes over full contexts: what the largest decode graph computes."""
    return StepShape((1,) * batch, (max_model_len,) * batch)


class StepProbe(Protocol):
    def peak_bytes(self, shape: StepShape) -> int:
        """Device memory one eager step of this shape needs beyond what is allocated now."""
        ...


@dataclass(frozen=True)
class Reservations:
    """Bytes set aside before the KV pool (CUDA, one rank)."""

    activations: int  # the largest step's peak (measured)
    graphs: int  # the decode graphs' pool (measured decode step + logits buffer + allowance); 0: none
    sampling: int  # sampler temporaries (estimate)
    tokens: int  # the largest step's tokens
    graph_batch: int  # the largest decode graph's batch; 0: no graphs

    @property
    def total(self) -> int:
        return self.activations + self.graphs + self.sampling


def reserve(
    probe: StepProbe,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    vocab_size: int,
    graph_batches: Sequence[int],
) -> Reservations:
    """Measure the largest step (and the largest decode graph's step, when graphs will be
    captured for `graph_batches`) through `probe`; estimate the rest."""
    step = largest_step(max_num_batched_tokens, max_num_seqs, max_model_len)
    activations = probe.peak_bytes(step)
    graphs = batch = 0
    if graph_batches:
        batch = max(graph_batches)
        graphs = probe.peak_bytes(decode_step(batch, max_model_len))
        graphs += batch * vocab_size * LOGIT_BYTES + GRAPH_ALLOWANCE * len(graph_batches)
    sampling = SAMPLING_COPIES * max_num_seqs * vocab_size * LOGIT_BYTES
    return Reservations(activations, graphs, sampling, step.num_tokens, batch)


@dataclass(frozen=True)
class MemoryBudget:
    """The KV pool's bytes: `fraction` of `free` (split between `sharers` pools on one device),
    less the reservations."""

    free: int  # bytes free on the device once the weights are loaded
    fraction: float  # NIM_KV_CACHE_PERCENT as a fraction, else the device's default
    sharers: int = 1
    reserved: Reservations | None = None  # None: nothing measured (CPU, tensor parallelism)

    @property
    def share(self) -> int:
        return int(self.free * self.fraction / self.sharers)

    @property
    def pool_bytes(self) -> int:
        reserved = self.reserved.total if self.reserved is not None else 0
        return max(0, self.share - reserved)

    def describe(self) -> str:
        """The numbers, for the start-up log and errors."""
        line = f"{self.free / GIB:.2f} GiB free after weights x {self.fraction:g}"
        if self.sharers > 1:
            line += f" / {self.sharers} ranks"
        line += f" = {self.share / GIB:.2f} GiB"
        r = self.reserved
        if r is not None:
            graphs = (
                f"{r.graphs / GIB:.2f} GiB for decode graphs up to {r.graph_batch} sequences (measured step "
                f"+ logits buffer + {GRAPH_ALLOWANCE // 2**20} MiB per graph)"
                if r.graph_batch
                else "no decode graphs"
            )
            line += (
                f"; reserved {r.activations / GIB:.2f} GiB for the activations of a {r.tokens}-token step "
                f"(measured), {graphs}, {r.sampling / GIB:.2f} GiB for sampling"
            )
        headroom = self.free - self.share * self.sharers
        line += f"; headroom {headroom / GIB:.2f} GiB; pool {self.pool_bytes / GIB:.2f} GiB"
        return line


def budget(
    free: int, fraction: float, sharers: int = 1, reservations: Callable[[], Reservations] | None = None
) -> MemoryBudget:
    """`free` is read before the reservations are measured (they run steps, which leave caches)."""
    return MemoryBudget(free, fraction, sharers, reservations() if reservations is not None else None)


class CudaStepProbe:
    """Runs a step's forward (the real model runner's, eagerly) over a one-block cache and reads
    the peak from the CUDA caching allocator's statistics, plus any memory the step took outside
    it (cuBLAS workspaces, Triton modules)."""

    def __init__(
        self,
        model: CausalLM,
        spec: KVCacheSpec,
        device: torch.device,
        kernel: bool,
        lora: LoraSlots | None = None,
    ) -> None:
        self.model, self.spec, self.device, self.kernel, self.lora = model, spec, device, kernel, lora

    def peak_bytes(self, shape: StepShape) -> int:
        device = self.device
        pool = KVPool(self.spec, 1, device)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        free, _ = torch.cuda.mem_get_info(device)
        try:
            run_step(self.model, pool, device, self.kernel, shape, self.lora)
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError as error:
            raise UnsupportedConfigError(
                f"one step of {shape.num_tokens} tokens over a {max(shape.context_lens)}-token context does "
                "not fit in the memory left after the weights: lower NIM_MAX_NUM_BATCHED_TOKENS or "
                "NIM_MAX_MODEL_LEN"
            ) from error
        peak = torch.cuda.max_memory_allocated(device) - allocated
        free_after, _ = torch.cuda.mem_get_info(device)
        outside = (free - free_after) - (torch.cuda.memory_reserved(device) - reserved)
        del pool
        torch.cuda.empty_cache()
        return peak + max(0, outside)


def run_step(
    model: CausalLM,
    pool: KVPool,
    device: torch.device,
    kernel: bool,
    shape: StepShape,
    lora: LoraSlots | None = None,
) -> torch.Tensor:
    """One eager step of this shape over `pool`'s block 0 through the real model runner (decodes
    through the Triton kernel when `kernel`); the sampled rows' logits [S, V]."""
    path = DecodePath.eager(pool, model, kernel, "memory profile")
    runner = ModelRunner(model, pool, device, path, lora=lora)
    with torch.inference_mode():
        logits, _ = runner.forward(profile_plan(shape, pool.spec.block_size))
    return logits


def profile_plan(shape: StepShape, block_size: int) -> StepPlan:
    """A plan of this shape over block 0 alone: every block table names it, every token writes
    into it. Token 0 everywhere, each sequence sampling; decodes first, as the planner orders."""
    order = sorted(range(len(shape.query_lens)), key=lambda i: shape.query_lens[i] != 1)
    queries = tuple(shape.query_lens[i] for i in order)
    contexts = tuple(shape.context_lens[i] for i in order)
    positions = tuple(p for q, c in zip(queries, contexts, strict=True) for p in range(c - q, c))
    return StepPlan(
        request_ids=tuple(f"profile-{i}" for i in range(len(queries))),
        query_lens=queries,
        context_lens=contexts,
        block_tables=tuple((0,) * cdiv(c, block_size) for c in contexts),
        sample=(True,) * len(queries),
        prompt_logits=(False,) * len(queries),
        adapter_slots=(NO_ADAPTER,) * len(queries),
        num_decodes=sum(1 for q in queries if q == 1),
        input_ids=(0,) * len(positions),
        positions=positions,
        slot_mapping=tuple(p % block_size for p in positions),
    )
