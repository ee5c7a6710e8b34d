"""BlockPool and hash_block: reference counts, the LRU free queue, and the prefix-cache index.

Pure Python, no model: in the spirit of vLLM's block-pool / prefix-caching unit tests. Every test
ends (and most steps end) with `check_invariants()`, the pool's own statement of its accounting.
"""

from __future__ import annotations

import random

import pytest

from service.engine.kv_events import KVEventLog
from service.engine.protocol import KVBlocksRemoved, KVBlockStored, KVCacheCleared, SamplingParams
from service.engine.torch.block_pool import ROOT_HASH, Block, BlockPool, event_id, hash_block
from service.engine.torch.kv_cache_manager import KVCacheManager
from service.engine.torch.request import Request


def h(n: int) -> bytes:
    """A distinct, recognisable block hash."""
    return hash_block(ROOT_HASH, [n])


def free_order(pool: BlockPool) -> list[int]:
    """Block ids in the order allocation would take them (drained and restored)."""
    blocks = pool.allocate(pool.num_free)
    order = [b.block_id for b in blocks]
    # Releasing in the same order puts them back at the tail in the same order; hashes are
    # gone though, so only use this at the end of a test.
    pool.release(blocks)
    return order


# ------------------------------------------------------------------------------------------------
# allocation and release accounting


def test_new_pool_is_all_free() -> None:
    pool = BlockPool(8)
    assert pool.num_blocks == 8
    assert pool.num_free == 8
    assert pool.usage == 0.0
    assert all(b.ref_count == 0 and b.block_hash is None for b in pool.blocks)
    assert [b.block_id for b in pool.blocks] == list(range(8))
    pool.check_invariants()


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_needs_at_least_one_block(num_blocks: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks)


def test_allocate_and_release_accounting() -> None:
    pool = BlockPool(10)
    taken = pool.allocate(4)
    pool.check_invariants()
    assert len(taken) == 4
    assert len({b.block_id for b in taken}) == 4
    assert all(b.ref_count == 1 for b in taken)
    assert pool.num_free == 6
    assert pool.usage == pytest.approx(0.4)

    more = pool.allocate(6)
    pool.check_invariants()
    assert pool.num_free == 0
    assert pool.usage == 1.0
    assert {b.block_id for b in taken} | {b.block_id for b in more} == set(range(10))

    pool.release(taken)
    pool.check_invariants()
    assert pool.num_free == 4
    assert all(b.ref_count == 0 for b in taken)
    pool.release(more)
    pool.check_invariants()
    assert pool.num_free == 10
    assert pool.usage == 0.0


def test_allocate_zero_blocks_is_a_no_op() -> None:
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.num_free == 3
    pool.release([])
    assert pool.num_free == 3
    pool.check_invariants()


def test_fresh_pool_allocates_in_block_id_order() -> None:
    pool = BlockPool(5)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert [b.block_id for b in pool.allocate(2)] == [3, 4]
    pool.check_invariants()


def test_over_allocation_raises_memory_error_and_changes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(3)
    pool.register(held[0], h(1))
    pool.release(held[:1])  # a cached free block: must not be evicted by the failed call
    before = (pool.num_free, [(b.ref_count, b.block_hash) for b in pool.blocks])
    with pytest.raises(MemoryError):
        pool.allocate(3)
    assert (pool.num_free, [(b.ref_count, b.block_hash) for b in pool.blocks]) == before
    assert pool.lookup(h(1)) is held[0]
    pool.check_invariants()


def test_over_allocating_an_empty_pool_raises() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.check_invariants()


def test_double_release_raises() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.release([block])
    pool.check_invariants()
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([block])
    assert block.ref_count == 0
    assert pool.num_free == 4
    pool.check_invariants()


def test_releasing_a_never_allocated_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.release([pool.blocks[1]])
    pool.check_invariants()


def test_shared_block_ref_counts() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.register(block, h(7))
    pool.touch(block)  # a second request hits it
    pool.touch(block)  # and a third
    assert block.ref_count == 3
    assert pool.num_free == 3
    pool.check_invariants()

    pool.release([block])
    assert block.ref_count == 2
    assert pool.num_free == 3  # still referenced: not allocatable
    pool.check_invariants()
    pool.release([block])
    pool.release([block])
    assert block.ref_count == 0
    assert pool.num_free == 4
    pool.check_invariants()
    with pytest.raises(RuntimeError):
        pool.release([block])


