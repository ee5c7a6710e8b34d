"""The engine's stats snapshots for metering: published by the step thread, read from any thread.

Each publication replaces one immutable EngineStats (readers on other threads see the old
snapshot or the new one, never half of each).
"""

from __future__ import annotations

from dataclasses import replace

from service.engine.protocol import EngineStats
from service.engine.torch.block_pool import BlockPool
from service.engine.torch.kv_cache_manager import KVCacheManager
from service.engine.torch.scheduler import Scheduler
from service.engine.torch.speculative.speculator import Speculator
from service.engine.torch.step_plan import StepPlan


class StatsPublisher:
    def __init__(
        self,
        pool: BlockPool,
        kv: KVCacheManager,
        scheduler: Scheduler,
        lora: bool,
        speculator: Speculator | None = None,
    ) -> None:
        self.speculator = speculator  # speculative decoding's counts, when it runs
        self.pool = pool
        self.kv = kv
        self.scheduler = scheduler
        self.lora = lora  # adapters are served: running and waiting adapters are reported
        self.snapshot = EngineStats(kv_blocks_total=pool.num_blocks)

    def reset(self) -> None:
        """Forget every count (after the warm-up) and publish the state as it is."""
        self.snapshot = EngineStats(kv_blocks_total=self.pool.num_blocks)
        self.publish()

    def publish(self, plan: StepPlan | None = None, seconds: float = 0.0) -> None:
        """A new snapshot; with `plan`, one more step of `seconds` is counted."""
        stats = self.snapshot
        if plan is not None:
            stats = replace(
                stats,
                num_steps=stats.num_steps + 1,
                step_tokens=stats.step_tokens.observe(plan.num_tokens),
                step_sequences=stats.step_sequences.observe(plan.num_sequences),
                step_seconds=stats.step_seconds.observe(seconds),
            )
        scheduler = self.scheduler
        lora_running: tuple[str, ...] = ()
        lora_waiting: tuple[str, ...] = ()
        if self.lora:
            lora_running = tuple(sorted({r.adapter for r in scheduler.running if r.adapter is not None}))
            lora_waiting = tuple(sorted({r.adapter for r in scheduler.waiting if r.adapter is not None}))
        if self.speculator is not None:
            counts = self.speculator.counts
            stats = replace(
                stats,
                spec_drafts=counts.num_drafts,
                spec_draft_tokens=counts.num_draft_tokens,
                spec_accepted_tokens=counts.num_accepted_tokens,
                spec_accepted_per_position=counts.accepted_per_position,
            )
        self.snapshot = replace(
            stats,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            lora_running=lora_running,
            lora_waiting=lora_waiting,
            kv_blocks_used=self.pool.num_blocks - self.pool.num_free,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            num_preemptions=scheduler.num_preemptions,
        )
