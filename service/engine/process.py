"""The engine core in a process of its own: the API's event loop and the step loop never share an
interpreter lock (vLLM's EngineCore behind AsyncLLM is the model).

    API process                                          engine process (spawned)
    ProcessEngine.generate -> writer thread --- pipe ---> reader thread -> event loop
                                                          engine.generate / check / abort
    per-request queues <- reader thread <--- pipe ------- one Update per step: the step's
                          (one wake-up per loop)          outputs, the stats, the adapters

The engine process (service.engine.process_core, which also defines the messages) builds whatever
`load_engine` builds from the same EngineConfig and serves it through the `Engine` protocol: no
engine's internals are known here. What crosses the pipe is plain data, the protocol's own
dataclasses (GenerationRequest in, RequestOutput, EngineStats and EngineInfo out) in small frozen
messages, pickled: the pipe is a private socket pair between this process and the one it spawned,
never a listening socket, and no weights cross it. The two processes share CLOCK_MONOTONIC, so the
times in outputs (time.monotonic()) compare with the API's arrival times as in process.
The API process keeps the tokenizer (read again from the model's files, as the engine reads it)
and a mirror of the LoRA adapter names, which the engine process pushes when they change.

Batching: the engine wakes its process's event loop once per step; every request's delta of that
step is gathered into one Update before it is sent. In the API process one reader thread receives
it, looks up each request's queue and wakes each event loop once for the whole batch. Stats
travel in the same Update (and on a short tick when they change while no output flows), so
`stats()` returns the latest snapshot without asking anyone.

Endings, as in process: every request ends with one finished output. An abort (the iterator
closed, or `abort`) is sent to the engine, whose abort output ends the request. If the engine
process dies (its step loop failed, it crashed, it was killed) the reader thread sees its exit:
every request still in flight ends with an error ("engine failure: <why>", the output a dead step
loop gives its requests), `ready` turns False, `failure` says why, later `generate` calls raise
EngineDeadError, and `on_fatal` is called so the server exits. If the API process dies, the
engine process sees its pipe close (or its parent change) and exits at once; its own workers
(tensor-parallel ranks, grammar compilers) see theirs close in turn.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Literal

from service.engine.config import EngineConfig, UnsupportedConfigError
from service.engine.kv_events import KVEventLog
from service.engine.lora_store import UnknownAdapterError
from service.engine.process_core import (
    Abort,
    CancelCheck,
    Check,
    Checked,
    ChildSetup,
    Died,
    Failed,
    FromEngine,
    Loaded,
    Start,
    Started,
    Stop,
    Submit,
    ToEngine,
    Update,
    engine_main,
)
from service.engine.protocol import (
    EngineDeadError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    KVEvent,
    LoadedEngine,
    RequestOutput,
)
from service.telemetry.logging import JSONLinesFormatter
from service.util import one_line

log = logging.getLogger(__name__)

EngineProcessMode = Literal["auto", "on", "off"]  # NIM_ENGINE_PROCESS
ENGINE_PROCESS_SETTING = "NIM_ENGINE_PROCESS=off"  # what turns it off (/v1/metadata's executionPaths)
STOP_TIMEOUT_S = 40.0  # a stop: the engine's own (its thread joins in 30 s, then its ranks)
KILL_GRACE_S = 5.0  # after terminate, before kill

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
    """`load_engine(config, ...)` in a spawned engine process; blocks until it has loaded (call it
    where load_engine is called, off the event loop). Its refusals (UnsupportedConfigError, ...)
    are raised here as they would be in process."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    root = logging.getLogger()
    setup = ChildSetup(
        config=config,
        log_level=root.getEffectiveLevel(),
        jsonl_logs=any(isinstance(h.formatter, JSONLinesFormatter) for h in root.handlers),
        parent_pid=os.getpid(),
    )
    # Not a daemon: a daemonic process may not start processes (tensor-parallel ranks).
    process = context.Process(target=engine_main, args=(setup, theirs), name="engine-core", daemon=False)
    try:
        process.start()
    except Exception as exc:
        ours.close()
        theirs.close()
        why = one_line(exc, with_type=True)
        raise EngineProcessError(f"the engine process could not be started: {why}") from exc
    theirs.close()  # the engine process holds the only other end: its exit closes the pipe
    # An exit while it loads (the server stopped meanwhile) ends it, before multiprocessing's own
    # exit handler would wait for it; the engine registers its own once made.
    abandon = functools.partial(_end_process, process, 0.0)
    atexit.register(abandon)
    try:
        tokenizer = config.load_tokenizer()  # while the engine process loads the weights
        loaded = _await_loaded(ours, process)
    except BaseException:
        _end_process(process, KILL_GRACE_S)  # it leaves on its own after a refusal
        ours.close()
        raise
    finally:
        atexit.unregister(abandon)
    engine = ProcessEngine(process, ours, loaded.info, loaded.adapters, on_fatal)
    log.info("the engine core runs in process %d", process.pid)
    return LoadedEngine(engine=engine, info=loaded.info, tokenizer=tokenizer, adapters=engine.adapters)


