"""Per-request context: request id (accepted from x-request-id or generated, echoed back) and
API-key authentication. Health, metrics, version and the API docs stay open and cheap."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import body_for
from service.api.security import APIKeyStore
from service.logs import TraceContext, request_id_var, trace_var
from service.telemetry.tracing import RequestTracing, span_ids

# vLLM's probes (/health, /ping, /version) are open as vLLM keeps them.
OPEN_PATHS = frozenset(
    ("/v1/metrics", "/metrics", "/v1/version", "/openapi.json", "/redoc", "/health", "/ping", "/version")
)
OPEN_PREFIXES = ("/v1/health/", "/docs")
UNTRACED_PATHS = (
    "/v1/health/",
    "/v1/metrics",
    "/metrics",
    "/health",
    "/ping",
)  # prefixes  # probes and scrapes would drown the traces
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
access_log = logging.getLogger("service.access")


def current_request_id() -> str | None:
    return request_id_var.get()


def _open(path: str) -> bool:
    """Health, metrics, version and the API docs need no key (probes and scrapers carry none)."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def _trace_context(caller: dict[str, str], span: Any) -> TraceContext | None:
    """Log correlation: the caller's trace context, plus this process's span when exporting."""
    if span is not None:
        trace_id, span_id = span_ids(span)
    elif caller:
        trace_id, span_id = caller["traceparent"].split("-")[1], None
    else:
        return None
    return TraceContext(trace_id, caller.get("traceparent"), caller.get("tracestate"), span_id)


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, keys: APIKeyStore, tracing: RequestTracing | None = None) -> None:
        self.app, self.keys, self.tracing = app, keys, tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        incoming = headers.get("x-request-id", "")
        request_id = incoming if _SAFE_ID.match(incoming) else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        traceparent = headers.get("traceparent", "").strip().lower()
        caller = {"traceparent": traceparent} if _TRACEPARENT.match(traceparent) else {}
        if caller and headers.get("tracestate"):
            caller["tracestate"] = headers["tracestate"][:512]
        echo = (b"x-request-id", request_id.encode())
        started = time.monotonic()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), echo]
            await send(message)

        with self._span(scope, caller) as span:
            trace_token = trace_var.set(_trace_context(caller, span))
            try:
                if self.keys.enabled and not _open(scope["path"]) and not self._authorized(headers):
                    await _unauthorized(send_with_id, scope["path"])
                    return
                await self.app(scope, receive, send_with_id)
            finally:
                # One line per request: what, outcome, time. Never bodies (prompts stay out of logs).
                elapsed_ms = round((time.monotonic() - started) * 1000, 1)
                fields = {
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status,
                    "duration_ms": elapsed_ms,
                }
                access_log.info(
                    "%s %s %d %.1f ms", scope["method"], scope["path"], status, elapsed_ms, extra=fields
                )
                if span is not None:
                    route = getattr(scope.get("route"), "path", None)
                    RequestTracing.finish(span, route, status)
                trace_var.reset(trace_token)
                request_id_var.reset(token)

    def _span(self, scope: Scope, caller: dict[str, str]) -> contextlib.AbstractContextManager[Any]:
        if self.tracing is None or scope["path"].startswith(UNTRACED_PATHS):
            return contextlib.nullcontext()
        return self.tracing.request_span(scope["method"], scope["path"], caller)

    def _authorized(self, headers: dict[str, str]) -> bool:
        """The key as a bearer token, or in x-api-key (as Anthropic's clients send it)."""
        scheme, _, credential = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and credential.strip():
            return self.keys.verify(credential.strip())
        api_key = headers.get("x-api-key", "").strip()
        return bool(api_key) and self.keys.verify(api_key)


async def _unauthorized(send: Send, path: str) -> None:
    message = "Incorrect or missing API key: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
    body = json.dumps(body_for(path, 401, message, "invalid_request_error", None, "invalid_api_key")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodySizeLimitMiddleware:
    """413 for request bodies over `max_bytes`.

    A declared Content-Length is checked before anything is read (the HTTP server holds the client
    to it). A body without one (chunked) is read here, up to the limit, before the route sees it:
    an overflow found later, inside the framework's body parsing, would come out as a 400. The
    buffer is bounded by the limit, and the route would buffer the body anyway."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                await _too_large(send, self.max_bytes, scope["path"])
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_bytes:
                await _too_large(send, self.max_bytes, scope["path"])
                return
            if not message.get("more_body", False):
                break
        buffered: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal buffered
            if buffered is not None:
                message, buffered = buffered, None
                return message
            return await receive()  # after the body: disconnect notices, as usual

        await self.app(scope, replay, send)


async def _too_large(send: Send, limit: int, path: str) -> None:
    message = f"request body exceeds {limit} bytes"
    body = json.dumps(
        body_for(path, 413, message, "invalid_request_error", None, "request_too_large")
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
