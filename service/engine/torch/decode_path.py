"""How decode steps run, decided once when the engine is built and logged once with the reason.

A decode-only step (every sequence computes one token) runs one of three ways:
- cuda-graphs: a captured CUDA graph per batch-size bucket is replayed
  (service.engine.torch.cuda_graphs; CUDA, one rank, the Triton paged kernel);
- scripted: the decoder layers run as one TorchScript call (service.engine.torch.scripted_decode;
  CPU, a Llama-shaped model over an unquantized cache, no tensor parallelism, no LoRA);
- eager: the model's own forward over PagedAttention.
Steps that are not decode-only (prefills, mixed steps, prompt logprobs) and steps with LoRA
rows run eagerly whatever the path. Eager decodes attend one of two ways, also decided here:
`kernel` (the Triton paged kernel over block tables, CUDA) or `gather` (the blocks gathered into
one tensor; a lone decode whose blocks form one ascending run reads them in place when the cache
holds the activations' dtype unscaled: `in_place_runs`).

Steps with prefill chunks attend, on CUDA with the kernel, through the unified Triton kernel (one
launch per layer for the whole step, nothing gathered: `unified_steps`) when a check at start
agrees with the gathered attention on a small step shaped like the model (its heads, head size,
dtype and cache dtype); otherwise, and on the CPU, through gathered blocks, with the reason logged.

The runner holds the DecodePath and every place that used to decide reads it: the runner's
step (graphs or not), its forward (scripted or not), its attention metadata (kernel, gather,
in-place runs), and the tensor-parallel worker ranks (eager, the same attention as rank 0).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, replace

import torch

from service.engine.models.base import CausalLM
from service.engine.torch.cuda_graphs import CudaGraphDecoder
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.paged_attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillChunk,
    UnifiedStep,
    decode_mask,
    prefill_mask,
)
from service.engine.torch.scripted_decode import ScriptedDecoder

log = logging.getLogger(__name__)


class DecodeAttention(enum.Enum):
    KERNEL = "the Triton paged kernel over block tables"
    GATHER = "gathered cache blocks"


@dataclass(frozen=True)
class DecodePath:
    kind: str  # "cuda-graphs", "scripted" or "eager"
    attention: DecodeAttention  # how eager decodes attend
    in_place_runs: bool  # a lone decode over one ascending run of blocks reads them in place
    reason: str  # why this path (logged once, at build)
    graphs: CudaGraphDecoder | None = None  # kind "cuda-graphs": the decoder (captured at warm-up)
    scripted: ScriptedDecoder | None = None  # kind "scripted"
    unified_steps: bool = False  # steps with prefill chunks attend through the unified kernel

    @classmethod
    def eager(cls, pool: KVPool, model: CausalLM, kernel: bool, reason: str) -> DecodePath:
        attention = DecodeAttention.KERNEL if kernel else DecodeAttention.GATHER
        return cls("eager", attention, _reads_in_place(pool, model), reason)

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


def choose_decode_path(
    model: CausalLM, pool: KVPool, device: torch.device, options: DecodeOptions
) -> DecodePath:
    """The engine's decode path, logged once with the reason."""
    path = _choose(model, pool, device, options)
    if device.type == "cuda" and path.attention is DecodeAttention.KERNEL:
        why_not = unified_check(model, pool, device)
        if why_not is None:
            path = replace(path, unified_steps=True)
        else:
            log.warning("steps with prefill chunks attend through gathered cache blocks: %s", why_not)
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
        if options.enforce_eager:
            return DecodePath.eager(pool, model, False, "NIM_ENFORCE_EAGER=1")
        started = time.monotonic()
        built = ScriptedDecoder.build(model, pool)
        if isinstance(built, str):
            return DecodePath.eager(pool, model, False, built)
        reason = f"compiled in {time.monotonic() - started:.2f} s"
        return DecodePath(
            "scripted", DecodeAttention.GATHER, _reads_in_place(pool, model), reason, scripted=built
        )
    why_not = _why_no_graphs(options)
    if why_not is not None:
        return DecodePath.eager(pool, model, options.kernel, why_not)
    graphs = CudaGraphDecoder(model, pool, options.max_num_seqs, options.max_model_len, device)
    reason = f"batch sizes {graphs.buckets}, captured at warm-up"
    return DecodePath(
        "cuda-graphs", DecodeAttention.KERNEL, _reads_in_place(pool, model), reason, graphs=graphs
    )


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


def _reads_in_place(pool: KVPool, model: CausalLM) -> bool:
    """Whether the cache holds the activations' dtype unscaled, so a run of blocks is read as is."""
    return pool.scales is None and pool.data[0].dtype == model.activation_dtype


