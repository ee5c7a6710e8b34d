"""The FastAPI application: routes, error handlers, HTTP metrics, and the model's lifecycle.

The server listens at once (liveness answers while weights load); readiness turns 200 only
after the model is loaded and warmed up. Bringing the model up is the entry point's business
(service.serving hands in a `BringUp`): this package sees an engine only through
service.engine.protocol. If bringing the model up fails, or the engine dies later, `on_fatal`
is called so the process can exit non-zero and be restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import service
from service.api import lora_routes, model_list, probe_routes, system_routes
from service.api.chat import router as chat
from service.api.chat.protocol import ChatCompletionChunk
from service.api.completions import router as completions
from service.api.completions.protocol import CompletionResponse
from service.api.errors import install_error_handlers
from service.api.messages import router as messages
from service.api.middleware import BodySizeLimitMiddleware, RequestContextMiddleware
from service.api.responses import router as responses
from service.api.responses.store import ResponseStore
from service.api.security import APIKeyStore
from service.api.state import ApiLimits, Ready, ServiceState
from service.api.tokens import router as tokens
from service.config import Settings
from service.telemetry.metrics import Metrics
from service.telemetry.tracing import configure_tracing

log = logging.getLogger(__name__)

FatalHandler = Callable[[str], None]
# Loads and starts the model; given the service's metrics and what to call if the engine dies.
BringUp = Callable[[Metrics, FatalHandler], Awaitable[Ready]]


def create_app(
    settings: Settings,
    served_name: str,
    bring_up: BringUp,
    on_fatal: FatalHandler | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The API over the model `bring_up` loads; `on_fatal` is told when the engine dies, `on_ready`
    is called once the model is up, just before the service reports ready (the serving process
    freezes its start-up heap there: service.util.freeze_startup_heap)."""
    tracing = configure_tracing(settings)
    state = ServiceState(
        limits=ApiLimits.from_settings(settings), metrics=Metrics(served_name), served_name=served_name
    )
    state.metrics.register(state.engine_stats)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(_bring_up(state, bring_up, on_fatal, on_ready))
        try:
            yield
        finally:
            state.phase = "stopping"
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loading
            await state.stop_engine()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # flush the spans still buffered

    app = FastAPI(
        title="nim-torch",
        version=service.__version__,
        description="OpenAI-compatible LLM inference service",
        lifespan=lifespan,
    )
    app.state.service = state
    app.state.responses_store = ResponseStore(
        settings.responses_store_max_count, settings.responses_store_max_bytes
    )
    install_error_handlers(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    # One package per endpoint: its router, its serving, its bodies (service.api.chat, ...).
    for endpoint in (chat, completions, responses, messages, model_list, tokens):
        app.include_router(endpoint.router)
    app.include_router(system_routes.router)
    app.include_router(system_routes.root_router)
    app.include_router(probe_routes.router)
    app.include_router(lora_routes.router)
    # Added innermost first: CORS answers preflights before authentication is asked for.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(
        RequestContextMiddleware,
        keys=APIKeyStore(settings.api_keys, settings.api_keys_file),
        tracing=tracing,
    )
    app.add_middleware(HTTPMetricsMiddleware, metrics=state.metrics)
    origins = settings.split(settings.cors_allow_origins)
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=settings.split(settings.cors_allow_methods),
            allow_headers=settings.split(settings.cors_allow_headers),
            expose_headers=settings.split(settings.cors_expose_headers),
            max_age=settings.cors_max_age,
        )
    return app


async def _bring_up(
    state: ServiceState, bring_up: BringUp, on_fatal: FatalHandler | None, on_ready: Callable[[], None] | None
) -> None:
    def engine_died(reason: str) -> None:
        state.failure = reason
        log.error("%s", reason)
        if on_fatal is not None:
            on_fatal(reason)

    try:
        ready = await bring_up(state.metrics, engine_died)
        try:
            state.resolve_reasoning(ready)  # decided and logged once; a bad setting stops the start
        except Exception:
            await ready.engine.stop()
            raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        state.phase, state.failure = "failed", f"{exc.__class__.__name__}: {exc}"
        log.error("could not bring the model up: %s", state.failure)
        if on_fatal is not None:
            on_fatal(state.failure)
        return
    state.model = ready
    state.engine_stats.attach(ready.engine, ready.info.engine)
    if state.phase == "loading":
        if on_ready is not None:
            on_ready()
        state.phase = "ready"
        info = ready.info
        log.info("serving %s as %r with profile %s (%s)", info.source, info.served_name, info.profile_name,
                 info.profile_id)  # fmt: skip


def _openapi(app: FastAPI) -> dict:
    """FastAPI documents a 422 for every body; this API answers validation errors with 400."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        for path, chunk in STREAMED.items():
            ok = schema["paths"][path]["post"]["responses"]["200"]
            ok["content"]["text/event-stream"] = {"schema": _sse_event_schema(chunk, components)}
            ok["description"] = "The response; with `stream: true`, server-sent events."
        app.openapi_schema = schema
    return app.openapi_schema


# Operations that answer with server-sent events when the request sets `stream: true`.
STREAMED: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionChunk,
    "/v1/completions": CompletionResponse,
}


def _sse_event_schema(chunk: type[BaseModel], components: dict) -> dict:
    """One event of a stream (OpenAPI 3.1 reads a text/event-stream schema as one event's)."""
    chunk_schema = chunk.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
    for name, definition in chunk_schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components.setdefault(chunk.__name__, chunk_schema)
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string", "enum": ["message"]},
            "data": {
                "description": f"A {chunk.__name__} as JSON; an ErrorResponse as JSON if the stream "
                "fails after it started; the literal `[DONE]` as the last event.",
                "anyOf": [
                    {"type": "string", "const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "oneOf": [
                                {"$ref": f"#/components/schemas/{chunk.__name__}"},
                                {"$ref": "#/components/schemas/ErrorResponse"},
                            ]
                        },
                    },
                ],
            },
        },
    }


class HTTPMetricsMiddleware:
    """Counts requests by route template (not raw path: bounded label cardinality) and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                route = scope.get("route")
                path = getattr(route, "path", "unmatched")
                self.metrics.observe_http(scope["method"], path, status, time.monotonic() - started)
            await send(message)

        await self.app(scope, receive, send_and_record)