def test_referenced_blocks_are_never_handed_out_twice() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)
    b = pool.allocate(3)
    assert not {x.block_id for x in a} & {x.block_id for x in b}
    pool.release(a[1:2])
    (c,) = pool.allocate(1)
    assert c is a[1]
    pool.check_invariants()


# ------------------------------------------------------------------------------------------------
# LRU eviction of unreferenced cached blocks


def test_lru_eviction_takes_least_recently_released_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.register(block, h(i))
    # Release in a scrambled order: 2, 0, 3, 1.
    for i in (2, 0, 3, 1):
        pool.release([blocks[i]])
        pool.check_invariants()
    assert pool.num_free == 4
    assert all(pool.lookup(h(i)) is blocks[i] for i in range(4))  # free but still cached

    evicted_order = []
    for _ in range(4):
        (block,) = pool.allocate(1)
        pool.check_invariants()
        evicted_order.append(block.block_id)
        assert block.block_hash is None
    assert evicted_order == [blocks[i].block_id for i in (2, 0, 3, 1)]


def test_allocating_an_evicted_block_drops_its_hash() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, h(1))
    pool.register(b, h(2))
    pool.release([a, b])
    (evicted,) = pool.allocate(1)
    pool.check_invariants()
    assert evicted is a
    assert a.block_hash is None
    assert pool.lookup(h(1)) is None  # miss: its contents are about to be overwritten
    assert pool.lookup(h(2)) is b  # the other one survives
    # The evicted block can be cached again under new contents.
    pool.register(a, h(3))
    assert pool.lookup(h(3)) is a
    pool.check_invariants()


def test_never_used_blocks_are_allocated_before_cached_ones() -> None:
    """Released blocks join the tail, behind blocks that were never allocated."""
    pool = BlockPool(6)
    cached = pool.allocate(2)
    pool.register(cached[0], h(0))
    pool.register(cached[1], h(1))
    pool.release(cached)
    fresh = pool.allocate(4)
    pool.check_invariants()
    assert {b.block_id for b in fresh} == {2, 3, 4, 5}
    assert pool.lookup(h(0)) is cached[0]
    assert pool.lookup(h(1)) is cached[1]
    # Only now do cached blocks go, oldest released first.
    (next_block,) = pool.allocate(1)
    assert next_block is cached[0]
    assert pool.lookup(h(0)) is None
    assert pool.lookup(h(1)) is cached[1]
    pool.check_invariants()


def test_touch_and_release_moves_a_block_to_the_most_recent_end() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for i, block in enumerate((a, b, c)):
        pool.register(block, h(i))
    pool.release([a, b, c])  # LRU order now a, b, c
    pool.touch(a)  # hit on a: leaves the free queue
    pool.check_invariants()
    pool.release([a])  # back at the tail: b, c, a
    pool.check_invariants()
    assert [x.block_id for x in pool.allocate(3)] == [b.block_id, c.block_id, a.block_id]
    pool.check_invariants()


def test_release_order_within_one_call_sets_lru_order() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.release(blocks[::-1])
    assert free_order(pool) == [2, 1, 0]
    pool.check_invariants()


def test_unhashed_free_blocks_are_plain_fifo() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.release([blocks[3], blocks[1]])
    pool.release([blocks[0]])
    pool.release([blocks[2]])
    assert free_order(pool) == [3, 1, 0, 2]
    pool.check_invariants()


# ------------------------------------------------------------------------------------------------
# register / lookup / touch


def test_register_then_lookup_hits_while_referenced() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    assert pool.lookup(h(5)) is None
    pool.register(block, h(5))
    pool.check_invariants()
    assert block.block_hash == h(5)
    assert pool.lookup(h(5)) is block
    assert pool.lookup(h(6)) is None


def test_touch_of_a_free_cached_block_removes_it_from_the_free_queue() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.register(a, h(1))
    pool.release([a, b, c])
    assert pool.num_free == 3

    hit = pool.lookup(h(1))
    assert hit is a
    pool.touch(hit)
    pool.check_invariants()
    assert a.ref_count == 1
    assert pool.num_free == 2
    # The remaining free blocks can be allocated without evicting the touched one...
    rest = pool.allocate(2)
    assert a not in rest
    assert pool.lookup(h(1)) is a
    # ...and nothing more.
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.check_invariants()


