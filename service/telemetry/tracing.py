"""OpenTelemetry export: one server span per API request, a child of the caller's `traceparent`.

Tracing is on when OTEL_EXPORTER_OTLP_ENDPOINT is set (or NIM_ENABLE_OTEL=1) and the OpenTelemetry
SDK with its OTLP/HTTP exporter is installed (the `otel` extra; the container image has it). Spans
go to the collector over OTLP/HTTP (protobuf) in batches; OTEL_TRACES_EXPORTER=console prints them
to the log instead, `none` turns export off. The SDK's own OTEL_* variables (headers, certificates,
timeouts, batch delays, sampler) apply as OpenTelemetry documents them.

Route handlers describe the generation on the request's span through `annotate`, using the GenAI
semantic conventions (gen_ai.request.model, gen_ai.usage.input_tokens, ...); it does nothing when
tracing is off, so callers never check. Prompts and outputs are never put on spans.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from service.config import Settings
from service.config_loading import ConfigError

log = logging.getLogger(__name__)

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]

# The span of the request being served; None when tracing is off or outside a request.
_span_var: contextvars.ContextVar[Any] = contextvars.ContextVar("otel_span", default=None)


def annotate(attributes: Mapping[str, AttributeValue | None]) -> None:
    """Set attributes on the current request's span (None values are skipped)."""
    span = _span_var.get()
    if span is not None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def span_ids(span: Any) -> tuple[str, str]:
    """(trace id, span id) in the hex form logs and W3C headers use."""
    context = span.get_span_context()
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


class RequestTracing:
    """Starts and exports the request spans; `shutdown` flushes what is still buffered."""

    def __init__(self, settings: Settings) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        import service

        if settings.otel_traces_exporter == "console":
            # The exporter asks for a typing.IO but only calls write() and flush(), which _LogWriter has.
            exporter: Any = ConsoleSpanExporter(out=_LogWriter())  # type: ignore[arg-type]
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=settings.otlp_traces_endpoint)
        resource = Resource.create(
            {"service.name": settings.otel_service_name, "service.version": service.__version__}
        )
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("service.api")
        self._propagator = TraceContextTextMapPropagator()
        self.exporter_name = settings.otel_traces_exporter

    @contextlib.contextmanager
    def request_span(self, method: str, path: str, headers: Mapping[str, str]) -> Iterator[Any]:
        """A SERVER span around one HTTP request, parented by the caller's W3C trace context."""
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(carrier=dict(headers))
        span = self._tracer.start_span(
            method,  # "METHOD /route/template" once routing has matched; never the raw path
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )
        token = _span_var.set(span)
        try:
            yield span
        finally:
            _span_var.reset(token)

    @staticmethod
    def finish(span: Any, route: str | None, status: int) -> None:
        from opentelemetry.trace import Status, StatusCode

        if route is not None:
            span.update_name(f"{span.attributes.get('http.request.method')} {route}")
            span.set_attribute("http.route", route)
        span.set_attribute("http.response.status_code", status)
        if status >= 500 or status == 0:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def shutdown(self) -> None:
        self._provider.shutdown()


def configure_tracing(settings: Settings) -> RequestTracing | None:
    """The request tracer the settings ask for, or None. Raises ConfigError when NIM_ENABLE_OTEL=1
    asks for tracing that cannot run; when only the endpoint is set, a missing SDK is a warning."""
    wanted = settings.enable_otel
    if wanted is None:
        wanted = settings.otel_exporter_otlp_endpoint is not None
    if not wanted or settings.otel_traces_exporter == "none":
        return None
    try:
        tracing = RequestTracing(settings)
    except ImportError as exc:
        message = (
            f"OpenTelemetry export needs the opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http "
            f"packages (pip install 'nim-torch[otel]'): {exc}"
        )
        if settings.enable_otel:
            raise ConfigError(f"NIM_ENABLE_OTEL=1: {message}") from None
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but traces are not exported: %s", message)
        return None
    target = settings.otlp_traces_endpoint if tracing.exporter_name == "otlp" else "the log"
    log.info("exporting request traces to %s as service %r", target, settings.otel_service_name)
    return tracing


class _LogWriter:
    """A file-like sink that turns the console exporter's output into log records."""

    def write(self, text: str) -> int:
        if text.strip():
            log.info("span %s", text.strip())
        return len(text)

    def flush(self) -> None:
        pass
