"""Scheduler + KVCacheManager + BlockPool, driven step by step without a model.

Each simulated engine step is what `TorchEngine._step` does: `schedule()`, (run the model),
`step_done()`, then for every chunk that `completes` its request append one sampled token and
`finish()` the request once it has its target number of output tokens (`sampling.max_tokens`).
The sampled token is a deterministic function of the tokens so far (a stand-in for greedy
decoding), so identical prefixes generate identical continuations.

In the style of vLLM's scheduler and prefix-caching tests; CPU only, a few seconds in all.
"""

from __future__ import annotations

import random
import threading
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.engine.lora import LoraAdapter, read_adapter
from service.engine.lora_store import LoraStore
from service.engine.models.lora_ops import NO_ADAPTER
from service.engine.protocol import SamplingParams
from service.engine.torch.block_pool import BlockPool
from service.engine.torch.kv_cache_manager import KVCacheManager
from service.engine.torch.lora_admission import LoraAdmission
from service.engine.torch.request import Request, RequestStatus
from service.engine.torch.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from service.util import cdiv

BS = 4  # block size for the hand-computed tests


# ------------------------------------------------------------------------------------------------
# helpers


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    prompt_logprobs: int | None = None,
    adapter: str | None = None,
) -> Request:
    return Request(
        request_id=request_id,
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs),
        arrival_time=0.0,
        adapter=adapter,
    )


def make_scheduler(
    num_blocks: int = 64,
    *,
    block_size: int = BS,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=enable_caching), block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens), kv)


def next_token(token_ids: list[int]) -> int:
    """A deterministic 'greedy model': the next token depends on the tokens so far."""
    tail = array("q", token_ids[-8:]).tobytes() + len(token_ids).to_bytes(4, "little")
    return zlib.crc32(tail) % 32_000


def expected_output(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def block_refs_match_tables(kv: KVCacheManager) -> None:
    """Every block's reference count is the number of block tables that hold it."""
    refs = Counter(block.block_id for table in kv.block_tables.values() for block in table)
    for block in kv.pool.blocks:
        assert block.ref_count == refs[block.block_id], (block, refs[block.block_id])


def check_state(sched: Scheduler) -> None:
    """Between steps: pool accounting, block tables and queues agree."""
    kv = sched.kv
    kv.pool.check_invariants()
    block_refs_match_tables(kv)
    running_ids = [r.request_id for r in sched.running]
    waiting_ids = [r.request_id for r in sched.waiting]
    assert len(set(running_ids)) == len(running_ids)
    assert not set(running_ids) & set(waiting_ids)
    assert set(kv.block_tables) == set(running_ids)
    assert len(sched.running) <= sched.config.max_num_seqs
    for request in sched.running:
        assert request.status is RequestStatus.RUNNING
        assert 0 < request.num_computed_tokens <= request.num_tokens
        # Exactly the blocks its computed tokens occupy: nothing over-allocated, nothing leaked.
        assert len(kv.block_tables[request.request_id]) == cdiv(request.num_computed_tokens, kv.block_size)
    for request in sched.waiting:
        assert request.status is RequestStatus.WAITING
        assert request.num_computed_tokens == 0


def head_of_waiting_fits(sched: Scheduler, budget_left: int) -> bool:
    """Would admission of the first waiting request succeed now (same arithmetic as allocate)?

    A request whose next block a running request is computing waits for it by design.
    """
    kv = sched.kv
    request = sched.waiting[0]
    prefix = kv.cached_prefix(request)
    upcoming = kv.next_uncached_block(request, prefix)
    if upcoming is not None and any(upcoming in kv.prompt_blocks_in_flight(r) for r in sched.running):
        return False
    num_new = min(request.num_uncomputed - len(prefix) * kv.block_size, budget_left)
    needed = cdiv(len(prefix) * kv.block_size + num_new, kv.block_size) - len(prefix)
    reclaimed = sum(1 for block in prefix if block.ref_count == 0)
    return needed <= kv.pool.num_free - reclaimed


def check_schedule(sched: Scheduler, out: SchedulerOutput, running_before: list[Request]) -> None:
    """Right after `schedule()`: the policy and budget of the scheduler's docstring."""
    config, kv = sched.config, sched.kv
    assert out.num_tokens <= config.max_num_batched_tokens
    assert len(sched.running) <= config.max_num_seqs
    scheduled = [c.request for c in out.chunks]
    assert len({id(r) for r in scheduled}) == len(scheduled), "a request scheduled twice"

    # Victims are the newest running requests, newest first; they go to the front of waiting.
    assert out.preempted == running_before[::-1][: len(out.preempted)]
    assert list(sched.waiting)[: len(out.preempted)] == out.preempted[::-1]
    for victim in out.preempted:
        assert victim not in scheduled
        assert victim.status is RequestStatus.WAITING
        assert victim.num_computed_tokens == 0
        assert victim.request_id not in kv.block_tables
    if out.preempted:
        assert all(r in running_before for r in scheduled), "admitted in a step that preempted"

    # Running requests first in running order, then admissions in arrival (waiting) order.
    old = [r for r in scheduled if r in running_before]
    assert scheduled[: len(old)] == old
    assert old == [r for r in running_before if r in old]

    for chunk in out.chunks:
        request = chunk.request
        assert chunk.num_tokens >= 1
        assert chunk.start == request.num_computed_tokens
        assert chunk.start + chunk.num_tokens <= request.num_tokens
        assert request.status is RequestStatus.RUNNING
        table = kv.block_tables[request.request_id]
        assert len(table) == cdiv(chunk.start + chunk.num_tokens, kv.block_size)

    # Work conserving: budget left over means nobody could use it.
    budget_left = config.max_num_batched_tokens - out.num_tokens
    if budget_left and not out.preempted:
        for chunk in out.chunks:
            assert chunk.completes, "a prefill chunk was cut short although budget was left"
        if (
            sched.waiting
            and len(sched.running) < config.max_num_seqs
            and not waits_for_lora(sched.waiting[0])
        ):
            assert not head_of_waiting_fits(sched, budget_left), "a waiting request that fits was left"


def waits_for_lora(request: Request) -> bool:
    """A request of an adapter without a slot: skipped while it waits for one (it keeps its place)."""
    return request.adapter is not None and request.lora_slot == NO_ADAPTER


@dataclass
class Step:
    """What one step scheduled. `completes` is captured at schedule time: `ScheduledChunk.completes`
    is computed from the request's current length, so it reads False once the token is appended."""

    chunks: list[ScheduledChunk]
    preempted: list[Request]
    completes: list[bool]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def triples(self) -> list[tuple[int, int, bool]]:
        """(start, num_tokens, completes) per chunk."""
        return [(c.start, c.num_tokens, done) for c, done in zip(self.chunks, self.completes, strict=True)]


def step(sched: Scheduler) -> Step:
    """One engine step: schedule, compute, sample for completing chunks, finish when done."""
    running_before = list(sched.running)
    out = sched.schedule()
    check_schedule(sched, out, running_before)
    result = Step(list(out.chunks), list(out.preempted), [c.completes for c in out.chunks])
    sched.step_done(out)
    for chunk in out.chunks:
        request = chunk.request
        if request.status is not RequestStatus.RUNNING:
            continue
        assert request.num_computed_tokens == chunk.start + chunk.num_tokens
        if chunk.completes:
            request.token_ids.append(next_token(request.token_ids))
            if request.num_generated >= request.sampling.max_tokens:
                sched.finish(request)
                assert request.status is RequestStatus.FINISHED
    check_state(sched)
    return result


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[Step]:
    outs = []
    while sched.has_work():
        outs.append(step(sched))
        assert len(outs) < max_steps, "no progress"
    return outs


def chunks_of(outs: list[Step], request: Request) -> list[tuple[int, int, int]]:
    """(step index, start, num_tokens) of every chunk the request got."""
    return [
        (i, c.start, c.num_tokens) for i, out in enumerate(outs) for c in out.chunks if c.request is request
    ]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32_000) for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# basics


