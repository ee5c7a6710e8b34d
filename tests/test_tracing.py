"""OpenTelemetry export: a real server sends its request spans over OTLP/HTTP to a collector the
test runs, parented by the caller's traceparent, with GenAI attributes, flushed on SIGTERM."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from service.config_loading import ConfigError, load_settings
from service.telemetry.tracing import RequestTracing, annotate, configure_tracing
from tests.conftest import start_server, wait_ready

trace_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="needs the otel extra (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)",
)

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"


class Collector:
    """An OTLP/HTTP trace receiver: keeps every span POSTed to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.resources: list[dict] = []
        self.paths: list[str] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector.receive(self.path, self.headers.get("Content-Type", ""), body)
                reply = trace_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def receive(self, path: str, content_type: str, body: bytes) -> None:
        assert content_type == "application/x-protobuf"
        self.paths.append(path)
        request = trace_pb2.ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            self.resources.append(resource)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        {
                            "name": span.name,
                            "kind": span.kind,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "status": span.status.code,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                        }
                    )


def _value(value) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Collector, dict]]:
    """Serve with tracing on, make the requests, stop with SIGTERM, then hand over what arrived.

    The batch delay is longer than the test, so every span reaching the collector proves that
    shutdown flushes the buffer."""
    collector = Collector()
    log_path = tmp_path_factory.mktemp("traced") / "server.log"
    server = start_server(
        log_path,
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
            "OTEL_SERVICE_NAME": "nim-under-test",
            "OTEL_BSP_SCHEDULE_DELAY": "600000",
            "NIM_JSONL_LOGGING": "1",
        },
    )
    results: dict = {}
    try:
        wait_ready(server)
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            results["chat"] = client.post(
                "/v1/chat/completions",
                headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1", "x-request-id": "trace-me-1"},
                json={
                    "model": "smollm2-135m-instruct",
                    "messages": [{"role": "user", "content": "Say hi"}],
                    "max_tokens": 5,
                    "temperature": 0,
                    "seed": 7,
                },
            )
            with client.stream(
                "POST",
                "/v1/completions",
                json={
                    "model": "smollm2-135m-instruct",
                    "prompt": "One, two,",
                    "max_tokens": 4,
                    "ignore_eos": True,  # sampled: without it the model may end before 4 tokens
                    "stream": True,
                },
            ) as stream:
                results["stream_body"] = stream.read().decode()
            results["not_found"] = client.post(
                "/v1/completions", json={"model": "no-such-model", "prompt": "x", "max_tokens": 1}
            )
            results["health"] = client.get("/v1/health/ready")
        results["exit_code"] = server.stop()
        results["log"] = server.log()
        yield collector, results
    finally:
        server.stop()
        collector.httpd.shutdown()


def _span(collector: Collector, route_name: str, status: int) -> dict:
    found = [
        s
        for s in collector.spans
        if s["name"] == route_name and s["attributes"]["http.response.status_code"] == status
    ]
    assert len(found) == 1, collector.spans
    return found[0]


def test_spans_reach_the_collector_and_are_flushed_on_shutdown(traced) -> None:
    collector, results = traced
    assert results["exit_code"] == 0
    assert set(collector.paths) == {"/v1/traces"}
    assert all(r["service.name"] == "nim-under-test" for r in collector.resources)
    names = sorted(s["name"] for s in collector.spans)
    # Health probes are not traced; every API request is, named by its route template.
    assert names == ["POST /v1/chat/completions", "POST /v1/completions", "POST /v1/completions"]


