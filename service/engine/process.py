"""The engine core in a process of its own: the API's event loop and the step loop never share an
interpreter lock (vLLM's EngineCore behind AsyncLLM is the model).

    API process                                           engine process (a child process)
    ProcessEngine.generate -> writer thread --- socket ---> reader thread -> queue -> main thread:
                                                            drive(core): add_request / abort / step
    per-request queues <- reader thread <--- socket ------- one Update per round: its outputs,
                          (one wake-up per loop)            the stats, the adapter names

The engine process (service.engine.process_core, which also defines the messages) loads the
engine's synchronous core from the same EngineConfig (`registry.load_core`) and drives it on its
main thread: no event loop and no task per request there. No engine's internals are known here.
What crosses the socket is plain data, the protocol's own
dataclasses (GenerationRequest in, RequestOutput, EngineStats and EngineInfo out) in small frozen
messages, pickled: the socket is a private pair between this process and its child
(service.engine.child), never a listening socket, and no weights cross it. The two processes share
CLOCK_MONOTONIC, so the times in outputs (time.monotonic()) compare with the API's arrival times as
in process.
The API process keeps the tokenizer (read again from the model's files, as the engine reads it)
and a mirror of the LoRA adapter names, which the engine process pushes when they change. Adding
or removing an adapter by name (the runtime LoRA API) is a call to the engine process, which owns
the adapter store: the mirror sends it and blocks until the answer, which carries the new names.

Batching: every request's delta of a round (the commands that arrived, then a step) leaves in one
Update. In the API process one reader thread receives
it, looks up each request's queue and wakes each event loop once for the whole batch. Stats
travel in the same Update (and on a short tick when they change while no output flows), so
`stats()` returns the latest snapshot without asking anyone. An Update's stats are applied before
its outputs are released, and the engine published them before it released those outputs in its
own process, so a client holding its last output never reads a gauge still counting it; a stream
closed early waits for the engine's abort output (at most ABORT_WAIT_S) for the same reason.

Endings, as in process: every request ends with one finished output. An abort (the iterator
closed, or `abort`) is sent to the engine, whose abort output ends the request. If the engine
process dies (its core failed, it crashed, it was killed) the reader thread sees its exit:
every request still in flight ends with an error ("engine failure: <why>", the output a dead step
loop gives its requests), `ready` turns False, `failure` says why, later `generate` calls raise
EngineDeadError, and `on_fatal` is called so the server exits. If the API process dies, the
engine process sees its socket close (or its parent change) and exits at once; its own children
(tensor-parallel ranks, grammar compilers) see theirs close in turn.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing.connection
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Literal

from service.engine.child import Child, ChildStartError
from service.engine.config import EngineConfig, UnsupportedConfigError
from service.engine.core import Abort, Stop, Submit
from service.engine.kv_events import KVEventLog
from service.engine.process_core import (
    AdapterChanged,
    CancelCheck,
    ChangeAdapter,
    Check,
    Checked,
    ChildSetup,
    Died,
    Failed,
    FromEngine,
    Loaded,
    Start,
    Started,
    ToEngine,
    Update,
)
from service.engine.protocol import (
    EngineDeadError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    KVEvent,
    LoadedEngine,
    RequestOutput,
    UnknownAdapterError,
)
from service.engine.streams import Streams
from service.logs import JSONLinesFormatter

log = logging.getLogger(__name__)

EngineProcessMode = Literal["auto", "on", "off"]  # NIM_ENGINE_PROCESS
ENGINE_PROCESS_SETTING = "NIM_ENGINE_PROCESS=off"  # what turns it off (/v1/metadata's executionPaths)
STOP_TIMEOUT_S = 40.0  # a stop: the engine's own (its step ends, then its ranks), before SIGTERM
KILL_GRACE_S = 5.0  # after SIGTERM, before SIGKILL

FatalCallback = Callable[[BaseException], None]


# --- The choice ---------------------------------------------------------------------------------


class EngineProcessError(EngineDeadError):
    """The engine process could not be started, or ended before it said why (not a refusal of the
    engine's: those are raised as themselves)."""


def wrap_in_process(mode: EngineProcessMode, config: EngineConfig) -> bool:
    """Whether the engine runs in a process of its own (NIM_ENGINE_PROCESS)."""
    return not_in_process(mode, config) is None


def not_in_process(mode: EngineProcessMode, config: EngineConfig) -> str | None:
    """None when the engine runs in a process of its own (NIM_ENGINE_PROCESS), else why not: `on`
    always (the torch engine only; another engine refuses it in one line), `off` never, `auto` on
    CUDA with one rank only (on CPUs the two processes share the cores the step needs, so off there
    until the CPU bars are measured with it; tensor-parallel ranks under an engine process are not
    tested yet)."""
    if mode == "off":
        return "NIM_ENGINE_PROCESS=off"
    if config.engine != "torch":
        if mode == "on":
            raise UnsupportedConfigError(
                f"NIM_ENGINE_PROCESS=on: only the torch engine runs in an engine process of its own; "
                f"profile {config.profile_name} runs {config.engine} (set NIM_ENGINE_PROCESS=auto or off)"
            )
        return f"the {config.engine} engine runs in the server's process"
    if mode == "on":
        return None
    if config.tensor_parallel_size != 1:
        return "NIM_ENGINE_PROCESS=auto: tensor-parallel ranks under an engine process are not tested yet"
    if not _runs_on_cuda(config):
        return "NIM_ENGINE_PROCESS=auto: on the CPU the engine runs in the server's process"
    return None


def _runs_on_cuda(config: EngineConfig) -> bool:
    if config.device == "cpu":
        return False
    import torch  # not at import: the choice is the only use of torch in the API process

    return config.device == "cuda" or torch.cuda.is_available()


# --- Loading -------------------------------------------------------------------------------------


def load_in_process(config: EngineConfig, on_fatal: FatalCallback | None = None) -> LoadedEngine:
    """The engine's core loaded in an engine process of its own; blocks until it has loaded (call
    it where load_engine is called, off the event loop). Its refusals (UnsupportedConfigError, ...)
    are raised here as they would be in process; EngineProcessError when the process cannot start
    or ends before it says why."""
    root = logging.getLogger()
    setup = ChildSetup(
        config=config,
        log_level=root.getEffectiveLevel(),
        jsonl_logs=any(isinstance(h.formatter, JSONLinesFormatter) for h in root.handlers),
    )
    try:
        child = Child.start("service.engine.process_core:engine_main", setup, name="the engine process")
    except ChildStartError as exc:
        raise EngineProcessError(f"the engine process could not be started: {exc}") from exc
    # An exit while it loads (the server stopped meanwhile) ends it; the engine registers its own.
    abandon = _ender(child)
    atexit.register(abandon)
    try:
        tokenizer = config.load_tokenizer()  # while the engine process loads the weights
        loaded = _await_loaded(child)
    except BaseException:
        child.stop(KILL_GRACE_S)  # it leaves on its own after a refusal
        raise
    finally:
        atexit.unregister(abandon)
    engine = ProcessEngine(child, loaded.info, loaded.adapters, on_fatal)
    log.info("the engine core runs in process %d", child.pid)
    return LoadedEngine(engine=engine, info=loaded.info, tokenizer=tokenizer, adapters=engine.adapters)


def _ender(child: Child) -> Callable[[], None]:
    def end() -> None:
        child.stop(0.0, ask=False)

    return end


def _await_loaded(child: Child) -> Loaded:
    while not child.poll(0.2):
        if not child.alive():
            raise EngineProcessError(f"{child.describe_exit()} while loading")
    try:
        message = child.recv()
    except (EOFError, OSError):
        child.wait()
        raise EngineProcessError(f"{child.describe_exit()} while loading") from None
    if isinstance(message, Failed):
        raise message.error
    if not isinstance(message, Loaded):
        raise RuntimeError(f"the engine process sent {type(message).__name__} before it loaded")
    return message


AdapterChange = Callable[[ChangeAdapter], None]  # sends a change and waits for its answer


class AdapterMirror:
    """The API process's AdapterCatalog: the names the engine process serves, as it last sent them
    (it owns the adapter store, its rescans and its reads); adding and removing are calls to it."""

    def __init__(self, names: tuple[str, ...], change: AdapterChange) -> None:
        self._names = names
        self._change = change
        self._call_ids = itertools.count()

    def names(self) -> list[str]:
        return list(self._names)

    def prepare(self, name: str) -> None:
        if name not in self._names:
            raise UnknownAdapterError(name)

    def add(self, name: str, path: Path, replace: bool = False) -> None:
        self._change(ChangeAdapter(next(self._call_ids), name, path, replace))

    def remove(self, name: str) -> None:
        self._change(ChangeAdapter(next(self._call_ids), name, None))

    def update(self, names: tuple[str, ...]) -> None:
        self._names = names


_Call = tuple[asyncio.AbstractEventLoop, asyncio.Future[BaseException | None]]


class ProcessEngine:
    """An Engine whose core runs in another process (made by `load_in_process`)."""

    def __init__(
        self,
        child: Child,
        info: EngineInfo,
        adapters: tuple[str, ...] | None,
        on_fatal: FatalCallback | None,
    ) -> None:
        self.child = child
        self._info = info
        self.adapters = AdapterMirror(adapters, self._change_adapter) if adapters is not None else None
        self._adapter_calls: dict[int, concurrent.futures.Future[BaseException | None]] = {}
        self.on_fatal = on_fatal
        self._streams = Streams()
        self._lock = threading.Lock()  # calls, the start and the expected exit, against the reader
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._starting: _Call | None = None
        self._outbox: queue.SimpleQueue[ToEngine | None] = queue.SimpleQueue()
        self._stats = EngineStats()
        self._kv_events = KVEventLog()  # received in order, until kv_events() drains them
        self._ready = False
        self._exit_expected = False  # stopping, or start failed: its exit is no death
        self._death: Died | None = None
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()
        threading.Thread(target=self._write, name="engine-process-writer", daemon=True).start()
        atexit.register(self._end_at_exit)

    @property
    def process_pid(self) -> int:
        return self.child.pid

    # --- Engine protocol --------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def ready(self) -> bool:
        return self._ready and self._streams.failure is None

    @property
    def failure(self) -> str | None:
        return self._streams.failure

    async def start(self) -> None:
        """The engine process warms up and starts driving its core; returns once it has."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[BaseException | None] = loop.create_future()
        with self._lock:
            if self._streams.failure is not None:
                raise EngineDeadError(self._streams.failure)
            self._starting = (loop, started)
        self._outbox.put(Start())
        error = await started
        if error is not None:
            await asyncio.to_thread(self._reap, STOP_TIMEOUT_S)
            raise error
        with self._lock:
            self._ready = not self._exit_expected  # a stop that came while it started wins

    async def stop(self) -> None:
        """The engine stops (what is in flight ends with an abort), then its process exits."""
        self._ready = False
        with self._lock:
            asked = self._exit_expected
            self._exit_expected = True
        self._streams.closing = True  # later requests end at once; those in flight get their aborts
        if not asked:
            self._outbox.put(Stop())
        await asyncio.to_thread(self._reap, STOP_TIMEOUT_S)

    async def check(self, request: GenerationRequest) -> None:
        """The engine process's check (a grammar compiles there); cancelling this cancels it.
        On a dead engine nothing is refused: `generate` says it is dead."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[BaseException | None] = loop.create_future()
        with self._lock:
            if self._streams.failure is not None:
                return
            call_id = next(self._call_ids)
            self._calls[call_id] = (loop, answer)
        self._outbox.put(Check(call_id, request))
        try:
            error = await answer
        except asyncio.CancelledError:
            with self._lock:
                self._calls.pop(call_id, None)
            self._outbox.put(CancelCheck(call_id))
            raise
        if error is not None:
            raise error

    def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        request_id = request.request_id
        return self._streams.follow(
            request, lambda: self._outbox.put(Submit(request)), lambda: self._outbox.put(Abort(request_id))
        )

    def abort(self, request_id: str) -> None:
        self._outbox.put(Abort(request_id))

    def _change_adapter(self, change: ChangeAdapter) -> None:
        """Add or remove an adapter in the engine process; blocks until it answers (an add reads the
        adapter's files there). Raises what the engine process's store raised."""
        answer: concurrent.futures.Future[BaseException | None] = concurrent.futures.Future()
        with self._lock:
            if self._streams.failure is not None:
                raise EngineDeadError(self._streams.failure)
            self._adapter_calls[change.call_id] = answer
        self._outbox.put(change)
        error = answer.result()
        if error is not None:
            raise error

    def stats(self) -> EngineStats:
        return self._stats

    def kv_events(self) -> list[KVEvent]:
        return self._kv_events.drain()

    # --- Writer thread: messages to the engine, a batch at a time -------------------------------------

    def _write(self) -> None:
        while True:
            batch = [self._outbox.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._outbox.get_nowait())
            messages = [m for m in batch if m is not None]
            try:
                if messages:
                    self.child.send(messages)
            except (OSError, ValueError):  # the engine process is gone (the reader reports it)
                return
            if len(messages) < len(batch):  # None: the reader has seen the process end
                return

    # --- Reader thread: outputs to their requests, and the engine process's end ---------------------

    def _read(self) -> None:
        child = self.child
        try:
            while True:
                ready = multiprocessing.connection.wait([child.conn, child.sentinel])
                if child.conn not in ready:  # it exited: take what it sent before
                    while child.poll(0):
                        self._handle(child.recv())
                    break
                self._handle(child.recv())
        except (EOFError, OSError):
            pass
        except BaseException:  # a message this side cannot read: the engine is lost to us
            log.exception("engine process: reading its messages failed")
            child.kill()
        child.wait()
        self._ended()

    def _handle(self, message: FromEngine) -> None:
        if isinstance(message, Update):
            if message.stats is not None:  # before the outputs it counts
                self._stats = message.stats
            if message.adapters is not None and self.adapters is not None:
                self.adapters.update(message.adapters)
            if message.kv_events:
                self._kv_events.extend(message.kv_events)
            if message.outputs:
                self._streams.deliver(message.outputs)
        elif isinstance(message, Checked):
            with self._lock:
                call = self._calls.pop(message.call_id, None)
            if call is not None:
                _settle(call, message.error)
        elif isinstance(message, AdapterChanged):
            if self.adapters is not None:
                self.adapters.update(message.names)
            with self._lock:
                answer = self._adapter_calls.pop(message.call_id, None)
            if answer is not None:
                answer.set_result(message.error)
        elif isinstance(message, Started | Failed):
            error = message.error if isinstance(message, Failed) else None
            if isinstance(message, Started):
                self._info = message.info
            with self._lock:
                starting, self._starting = self._starting, None
                self._exit_expected |= error is not None  # it exits next, as asked
            if starting is not None:
                _settle(starting, error)
        elif isinstance(message, Died):
            self._death = message

    def _ended(self) -> None:
        """The engine process has exited: end what it left behind; a death is fatal."""
        child = self.child
        with self._lock:
            expected = self._exit_expected and self._death is None
            failure = None
            if not expected:
                failure = self._death.message if self._death is not None else child.describe_exit()
            calls, self._calls = list(self._calls.values()), {}
            adapter_calls, self._adapter_calls = list(self._adapter_calls.values()), {}
            starting, self._starting = self._starting, None
        self._streams.fail(failure)
        self._outbox.put(None)
        child.close()
        atexit.unregister(self._end_at_exit)
        for call in calls:
            _settle(call, None)  # nothing refused: generate reports the dead engine
        for answer in adapter_calls:
            answer.set_result(EngineDeadError(failure or child.describe_exit()))
        if starting is not None:  # start raises it, as a warm-up failure in process does
            _settle(starting, EngineDeadError(failure or child.describe_exit()))
        if expected:
            return
        log.error("engine process: %s", failure)
        if starting is not None:
            return
        if self.on_fatal is not None:
            error = self._death.error if self._death is not None else EngineDeadError(failure or "")
            self.on_fatal(error)

    def _reap(self, timeout: float) -> None:
        """Wait for the engine process to leave (SIGTERM, then SIGKILL, past `timeout`), then for the
        reader to have ended what it left."""
        if self.child.wait(timeout) is None:
            self.child.stop(KILL_GRACE_S, ask=False)
        self._reader.join(KILL_GRACE_S)

    def _end_at_exit(self) -> None:
        """At interpreter exit without a stop: the engine process must not outlive this one."""
        with self._lock:
            self._exit_expected = True
        self.child.stop(0.0, ask=False)


def _settle(call: _Call, error: BaseException | None) -> None:
    loop, future = call

    def settle() -> None:
        if not future.done():
            future.set_result(error)

    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody awaits it
        loop.call_soon_threadsafe(settle)