def _await_loaded(conn: Connection, process: BaseProcess) -> Loaded:
    while not conn.poll(0.2):
        if not process.is_alive():
            process.join()
            raise EngineProcessError(f"{_describe_exit(process)} while loading")
    try:
        message = conn.recv()
    except EOFError:
        process.join()
        raise EngineProcessError(f"{_describe_exit(process)} while loading") from None
    if isinstance(message, Failed):
        raise message.error
    if not isinstance(message, Loaded):
        raise RuntimeError(f"the engine process sent {type(message).__name__} before it loaded")
    return message


def _describe_exit(process: BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"the engine process (pid {process.pid}) was killed by {signal.Signals(-code).name}"
    return f"the engine process (pid {process.pid}) exited with code {code}"


def _end_process(process: BaseProcess, timeout: float) -> None:
    """Wait up to `timeout` for `process` to leave, then terminate it, then kill it."""
    process.join(timeout)
    if process.is_alive():
        process.terminate()
        process.join(KILL_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join()


class AdapterMirror:
    """The API process's AdapterCatalog: the names the engine process serves, as it last sent them
    (it owns the adapter store, its rescans and its reads)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names

    def names(self) -> list[str]:
        return list(self._names)

    def prepare(self, name: str) -> None:
        if name not in self._names:
            raise UnknownAdapterError(name)

    def update(self, names: tuple[str, ...]) -> None:
        self._names = names


@dataclass(frozen=True)
class _Stream:
    """One request's outputs in the API process: the loop that awaits them, and its queue."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput]
    num_prompt_tokens: int


_Call = tuple[asyncio.AbstractEventLoop, asyncio.Future[BaseException | None]]


class ProcessEngine:
    """An Engine whose core runs in another process (made by `load_in_process`)."""

    def __init__(
        self,
        process: BaseProcess,
        conn: Connection,
        info: EngineInfo,
        adapters: tuple[str, ...] | None,
        on_fatal: FatalCallback | None,
    ) -> None:
        self.process = process
        self._conn = conn
        self._info = info
        self.adapters = AdapterMirror(adapters) if adapters is not None else None
        self.on_fatal = on_fatal
        self._lock = threading.Lock()  # streams, calls, and the failure, against the reader thread
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._starting: _Call | None = None
        self._outbox: queue.SimpleQueue[ToEngine | None] = queue.SimpleQueue()
        self._stats = EngineStats()
        self._kv_events = KVEventLog()  # received in order, until kv_events() drains them
        self._ready = False
        self._failure: str | None = None
        self._exit_expected = False  # stopping, or start failed: its exit is no death
        self._death: Died | None = None
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()
        threading.Thread(target=self._write, name="engine-process-writer", daemon=True).start()
        atexit.register(self._end_at_exit)  # before multiprocessing's own, which would join it

    # --- Engine protocol --------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def ready(self) -> bool:
        return self._ready and self._failure is None

    @property
    def failure(self) -> str | None:
        return self._failure

    async def start(self) -> None:
        """The engine process warms up and starts its step loop; returns once it has."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[BaseException | None] = loop.create_future()
        with self._lock:
            if self._failure is not None:
                raise EngineDeadError(self._failure)
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
        if not asked:
            self._outbox.put(Stop())
        await asyncio.to_thread(self._reap, STOP_TIMEOUT_S)

    async def check(self, request: GenerationRequest) -> None:
        """The engine process's `check` (a grammar compiles there); cancelling this cancels it.
        On a dead engine nothing is refused: `generate` says it is dead."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[BaseException | None] = loop.create_future()
        with self._lock:
            if self._failure is not None:
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

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), len(request.prompt_token_ids))
        with self._lock:
            if self._failure is not None:
                raise EngineDeadError(self._failure)
            refused = self._refusal(request_id, stream.num_prompt_tokens)
            if refused is None:
                self._streams[request_id] = stream
        if refused is not None:
            yield refused
            return
        self._outbox.put(Submit(request))
        finished = False
        try:
            while not finished:
                out = await stream.outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                with self._lock:
                    self._streams.pop(request_id, None)
                self._outbox.put(Abort(request_id))

    def _refusal(self, request_id: str, num_prompt_tokens: int) -> RequestOutput | None:
        """How a request that cannot be submitted ends (under the lock): aborted when the engine is
        stopping, failed when its id is in flight (in the engine's own words)."""
        if self._exit_expected:
            return _last(request_id, num_prompt_tokens, None, time.monotonic())
        if request_id in self._streams:
            why = f"request could not be admitted: duplicate request id {request_id!r}"
            return _last(request_id, num_prompt_tokens, why, time.monotonic())
        return None

    def abort(self, request_id: str) -> None:
        self._outbox.put(Abort(request_id))

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
                    self._conn.send(messages)
            except (OSError, ValueError):  # the engine process is gone (the reader reports it)
                return
            if len(messages) < len(batch):  # None: the reader has seen the process end
                return

    # --- Reader thread: outputs to their requests, and the engine process's end ---------------------

    def _read(self) -> None:
        conn, sentinel = self._conn, self.process.sentinel
        try:
            while True:
                ready = multiprocessing.connection.wait([conn, sentinel])
                if conn not in ready:  # it exited: take what it sent before
                    while conn.poll(0):
                        self._handle(conn.recv())
                    break
                self._handle(conn.recv())
        except (EOFError, OSError):
            pass
        except BaseException:  # a message this side cannot read: the engine is lost to us
            log.exception("engine process: reading its messages failed")
            self.process.kill()
        self.process.join()
        self._ended()

    def _handle(self, message: FromEngine) -> None:
        if isinstance(message, Update):
            if message.stats is not None:
                self._stats = message.stats
            if message.adapters is not None and self.adapters is not None:
                self.adapters.update(message.adapters)
            if message.kv_events:
                self._kv_events.extend(message.kv_events)
            if message.outputs:
                self._deliver(message.outputs)
        elif isinstance(message, Checked):
            with self._lock:
                call = self._calls.pop(message.call_id, None)
            if call is not None:
                _settle(call, message.error)
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

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Each output to its request's queue; each event loop is woken once for the batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # its consumer left (and aborted it)
                if out.finished:
                    del self._streams[out.request_id]
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_put_all, items)

    def _ended(self) -> None:
        """The engine process has exited: end what it left behind; a death is fatal."""
        with self._lock:
            expected = self._exit_expected and self._death is None
            if not expected:
                self._failure = (
                    self._death.message if self._death is not None else _describe_exit(self.process)
                )
            streams, self._streams = self._streams, {}
            calls, self._calls = list(self._calls.values()), {}
            starting, self._starting = self._starting, None
        self._outbox.put(None)
        self._conn.close()
        atexit.unregister(self._end_at_exit)
        now = time.monotonic()
        why = None if expected else f"engine failure: {self._failure}"
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for request_id, stream in streams.items():
            out = _last(request_id, stream.num_prompt_tokens, why, now)
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)
        for call in calls:
            _settle(call, None)  # nothing refused: generate reports the dead engine
        if starting is not None:  # start raises it, as a warm-up failure in process does
            _settle(starting, EngineDeadError(self._failure or _describe_exit(self.process)))
        if expected:
            return
        log.error("engine process: %s", self._failure)
        if starting is not None:
            return
        if self.on_fatal is not None:
            error = self._death.error if self._death is not None else EngineDeadError(self._failure)
            self.on_fatal(error)

    def _reap(self, timeout: float) -> None:
        """Wait for the engine process to leave (terminate, then kill, past `timeout`), then for the
        reader to have ended what it left."""
        _end_process(self.process, timeout)
        self._reader.join(KILL_GRACE_S)

    def _end_at_exit(self) -> None:
        """At interpreter exit without a stop: the engine process must not outlive this one."""
        with self._lock:
            self._exit_expected = True
        _end_process(self.process, 0.0)


def _last(request_id: str, num_prompt_tokens: int, error: str | None, now: float) -> RequestOutput:
    """A request's last output: failed with `error`, or aborted (None)."""
    if error is None:
        return RequestOutput.last(request_id, num_prompt_tokens, finish_reason="abort", time=now)
    return RequestOutput.last(request_id, num_prompt_tokens, error=error, time=now)


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.outputs.put_nowait(out)


def _settle(call: _Call, error: BaseException | None) -> None:
    loop, future = call

    def settle() -> None:
        if not future.done():
            future.set_result(error)

    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody awaits it
        loop.call_soon_threadsafe(settle)