def test_empty_scheduler_schedules_nothing() -> None:
    sched = make_scheduler()
    assert not sched.has_work()
    out = sched.schedule()
    assert out.chunks == []
    assert out.preempted == []
    assert out.num_tokens == 0


def test_single_request_prefill_then_decode() -> None:
    sched = make_scheduler(16)
    tokens = prompt(1, 10)
    request = make_request("r", tokens, max_tokens=3)
    sched.add(request)
    assert request.status is RequestStatus.WAITING
    assert sched.has_work()

    out = step(sched)
    assert out.triples() == [(0, 10, True)]
    assert request.status is RequestStatus.RUNNING
    assert request.num_computed_tokens == 10
    assert request.num_generated == 1
    assert sched.kv.block_table(request) == [0, 1, 2]

    out = step(sched)
    assert out.triples() == [(10, 1, True)]
    out = step(sched)
    assert out.triples() == [(11, 1, True)]

    assert request.status is RequestStatus.FINISHED
    assert request.token_ids == tokens + expected_output(tokens, 3)
    assert not sched.has_work()
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
    assert sched.kv.block_tables == {}


def test_first_admission_splits_the_budget_in_arrival_order() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b, c = (make_request(n, prompt(i, 4)) for i, n in enumerate("abc"))
    for r in (a, b, c):
        sched.add(r)
    out = step(sched)
    assert [(ch.request, ch.start, ch.num_tokens) for ch in out.chunks] == [(a, 0, 4), (b, 0, 4), (c, 0, 2)]
    assert out.completes == [True, True, False]
    assert list(sched.waiting) == []
    assert c.num_generated == 0


# ------------------------------------------------------------------------------------------------
# continuous batching


def test_continuous_batching_admits_waiting_requests_fcfs_as_others_finish() -> None:
    sched = make_scheduler(max_num_seqs=2)
    lengths = [3, 1, 4, 2, 1, 5]
    requests = [make_request(f"r{i}", prompt(i, 5), max_tokens=n) for i, n in enumerate(lengths)]
    for r in requests:
        sched.add(r)

    outs = []
    admitted: list[Request] = []
    while sched.has_work():
        out = step(sched)
        outs.append(out)
        admitted += [c.request for c in out.chunks if c.start == 0]
        assert sum(r.status is RequestStatus.RUNNING for r in requests) <= 2
    assert admitted == requests  # each admitted once, in arrival order
    for r, n in zip(requests, lengths, strict=True):
        assert r.status is RequestStatus.FINISHED
        assert r.num_generated == n
    assert max(len(out.chunks) for out in outs) == 2
    # r1 (1 token) finishes after step 0, so r2 is admitted in step 1 next to r0's decode.
    assert [(c.request.request_id, c.start) for c in outs[1].chunks] == [("r0", 5), ("r2", 0)]


def test_max_num_seqs_caps_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=1000)
    requests = [make_request(f"r{i}", prompt(i, 3), max_tokens=2) for i in range(10)]
    for r in requests:
        sched.add(r)
    out = step(sched)
    assert [c.request for c in out.chunks] == requests[:3]
    assert list(sched.waiting) == requests[3:]
    outs = run_to_completion(sched)
    assert all(len(o.chunks) <= 3 for o in outs)
    assert all(r.num_generated == 2 for r in requests)


def test_token_budget_is_respected_every_step() -> None:
    rng = random.Random(7)
    budget = 16
    sched = make_scheduler(256, max_num_seqs=6, max_num_batched_tokens=budget)
    requests = [
        make_request(f"r{i}", prompt(i, rng.randint(1, 40)), max_tokens=rng.randint(1, 6)) for i in range(15)
    ]
    for r in requests:
        sched.add(r)
    outs = run_to_completion(sched)  # check_schedule asserts the budget and work conservation
    assert all(0 < o.num_tokens <= budget for o in outs)
    assert sum(o.num_tokens for o in outs) == sum(r.num_prompt_tokens + r.num_generated - 1 for r in requests)
    assert all(r.num_generated == r.sampling.max_tokens for r in requests)