def test_touch_of_a_referenced_block_only_adds_a_reference() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.register(a, h(1))
    pool.touch(a)
    assert a.ref_count == 2
    assert pool.num_free == 2
    pool.check_invariants()


def test_duplicate_hash_registration_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    pool.register(first, h(9))
    pool.register(second, h(9))  # same tokens computed twice (two requests admitted together)
    pool.check_invariants()
    assert pool.lookup(h(9)) is first
    assert second.block_hash is None  # stays private
    # Releasing and evicting the private duplicate does not disturb the cached one.
    pool.release([second])
    assert pool.allocate(pool.num_free)  # evicts whatever is free, including `second`
    assert pool.lookup(h(9)) is first
    pool.check_invariants()


def test_register_of_an_already_hashed_block_is_a_no_op() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.register(block, h(1))
    pool.register(block, h(2))
    pool.check_invariants()
    assert block.block_hash == h(1)
    assert pool.lookup(h(1)) is block
    assert pool.lookup(h(2)) is None


def test_register_of_a_free_block_keeps_it_evictable() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    pool.register(block, h(4))
    pool.check_invariants()
    assert pool.lookup(h(4)) is block
    assert pool.num_free == 2


def test_reset_cache_forgets_every_hash() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.register(block, h(i))
    pool.release(blocks[:2])
    pool.reset_cache()
    pool.check_invariants()
    assert all(pool.lookup(h(i)) is None for i in range(3))
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free == 3  # reference counts untouched
    assert blocks[2].ref_count == 1
    # Hashes can be registered again afterwards.
    pool.register(blocks[2], h(2))
    assert pool.lookup(h(2)) is blocks[2]
    pool.check_invariants()


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.allocate(2)
    pool.register(blocks[0], h(1))
    pool.check_invariants()
    assert blocks[0].block_hash is None
    assert pool.lookup(h(1)) is None
    pool.release(blocks)
    assert pool.lookup(h(1)) is None
    assert pool.num_free == 4
    pool.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    """The checker the other tests lean on actually catches broken accounting."""
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    block.ref_count = 0  # referenced-looking state gone, but not in the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()

    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    block.block_hash = h(1)  # a hash the index does not know
    with pytest.raises(AssertionError):
        pool.check_invariants()


# ------------------------------------------------------------------------------------------------
# hash chain


def test_hash_block_is_deterministic_and_16_bytes() -> None:
    a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block(ROOT_HASH, (1, 2, 3, 4))  # any sequence
    assert isinstance(a, bytes)
    assert len(a) == 16
    assert len(ROOT_HASH) == 16


def test_same_tokens_with_different_parents_hash_differently() -> None:
    tokens = [10, 20, 30, 40]
    parent_a = hash_block(ROOT_HASH, [1, 1, 1, 1])
    parent_b = hash_block(ROOT_HASH, [2, 2, 2, 2])
    hashes = {hash_block(p, tokens) for p in (ROOT_HASH, parent_a, parent_b)}
    assert len(hashes) == 3


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ([1, 2, 3, 4], [1, 2, 3, 5]),
        ([1, 2, 3, 4], [4, 3, 2, 1]),  # order matters
        ([1, 2], [1, 2, 0]),  # a trailing zero token is not padding
        ([256], [1, 0]),  # no byte-level aliasing between token boundaries
        ([0], [-1]),
        ([2**31], [2**31 + 1]),  # beyond 32 bits
        ([], [0]),
    ],
)
def test_different_tokens_hash_differently(a: list[int], b: list[int]) -> None:
    assert hash_block(ROOT_HASH, a) != hash_block(ROOT_HASH, b)


def test_hash_block_accepts_large_vocabulary_ids() -> None:
    assert len(hash_block(ROOT_HASH, [2**63 - 1, 0, 151_935])) == 16


