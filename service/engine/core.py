"""The synchronous engine core's interface, and the loop that drives one.

An `EngineCore` takes requests and gives outputs, one step at a time, with no event loop and no
thread of its own: `add_request` and `abort` take effect before the next step, `step` runs one
forward pass over the batch its scheduler picks. Every call returns the outputs it produced (a
refusal, an abort, a step's deltas and endings) and has published the stats that count them
before it returns, so whoever hands the outputs on afterwards never shows a reader a gauge still
counting a request whose last output it holds.

A core runs three ways (vLLM v1's EngineCore is the model):
- in this process, under `AsyncEngine` (service.engine.async_engine): one thread drives it with
  `drive`, fed by an inbox; the event loop sees async iterators;
- in a process of its own (service.engine.process_core): that process's main thread drives it
  with `drive`, fed by the API process's messages; one message of outputs leaves per step;
- in tests, directly.

`drive` is the loop both use: take what has arrived (waiting only while the core has no work),
apply it in order, step while there is work, and emit each round's outputs in one batch.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from service.engine.protocol import (
    AdapterCatalog,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    KVEvent,
    RequestOutput,
)
from service.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Submit:
    request: GenerationRequest


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Wake:
    """Something off the step (a LoRA adapter's read into memory) may let waiting requests in."""


@dataclass(frozen=True)
class Fail:
    """Another thread saw the core become unusable (a tensor-parallel rank died)."""

    error: BaseException


@dataclass(frozen=True)
class Stop:
    """End every request in flight (aborted) and stop driving."""


Command = Submit | Abort | Wake | Fail | Stop


class PendingCompile(Protocol):
    """A constraint's compile that a request waits for before it is submitted
    (service.engine.guided.compiler.CompileJob): settles with None or the refusal."""

    @property
    def future(self) -> concurrent.futures.Future[None]: ...

    def cancel(self) -> None: ...


class EngineCore(Protocol):
    """An engine as a synchronous state machine. Not thread-safe, except `prepare`, `stats`,
    `info`, `tokenizer` and `adapters`, which any thread may call."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def adapters(self) -> AdapterCatalog | None: ...

    def start(self, wake: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        """Warm up (on the thread that will drive the core) and start what runs beside it;
        `wake` and `fail` are how those helpers reach the driver (as Wake and Fail commands)."""
        ...

    def prepare(self, request: GenerationRequest) -> PendingCompile | None:
        """Refuse `request` at once (RequestRefusedError, one line) for what this core cannot run,
        or return the compile its constraint needs first (None: nothing to wait for). Called from
        any thread, while the driving thread steps: it reads what the request needs, never the
        scheduler's state."""
        ...

    def add_request(self, request: GenerationRequest) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> list[RequestOutput]: ...

    def wake(self) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def end_all(self, error: str | None) -> list[RequestOutput]:
        """End every request in flight: failed with `error`, else aborted."""
        ...

    def stats(self) -> EngineStats: ...

    def kv_events(self) -> list[KVEvent]:
        """The prefix cache's events since the last call (Engine.kv_events); any thread."""
        ...

    def death(self, error: BaseException) -> tuple[str, BaseException]:
        """What killed the core, in one line (with a dead tensor-parallel rank's cause), and the
        exception to report; called once, after `step` or a Fail raised `error`."""
        ...

    def shutdown(self) -> None:
        """Stop what runs beside the core (adapter rescans and reads, tensor-parallel ranks)."""
        ...


def drive(
    core: EngineCore,
    commands: Callable[[bool], Sequence[Command]],
    emit: Callable[[list[RequestOutput]], None],
) -> None:
    """Run `core` until a Stop (returns once every request in flight has ended, aborted) or until
    it fails (raises what failed it; the caller ends the requests with the error).

    `commands(wait)` returns what has arrived, waiting a while for something when `wait` (the core
    has no work); `emit` takes each round's outputs, after the stats that count them."""
    while True:
        outputs: list[RequestOutput] = []
        for command in commands(not core.has_work()):
            if isinstance(command, Submit):
                outputs += core.add_request(command.request)
            elif isinstance(command, Abort):
                outputs += core.abort(command.request_id)
            elif isinstance(command, Wake):
                core.wake()
            elif isinstance(command, Fail):
                raise command.error
            else:
                emit(outputs + core.end_all(None))
                return
        if core.has_work():
            outputs += core.step()
        if outputs:
            emit(outputs)
