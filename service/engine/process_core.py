"""The engine process's side of service.engine.process, and the messages the two sides exchange.

The engine process (a child process: service.engine.child) loads the engine's core
(`registry.load_core`) and drives it on its main thread with service.engine.core.drive: no event
loop, no task per request. A reader thread turns the API process's messages into the core's
commands (a queue); constraint checks become compile jobs whose results are sent when they
settle, off the step's path. Each round's outputs leave in one Update with the stats that count
them (published first) and the adapter names where they changed; when nothing flows, changed stats
and adapter names still leave on a short tick. It exits when told to stop, when its core dies
(after sending the requests' last outputs and a Died), and at once when the API process is gone.

Messages are the protocol's own dataclasses (GenerationRequest, RequestOutput, EngineStats,
EngineInfo) in the small frozen wrappers below, pickled over a private socket pair between the API
process and this one; exceptions cross as themselves when they pickle (`portable`).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NoReturn

from service.engine.config import EngineConfig
from service.engine.core import Abort, Command, EngineCore, Fail, PendingCompile, Stop, Submit, Wake, drive
from service.engine.guided.specs import GrammarError
from service.engine.protocol import (
    ConstraintRefusedError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    KVEvent,
    RequestOutput,
    RequestRefusedError,
)
from service.engine.registry import load_core
from service.logs import configure_logging
from service.util import freeze_startup_heap, one_line

log = logging.getLogger(__name__)

TICK_S = 0.05  # how often an idle engine process sends stats or adapter names that changed


# --- Messages: API process -> engine process (sent as a list, a batch at a time) -----------------


@dataclass(frozen=True)
class Check:
    call_id: int
    request: GenerationRequest


@dataclass(frozen=True)
class CancelCheck:
    call_id: int


@dataclass(frozen=True)
class ChangeAdapter:
    """Serve the adapter at `path` as `name` (AdapterCatalog.add), or, with no path, stop serving
    `name` (AdapterCatalog.remove); answered by AdapterChanged."""

    call_id: int
    name: str
    path: Path | None
    replace: bool = False


@dataclass(frozen=True)
class Start:
    pass


ToEngine = Submit | Abort | Check | CancelCheck | ChangeAdapter | Start | Stop


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
    """One round's outputs (any number of requests), with the stats and adapter names where they
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
class AdapterChanged:
    call_id: int
    error: BaseException | None  # None: done
    names: tuple[str, ...]  # the adapters served now


@dataclass(frozen=True)
class Died:
    """The core failed: `message` is the engine's `failure`, `error` what it raised."""

    message: str
    error: BaseException


@dataclass(frozen=True)
class Stopped:
    pass


FromEngine = Loaded | Failed | Started | Update | Checked | AdapterChanged | Died | Stopped


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
    """What the engine process needs besides its connection."""

    config: EngineConfig
    log_level: int
    jsonl_logs: bool


# --- Engine process -----------------------------------------------------------------------------


def engine_main(setup: ChildSetup, conn: Connection) -> int:
    """The engine process's whole life (a child process's target): its exit code."""
    configure_logging(logging.getLevelName(setup.log_level), setup.jsonl_logs)
    return EngineProcess(conn).run(setup.config)