# (cached, new) tokens of the sequences of the start-up check: two decodes, a continued and a fresh prefill.
_CHECK_LAYOUT = ((37, 1), (5, 1), (21, 19), (0, 33))


def unified_check(model: CausalLM, pool: KVPool, device: torch.device) -> str | None:
    """Run the unified kernel once on a small random step shaped like the model, against the
    gathered attention over the same cache; None when they agree (to the dtype's rounding), else
    why the unified kernel will not be used."""
    config = model.config
    dtype = model.activation_dtype
    spec = KVCacheSpec(1, config.num_kv_heads, config.head_dim, pool.spec.block_size,
                       pool.spec.cache_dtype, dtype)  # fmt: skip
    block = spec.block_size
    tables, used = [], 0
    for cached, new in _CHECK_LAYOUT:  # descending block ids: read through the table, not in order
        count = -(-(cached + new) // block)
        tables.append(list(range(used + count - 1, used - 1, -1)))
        used += count
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(rows: int, heads: int) -> torch.Tensor:
        values = torch.randn(rows, heads, config.head_dim, generator=generator, device=device)
        return values.to(dtype)

    def slots(table: list[int], start: int, end: int) -> list[int]:
        return [table[p // block] * block + p % block for p in range(start, end)]

    try:
        check_pool = KVPool(spec, used, device)
        for (cached, _), table in zip(_CHECK_LAYOUT, tables, strict=True):
            if cached:
                at = torch.tensor(slots(table, 0, cached), device=device)
                check_pool.write(0, at, rand(cached, spec.num_kv_heads), rand(cached, spec.num_kv_heads))
        total = sum(new for _, new in _CHECK_LAYOUT)
        q, k, v = (
            rand(total, config.num_heads),
            rand(total, spec.num_kv_heads),
            rand(total, spec.num_kv_heads),
        )
        step_slots = [s for (c, n), t in zip(_CHECK_LAYOUT, tables, strict=True) for s in slots(t, c, c + n)]
        slot_mapping = torch.tensor(step_slots, device=device)
        unified = AttentionMetadata(
            slot_mapping, 0, None, None, (), unified=_check_step(check_pool, tables, device)
        )
        gathered = _gathered_meta(check_pool, tables, slot_mapping, device, dtype)
        got = PagedAttention(check_pool, unified, config.num_heads, config.head_dim)(0, q, k, v)
        want = PagedAttention(check_pool, gathered, config.num_heads, config.head_dim)(0, q, k, v)
    except Exception as exc:  # a kernel that does not compile or launch here
        return f"the unified kernel failed its start-up check: {type(exc).__name__}: {exc}"
    error = float((got.float() - want.float()).abs().max())
    # Quantized caches: the gathered decodes read their own new key rounded, the kernel as computed.
    bound = {"int8": 3e-2, "fp8": 1e-1}.get(spec.cache_dtype, 1e-4 if dtype == torch.float32 else 3e-2)
    if not error <= bound * max(1.0, float(want.float().abs().max())):
        return f"the unified kernel differs from gathered attention by {error:.3g} at its start-up check"
    return None


def _check_step(pool: KVPool, tables: list[list[int]], device: torch.device) -> UnifiedStep:
    starts = [0]
    for _, new in _CHECK_LAYOUT:
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    padded = [t + [pool.scratch_block] * (width - len(t)) for t in tables]
    return UnifiedStep(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + n for c, n in _CHECK_LAYOUT], dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(n for _, n in _CHECK_LAYOUT),
    )


def _gathered_meta(
    pool: KVPool,
    tables: list[list[int]],
    slot_mapping: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionMetadata:
    """The same step as the runner describes it for the gathered path (decodes first)."""
    block = pool.spec.block_size
    decodes = [(c, n, t) for (c, n), t in zip(_CHECK_LAYOUT, tables, strict=True) if n == 1]
    width = max(len(t) for _, _, t in decodes)
    padded = [b for _, _, t in decodes for b in t + [0] * (width - len(t))]
    lens = torch.tensor([c + n for c, n, _ in decodes], device=device)
    prefills = []
    start = len(decodes)
    for (cached, new), table in list(zip(_CHECK_LAYOUT, tables, strict=True))[len(decodes) :]:
        mask = prefill_mask(cached, new, len(table) * block, device, dtype)
        ids = pool.head_block_ids(torch.tensor(table, device=device))
        prefills.append(PrefillChunk(start, new, cached + new, ids, mask))
        start += new
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decodes=len(decodes),
        decode_block_ids=pool.head_block_ids(torch.tensor(padded, device=device)),
        decode_mask=decode_mask(lens, width * block, dtype),
        prefills=tuple(prefills),
    )