def test_a_small_request_never_overtakes_an_older_one_that_does_not_fit() -> None:
    sched = make_scheduler(8)  # 32 token slots
    a = make_request("a", prompt(1, 17), max_tokens=3)  # 5 blocks for its whole life
    b = make_request("b", prompt(2, 16), max_tokens=1)  # needs 4 blocks: only 3 left while a runs
    c = make_request("c", prompt(3, 2), max_tokens=1)  # needs 1 block: would fit, must wait behind b
    for r in (a, b, c):
        sched.add(r)
    outs = run_to_completion(sched)
    assert [[ch.request.request_id for ch in o.chunks] for o in outs] == [["a"], ["a"], ["a"], ["b", "c"]]
    assert sched.num_preemptions == 0


# ------------------------------------------------------------------------------------------------
# chunked prefill


def test_long_prompt_is_split_across_steps() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    tokens = prompt(5, 30)
    r = make_request("r", tokens, max_tokens=2)
    sched.add(r)
    outs = run_to_completion(sched)
    assert [t for o in outs for t in o.triples()] == [
        (0, 8, False),
        (8, 8, False),
        (16, 8, False),
        (24, 6, True),  # only the last chunk samples
        (30, 1, True),
    ]
    assert r.token_ids == tokens + expected_output(tokens, 2)


def test_decodes_keep_running_during_a_chunked_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    decoder = make_request("decoder", prompt(1, 3), max_tokens=20)
    sched.add(decoder)
    step(sched)
    long = make_request("long", prompt(2, 30), max_tokens=2)
    sched.add(long)

    sizes = []
    while long.num_generated == 0:
        out = step(sched)
        (_, d_num, d_done), (l_start, l_num, l_done) = out.triples()
        assert [c.request for c in out.chunks] == [decoder, long]
        assert (d_num, d_done) == (1, True)  # the older decode gets its token every step
        sizes.append(l_num)
        assert l_done == (l_start + l_num == 30)
        assert out.num_tokens <= 8
    assert sizes == [7, 7, 7, 7, 2]
    run_to_completion(sched)
    assert decoder.num_generated == 20
    assert long.num_generated == 2


def test_an_older_prefill_takes_the_budget_before_a_newer_request() -> None:
    """FCFS: running requests (oldest first) are served before waiting ones are admitted."""
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", prompt(1, 20), max_tokens=1)
    b = make_request("b", prompt(2, 4), max_tokens=1)
    sched.add(a)
    sched.add(b)
    outs = run_to_completion(sched)
    assert [[(c.request.request_id, c.start, c.num_tokens) for c in o.chunks] for o in outs] == [
        [("a", 0, 8)],
        [("a", 8, 8)],
        [("a", 16, 4), ("b", 0, 4)],
    ]


# ------------------------------------------------------------------------------------------------
# prefix caching


def test_second_request_reuses_the_shared_full_blocks() -> None:
    sched = make_scheduler(32)
    kv = sched.kv
    shared = prompt(1, 10)  # two full blocks of 4, plus 2 tokens
    r1 = make_request("r1", [*shared, 1, 2, 3], max_tokens=2)
    sched.add(r1)
    step(sched)
    r1_blocks = kv.block_table(r1)
    run_to_completion(sched)
    assert r1.num_cached_tokens == 0

    r2 = make_request("r2", [*shared, 4, 5, 6, 7, 8], max_tokens=2)
    sched.add(r2)
    out = step(sched)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(8, 7)]
    assert r2.num_cached_tokens == 8
    assert kv.block_table(r2)[:2] == r1_blocks[:2]
    assert kv.prefix_queries == 13 + 15
    assert kv.prefix_hits == 8
    run_to_completion(sched)
    assert r2.token_ids[15:] == expected_output(r2.token_ids[:15], 2)


def test_prefix_blocks_are_shared_while_both_requests_run() -> None:
    sched = make_scheduler(32)
    kv = sched.kv
    shared = prompt(2, 12)
    r1 = make_request("r1", [*shared, 9], max_tokens=6)
    sched.add(r1)
    step(sched)
    free_before = kv.pool.num_free
    r2 = make_request("r2", [*shared, 8, 8], max_tokens=6)
    sched.add(r2)
    step(sched)
    assert r2.num_cached_tokens == 12
    assert kv.block_table(r2)[:3] == kv.block_table(r1)[:3]
    assert [b.ref_count for b in kv.block_tables["r2"][:3]] == [2, 2, 2]
    assert kv.pool.num_free == free_before - 1  # r2 only needed one block of its own
    sched.abort("r1")
    assert [b.ref_count for b in kv.block_tables["r2"][:3]] == [1, 1, 1]
    run_to_completion(sched)
    assert r2.num_generated == 6
    assert kv.pool.num_free == kv.pool.num_blocks


@pytest.mark.parametrize(
    ("length", "cached"),
    [(12, 8), (13, 12), (4, 0), (5, 4), (1, 0), (16, 12), (17, 16)],
)
def test_an_identical_prompt_always_computes_at_least_its_last_token(length: int, cached: int) -> None:
    sched = make_scheduler(32)
    tokens = prompt(3, length)
    sched.add(make_request("r1", tokens, max_tokens=1))
    run_to_completion(sched)
    r2 = make_request("r2", tokens, max_tokens=1)
    sched.add(r2)
    out = step(sched)
    assert r2.num_cached_tokens == cached
    assert out.triples() == [(cached, length - cached, True)]
    assert r2.num_generated == 1
    assert sched.kv.prefix_hits == cached


def test_shared_system_prompt_across_many_requests() -> None:
    sched = make_scheduler(64, max_num_seqs=16, max_num_batched_tokens=256)
    kv = sched.kv
    system = prompt(4, 16)  # four full blocks
    first = make_request("u0", [*system, 7], max_tokens=3)
    sched.add(first)
    step(sched)
    system_blocks = kv.block_tables["u0"][:4]

    users = [
        make_request(f"u{i}", [*system, *prompt(100 + i, i % 7 + 1)], max_tokens=3) for i in range(1, 10)
    ]
    for u in users:
        sched.add(u)
    out = step(sched)
    assert {c.request for c in out.chunks} == {first, *users}
    for u in users:
        assert u.num_cached_tokens == 16
        assert kv.block_tables[u.request_id][:4] == system_blocks
    assert [b.ref_count for b in system_blocks] == [10] * 4
    assert kv.prefix_hits == 9 * 16
    assert kv.prefix_queries == first.num_prompt_tokens + sum(u.num_prompt_tokens for u in users)
    run_to_completion(sched)
    assert all(u.num_generated == 3 for u in [first, *users])
    assert kv.pool.num_free == kv.pool.num_blocks