class EngineProcess:
    """The core, the connection to the API process, and what is pending between them."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        # What arrived, a batch at a time: the API process's messages, or a helper's Wake or Fail;
        # None: the API process is gone.
        self.inbox: queue.SimpleQueue[Sequence[ToEngine | Wake | Fail] | None] = queue.SimpleQueue()
        self.send_lock = threading.Lock()  # the main thread and settling compile jobs both send
        self.checks: dict[int, PendingCompile] = {}
        self.checks_lock = threading.Lock()
        self.sent_stats: EngineStats | None = None
        self.sent_adapters: tuple[str, ...] | None = None
        self.core: EngineCore | None = None

    def run(self, config: EngineConfig) -> int:
        threading.Thread(target=self._read, name="engine-process-reader", daemon=True).start()
        try:
            core = self.core = load_core(config)
        except Exception as exc:
            log.error("engine process: loading failed: %s", one_line(exc, with_type=True))
            self.send(Failed(portable(exc)))
            return 1
        self.sent_adapters = self._adapter_names()
        self.send(Loaded(core.info, self.sent_adapters))
        if not self._wait_for_start():
            return 0
        try:
            core.start(lambda: self.inbox.put([Wake()]), lambda exc: self.inbox.put([Fail(exc)]))
        except Exception as exc:
            log.error("engine process: start failed: %s", one_line(exc, with_type=True))
            self.send(Failed(portable(exc)))
            core.shutdown()
            return 1
        self.sent_stats = core.stats()
        freeze_startup_heap()
        self.send(Started(core.info))
        try:
            drive(core, self._commands, self._emit)
        except BaseException as exc:  # the core must never die silently
            log.exception("engine process: the engine core failed")
            message, error = core.death(exc)
            self._emit(core.end_all(f"engine failure: {message}"))
            self.send(Died(message, portable(error)))
            core.shutdown()
            return 1
        core.shutdown()
        self.send(Stopped())
        return 0

    def _wait_for_start(self) -> bool:
        """Wait for Start (True) or Stop (False); checks before the start are answered."""
        while True:
            batch = self.inbox.get()
            if batch is None:
                self._gone()
            for message in batch:
                if isinstance(message, Start):
                    return True
                if isinstance(message, Stop):
                    self.send(Stopped())
                    return False
                if isinstance(message, Check | CancelCheck):
                    self._check(message)

    # --- From the API process -------------------------------------------------------------------------

    def _read(self) -> None:
        """The reader thread: checks answered here once the core is up (a request's check must not
        wait for the step in progress: on a GPU a prefill step of 8192 tokens takes ~0.2 s, and a
        check answered only between steps cost every arriving request a whole step before its
        Submit was even sent); every other message batch into the inbox. The API process gone,
        this one goes."""
        while True:
            try:
                batch: list[ToEngine] = self.conn.recv()
            except (EOFError, OSError):
                self.inbox.put(None)
                return
            if self.core is not None:
                checks = [m for m in batch if isinstance(m, Check | CancelCheck)]
                for message in checks:
                    self._check(message)
                if checks:
                    batch = [m for m in batch if not isinstance(m, Check | CancelCheck)]
                    if not batch:
                        continue
            self.inbox.put(batch)

    def _commands(self, wait: bool) -> Sequence[Command]:
        """What arrived since the last round, as the core's commands (checks are answered here)."""
        commands: list[Command] = []
        try:
            batch = self.inbox.get(timeout=TICK_S) if wait else self.inbox.get_nowait()
            while True:
                if batch is None:
                    self._gone()
                for message in batch:
                    if isinstance(message, Check | CancelCheck):
                        self._check(message)
                    elif isinstance(message, ChangeAdapter):
                        self._change_adapter(message)
                    elif not isinstance(message, Start):
                        commands.append(message)
                batch = self.inbox.get_nowait()
        except queue.Empty:
            pass
        if wait and not commands:
            self._tick()
        return commands

    def _check(self, message: Check | CancelCheck) -> None:
        """Answer a check (on the reader thread once the core is up, before that on the main one:
        EngineCore.prepare may run beside a step). Whatever `prepare` raises is that request's
        answer: a fault in one request's check fails that request, not the engine."""
        assert self.core is not None
        if isinstance(message, CancelCheck):
            with self.checks_lock:
                pending = self.checks.pop(message.call_id, None)
            if pending is not None:
                pending.cancel()
            return
        call_id = message.call_id
        try:
            pending = self.core.prepare(message.request)
        except RequestRefusedError as exc:
            self.send(Checked(call_id, exc))
            return
        except Exception as exc:
            log.exception("engine process: checking request %s failed", message.request.request_id)
            self.send(Checked(call_id, portable(exc)))
            return
        if pending is None:
            self.send(Checked(call_id, None))
            return
        with self.checks_lock:
            self.checks[call_id] = pending

        def settled(future: object) -> None:
            with self.checks_lock:
                if self.checks.pop(call_id, None) is None:
                    return  # cancelled: the API process no longer waits
            error = None if pending.future.cancelled() else pending.future.exception()
            if isinstance(error, GrammarError):
                error = ConstraintRefusedError(str(error))
            self.send(Checked(call_id, None if error is None else portable(error)))

        pending.future.add_done_callback(settled)

    def _change_adapter(self, message: ChangeAdapter) -> None:
        """An adapter added or removed by name, on a thread of its own (adding one reads and checks
        its files, which the step loop must not wait for); answered with the names served after."""

        def change() -> None:
            catalog = self.core.adapters if self.core is not None else None
            error: BaseException | None = None
            try:
                if catalog is None:
                    raise RuntimeError("this engine serves no LoRA adapters")
                if message.path is None:
                    catalog.remove(message.name)
                else:
                    catalog.add(message.name, message.path, message.replace)
            except Exception as exc:
                error = portable(exc)
            self.send(AdapterChanged(message.call_id, error, self._adapter_names() or ()))

        threading.Thread(target=change, name="engine-process-adapter-change", daemon=True).start()

    # --- To the API process -------------------------------------------------------------------------

    def _emit(self, outputs: list[RequestOutput]) -> None:
        self.send(Update(outputs, *self._changes()))

    def _tick(self) -> None:
        """Stats (and adapter names) that changed while no output flowed: a rescan, a wake."""
        stats, adapters, kv_events = self._changes()
        if stats is not None or adapters is not None or kv_events:
            self.send(Update([], stats, adapters, kv_events))

    def _changes(self) -> tuple[EngineStats | None, tuple[str, ...] | None, tuple[KVEvent, ...]]:
        """The stats and adapter names, each where it changed since it was last sent (else None),
        and the KV events not sent yet."""
        assert self.core is not None
        stats: EngineStats | None = self.core.stats()
        if stats is self.sent_stats:
            stats = None
        else:
            self.sent_stats = stats
        adapters = self._adapter_names()
        if adapters == self.sent_adapters:
            adapters = None
        else:
            self.sent_adapters = adapters
        return stats, adapters, tuple(self.core.kv_events())

    def _adapter_names(self) -> tuple[str, ...] | None:
        catalog = self.core.adapters if self.core is not None else None
        return tuple(catalog.names()) if catalog is not None else None

    def send(self, message: FromEngine) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (OSError, ValueError):
            self._gone()

    def _gone(self) -> NoReturn:
        log.error("engine process: the API process is gone; exiting")
        sys.stderr.flush()
        os._exit(1)