def test_span_continues_the_callers_trace_with_genai_attributes(traced) -> None:
    collector, results = traced
    response = results["chat"]
    assert response.status_code == 200
    body = response.json()
    span = _span(collector, "POST /v1/chat/completions", 200)
    assert span["trace_id"] == CALLER_TRACE_ID
    assert span["parent_span_id"] == CALLER_SPAN_ID
    assert span["span_id"] != CALLER_SPAN_ID
    assert span["kind"] == 2  # SPAN_KIND_SERVER
    attrs = span["attributes"]
    assert attrs["http.route"] == "/v1/chat/completions"
    assert attrs["http.request.method"] == "POST"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "smollm2-135m-instruct"
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.request.seed"] == 7
    assert attrs["gen_ai.response.id"] == body["id"] == "chatcmpl-trace-me-1"
    assert attrs["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == [body["choices"][0]["finish_reason"]]
    # Nothing the user wrote or the model said goes on a span.
    assert "Say hi" not in json.dumps(collector.spans)
    assert body["choices"][0]["message"]["content"] not in json.dumps(attrs)


def test_stream_span_counts_tokens_even_without_include_usage(traced) -> None:
    collector, results = traced
    assert '"usage"' not in results["stream_body"]
    span = _span(collector, "POST /v1/completions", 200)
    assert span["parent_span_id"] == ""  # no caller context: a new trace
    assert span["trace_id"] != CALLER_TRACE_ID
    attrs = span["attributes"]
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]


def test_client_errors_are_recorded_but_not_marked_as_span_errors(traced) -> None:
    collector, results = traced
    assert results["not_found"].status_code == 404
    span = _span(collector, "POST /v1/completions", 404)
    assert span["status"] == 0  # STATUS_CODE_UNSET: a 4xx is the caller's problem, not the server's


def test_log_records_carry_the_exported_span_ids(traced) -> None:
    collector, results = traced
    span = _span(collector, "POST /v1/chat/completions", 200)
    records = [json.loads(line) for line in results["log"].splitlines() if line.startswith("{")]
    access = [r for r in records if r.get("request_id") == "trace-me-1" and r["logger"] == "service.access"]
    assert len(access) == 1
    assert access[0]["trace_id"] == CALLER_TRACE_ID
    assert access[0]["span_id"] == span["span_id"]
    assert access[0]["traceparent"] == TRACEPARENT
    assert access[0]["tracestate"] == "vendor=1"


def test_tracing_is_off_without_an_endpoint_or_when_disabled() -> None:
    assert configure_tracing(load_settings()) is None
    assert (
        configure_tracing(load_settings(otel_exporter_otlp_endpoint="http://c:4318", enable_otel=False))
        is None
    )
    none_exporter = load_settings(otel_exporter_otlp_endpoint="http://c:4318", otel_traces_exporter="NONE")
    assert configure_tracing(none_exporter) is None


def test_traces_endpoint_follows_the_otel_conventions() -> None:
    assert load_settings(otel_exporter_otlp_endpoint="http://c:4318/").otlp_traces_endpoint == (
        "http://c:4318/v1/traces"
    )
    signal = load_settings(
        otel_exporter_otlp_endpoint="http://c:4318", otel_exporter_otlp_traces_endpoint="http://t:1/x"
    )
    assert signal.otlp_traces_endpoint == "http://t:1/x"
    assert load_settings(enable_otel=True).otlp_traces_endpoint == "http://localhost:4318/v1/traces"


def test_missing_sdk_warns_or_fails_as_asked(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    auto = load_settings(otel_exporter_otlp_endpoint="http://c:4318")
    with caplog.at_level("WARNING", logger="service.telemetry.tracing"):
        assert configure_tracing(auto) is None
    assert "traces are not exported" in caplog.text and "nim-torch[otel]" in caplog.text
    with pytest.raises(ConfigError, match="NIM_ENABLE_OTEL=1"):
        configure_tracing(load_settings(otel_exporter_otlp_endpoint="http://c:4318", enable_otel=True))


def test_console_exporter_writes_spans_to_the_log(caplog) -> None:
    settings = load_settings(enable_otel=True, otel_traces_exporter="console")
    with caplog.at_level("INFO", logger="service.telemetry.tracing"):
        tracing = configure_tracing(settings)
        assert tracing is not None
        with tracing.request_span("GET", "/v1/models", {}) as span:
            annotate({"gen_ai.request.model": "m", "skipped": None})
        RequestTracing.finish(span, "/v1/models", 200)
        tracing.shutdown()
    assert "exporting request traces to the log" in caplog.text
    printed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("span {")]
    assert len(printed) == 1
    exported = json.loads(printed[0].removeprefix("span "))
    assert exported["name"] == "GET /v1/models"
    assert exported["attributes"]["gen_ai.request.model"] == "m"
    assert "skipped" not in exported["attributes"]
    annotate({"outside": "a request"})  # no span: nothing happens, nothing fails