def test_multi_turn_reuses_the_previous_turn_after_it_finished() -> None:
    sched = make_scheduler(32)
    kv = sched.kv
    turn1 = make_request("turn1", prompt(5, 10), max_tokens=5)
    sched.add(turn1)
    step(sched)
    turn1_blocks = kv.block_table(turn1)
    run_to_completion(sched)
    assert turn1.num_tokens == 15
    # Its last sampled token was never computed: 14 computed tokens, 3 full blocks registered.
    assert kv.pool.num_free == kv.pool.num_blocks  # freed, but still cached
    assert all(kv.pool.lookup(h) is not None for h in turn1.full_block_hashes(BS)[:3])

    turn2 = make_request("turn2", [*turn1.token_ids, *prompt(6, 6)], max_tokens=2)
    sched.add(turn2)
    out = step(sched)
    assert turn2.num_cached_tokens == 12  # prompt plus two generated tokens of turn 1
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(12, 9)]
    assert kv.block_table(turn2)[:3] == turn1_blocks[:3]
    run_to_completion(sched)
    assert turn2.num_generated == 2


def test_cached_blocks_are_evicted_lru_with_a_finished_prefix_tail_first() -> None:
    sched = make_scheduler(8)
    kv = sched.kv
    tokens = prompt(7, 16)  # four full blocks
    sched.add(make_request("r1", tokens, max_tokens=1))
    run_to_completion(sched)
    # Free queue: the 4 never-used blocks, then r1's blocks tail first (so its prefix goes last).
    filler = make_request("filler", prompt(8, 20), max_tokens=1)  # 5 blocks: evicts r1's last block
    sched.add(filler)
    step(sched)
    assert filler.status is RequestStatus.FINISHED
    r2 = make_request("r2", [*tokens, 1], max_tokens=1)
    assert len(kv.cached_prefix(r2)) == 3
    sched.add(r2)
    step(sched)
    assert r2.num_cached_tokens == 12


def test_cached_free_blocks_count_as_room_for_the_request_that_reuses_them() -> None:
    sched = make_scheduler(4)
    kv = sched.kv
    tokens = prompt(9, 12)
    sched.add(make_request("r1", tokens, max_tokens=1))
    run_to_completion(sched)
    # One never-used block plus r1's three cached ones are free; r2 needs all four.
    r2 = make_request("r2", [*tokens, 1, 2, 3, 4], max_tokens=2)
    sched.add(r2)
    out = step(sched)
    assert [(c.request, c.start, c.num_tokens) for c in out.chunks] == [(r2, 12, 4)]
    assert kv.pool.num_free == 0


def test_prefix_admission_that_does_not_fit_changes_nothing() -> None:
    sched = make_scheduler(4)
    kv = sched.kv
    tokens = prompt(9, 12)
    sched.add(make_request("r1", tokens, max_tokens=1))
    run_to_completion(sched)
    holder = make_request("holder", prompt(10, 2), max_tokens=100)  # takes the never-used block
    sched.add(holder)
    step(sched)
    r2 = make_request("r2", [*tokens, 1, 2, 3, 4], max_tokens=1)  # 3 cached + 1 new: no room
    sched.add(r2)
    snapshot = [(b.ref_count, b.block_hash) for b in kv.pool.blocks]
    out = step(sched)
    assert [c.request for c in out.chunks] == [holder]
    assert list(sched.waiting) == [r2]
    assert r2.num_computed_tokens == 0
    assert r2.num_cached_tokens == 0
    assert not r2.admitted_before
    assert [(b.ref_count, b.block_hash) for b in kv.pool.blocks] == snapshot
    assert len(kv.cached_prefix(r2)) == 3  # the prefix was not evicted to make room for itself
    assert kv.prefix_queries == 12 + 2  # r1 and holder; r2's lookup is counted when it is admitted
    sched.abort("holder")
    step(sched)
    assert r2.num_cached_tokens == 12


def test_caching_disabled_never_hits() -> None:
    sched = make_scheduler(32, enable_caching=False)
    kv = sched.kv
    shared = prompt(11, 16)
    sched.add(make_request("r1", [*shared, 1], max_tokens=2))
    run_to_completion(sched)
    r2 = make_request("r2", [*shared, 2], max_tokens=2)
    sched.add(r2)
    out = step(sched)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 17)]
    assert r2.num_cached_tokens == 0
    assert kv.prefix_hits == 0
    assert kv.cached_prefix(r2) == []
    assert all(b.block_hash is None for b in kv.pool.blocks)


def test_a_request_asking_for_prompt_logprobs_is_not_served_from_the_prefix_cache() -> None:
    sched = make_scheduler(32)
    shared = prompt(12, 16)
    sched.add(make_request("r1", [*shared, 1], max_tokens=1))
    run_to_completion(sched)
    r2 = make_request("r2", [*shared, 2], max_tokens=1, prompt_logprobs=0)
    sched.add(r2)
    out = step(sched)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 17)]
    assert r2.num_cached_tokens == 0


