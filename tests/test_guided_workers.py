"""The grammar compiler's worker processes and cache, in process (no server).

A compile whose request is cancelled has its worker killed and reaped (no zombie), a replacement
starts, and no file descriptor is left behind, however often it happens; a worker that dies while
compiling is a refusal of that spec, and the next compile works; a request waiting for a compile
slot stops waiting when cancelled, without disturbing the compile that holds the slot; the cache
keeps to its byte budget except for grammars that live requests were checked with.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import time
from collections.abc import Iterator

import pytest

from service.engine.config import GuidedLimits
from service.engine.guided.cache import GrammarCache as _GrammarCache
from service.engine.guided.compiler import GrammarCompiler
from service.engine.guided.specs import GrammarError
from service.engine.protocol import GuidedDecoding
from tests.conftest import process_alive

pytest.importorskip("xgrammar")


def _slow(tag: str) -> GuidedDecoding:
    """An object with 3,000 optional properties: minutes of compiling."""
    return GuidedDecoding(
        "json_schema", json.dumps({"type": "object", "properties": {f"{tag}{i}": {} for i in range(3000)}})
    )


@pytest.fixture(scope="module")
def compiler(embedded_tokenizer) -> Iterator[GrammarCompiler]:
    grammars = GrammarCompiler(
        embedded_tokenizer,
        embedded_tokenizer.vocab_size,
        GuidedLimits(compile_timeout_s=60, compile_workers=1),
    )
    yield grammars
    grammars.close()


async def _compiling(compiler: GrammarCompiler, guided: GuidedDecoding) -> tuple[asyncio.Task[None], int]:
    """`guided` being compiled by a ready worker: the task and the worker's pid."""
    await compiler.prepare(GuidedDecoding("regex", f"[a-c]{{{time.monotonic_ns() % 1000}}}"))  # ready
    (pid,) = compiler.worker_pids
    task = asyncio.ensure_future(compiler.prepare(guided))
    await asyncio.sleep(1)
    assert not task.done()
    return task, pid


def _descriptors() -> list[str]:
    """What this process's descriptors point at ("pipe:[123]", a path...), one entry per descriptor."""
    entries = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            entries.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the descriptor listdir itself used
            continue
    return entries


def test_a_cancelled_compile_kills_its_worker_and_leaves_nothing_behind(compiler: GrammarCompiler) -> None:
    async def scenario() -> None:
        await compiler.prepare(GuidedDecoding("regex", "[0-9]+"))
        gc.collect()
        before = _descriptors()
        for round_ in range(3):
            task, pid = await _compiling(compiler, _slow(f"c{round_}"))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 5
            while (process_alive(pid) or compiler.worker_pids in ([], [pid])) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not process_alive(pid), "the cancelled compile's worker still runs"
            assert compiler.worker_pids and compiler.worker_pids != [pid], "no replacement started"
        await compiler.prepare(GuidedDecoding("regex", "[a-z]+"))  # the replacement compiles
        gc.collect()
        after = _descriptors()
        # Other tests' objects may close descriptors meanwhile (the count can fall); three rounds that
        # each left a pipe behind would raise it by three.
        kept = sorted(set(after) - set(before))
        assert len(after) <= len(before), f"descriptors opened and not closed: {kept}"

    asyncio.run(scenario())


def test_a_worker_dying_mid_compile_refuses_that_spec_and_the_next_compiles(
    compiler: GrammarCompiler,
) -> None:
    async def scenario() -> None:
        task, pid = await _compiling(compiler, _slow("k"))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(GrammarError, match="the grammar compiler failed on this JSON schema"):
            await asyncio.wait_for(task, 10)
        await asyncio.wait_for(compiler.prepare(GuidedDecoding("regex", "[k-m]+")), 60)
        assert not process_alive(pid)

    asyncio.run(scenario())


def test_a_wait_for_a_slot_ends_when_cancelled(compiler: GrammarCompiler) -> None:
    async def scenario() -> None:
        holder, pid = await _compiling(compiler, _slow("w"))  # the one slot
        waiting = asyncio.ensure_future(compiler.prepare(GuidedDecoding("regex", "[w-z]+")))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        started = time.monotonic()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert time.monotonic() - started < 1
        assert not holder.done() and process_alive(pid)  # the compile holding the slot goes on
        holder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holder

    asyncio.run(scenario())


def test_the_cache_keeps_to_its_budget_but_not_past_live_requests() -> None:
    cache = _GrammarCache(budget=100)
    specs = [GuidedDecoding("regex", str(i)) for i in range(4)]
    first, second = GuidedDecoding("regex", "0"), GuidedDecoding("regex", "1")  # requests' own objects
    cache.put(specs[0], "g0", 60, pin_for=first)
    cache.put(specs[2], "g2", 30)
    cache.put(specs[3], "g3", 30)  # 120: the least recent unpinned (g2) goes; g0 stays, pinned
    assert cache.get(specs[2]) is None and cache.get(specs[0]) == "g0" and cache.total == 90
    cache.put(specs[1], "g1", 60, pin_for=second)  # 150: g3 goes, and both pinned stay over budget
    assert cache.get(specs[3]) is None and cache.total == 120
    del first, second
    gc.collect()  # their requests are over: their grammars may go
    assert cache.total <= 100 and cache.get(specs[1]) == "g1"


def test_a_caller_without_an_event_loop_submits_and_cancels(compiler: GrammarCompiler) -> None:
    """The engine process has no event loop: it submits a job and waits on (or cancels) its future."""
    job = compiler.submit(GuidedDecoding("regex", f"[p-r]{{{time.monotonic_ns() % 997}}}"))
    assert job is not None
    assert job.future.result(timeout=60) is None
    assert compiler.submit(job.guided) is None  # compiled already: nothing to wait for
    slow = compiler.submit(_slow("s"))
    waiting = compiler.submit(GuidedDecoding("regex", "[s-u]+"))
    assert slow is not None and waiting is not None
    waiting.cancel()  # skipped when its turn comes
    assert waiting.future.done()
    slow.cancel()  # its worker is killed
    assert slow.future.result(timeout=10) is None
    with pytest.raises(GrammarError, match="invalid regular expression"):
        refused = compiler.submit(GuidedDecoding("regex", "(unclosed"))
        assert refused is not None
        refused.future.result(timeout=60)
