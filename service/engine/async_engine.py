"""An EngineCore served in this process: one thread drives it, the event loop never waits on it.

    event loop                          driving thread (service.engine.core.drive)
    generate -> Submit ---- inbox ----> add_request / abort / step
    per-request queues <-- deliver <--- each round's outputs (stats published first),
    (one wake per loop per round)       one batch

All of the core's PyTorch work (warm-up included) runs on the driving thread. If the core fails
(its step raises, or a helper reports a Fail), the engine is dead: every request in flight ends
with an error, `ready` turns False, `failure` says why, later `generate` calls raise
EngineDeadError, and `on_fatal` is called so the process can exit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Sequence

from service.engine.core import Abort, Command, EngineCore, Fail, Stop, Submit, Wake, drive
from service.engine.guided.specs import GrammarError
from service.engine.protocol import (
    AdapterCatalog,
    ConstraintRefusedError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    KVEvent,
    RequestOutput,
)
from service.engine.streams import Streams
from service.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle driving thread waits for a command before looking again
STOP_JOIN_S = 30.0  # how long a stop waits for the driving thread


class AsyncEngine:
    """The Engine protocol over a core driven on a thread of this process."""

    def __init__(self, core: EngineCore, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.core = core
        self.on_fatal = on_fatal
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams = Streams()
        self._thread: threading.Thread | None = None
        self._ready = False

    @property
    def info(self) -> EngineInfo:
        return self.core.info

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def adapters(self) -> AdapterCatalog | None:
        return self.core.adapters

    @property
    def ready(self) -> bool:
        return self._ready and self._streams.failure is None

    @property
    def failure(self) -> str | None:
        return self._streams.failure

    async def start(self) -> None:
        """Warm up on the driving thread, which then drives the core; returns once warmed up."""
        loop = asyncio.get_running_loop()
        warmed: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if not warmed.done():
                warmed.set_result(None) if error is None else warmed.set_exception(error)

        def run() -> None:
            try:
                self.core.start(lambda: self._inbox.put(Wake()), lambda exc: self._inbox.put(Fail(exc)))
            except BaseException as exc:
                loop.call_soon_threadsafe(settle, exc)
                return
            loop.call_soon_threadsafe(settle, None)
            self._drive()

        self._thread = threading.Thread(target=run, name="engine-core", daemon=True)
        self._thread.start()
        try:
            await warmed
        except BaseException:
            await asyncio.to_thread(self.core.shutdown)
            raise
        self._ready = True

    async def stop(self) -> None:
        """Every request in flight ends (aborted); the driving thread and the core's helpers stop."""
        self._ready = False
        self._inbox.put(Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, STOP_JOIN_S)
        self._streams.fail(None)
        await asyncio.to_thread(self.core.shutdown)

    async def check(self, request: GenerationRequest) -> None:
        """The core's refusal, else the compile its constraint needs (cancelling this cancels it)."""
        job = self.core.prepare(request)
        if job is None:
            return
        try:
            await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.cancel()
            raise
        except GrammarError as exc:
            raise ConstraintRefusedError(str(exc)) from None

    def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        request_id = request.request_id
        return self._streams.follow(
            request, lambda: self._inbox.put(Submit(request)), lambda: self._inbox.put(Abort(request_id))
        )

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def stats(self) -> EngineStats:
        return self.core.stats()

    def kv_events(self) -> list[KVEvent]:
        return self.core.kv_events()

    # --- The driving thread ------------------------------------------------------------------------

    def _commands(self, wait: bool) -> Sequence[Command]:
        commands: list[Command] = []
        try:
            commands.append(self._inbox.get(timeout=IDLE_WAIT_S) if wait else self._inbox.get_nowait())
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            return commands

    def _drive(self) -> None:
        try:
            drive(self.core, self._commands, self._streams.deliver)
        except BaseException as exc:  # the core must never die silently
            log.exception("engine core failed")
            message, error = self.core.death(exc)
            self._streams.mark_failed(message)  # readiness fails first; no request is taken from here
            self._streams.deliver(self.core.end_all(f"engine failure: {message}"))
            self._streams.fail(message)  # what was submitted but never reached the core ends too
            if self.on_fatal is not None:
                self.on_fatal(error)
