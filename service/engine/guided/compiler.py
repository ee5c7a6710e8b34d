"""The grammar compiler: compile jobs under the NIM_*GUIDED* limits, the compiled grammars kept, and
the per-row bitmasks a step applies (the package docstring tells the whole path).

Jobs. `submit` refuses a spec at once (its size, keywords xgrammar would not enforce, a spec
refused before) or finds it compiled already, else queues a `CompileJob` and returns it; one
thread per worker process takes jobs in arrival order, has its worker check the spec under the
time limit, then compiles it in this process and caches it. A job's `future` (concurrent.futures)
settles with None or the refusal; `cancel` stops a job that waits (it is skipped) or compiles (its
worker is killed, then replaced). `prepare` is the same for a caller on an event loop: awaiting it
waits for the job, and cancelling the await cancels the job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from service.engine.config import GuidedLimits
from service.engine.guided.cache import GrammarCache
from service.engine.guided.row import GuidedRow
from service.engine.guided.specs import NAMES, GrammarError, GuidedUnavailableError, build_grammar, check_spec
from service.engine.guided.worker import (
    CompileCrashedError,
    CompileWorker,
    WorkerFailedError,
    memory_bytes,
)
from service.engine.protocol import GuidedDecoding
from service.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

REFUSALS_KEPT = 256  # refused specs remembered (each at most NIM_MAX_GUIDED_SPEC_BYTES)
WORKER_RSS_LIMIT = 1 << 30  # a worker holding more after a compile is replaced (it starts at ~0.3 GB)


@dataclass(eq=False)
class CompileJob:
    """One spec waiting for, or in, a compile; `future` settles with None or its refusal."""

    guided: GuidedDecoding
    future: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    cancelled: bool = False
    worker: CompileWorker | None = None  # while a worker checks it
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Stop it: skipped if it still waits, its worker killed if it compiles (from any thread)."""
        with self._lock:
            self.cancelled = True
            worker = self.worker
        if worker is not None:
            pid = worker.kill()
            if pid is not None:
                log.info("structured output: request cancelled while its %s compiled; worker %d killed",
                         NAMES[self.guided.kind], pid)  # fmt: skip
        _settle(self.future, None)


