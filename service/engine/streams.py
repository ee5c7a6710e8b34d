"""The requests in flight as the event loops see them: one asyncio queue each, filled from the
thread that receives the core's outputs, each event loop woken once per batch.

Used by both ways of serving a core (service.engine.async_engine in this process, and
service.engine.process beside an engine process). A stream ends with its request's last output;
a consumer that leaves early asks for an abort and waits (at most ABORT_WAIT_S) for the core's
abort output, whose stats were published before it, so what it reads afterwards counts the abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from service.engine.protocol import EngineDeadError, GenerationRequest, RequestOutput, until_last

ABORT_WAIT_S = 5.0  # how long a stream closed early waits for the core to take its abort


@dataclass(frozen=True)
class Stream:
    """One request's outputs: the loop that awaits them, and its queue."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput]
    num_prompt_tokens: int


class Streams:
    """Request id -> its stream, with the engine's failure (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, Stream] = {}
        self.failure: str | None = None  # why the engine is dead, once it is
        self.closing = False  # stopping: new requests end at once, aborted

    async def follow(
        self, request: GenerationRequest, submit: Callable[[], None], abort: Callable[[], None]
    ) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of `request`, once `submit` has sent it; closing the iterator early sends
        `abort` and waits for the abort output (or a timeout). EngineDeadError when the engine is
        dead; a duplicate id or a stopping engine ends it at once."""
        request_id = request.request_id
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue(), len(request.prompt_token_ids))
        with self._lock:
            if self.failure is not None:
                raise EngineDeadError(self.failure)
            refused = self._refusal(request_id, stream.num_prompt_tokens)
            if refused is None:
                self._streams[request_id] = stream
                submit()  # under the lock: ordered against the engine's death
        if refused is not None:
            yield refused
            return
        finished = False
        try:
            while not finished:
                out = await stream.outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # the core's abort output ends the stream, its stats published first
                abort()
                await until_last(stream.outputs, ABORT_WAIT_S)
                with self._lock:
                    if self._streams.get(request_id) is stream:  # it timed out
                        del self._streams[request_id]

    def _refusal(self, request_id: str, num_prompt_tokens: int) -> RequestOutput | None:
        """How a request that cannot be submitted ends (under the lock): aborted when the engine is
        stopping, failed when its id is in flight (in the core's own words)."""
        if self.closing:
            return last(request_id, num_prompt_tokens, None, time.monotonic())
        if request_id in self._streams:
            why = f"request could not be admitted: duplicate request id {request_id!r}"
            return last(request_id, num_prompt_tokens, why, time.monotonic())
        return None

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Each output to its request's queue; each event loop woken once for the batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # its consumer left (and gave up waiting)
                if out.finished:
                    del self._streams[out.request_id]
                by_loop.setdefault(stream.loop, []).append((stream, out))
        _wake_loops(by_loop)

    def mark_failed(self, failure: str) -> None:
        """The engine is dead: from now on `generate` raises EngineDeadError (the streams open stay
        open for the engine's last outputs; `fail` ends what is left)."""
        with self._lock:
            self.failure = failure

    def fail(self, failure: str | None) -> None:
        """The engine is gone (`failure`: dead; None: it stopped as asked): every stream still open
        ends (failed or aborted), and later requests are refused."""
        with self._lock:
            if failure is not None:
                self.failure = failure
            self.closing = True
            streams, self._streams = self._streams, {}
        now = time.monotonic()
        why = None if failure is None else f"engine failure: {failure}"
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput]]] = {}
        for request_id, stream in streams.items():
            by_loop.setdefault(stream.loop, []).append(
                (stream, last(request_id, stream.num_prompt_tokens, why, now))
            )
        _wake_loops(by_loop)


def last(request_id: str, num_prompt_tokens: int, error: str | None, now: float) -> RequestOutput:
    """A request's last output: failed with `error`, or aborted (None)."""
    if error is None:
        return RequestOutput.last(request_id, num_prompt_tokens, finish_reason="abort", time=now)
    return RequestOutput.last(request_id, num_prompt_tokens, error=error, time=now)


def _wake_loops(by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput]]]) -> None:
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.outputs.put_nowait(out)
