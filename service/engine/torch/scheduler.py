"""Continuous (inflight) batching: which requests compute how many tokens in the next step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from service.engine.models.lora_ops import NO_ADAPTER
from service.engine.torch.block_pool import BlockHash
from service.engine.torch.kv_cache_manager import KVCacheManager
from service.engine.torch.lora_admission import AdapterUnavailableError, LoraAdmission
from service.engine.torch.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at `start` (its computed count when scheduled).

    `completes`: the chunk reaches the request's last token, so a new token is sampled after it.
    `num_drafts`: the last of the tokens are that many speculative ones (the request's
    `draft_token_ids`, past its last token), which the step verifies.
    """

    request: Request
    start: int
    num_tokens: int
    num_drafts: int = 0

    @property
    def completes(self) -> bool:
        return self.start + self.num_tokens - self.num_drafts == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # left the queue: why (its adapter)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """First come, first served, under one token budget per step.

    Each step:
      1. Running requests, oldest first, get the tokens they still need: 1 when decoding, the
         next chunk (up to the remaining budget) when their prompt is still being prefilled.
         A decoding request with speculative tokens (`draft_token_ids`) computes them too, as many
         as the budget and the free blocks allow (no preemption is made for them); after the step
         only the accepted ones count as computed (`accept_drafts`), and the blocks that held only
         rejected ones go back to the pool.
         When the block pool cannot hold a request's new tokens, the newest running request is
         preempted (blocks freed, back to the front of the waiting queue, recomputed later)
         until it can. A request that fits the context alone is therefore never failed for
         lack of blocks: the pool holds at least one full-context sequence.
      2. Only if nothing was preempted, waiting requests are admitted in arrival order while
         the budget, `max_num_seqs` and free blocks allow; the first that does not fit stops
         admission, so nobody overtakes an older request. Admission first takes the longest
         cached prefix of the request's tokens, so only the rest is computed; and a request
         whose next block is a prompt block some running request is computing right now waits
         (also stopping admission) until that block is published, so prompts shared by
         requests that arrive together (the choices of n > 1) are computed once.
         A request of a LoRA adapter is admitted only with a device slot holding its adapter
         (`lora`, counted like vLLM's max_loras); one that must wait for a slot, or for its
         adapter to be read, is skipped and keeps its place, and the requests behind it go on.
         Requests of an adapter that cannot be read any more leave the queue in `failed`.
    Abort removes a request from either queue and frees its blocks (and its LoRA slot) at once.
    """

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, lora: LoraAdmission | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.lora = lora
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Every waiting request waits on a LoRA read and nothing runs: no step can do anything
        # until a request arrives or a read ends (`wake`).
        self.stalled = False

    def add(self, request: Request) -> None:
        if request.adapter is not None and self.lora is None:
            raise ValueError(f"LoRA adapter {request.adapter!r} requested, but this engine serves none")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.stalled = False

    def wake(self) -> None:
        """A LoRA read ended: waiting requests may be admitted (or fail) now."""
        self.stalled = False

    def abort(self, request_id: str, discard: bool = False) -> Request | None:
        """Remove a request from either queue and free its blocks (`discard`: KVCacheManager.free)."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._release(request, discard)
                    return request
        return None

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)

    def _release(self, request: Request, discard: bool = False) -> None:
        request.status = RequestStatus.FINISHED
        self.kv.free(request, discard)
        if self.lora is not None:
            self.lora.release(request)

    def has_work(self) -> bool:
        return bool(self.running) or (bool(self.waiting) and not self.stalled)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.lora is not None:
            self._fail_unreadable(out)

        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_uncomputed, budget)
            drafts = self._fit_drafts(request, num_new, budget)
            if drafts:
                out.chunks.append(
                    ScheduledChunk(request, request.num_computed_tokens, num_new + drafts, drafts)
                )
                budget -= num_new + drafts
                continue
            while not self.kv.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
                budget -= num_new

        if out.preempted:
            return out
        in_flight: set[BlockHash] | None = None
        skipped: list[Request] = []  # waiting for a LoRA slot or read: they keep their places
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.adapter is not None and request.lora_slot == NO_ADAPTER:
                try:
                    placed = self._lora_admit(request)
                except AdapterUnavailableError as exc:  # its adapter is gone: it fails
                    self.waiting.popleft()
                    request.status = RequestStatus.FINISHED
                    out.failed.append((request, str(exc)))
                    continue
                if not placed:
                    skipped.append(self.waiting.popleft())
                    continue
            prefix = self.kv.cached_prefix(request) if request.num_computed_tokens == 0 else []
            upcoming = (
                self.kv.next_uncached_block(request, prefix) if request.num_computed_tokens == 0 else None
            )
            if upcoming is not None:
                if in_flight is None:
                    in_flight = {h for r in self.running for h in self.kv.prompt_blocks_in_flight(r)}
                if upcoming in in_flight:
                    break  # being computed by a running request: reuse it next step instead
            num_new = min(request.num_uncomputed - len(prefix) * self.kv.block_size, budget)
            if not self.kv.allocate(request, num_new, prefix):
                break
            self.waiting.popleft()
            if not request.admitted_before:
                request.admitted_before = True
                request.num_cached_tokens = len(prefix) * self.kv.block_size
                self.kv.record_prefix_lookup(request, request.num_cached_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if in_flight is not None:
                in_flight.update(self.kv.prompt_blocks_in_flight(request))
            out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        self.stalled = not out.chunks and not self.running and bool(self.waiting)
        return out

    def _fit_drafts(self, request: Request, num_new: int, budget: int) -> int:
        """How many of a decoding request's draft tokens this step verifies (their blocks and its
        own token's taken): as many as the budget and free blocks allow; 0 (drafts dropped) when
        none fit, or when it is not decoding."""
        drafts = request.draft_token_ids
        if not drafts:
            return 0
        count = min(len(drafts), budget - num_new) if num_new == 1 else 0
        while count > 0 and not self.kv.allocate(request, num_new + count):
            count -= 1
        del drafts[count:]
        return count

    def accept_drafts(self, request: Request, num_accepted: int) -> None:
        """After a verifying step: `num_accepted` draft tokens (now in `token_ids`) have their keys
        and values computed; blocks that became full are published and the blocks past the
        computed tokens (the rejected ones' only) are freed."""
        request.draft_token_ids = []
        if request.status is not RequestStatus.RUNNING:
            return
        request.num_computed_tokens += num_accepted
        self.kv.register_full_blocks(request)
        self.kv.trim(request)

    def _lora_admit(self, request: Request) -> bool:
        """Whether `request` (of an adapter, holding no slot) holds a slot now; False: it waits."""
        assert self.lora is not None
        return self.lora.admit(request)

    def _fail_unreadable(self, out: SchedulerOutput) -> None:
        """Waiting requests of adapters whose read failed leave the queue, failed with why."""
        assert self.lora is not None
        failures = self.lora.take_failures()
        if not failures:
            return
        for request in [r for r in self.waiting if r.adapter in failures and r.lora_slot == NO_ADAPTER]:
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED
            assert request.adapter is not None
            out.failed.append((request, failures[request.adapter]))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.draft_token_ids = []
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def step_done(self, out: SchedulerOutput) -> None:
        """Advance computed counts for what ran, and publish blocks that became full."""
        for chunk in out.chunks:
            if chunk.request.status is RequestStatus.RUNNING:  # drafts: counted once accepted
                chunk.request.num_computed_tokens += chunk.num_tokens - chunk.num_drafts
                self.kv.register_full_blocks(chunk.request)
