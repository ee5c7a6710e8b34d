"""The engine process's side of service.engine.process, and the messages the two sides exchange.

The engine process runs `load_engine(config)` and serves that engine through the `Engine`
protocol: a reader thread hands the API process's messages to its event loop, a task per request
forwards the engine's outputs, and the outputs of one step leave in one Update with the stats. It
exits when told to stop, when its step loop dies (after forwarding the requests' last outputs and
a Died), and at once when the API process is gone (its pipe closes, or its parent changes).

Messages are the protocol's own dataclasses (GenerationRequest, RequestOutput, EngineStats,
EngineInfo) in the small frozen wrappers below, pickled over a private socket pair between the API
process and the process it spawned; exceptions cross as themselves when they pickle (`portable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TypeVar

from service.engine.config import EngineConfig
from service.engine.protocol import (
    Engine,
    EngineDeadError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    KVEvent,
    LoadedEngine,
    RequestOutput,
)
from service.util import on_new_thread, one_line

log = logging.getLogger(__name__)

STATS_TICK_S = 0.05  # how often the engine process sends stats or adapters that changed off-step
PARENT_POLL_S = 1.0  # how often the engine process checks that the API process still runs
DRAIN_S = 10.0  # how long the engine process waits for its requests' last outputs when ending
K = TypeVar("K")


# --- Messages: API process -> engine process (sent as a list, a batch at a time) -----------------


@dataclass(frozen=True)
class Submit:
    request: GenerationRequest


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Check:
    call_id: int
    request: GenerationRequest


@dataclass(frozen=True)
class CancelCheck:
    call_id: int


@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class Stop:
    pass


ToEngine = Submit | Abort | Check | CancelCheck | Start | Stop


# --- Messages: engine process -> API process ------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    info: EngineInfo
    adapters: tuple[str, ...] | None  # None: the engine serves no adapters


@dataclass(frozen=True)
class Failed:
    """Loading or starting failed; the engine process exits after sending this."""

    error: BaseException


@dataclass(frozen=True)
class Started:
    info: EngineInfo  # what the engine is once started (its decode graphs captured)


@dataclass(frozen=True)
class Update:
    """One step's outputs (any number of requests), with the stats and adapter names where they
    changed since the last Update (None: unchanged), and the prefix cache's KV events since the
    last Update (in order; empty unless the engine records them)."""

    outputs: list[RequestOutput]
    stats: EngineStats | None = None
    adapters: tuple[str, ...] | None = None
    kv_events: tuple[KVEvent, ...] = ()


@dataclass(frozen=True)
class Checked:
    call_id: int
    error: BaseException | None  # None: the engine would run the request


@dataclass(frozen=True)
class Died:
    """The step loop failed: `message` is the engine's `failure`, `error` what it raised."""

    message: str
    error: BaseException


@dataclass(frozen=True)
class Stopped:
    pass


