"""Decode steps as replayed CUDA graphs: one graph per batch-size bucket, captured at start-up.

A decode step launches the same ~1,300 kernels every time; launched one by one from Python that
costs far more host time than the GPU needs to run them. Captured once into a CUDA graph per
batch-size bucket, a step is one H2D copy of its inputs, one graph launch and the logits.

The graphs read persistent device buffers that each step overwrites in place:

    inputs [bucket_max, 4 + W] int64: token id, position, cache slot, context length, then the
    request's block table (W = blocks of the longest context)

A step with B sequences runs the smallest bucket >= B; rows B..bucket are padding: token 0 at
position 0, writing its keys/values into the pool's scratch slot (never allocated to a request)
and attending over that one slot, so padding never touches a request's cache. Attention reads
the paged cache in place (triton_attention.paged_decode_attention), so nothing in a graph
depends on a host-side value.

Only steps whose every sequence decodes one token and samples run here; prefill and mixed steps
run eagerly.

A bucket whose capture fails, or whose replay at start disagrees with the same step run eagerly
(random tokens over real blocks of the still empty pool), is dropped with a log line: its batch
sizes run in the next larger captured bucket, or eagerly above the largest.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from service.engine.models.base import CausalLM
from service.engine.protocol import PathChoice
from service.engine.torch.kv_pool import KVPool
from service.engine.torch.startup_checks import GRAPHS_SETTING, close_enough
from service.engine.torch.step_plan import StepPlan
from service.engine.torch.triton_attention import paged_decode_attention
from service.util import cdiv, one_line

log = logging.getLogger(__name__)

# Columns of the inputs buffer before the block table.
TOKEN, POSITION, SLOT, LENGTH, TABLE = 0, 1, 2, 3, 4


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond, up to max_batch (always included)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    buckets += list(range(8, min(max_batch, 64) + 1, 8)) + list(range(80, max_batch + 1, 16))
    if not buckets or buckets[-1] != max_batch:
        buckets.append(max_batch)
    return sorted(set(buckets))


class GraphDecodeAttention:
    """The model's attention seam for a graph: writes the step's keys/values, then attends from
    the paged cache, with every tensor a view of the persistent buffers."""

    def __init__(
        self, pool: KVPool, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, head_dim: int
    ) -> None:
        self.pool, self.slots, self.tables, self.lens = pool, slots, tables, lens
        self.scale = 1.0 / math.sqrt(head_dim)

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """A layer's window and scale are fixed by the model, so each layer's are captured as
        constants of the graph."""
        pool = self.pool
        pool.write(layer, self.slots, k, v)
        scales = pool.scales[layer] if pool.scales is not None else None
        return paged_decode_attention(
            q, pool.data[layer], scales, pool.spec.cache_dtype, self.tables, self.lens,
            self.scale if scale is None else scale, window=window,
        )  # fmt: skip


class CudaGraphDecoder:
    def __init__(
        self, model: CausalLM, pool: KVPool, max_batch: int, max_model_len: int, device: torch.device
    ) -> None:
        self.model, self.pool, self.device = model, pool, device
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        width = cdiv(max_model_len, pool.spec.block_size)
        shape = (self.max_batch, TABLE + width)
        # Pinned, so the step's one copy to the GPU is asynchronous (the graph waits for it in order).
        self.staging = torch.zeros(shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.staged = self.staging.numpy()
        self.inputs = torch.zeros(shape, dtype=torch.int64, device=device)
        # What a padding row holds: token 0 at position 0, one slot of context: the scratch slot.
        self.padding = np.zeros(shape[1], dtype=np.int64)
        self.padding[SLOT] = pool.scratch_block * pool.spec.block_size
        self.padding[LENGTH] = 1
        self.padding[TABLE] = pool.scratch_block
        self.staged[:] = self.padding
        self.inputs.copy_(self.staging)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the buckets captured and checked
        self.dropped: dict[int, str] = {}  # bucket -> why its capture or check failed
        self.output: torch.Tensor | None = None  # [max_batch, V] float32: every graph's logits
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> its rows of `output`

    def can_run(self, plan: StepPlan) -> bool:
        # Only once captured: the warm-up request before capture runs eagerly.
        return bool(self.graphs) and self.fits(plan) and plan.num_sequences <= max(self.graphs)

    def fits(self, plan: StepPlan) -> bool:
        """Whether a graph computes this step: every sequence decodes one token and samples."""
        return (
            plan.decode_only
            and plan.num_sequences <= self.max_batch
            and all(plan.sample)
            and not any(plan.prompt_logits)
        )

    def choice(self) -> PathChoice:
        """What capture gave, as /v1/metadata reports it."""
        if not self.graphs and not self.dropped:
            return PathChoice("cuda_graphs", False, "not captured yet", GRAPHS_SETTING)
        dropped = "; ".join(f"batch {b}: {why}" for b, why in sorted(self.dropped.items()))
        if not self.graphs:
            return PathChoice("cuda_graphs", False, f"every capture failed, decodes run eagerly ({dropped})",
                              GRAPHS_SETTING)  # fmt: skip
        reason = (
            f"decode steps replay graphs for batch sizes {sorted(self.graphs)}, each checked against "
            "the eager step"
        )
        if dropped:
            reason += f"; dropped (run in a larger graph or eagerly): {dropped}"
        return PathChoice("cuda_graphs", True, reason, GRAPHS_SETTING)

    def capture(self) -> float:
        """Capture every bucket's graph (largest first, sharing one memory pool); returns seconds.

        Every graph writes its logits into one buffer of the largest bucket's rows, so the pool
        holds one step's working set: a graph's own output would stay allocated, and a logits
        tensor per bucket adds up to several of the largest (about 1.2 GB at 256 sequences and a
        128k vocabulary). What capture took from the device (its pool, the buffer, the graphs) is
        logged, to hold against the reservation the KV pool was sized with
        (service.engine.torch.memory_budget)."""
        started = time.monotonic()
        free_before = _free_memory(self.device)
        memory_pool = torch.cuda.graph_pool_handle()
        vocab = self.model.config.vocab_size
        self.output = torch.empty(self.max_batch, vocab, dtype=torch.float32, device=self.device)
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                try:
                    graph = self._capture(bucket, memory_pool)
                    why = self._check(bucket, graph)
                except Exception as exc:  # a capture CUDA refuses: this bucket runs without a graph
                    why = one_line(exc, with_type=True)
                if why is not None:
                    self.dropped[bucket] = why
                    log.warning(
                        "the decode CUDA graph for batch size %d is dropped (its steps run in a larger "
                        "graph or eagerly; %s skips graphs): %s", bucket, GRAPHS_SETTING, why,
                    )  # fmt: skip
                    continue
                self.logits[bucket] = self.output[:bucket]
                self.graphs[bucket] = graph
        self.staged[:] = self.padding
        free_after = _free_memory(self.device)
        seconds = time.monotonic() - started
        taken = (free_before - free_after) / 2**30
        log.info("captured %d CUDA graphs for decode batch sizes %s in %.1f s, taking %.2f GiB of "
                 "device memory", len(self.graphs), sorted(self.graphs), seconds, taken)  # fmt: skip
        return seconds

    def _capture(self, bucket: int, memory_pool: Any) -> torch.cuda.CUDAGraph:
        assert self.output is not None
        logits = self.forward(bucket)  # warm-up: kernels compiled, workspaces allocated
        if logits.shape != self.output[:bucket].shape:
            raise RuntimeError(f"the step's logits are {tuple(logits.shape)}, not [{bucket}, vocab]")
        del logits
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=memory_pool):
            self.output[:bucket].copy_(self.forward(bucket))
        return graph

    def _check(self, bucket: int, graph: torch.cuda.CUDAGraph) -> str | None:
        """Replay `graph` on a step of random tokens over real blocks (the pool holds no request
        yet) against the same step run eagerly; None when the logits agree."""
        assert self.output is not None
        rows = self._stage_check(bucket)
        want = self.forward(bucket)[:rows].clone()
        graph.replay()
        got = self.output[:rows]
        bound = 1e-4 if self.model.activation_dtype == torch.float32 else 2e-2
        why = close_enough(got, want, bound)
        return None if why is None else f"its replay {why} from the eager step"

    def _stage_check(self, bucket: int) -> int:
        """Stage `bucket` rows of random tokens, each decoding at a different context length over
        blocks of its own; the rows that got blocks (the rest are padding)."""
        block = self.pool.spec.block_size
        width = min(cdiv(40, block), self.staging.shape[1] - TABLE)  # contexts of up to 40 tokens
        usable = self.pool.scratch_block  # blocks [0, scratch) belong to requests, all free now
        rows = min(bucket, usable // width)
        generator = np.random.default_rng(bucket)
        self.staged[:bucket] = self.padding
        for row in range(rows):
            length = 1 + (7 * row + 3) % (width * block)
            table = [row * width + i for i in range(width)]
            position = length - 1
            self.staged[row, TOKEN] = generator.integers(0, self.model.config.vocab_size)
            self.staged[row, POSITION] = position
            self.staged[row, SLOT] = table[position // block] * block + position % block
            self.staged[row, LENGTH] = length
            self.staged[row, TABLE : TABLE + width] = table
        self.inputs[:bucket].copy_(self.staging[:bucket])
        return rows

    def forward(self, bucket: int) -> torch.Tensor:
        """The bucket's step, eagerly, from the staged inputs: what its graph replays."""
        inputs = self.inputs[:bucket]
        attention = GraphDecodeAttention(
            self.pool, inputs[:, SLOT], inputs[:, TABLE:], inputs[:, LENGTH], self.model.config.head_dim
        )
        hidden = self.model(inputs[:, TOKEN], inputs[:, POSITION], attention)  # [bucket, H]
        return self.model.compute_logits(hidden)  # [bucket, V] float32

    def run(self, plan: StepPlan) -> torch.Tensor:
        """The plan's logits [B, V] (one row per sequence, in plan order)."""
        bucket = self.stage(plan)
        self.graphs[bucket].replay()
        return self.logits[bucket][: plan.num_sequences]

    def bucket_for(self, count: int) -> int:
        """The smallest captured bucket that holds `count` sequences (before capture: of all)."""
        buckets = sorted(self.graphs) or self.buckets
        return next(b for b in buckets if b >= count)

    def stage(self, plan: StepPlan) -> int:
        """Write the plan into the input buffer (padding the rest of its bucket); the bucket."""
        count = plan.num_sequences
        bucket = self.bucket_for(count)
        staged = self.staged
        staged[:count, TOKEN] = plan.input_ids
        staged[:count, POSITION] = plan.positions
        staged[:count, SLOT] = plan.slot_mapping
        staged[:count, LENGTH] = plan.context_lens
        _fill_tables(staged, plan.block_tables)
        staged[count:bucket] = self.padding
        self.inputs[:bucket].copy_(self.staging[:bucket], non_blocking=True)
        return bucket


def _free_memory(device: torch.device) -> int:
    """Free device memory once every kernel ran and the caching allocator let go of what it holds
    unused (the graphs' private pool stays: it is what capture is measured by)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return free


def _fill_tables(staged: np.ndarray, tables: Sequence[Sequence[int]]) -> None:
    for row, table in enumerate(tables):
        staged[row, TABLE : TABLE + len(table)] = table
