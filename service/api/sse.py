"""Server-sent events: a stream of frames, a failure mid-stream as an error frame (the status line has
gone out already; OpenAI's `data: {"error": ...}` unless the endpoint renders its own), and the
admission slot released exactly once however it ends."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from service.api.errors import APIError, error_body
from service.api.generation import timed_out
from service.api.state import ServiceState

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(
    events: AsyncIterator[str], state: ServiceState, render_error: Callable[[APIError], str] | None = None
) -> StreamingResponse:
    """Stream events; the admission slot is released exactly once, however the stream ends
    (finished, failed, client gone before or after the first byte). A failure is sent as
    `render_error` renders it (default: OpenAI's error frame, then `[DONE]`)."""
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.release()

    guarded = guard(events, release, state.limits.request_timeout_seconds, render_error or sse_error)
    return StreamingResponse(
        guarded, media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(release)
    )


async def guard(
    events: AsyncIterator[str],
    release: Callable[[], None],
    timeout_s: float | None,
    render_error: Callable[[APIError], str],
) -> AsyncIterator[str]:
    """A failure mid-stream becomes an error frame: the status line has already gone out."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        async for event in events:
            yield event
            if deadline is not None and time.monotonic() > deadline:
                yield render_error(timed_out(timeout_s))
                return
    except APIError as exc:
        yield render_error(exc)
    except Exception:
        log.exception("stream failed")
        yield render_error(APIError(500, "internal server error", "server_error"))
    finally:
        if hasattr(events, "aclose"):
            await events.aclose()  # aborts the engine requests if the stream ended early
        release()


def sse_data(payload: BaseModel, include_usage: bool) -> str:
    exclude: set[str] | None = None if include_usage else {"usage"}
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


def sse_error(err: APIError) -> str:
    """An error frame (the official client raises on it), then the end of the stream."""
    return (
        f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n" + "data: [DONE]\n\n"
    )