class GrammarCompiler:
    """Checks and compiles GuidedDecoding specs for one tokenizer and vocabulary, under `limits`;
    thread-safe. `submit` / `prepare` (before a request is admitted) is the checked path; `compile`
    and `matcher` (the step) find what it cached."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: GuidedLimits | None = None) -> None:
        try:
            import xgrammar
        except ImportError as exc:
            raise GuidedUnavailableError(
                "structured output needs xgrammar, which is not installed "
                "(pip install 'nim-torch[structured]')"
            ) from exc
        self._xgr = xgrammar
        self.limits = limits or GuidedLimits()
        encoded = [
            b"" if tokenizer.is_special(i) and i not in tokenizer.eos_token_ids else tokenizer.token_bytes(i)
            for i in range(tokenizer.vocab_size)
        ]
        stop_token_ids = list(tokenizer.eos_token_ids)
        info = xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache = GrammarCache(self.limits.cache_bytes)
        self._refused: OrderedDict[GuidedDecoding, str] = OrderedDict()
        self._refused_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[CompileJob | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._workers = [
            CompileWorker((encoded, vocab_size, stop_token_ids)) for _ in range(self.limits.compile_workers)
        ]
        for worker in self._workers:  # each imports xgrammar (seconds) while requests go on
            self._restart(worker)
            args = (weakref.ref(self), worker, self._jobs)
            threading.Thread(target=_serve, args=args, name="grammar-compile", daemon=True).start()
        # Killed when the compiler is collected (its threads hold it only while they compile) or at exit.
        weakref.finalize(self, _stop, self._workers, self._jobs, self._closed)

    def close(self) -> None:
        """Kill the workers and end their threads; compiles after this are refused."""
        _stop(self._workers, self._jobs, self._closed)

    @property
    def worker_pids(self) -> list[int]:
        return [pid for pid in (worker.pid for worker in self._workers) if pid is not None]

    def submit(self, guided: GuidedDecoding) -> CompileJob | None:
        """Refuse `guided` (GrammarError, one line), find it compiled (None), or queue its compile
        (the job). Its compiled grammar stays cached while this `guided` object lives (the request
        carries it to the step)."""
        if self._known(guided):
            return None
        check_spec(guided, self.limits.max_spec_bytes)
        if self._closed.is_set():
            raise GuidedUnavailableError("structured output is shut down")
        job = CompileJob(guided)
        self._jobs.put(job)
        return job

    async def prepare(self, guided: GuidedDecoding) -> None:
        """`submit`, awaited: cancelling this cancels the compile (or the wait for a worker)."""
        job = self.submit(guided)
        if job is None:
            return
        try:
            await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.cancel()
            raise

    def _known(self, guided: GuidedDecoding) -> bool:
        """True when `guided` is compiled already (pinned for this request), GrammarError when it
        was refused already, False when it has still to be compiled."""
        if self._cache.get(guided, pin_for=guided) is not None:
            return True
        with self._refused_lock:
            refused = self._refused.get(guided)
        if refused is not None:
            raise GrammarError(refused)
        return False

    def _run(self, job: CompileJob, worker: CompileWorker) -> None:
        """One job on `worker`'s thread; its future settles."""
        outcome: BaseException | None = None
        try:
            if not self._known(job.guided):  # compiled meanwhile: many ask at once
                self._check_and_compile(job, worker)
        except BaseException as exc:  # handed to the request
            outcome = exc
        finally:
            if worker.pid is None and not self._closed.is_set():  # killed: a replacement starts now
                self._restart(worker)
        _settle(job.future, outcome)

    def _check_and_compile(self, job: CompileJob, worker: CompileWorker) -> None:
        guided, name = job.guided, NAMES[job.guided.kind]
        timeout_s = self.limits.compile_timeout_s
        with job._lock:
            if job.cancelled:  # after publishing the worker: a cancel either sees it or is seen here
                return
            job.worker = worker
        try:
            answer = worker.compile(guided, timeout_s)
        except TimeoutError:
            message = (
                f"the {name} did not compile within NIM_GUIDED_COMPILE_TIMEOUT_SECONDS={timeout_s:g} s; "
                "make it simpler (fewer optional properties, alternatives or nesting)"
            )
            log.warning("structured output: a %s compile passed %g s and was stopped", name, timeout_s)
            self._remember_refusal(guided, message)
            raise GrammarError(message) from None
        except CompileCrashedError as exc:
            if job.cancelled:
                return
            message = (
                f"the grammar compiler failed on this {name} (its process exited with code {exc.args[0]})"
            )
            log.warning("structured output: %s", message)
            self._remember_refusal(guided, message)
            raise GrammarError(message) from None
        except WorkerFailedError as exc:
            if job.cancelled:
                return
            log.warning("structured output: %s", exc)
            raise GuidedUnavailableError(f"structured output failed: {exc}") from None
        finally:
            with job._lock:
                job.worker = None
        if answer[0] == "refused":
            self._remember_refusal(guided, answer[1])
            raise GrammarError(answer[1])
        seconds, nbytes, resident = answer[1], answer[2], answer[3]
        log.debug("structured output: a %s compiled in %.3f s (%d bytes)", name, seconds, nbytes)
        if resident > WORKER_RSS_LIMIT:  # what the allocator kept after a large compile: start afresh
            worker.reap()
        if job.cancelled:
            return
        compiled = self._compiler.compile_grammar(build_grammar(self._xgr, guided))
        self._cache.put(guided, compiled, memory_bytes(compiled), guided)

    def _restart(self, worker: CompileWorker) -> None:
        """A worker process started now, for the next compile (which waits for it to be ready)."""
        try:
            worker.start()
        except WorkerFailedError as exc:
            log.warning("structured output: %s", exc)

    def _remember_refusal(self, guided: GuidedDecoding, message: str) -> None:
        with self._refused_lock:
            self._refused[guided] = message
            while len(self._refused) > REFUSALS_KEPT:
                self._refused.popitem(last=False)

    def compile(self, guided: GuidedDecoding) -> Any:
        """The compiled grammar for `guided`: the one `prepare` cached, else compiled here, at once
        and without limits (a request that did not pass through the engine's check)."""
        found = self._cache.get(guided)
        if found is not None:
            return found
        compiled = self._compiler.compile_grammar(build_grammar(self._xgr, guided))
        self._cache.put(guided, compiled, memory_bytes(compiled))
        return compiled

    def matcher(self, guided: GuidedDecoding) -> GuidedRow:
        return GuidedRow(
            self._xgr.GrammarMatcher(self.compile(guided)), guided.start_after, guided.opens_with
        )

    def bitmask(self, rows: int) -> torch.Tensor:
        mask: torch.Tensor = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        return mask

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
        """Disallowed tokens of rows `indices` of logits [R, V] become -inf, in place."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)


def _serve(
    compiler: weakref.ref[GrammarCompiler], worker: CompileWorker, jobs: queue.SimpleQueue[CompileJob | None]
) -> None:
    """A worker's thread: the jobs, one at a time, in arrival order, until the end (None) or the
    compiler is gone."""
    while (job := jobs.get()) is not None:
        held = compiler()
        if held is None:
            return
        if not job.cancelled:
            held._run(job, worker)
        del held


def _settle(future: concurrent.futures.Future[None], outcome: BaseException | None) -> None:
    """Settle once: a job cancelled (settled with None) while its worker ran stays settled."""
    try:
        if outcome is None:
            future.set_result(None)
        else:
            future.set_exception(outcome)
    except concurrent.futures.InvalidStateError:
        pass


def _stop(
    workers: list[CompileWorker], jobs: queue.SimpleQueue[CompileJob | None], closed: threading.Event
) -> None:
    closed.set()  # no replacements from here on
    for worker in workers:
        jobs.put(None)  # one end-of-work per worker thread
        worker.reap()