FromEngine = Loaded | Failed | Started | Update | Checked | Died | Stopped


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling (its type and message arrive whole), else a RuntimeError
    carrying its type and message in one line."""
    try:
        copy: BaseException = pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(one_line(exc, with_type=True))
    return copy


@dataclass(frozen=True)
class ChildSetup:
    """What the engine process needs besides its pipe; pickled into the spawned process."""

    config: EngineConfig
    log_level: int
    jsonl_logs: bool
    parent_pid: int


# --- Engine process -----------------------------------------------------------------------------


def engine_main(setup: ChildSetup, conn: Connection) -> None:
    """The engine process's whole life (the spawned process's target)."""
    from service.telemetry.logging import configure_logging

    # A session of its own: a terminal's ^C or a signal to the server's process group is the API
    # process's to handle (it drains, then stops this one); this process ends when told to, or
    # when the API process is gone.
    with contextlib.suppress(OSError):
        os.setsid()
    configure_logging(logging.getLevelName(setup.log_level), setup.jsonl_logs)
    code = 1
    try:
        code = asyncio.run(_serve(setup, conn))
    except BaseException:
        log.exception("engine process failed")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no atexit or thread joins that could wait on a dead engine


def _forget(tasks: dict[K, asyncio.Task[None]], key: K, task: asyncio.Task[None]) -> None:
    """A finished task leaves its table (unless another took its key meanwhile)."""
    if tasks.get(key) is task:
        del tasks[key]


async def _serve(setup: ChildSetup, conn: Connection) -> int:
    return await EngineCore(setup, conn).run()


class EngineCore:
    """The engine process's side: the engine, its event loop, and the pipe to the API process."""

    def __init__(self, setup: ChildSetup, conn: Connection) -> None:
        self.setup = setup
        self.conn = conn
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[int] = self.loop.create_future()  # the exit code
        self.loaded: asyncio.Future[LoadedEngine] = self.loop.create_future()
        self.requests: dict[str, asyncio.Task[None]] = {}
        self.checks: dict[int, asyncio.Task[None]] = {}
        self.pending: list[RequestOutput] = []
        self.flush_scheduled = False
        self.sent_stats: EngineStats | None = None
        self.sent_adapters: tuple[str, ...] | None = None
        self.send_lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        return self.loaded.result().engine

    async def run(self) -> int:
        threading.Thread(target=self._read, name="engine-core-reader", daemon=True).start()
        config = self.setup.config
        from service.engine.registry import load_engine  # the registry imports no engine package

        try:
            loaded = await on_new_thread(load_engine, config, self._died, name="engine-load")
        except Exception as exc:
            log.error("engine process: loading failed: %s", one_line(exc, with_type=True))
            self.send(Failed(portable(exc)))
            return 1
        self.loaded.set_result(loaded)
        self.sent_adapters = self._adapter_names()
        self.send(Loaded(loaded.info, self.sent_adapters))
        return await self.done

    # --- From the API process -------------------------------------------------------------------------

    def _read(self) -> None:
        """The reader thread: messages to the event loop; the API process gone, this one goes."""
        while True:
            try:
                if not self.conn.poll(PARENT_POLL_S):
                    if os.getppid() != self.setup.parent_pid:
                        raise EOFError
                    continue
                batch: list[ToEngine] = self.conn.recv()
            except (EOFError, OSError):
                log.error("engine process: the API process is gone; exiting")
                sys.stderr.flush()
                os._exit(1)
            self.loop.call_soon_threadsafe(self._handle, batch)

    def _handle(self, batch: list[ToEngine]) -> None:
        for message in batch:
            if isinstance(message, Submit):
                request_id = message.request.request_id
                task = self.loop.create_task(self._forward(message.request))
                self.requests[request_id] = task
                task.add_done_callback(functools.partial(_forget, self.requests, request_id))
            elif isinstance(message, Abort):
                # After the request's task has taken its first step (call_soon keeps the order), so
                # the engine has the request before its abort.
                if message.request_id in self.requests:
                    self.loop.call_soon(self.engine.abort, message.request_id)
            elif isinstance(message, Check):
                task = self.loop.create_task(self._check(message))
                self.checks[message.call_id] = task
                task.add_done_callback(functools.partial(_forget, self.checks, message.call_id))
            elif isinstance(message, CancelCheck):
                check = self.checks.get(message.call_id)
                if check is not None:
                    check.cancel()
            elif isinstance(message, Start):
                self.loop.create_task(self._start())
            else:
                self.loop.create_task(self._stop())

    async def _forward(self, request: GenerationRequest) -> None:
        stream = self.engine.generate(request)
        try:
            async for out in stream:
                self.emit(out)
        except Exception as exc:  # EngineDeadError: the engine died before it took the request
            failure = one_line(exc) if isinstance(exc, EngineDeadError) else one_line(exc, with_type=True)
            self.emit(
                RequestOutput.last(
                    request.request_id,
                    len(request.prompt_token_ids),
                    error=f"engine failure: {failure}",
                    time=time.monotonic(),
                )
            )
        finally:
            await stream.aclose()

    async def _check(self, message: Check) -> None:
        try:
            await self.engine.check(message.request)
        except Exception as exc:
            self.send(Checked(message.call_id, portable(exc)))
        else:
            self.send(Checked(message.call_id, None))

    async def _start(self) -> None:
        try:
            await self.engine.start()
        except Exception as exc:
            log.error("engine process: start failed: %s", one_line(exc, with_type=True))
            self.send(Failed(portable(exc)))
            self._exit(1)
            return
        self.send(Started(self.engine.info))
        self.loop.create_task(self._tick())

    async def _stop(self) -> None:
        if self.loaded.done():
            await self.engine.stop()  # what is in flight ends with an abort
        await self._drain()
        self.send(Stopped())
        self._exit(0)

    # --- To the API process -------------------------------------------------------------------------

    def emit(self, out: RequestOutput) -> None:
        """Gather `out` into this step's Update. The engine wakes this loop once per step and every
        request's task is woken before the first of them schedules the flush, so the flush (run
        after them) sends the whole step in one message."""
        self.pending.append(out)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        outputs, self.pending = self.pending, []
        self.send(Update(outputs, *self._changes()))

    def _changes(self) -> tuple[EngineStats | None, tuple[str, ...] | None, tuple[KVEvent, ...]]:
        """The stats and adapter names, each where it changed since it was last sent (else None),
        and the KV events not sent yet."""
        stats: EngineStats | None = self.engine.stats()
        if stats is self.sent_stats:
            stats = None
        else:
            self.sent_stats = stats
        adapters = self._adapter_names()
        if adapters == self.sent_adapters:
            adapters = None
        else:
            self.sent_adapters = adapters
        return stats, adapters, tuple(self.engine.kv_events())

    def _adapter_names(self) -> tuple[str, ...] | None:
        catalog = self.loaded.result().adapters
        return tuple(catalog.names()) if catalog is not None else None

    async def _tick(self) -> None:
        """Stats (and adapter names) that change while no output flows: after an abort, a rescan."""
        while True:
            await asyncio.sleep(STATS_TICK_S)
            stats, adapters, kv_events = self._changes()
            if stats is not None or adapters is not None or kv_events:
                self.send(Update([], stats, adapters, kv_events))

    def send(self, message: FromEngine) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (OSError, ValueError):
            log.error("engine process: the API process is gone; exiting")
            sys.stderr.flush()
            os._exit(1)

    # --- Death ---------------------------------------------------------------------------------------

    def _died(self, exc: BaseException) -> None:
        """The engine's on_fatal (from its own thread): its requests have been ended with the error;
        forward their last outputs, report the death, exit."""
        failure = self.loaded.result().engine.failure if self.loaded.done() else None
        message = failure or one_line(exc, with_type=True)
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._die(message, portable(exc))))

    async def _die(self, message: str, error: BaseException) -> None:
        await self._drain()
        self.send(Died(message, error))
        self._exit(1)

    async def _drain(self) -> None:
        """Wait for every request's last output to be gathered, then send what is gathered."""
        if self.requests:
            await asyncio.wait(list(self.requests.values()), timeout=DRAIN_S)
        if self.pending:
            self.flush()

    def _exit(self, code: int) -> None:
        if not self.done.done():
            self.done.set_result(code)