def test_request_full_block_hashes_chain_from_the_root() -> None:
    tokens = list(range(100, 111))  # 11 tokens: two full blocks of 4 plus 3
    request = Request("r", list(tokens), len(tokens), SamplingParams(max_tokens=4), 0.0)
    hashes = request.full_block_hashes(4)
    first = hash_block(ROOT_HASH, tokens[0:4])
    second = hash_block(first, tokens[4:8])
    assert hashes == [first, second]

    # Extended incrementally as tokens are appended; earlier hashes unchanged.
    request.token_ids.append(111)
    assert request.full_block_hashes(4) == [first, second, hash_block(second, [*tokens[8:11], 111])]


def test_identical_block_after_different_prefixes_hashes_differently() -> None:
    shared_tail = [7, 7, 7, 7]
    r1 = Request("a", [1, 2, 3, 4, *shared_tail], 8, SamplingParams(max_tokens=1), 0.0)
    r2 = Request("b", [9, 2, 3, 4, *shared_tail], 8, SamplingParams(max_tokens=1), 0.0)
    h1, h2 = r1.full_block_hashes(4), r2.full_block_hashes(4)
    assert h1[0] != h2[0]
    assert h1[1] != h2[1]  # same tokens, different prefix: must not share keys/values

    r3 = Request("c", [1, 2, 3, 4, 5, 5, 5, 5], 8, SamplingParams(max_tokens=1), 0.0)
    h3 = r3.full_block_hashes(4)
    assert h3[0] == h1[0]  # shared first block
    assert h3[1] != h1[1]


# ------------------------------------------------------------------------------------------------
# randomized: a shadow model of the pool


@pytest.mark.parametrize("enable_caching", [True, False])
def test_random_operations_against_a_shadow_model(enable_caching: bool) -> None:
    rng = random.Random(20240611 + enable_caching)
    n = 16
    pool = BlockPool(n, enable_caching=enable_caching)
    refs = {i: 0 for i in range(n)}  # shadow reference counts
    lru: list[int] = list(range(n))  # shadow free queue, front = next to allocate
    cached: dict[bytes, int] = {}  # shadow index
    held: list[Block] = []  # one entry per reference we own

    for _ in range(3000):
        op = rng.random()
        if op < 0.3:
            count = rng.randint(0, 5)
            if count > len(lru):
                with pytest.raises(MemoryError):
                    pool.allocate(count)
            else:
                taken = pool.allocate(count)
                expected = lru[:count]
                del lru[:count]
                assert [b.block_id for b in taken] == expected
                for b in taken:
                    refs[b.block_id] = 1
                    for key in [k for k, v in cached.items() if v == b.block_id]:
                        del cached[key]
                held.extend(taken)
        elif op < 0.6 and held:
            block = held.pop(rng.randrange(len(held)))
            pool.release([block])
            refs[block.block_id] -= 1
            if refs[block.block_id] == 0:
                lru.append(block.block_id)
        elif op < 0.75 and held:
            block = rng.choice(held)
            key = h(rng.randrange(24))
            pool.register(block, key)
            already = any(v == block.block_id for v in cached.values())
            if enable_caching and not already and key not in cached:
                cached[key] = block.block_id
        else:
            key = h(rng.randrange(24))
            hit = pool.lookup(key)
            expected_id = cached.get(key)
            assert (hit.block_id if hit else None) == expected_id
            if hit is not None and rng.random() < 0.7:
                pool.touch(hit)
                if refs[hit.block_id] == 0:
                    lru.remove(hit.block_id)
                refs[hit.block_id] += 1
                held.append(hit)

        pool.check_invariants()
        assert pool.num_free == len(lru)
        assert [b.ref_count for b in pool.blocks] == [refs[i] for i in range(n)]
        assert {k: b.block_id for k, b in pool._cached.items()} == cached

    pool.release(held)
    pool.check_invariants()
    assert pool.num_free == n


# ------------------------------------------------------------------------------------------------
# the event log a KV-aware router follows (Engine.kv_events; service/dynamo publishes it)


def _router_view(events: list, view: dict[int, int | None] | None = None) -> dict[int, int | None]:
    """Replay events as a router indexes them: id -> parent id, refusing what a router refuses."""
    view = {} if view is None else view
    for event in events:
        if isinstance(event, KVBlockStored):
            assert event.parent_hash is None or event.parent_hash in view, "stored before its parent"
            view[event.block_hash] = event.parent_hash
        elif isinstance(event, KVBlocksRemoved):
            for block_id in event.block_hashes:
                assert block_id in view, "removed before it was stored"
                del view[block_id]
        else:
            assert isinstance(event, KVCacheCleared)
            view.clear()
    return view