def test_requests_with_different_cache_salts_never_share_blocks() -> None:
    """The hash chain starts from the salt (a LoRA adapter changes the keys/values of the same
    tokens): equal prompts under different salts are different blocks; under the same salt, one."""
    sched = make_scheduler(32)
    shared = prompt(12, 16)
    first = make_request("a1", [*shared, 1], max_tokens=1)
    first.cache_salt = "adapter-a"
    sched.add(first)
    run_to_completion(sched)
    other = make_request("b1", [*shared, 1], max_tokens=1)
    other.cache_salt = "adapter-b"
    unsalted = make_request("n1", [*shared, 1], max_tokens=1)
    same = make_request("a2", [*shared, 1], max_tokens=1)
    same.cache_salt = "adapter-a"
    for request in (other, unsalted, same):
        sched.add(request)
        run_to_completion(sched)
    assert (other.num_cached_tokens, unsalted.num_cached_tokens, same.num_cached_tokens) == (0, 0, 16)
    assert len({tuple(r.full_block_hashes(BS)) for r in (first, other, unsalted)}) == 3


# ------------------------------------------------------------------------------------------------
# preemption


def test_newest_running_request_is_preempted_and_resumes_later() -> None:
    sched = make_scheduler(6, max_num_seqs=2, enable_caching=False)
    kv = sched.kv
    a = make_request("a", prompt(1, 8), max_tokens=12)  # 19 computed tokens at most: 5 blocks
    b = make_request("b", prompt(2, 8), max_tokens=12)
    c = make_request("c", prompt(3, 4), max_tokens=1)  # waits behind them (max_num_seqs=2)
    for r in (a, b, c):
        sched.add(r)

    outs = []
    while not sched.num_preemptions:
        outs.append(step(sched))
    out = outs[-1]
    assert out.preempted == [b]
    assert [ch.request for ch in out.chunks] == [a]
    assert sched.num_preemptions == 1
    assert b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert "b" not in kv.block_tables
    assert list(sched.waiting) == [b, c]  # back to the FRONT of waiting
    generated_at_preemption = b.num_generated
    assert generated_at_preemption > 0
    assert kv.pool.num_free == 6 - len(kv.block_tables["a"])  # b's blocks came back at once

    outs += run_to_completion(sched)
    assert all(a not in o.preempted for o in outs)  # the older request is never the victim
    assert sched.num_preemptions == 1
    for r in (a, b):
        assert r.status is RequestStatus.FINISHED
        assert r.num_generated == 12
        assert r.token_ids[8:] == expected_output(r.token_ids[:8], 12)
    # b resumed by recomputing prompt and generated tokens in one chunk, before c was admitted.
    resumed = [ch for ch in chunks_of(outs, b) if ch[1] == 0][1]
    assert resumed[2] == 8 + generated_at_preemption
    assert chunks_of(outs, c)[0][0] >= resumed[0]
    assert b.num_cached_tokens == 0


def test_resumed_request_reuses_its_own_cached_blocks() -> None:
    sched = make_scheduler(6, max_num_seqs=2)
    a = make_request("a", prompt(1, 8), max_tokens=12)
    b = make_request("b", prompt(2, 8), max_tokens=12)
    sched.add(a)
    sched.add(b)
    outs = run_to_completion(sched)
    assert sched.num_preemptions == 1
    first, resumed = [ch for ch in chunks_of(outs, b) if ch[1] % BS == 0 and ch[2] > 1]
    assert first[1] == 0
    assert resumed[1] > 0  # part of b's context was still cached when it came back
    assert b.num_cached_tokens == 0  # reported for the first admission only
    assert b.num_generated == a.num_generated == 12
    assert b.token_ids[8:] == expected_output(b.token_ids[:8], 12)


def test_the_newest_request_preempts_itself_when_it_cannot_grow() -> None:
    sched = make_scheduler(4, enable_caching=False)
    a = make_request("a", prompt(1, 6), max_tokens=2)  # 2 blocks, stays within them
    b = make_request("b", prompt(2, 8), max_tokens=2)  # 2 blocks, its first decode needs a third
    sched.add(a)
    sched.add(b)
    step(sched)
    out = step(sched)
    assert out.preempted == [b]
    assert [ch.request for ch in out.chunks] == [a]
    assert list(sched.waiting) == [b]
    run_to_completion(sched)
    assert a.num_generated == b.num_generated == 2


def test_several_requests_preempted_in_one_step_newest_first() -> None:
    sched = make_scheduler(8, enable_caching=False)
    a = make_request("a", prompt(1, 7), max_tokens=10)  # 2 blocks; crosses into a third at step 2
    b = make_request("b", prompt(2, 7), max_tokens=10)  # the same, in lockstep with a
    sched.add(a)
    sched.add(b)
    step(sched)
    small = [make_request(f"s{i}", prompt(10 + i, 2), max_tokens=3) for i in range(4)]  # 1 block each
    for s in small:
        sched.add(s)
    out = step(sched)
    assert [c.request for c in out.chunks] == [a, b, *small]
    assert sched.kv.pool.num_free == 0

    out = step(sched)
    assert out.preempted == [small[3], small[2]]  # one victim for a, the next newest for b
    assert [c.request for c in out.chunks] == [a, b, small[0], small[1]]
    assert list(sched.waiting) == [small[2], small[3]]
    assert sched.num_preemptions == 2
    outs = run_to_completion(sched)
    assert all(a not in o.preempted and b not in o.preempted for o in outs)
    assert all(r.num_generated == r.sampling.max_tokens for r in [a, b, *small])