def test_event_log_records_stores_evictions_forgets_and_resets_in_order() -> None:
    log = KVEventLog()
    pool = BlockPool(2, events=log)
    a, b = pool.allocate(2)
    pool.register(a, h(1), None, [1, 2], None)
    pool.register(b, h(2), h(1), [3, 4], "ad1")
    assert log.drain() == [
        KVBlockStored(event_id(h(1)), None, (1, 2), None),
        KVBlockStored(event_id(h(2)), event_id(h(1)), (3, 4), "ad1"),
    ]
    assert log.drain() == []  # drained once
    pool.register(b, h(3))  # already holds h(2): no second store
    pool.release([b, a])
    (c,) = pool.allocate(1)  # evicts b (released first)
    assert log.drain() == [KVBlocksRemoved((event_id(h(2)),))]
    pool.forget(a)  # a still cached (free): unpublished
    pool.forget(a)  # nothing left to unpublish
    assert log.drain() == [KVBlocksRemoved((event_id(h(1)),))]
    pool.register(c, h(4))
    pool.reset_cache()
    events = log.drain()
    assert events[-1] == KVCacheCleared() and len(events) == 2
    assert -(2**63) <= event_id(h(4)) < 2**63


def test_event_log_overflow_starts_over_with_a_clear() -> None:
    log = KVEventLog(capacity=3)
    log.extend(KVBlocksRemoved((i,)) for i in range(5))
    assert log.overflows == 1
    assert log.drain() == [KVCacheCleared(), KVBlocksRemoved((3,)), KVBlocksRemoved((4,))]


def test_manager_publishes_each_full_block_after_its_parent_with_its_tokens() -> None:
    log = KVEventLog()
    kv = KVCacheManager(BlockPool(8, events=log), 4)
    request = Request("r", list(range(10)), 10, SamplingParams(max_tokens=4), 0.0, adapter="ad1")
    assert kv.allocate(request, 10)
    request.num_computed_tokens = 10
    kv.register_full_blocks(request)
    first, second = request.full_block_hashes(4)
    assert log.drain() == [
        KVBlockStored(event_id(first), None, (0, 1, 2, 3), "ad1"),
        KVBlockStored(event_id(second), event_id(first), (4, 5, 6, 7), "ad1"),
    ]


@pytest.mark.parametrize("seed", range(3))
def test_random_requests_keep_the_router_view_equal_to_the_cache(seed: int) -> None:
    """Requests with shared prefixes come and go through a small pool (evictions, discards, a
    reset): replaying the log as a router would never meets a child before its parent or an
    unknown removal, and ends with exactly the blocks the pool has cached, linked to their parents."""
    rng = random.Random(seed)
    log = KVEventLog()
    pool = BlockPool(12, events=log)
    kv = KVCacheManager(pool, 4)
    view: dict[int, int | None] = {}
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    live: list[Request] = []
    for step in range(300):
        if live and (rng.random() < 0.45 or len(live) > 3):
            done = live.pop(rng.randrange(len(live)))
            kv.free(done, discard=rng.random() < 0.1)
        else:
            tokens = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(rng.randrange(1, 9)))]
            request = Request(f"r{step}", tokens, len(tokens), SamplingParams(max_tokens=1), 0.0)
            prefix = kv.cached_prefix(request)
            if kv.allocate(request, len(tokens) - len(prefix) * 4, prefix):
                request.num_computed_tokens = len(tokens)
                kv.register_full_blocks(request)
                live.append(request)
        if step == 150:
            pool.reset_cache()
        _router_view(log.drain(), view)
        pool.check_invariants()
        assert set(view) == {event_id(hash_) for hash_ in pool._cached}
    for request in live:
        for i, hash_ in enumerate(request.full_block_hashes(4)[: request.num_computed_tokens // 4]):
            if hash_ in pool._cached and i:
                assert view[event_id(hash_)] == event_id(request.full_block_hashes(4)[i - 1])