@pytest.mark.parametrize("enable_caching", [True, False])
def test_a_pool_of_exactly_one_full_context_serves_every_request(enable_caching: bool) -> None:
    """The docstring's guarantee: a request that fits the context alone never starves."""
    max_context = 24  # computed tokens at most: 12 prompt + 13 output - 1
    sched = make_scheduler(max_context // BS, enable_caching=enable_caching)
    requests = [make_request(f"r{i}", prompt(i, 12), max_tokens=13) for i in range(5)]
    for r in requests:
        sched.add(r)
    outs = run_to_completion(sched, max_steps=2_000)
    assert sched.num_preemptions > 0
    finish_step = {}
    for r in requests:
        assert r.num_generated == 13
        assert r.token_ids[12:] == expected_output(r.token_ids[:12], 13)
        finish_step[r.request_id] = max(i for i, *_ in chunks_of(outs, r))
    # Oldest first: nobody finishes before an older request.
    assert list(finish_step.values()) == sorted(finish_step.values())


# ------------------------------------------------------------------------------------------------
# abort


def test_abort_waiting_request() -> None:
    sched = make_scheduler(8, max_num_seqs=1)
    a = make_request("a", prompt(1, 4), max_tokens=5)
    b = make_request("b", prompt(2, 4), max_tokens=5)
    sched.add(a)
    sched.add(b)
    step(sched)
    free = sched.kv.pool.num_free
    assert sched.abort("b") is b
    assert b.status is RequestStatus.FINISHED
    assert list(sched.waiting) == []
    assert sched.kv.pool.num_free == free
    check_state(sched)
    run_to_completion(sched)
    assert b.num_generated == 0


def test_abort_mid_prefill_frees_blocks_at_once() -> None:
    sched = make_scheduler(16, max_num_batched_tokens=8)
    r = make_request("r", prompt(1, 30), max_tokens=3)
    sched.add(r)
    step(sched)
    step(sched)
    assert r.num_computed_tokens == 16
    assert sched.kv.pool.num_free == 12
    assert sched.abort("r") is r
    assert sched.kv.pool.num_free == 16
    assert sched.kv.block_tables == {}
    assert not sched.has_work()
    check_state(sched)
    # What was computed stays cached for the next request with that prefix.
    again = make_request("again", r.token_ids, max_tokens=1)
    sched.add(again)
    step(sched)
    assert again.num_cached_tokens == 16


def test_abort_mid_decode_frees_blocks_at_once() -> None:
    sched = make_scheduler(16, enable_caching=False)
    other = make_request("other", prompt(1, 6), max_tokens=10)
    r = make_request("r", prompt(2, 9), max_tokens=10)
    sched.add(other)
    step(sched)
    free_before = sched.kv.pool.num_free
    sched.add(r)
    for _ in range(3):
        step(sched)
    assert r.num_generated == 3
    assert sched.abort("r") is r
    assert free_before == 14
    assert sched.kv.pool.num_free == 16 - len(sched.kv.block_tables["other"])
    check_state(sched)
    run_to_completion(sched)
    assert other.num_generated == 10
    assert sched.kv.pool.num_free == 16


def test_abort_between_schedule_and_step_done() -> None:
    sched = make_scheduler(16)
    a = make_request("a", prompt(1, 6), max_tokens=3)
    b = make_request("b", prompt(2, 6), max_tokens=3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert sched.abort("b") is b
    sched.step_done(out)  # the aborted request's chunk is ignored
    assert b.num_computed_tokens == 0
    check_state(sched)
    assert sched.kv.pool.num_free == 16 - 2
    for chunk in out.chunks:
        if chunk.request.status is RequestStatus.RUNNING and chunk.completes:
            chunk.request.token_ids.append(next_token(chunk.request.token_ids))
    run_to_completion(sched)
    assert a.num_generated == 3
    assert sched.kv.pool.num_free == 16


def test_abort_of_a_preempted_request() -> None:
    sched = make_scheduler(4, enable_caching=False)
    a = make_request("a", prompt(1, 6), max_tokens=2)
    b = make_request("b", prompt(2, 8), max_tokens=2)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    assert list(sched.waiting) == [b]
    assert sched.abort("b") is b
    check_state(sched)
    run_to_completion(sched)
    assert sched.kv.pool.num_free == 4


def test_abort_of_an_unknown_or_finished_request_returns_none() -> None:
    sched = make_scheduler()
    assert sched.abort("nope") is None
    r = make_request("r", prompt(1, 3), max_tokens=1)
    sched.add(r)
    run_to_completion(sched)
    assert sched.abort("r") is None
    s = make_request("s", prompt(2, 3), max_tokens=1)
    sched.add(s)
    assert sched.abort("s") is s
    assert sched.abort("s") is None
    check_state(sched)


# ------------------------------------------------------------------------------------------------
# KVCacheManager directly


def test_kv_allocate_refuses_a_prefix_on_a_started_table() -> None:
    kv = KVCacheManager(BlockPool(8), BS)
    r = make_request("r", prompt(1, 8))
    assert kv.allocate(r, 4)
    with pytest.raises(ValueError):
        kv.allocate(r, 4, prefix=[kv.pool.blocks[5]])


def test_kv_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(BlockPool(3), BS)
    r = make_request("r", prompt(1, 20))
    assert not kv.allocate(r, 13)  # needs 4 blocks
    assert kv.block_tables == {}
    assert kv.pool.num_free == 3
    assert kv.allocate(r, 12)
    assert kv.block_table(r) == [0, 1, 2]
    kv.free(r)
    assert kv.pool.num_free == 3
    kv.pool.check_invariants()


def test_kv_free_releases_tail_first() -> None:
    kv = KVCacheManager(BlockPool(3), BS)
    r = make_request("r", prompt(1, 12))
    kv.allocate(r, 12)
    kv.free(r)
    assert [b.block_id for b in kv.pool.allocate(3)] == [2, 1, 0]


# ------------------------------------------------------------------------------------------------
# randomized end-to-end


@pytest.mark.parametrize(("seed", "bs", "enable_caching"), [(0x5EED, 8, True), (1, 16, True), (2, 8, False)])
def test_randomized_requests_with_arrivals_aborts_preemption_and_prefix_sharing(
    seed: int, bs: int, enable_caching: bool
) -> None:
    """1,000 requests through a small pool, checking every step against a shadow KV cache.

    Random prompt lengths (1..200), output lengths, arrival steps and cancellations (while
    waiting, mid-prefill, mid-decode, and between `schedule()` and `step_done()`), prompts
    built from a few common prefixes, and a pool that holds only a few sequences at a time so
    preemption is common. The shadow cache records, for each KV slot, which context (token and
    every token before it) it was computed for: a request admitted with a cached prefix (or
    finishing) must find its own context in every slot of its block table, and no step may
    write into a block that is shared or published in the prefix cache.
    """
    rng = random.Random(seed)
    max_prompt, max_output = 200, 24
    num_requests = 1000
    budget, max_num_seqs = 128, 8
    num_blocks = cdiv(max_prompt + max_output, bs) + 320 // bs  # one full context and a bit
    sched = make_scheduler(
        num_blocks,
        block_size=bs,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_caching=enable_caching,
    )
    kv, pool = sched.kv, sched.kv.pool

    prefixes = [prompt(1000 + i, n) for i, n in enumerate((24, 40, 64, 130))]
    prompts: list[list[int]] = []
    arrivals: dict[int, list[Request]] = {}
    # Cancellations: at a random step after arrival (whatever the request is doing then), or
    # targeted at a phase so that each one is surely hit: in its prefill, after k output tokens,
    # between `schedule()` and `step_done()` of a step that runs it, or once it was preempted.
    abort_at: dict[int, list[str]] = {}
    abort_in_prefill: set[str] = set()
    abort_after: dict[str, int] = {}
    abort_mid_step: set[str] = set()
    abort_if_preempted: set[str] = set()
    requests: list[Request] = []
    for i in range(num_requests):
        length = rng.randint(1, max_prompt)
        kind = rng.random()
        if kind < 0.5:
            p = rng.choice(prefixes)[:length]
            tokens = p + [rng.randrange(1, 32_000) for _ in range(length - len(p))]
        elif kind < 0.6 and prompts:
            tokens = list(rng.choice(prompts))  # the same prompt again (think n > 1)
        elif kind < 0.7:
            # Identical blocks behind different prefixes: they must not share keys/values.
            head = [rng.randrange(1, 32_000) for _ in range(rng.randint(1, 40))]
            tokens = (head + [7] * length)[:length]
        else:
            tokens = [rng.randrange(1, 32_000) for _ in range(length)]
        prompts.append(tokens)
        request = make_request(f"req-{i}", tokens, max_tokens=rng.randint(1, max_output))
        requests.append(request)
        arrive = rng.randrange(0, 1500)
        arrivals.setdefault(arrive, []).append(request)
        rid, dice = request.request_id, rng.random()
        if dice < 0.08:
            abort_at.setdefault(arrive + rng.randrange(0, 400), []).append(rid)
        elif dice < 0.11:
            abort_in_prefill.add(rid)
        elif dice < 0.15 and request.sampling.max_tokens > 1:
            abort_after[rid] = rng.randrange(1, request.sampling.max_tokens)
        elif dice < 0.18:
            abort_mid_step.add(rid)
        elif dice < 0.22:
            abort_if_preempted.add(rid)
    last_event = max([*arrivals, *abort_at])
    by_id = {r.request_id: r for r in requests}

    # A slot's keys/values depend on its token and every token before it: the shadow cache
    # stores a chained hash of the request's tokens up to and including that position.
    shadow: dict[int, list[int | None]] = {b.block_id: [None] * bs for b in pool.blocks}
    chains: dict[str, list[int]] = {}

    def context_hash(request: Request, pos: int) -> int:
        chain = chains.setdefault(request.request_id, [])
        while len(chain) <= pos:
            chain.append(hash((chain[-1] if chain else 0, request.token_ids[len(chain)])))
        return chain[pos]

    def verify_context(request: Request, end: int) -> None:
        table = kv.block_tables[request.request_id]
        for pos in range(end):
            assert shadow[table[pos // bs].block_id][pos % bs] == context_hash(request, pos), (request, pos)

    aborted: dict[str, str] = {}  # request id -> where it was when aborted
    abort_misses = 0

    def do_abort(request_id: str) -> None:
        nonlocal abort_misses
        request = by_id[request_id]
        if request.status is RequestStatus.WAITING:
            phase = "preempted" if request.admitted_before else "waiting"
        elif request.status is RequestStatus.RUNNING:
            phase = "prefill" if request.num_computed_tokens < request.num_prompt_tokens else "decode"
        else:
            phase = "finished"
        got = sched.abort(request_id)
        if phase in ("prefill", "decode") and request_id in abort_mid_step:
            phase = "mid-step " + phase
        if phase == "finished":
            assert got is None
            abort_misses += 1
        else:
            assert got is request
            assert request.status is RequestStatus.FINISHED
            assert request_id not in kv.block_tables
            aborted[request_id] = phase

    step_no = max_running = 0
    while step_no <= last_event or sched.has_work():
        assert step_no < 100_000, "no progress"
        for request in arrivals.get(step_no, []):
            sched.add(request)
        for request_id in abort_at.get(step_no, []):
            do_abort(request_id)
        for request in list(sched.waiting):
            if request.request_id in abort_if_preempted and request.admitted_before:
                do_abort(request.request_id)
        for request in list(sched.running):
            rid = request.request_id
            in_prefill = request.num_computed_tokens < request.num_prompt_tokens
            if (rid in abort_in_prefill and in_prefill) or request.num_generated >= abort_after.get(
                rid, 1 << 30
            ):
                do_abort(rid)
        if sched.abort(f"unknown-{step_no}") is not None:
            raise AssertionError("abort of an unknown id")

        running_before = list(sched.running)
        out = sched.schedule()
        check_schedule(sched, out, running_before)
        max_running = max(max_running, len(sched.running))
        for chunk in out.chunks:
            if chunk.request not in running_before:  # (re)admitted: its cached prefix is right
                verify_context(chunk.request, chunk.start)
        for chunk in out.chunks:
            if chunk.request.request_id in abort_mid_step and rng.random() < 0.3:
                do_abort(chunk.request.request_id)
        # "Run the model": write this step's keys/values into the shadow cache.
        for chunk in out.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue
            table = kv.block_tables[request.request_id]
            for pos in range(chunk.start, chunk.start + chunk.num_tokens):
                block = table[pos // bs]
                assert block.ref_count == 1 and block.block_hash is None, "write into a shared block"
                shadow[block.block_id][pos % bs] = context_hash(request, pos)
        sched.step_done(out)
        for chunk in out.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING or not chunk.completes:
                continue
            request.token_ids.append(next_token(request.token_ids))
            if request.num_generated == request.sampling.max_tokens:
                verify_context(request, request.num_computed_tokens)
                sched.finish(request)
        check_state(sched)
        step_no += 1

    for request in requests:
        assert request.status is RequestStatus.FINISHED
        if request.request_id in aborted:
            assert request.num_generated < request.sampling.max_tokens
        else:
            assert request.num_generated == request.sampling.max_tokens, request
        generated = request.token_ids[request.num_prompt_tokens :]
        assert generated == expected_output(request.token_ids[: request.num_prompt_tokens], len(generated))
    assert pool.num_free == pool.num_blocks
    assert kv.block_tables == {}
    assert not sched.running and not sched.waiting
    pool.check_invariants()

    # The run exercised what it is meant to.
    phases = Counter(aborted.values())
    for phase in ("waiting", "preempted", "prefill", "decode", "mid-step prefill", "mid-step decode"):
        assert phases[phase] > 0, phases
    assert sched.num_preemptions > 50
    assert max_running == max_num_seqs
    assert abort_misses > 0  # cancelling a request that already finished is a no-op
    if enable_caching:
        assert sum(r.num_cached_tokens > 0 for r in requests) > 100
    else:
        assert kv.prefix_hits == 0
    assert 100 < len(aborted) < num_requests // 2


# ------------------------------------------------------------------------------------------------
# LoRA device slots as a scheduler resource (real adapters, a real LoraStore)


def lora_scheduler(
    tmp_path: Path, names: list[str], slots: int, host: int
) -> tuple[Scheduler, LoraAdmission, threading.Event]:
    """A scheduler whose LoRA requests take `slots` device slots of a store over `names`; the
    event is set whenever an adapter's read into host memory ends."""
    from tests.test_lora import CONFIG, write_adapter

    source = tmp_path / "loras"
    for seed, name in enumerate(names):
        write_adapter(source / name, seed=seed)

    def reader(path: Path, name: str) -> LoraAdapter:
        return read_adapter(path, name, CONFIG, max_rank=16)

    store = LoraStore(source, reader, device_slots=slots, host_capacity=host)
    store.refresh()
    woken = threading.Event()
    lora = LoraAdmission(store, woken.set)
    kv = KVCacheManager(BlockPool(64), BS)
    return Scheduler(SchedulerConfig(8, 64), kv, lora), lora, woken


def test_a_lora_request_waits_in_the_queue_for_a_slot_and_the_requests_behind_it_go_on(
    tmp_path: Path,
) -> None:
    sched, lora, _ = lora_scheduler(tmp_path, ["a", "b"], slots=1, host=2)
    a1 = make_request("a1", prompt(1, 6), adapter="a")
    b = make_request("b", prompt(2, 6), adapter="b")
    a2 = make_request("a2", prompt(3, 6), adapter="a")
    base = make_request("base", prompt(4, 6))
    for request in (a1, b, a2, base):
        sched.add(request)
    first = step(sched)
    assert [c.request for c in first.chunks] == [a1, a2, base]  # b waits; its adapter's slot is a's
    assert list(sched.waiting) == [b] and b.lora_slot == NO_ADAPTER and b.num_computed_tokens == 0
    assert a1.lora_slot == a2.lora_slot == 0 and base.lora_slot == NO_ADAPTER
    assert [(slot, adapter.name) for slot, adapter in lora.take_fills()] == [(0, "a")]  # filled once
    assert a1.cache_salt is not None and a1.cache_salt.startswith("lora:a:") and base.cache_salt is None
    assert lora.store.running() == {"a": 2}
    outs = run_to_completion(sched)
    admitted = next(i for i, out in enumerate(outs) if b in [c.request for c in out.chunks])
    assert all(r.status is RequestStatus.FINISHED for r in (a1, a2)) and admitted > 0
    assert all(a1 not in [c.request for c in out.chunks] for out in outs[admitted:])  # after a's requests
    assert [(slot, adapter.name) for slot, adapter in lora.take_fills()] == [(0, "b")]
    assert lora.store.running() == {}  # every slot released with its request


def test_an_adapter_is_read_off_the_step_thread_and_an_idle_scheduler_waits_for_it(tmp_path: Path) -> None:
    sched, lora, woken = lora_scheduler(tmp_path, ["a", "b", "c"], slots=1, host=1)
    lora.store.load("c")  # host memory holds c alone
    request = make_request("r", prompt(1, 6), adapter="a")
    sched.add(request)
    out = sched.schedule()
    assert not out.chunks and list(sched.waiting) == [request]
    assert sched.stalled and not sched.has_work()  # the engine's loop sleeps until the read ends
    assert woken.wait(10)
    sched.wake()
    assert sched.has_work()
    out = sched.schedule()
    assert [c.request for c in out.chunks] == [request] and request.lora_slot == 0
    assert [adapter.name for _, adapter in lora.take_fills()] == ["a"]
    sched.abort("r")
    assert lora.store.running() == {}
    lora.close()


def test_requests_of_an_adapter_that_cannot_be_read_fail_with_the_reason(tmp_path: Path) -> None:
    from tests.test_lora import truncate

    sched, lora, woken = lora_scheduler(tmp_path, ["a", "b"], slots=1, host=1)
    lora.store.load("b")  # a is out of host memory
    truncate(tmp_path / "loras" / "a")  # and its file goes bad
    doomed = [make_request(f"a{i}", prompt(i, 6), adapter="a") for i in range(2)]
    base = make_request("base", prompt(9, 6))
    for request in (*doomed, base):
        sched.add(request)
    out = sched.schedule()
    assert [c.request for c in out.chunks] == [base]
    failed = list(out.failed)  # those admitted after the read failed, if it was that quick
    assert woken.wait(10)
    sched.wake()
    failed += sched.schedule().failed
    assert sorted(r.request_id for r, _ in failed) == ["a0", "a1"] and not sched.waiting
    for _, why in failed:
        assert "LoRA adapter a cannot be loaded" in why and "adapter_model.safetensors is" in why
    assert lora.store.names() == ["b"]
    late = make_request("late", prompt(5, 6), adapter="a")
    sched.add(late)
    out = sched.schedule()
    assert out.failed == [(late, "LoRA adapter a is no longer served")]
    lora.close()
