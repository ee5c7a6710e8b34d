"""Prometheus metrics: the series, their names and buckets.

Nothing here observes an engine directly: service.telemetry.metering turns what engines report (typed
stats snapshots and timed outputs) into these series, and the API's middleware observes HTTP
outcomes. Names follow vLLM's (`vllm:*`), which Kubernetes inference gateways and vLLM's Grafana
dashboard already read, with vLLM's buckets; NIM's documented unprefixed names are exported beside
them, unlabelled as NIM's per-model series of a one-model server. Every `Metrics` owns its registry:
no global state, so tests and several servers in one process never collide.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.registry import Collector

# `*_created` series double the scrape size and no gateway reads them (vLLM drops them too).
disable_created_metrics()

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours unchanged.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# Inter-token latency and time per output token (per token and per request).
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
# End to end, and the request's phases: queued, prefill, decode, inference (prefill + decode).
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class RequestTimes:
    """One finished request's times (time.monotonic()) and counts, as the meter saw them.

    `first_scheduled` is None where the engine cannot tell when it first scheduled the request;
    `first_token` and `last_token` are None when no token came."""

    finish_reason: str
    arrival: float
    end: float
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None
    prompt_tokens: int
    generated_tokens: int
    max_tokens: int


class _RequestTokenHistograms:
    """Per-request token counts, bucketed by the context length as vLLM does (so made at attach)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        r, m, buckets = registry, ["model_name"], token_buckets(max_model_len)

        def labelled(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.max_model_len = max_model_len
        self.prompt = labelled("vllm:request_prompt_tokens", "Prompt length per request.")
        self.generation = labelled("vllm:request_generation_tokens", "Output length per request.")
        self.max_generation = labelled(
            "vllm:request_max_num_generation_tokens",
            "Tokens generated per request (vLLM: the most of its n sequences; here one per sequence).",
        )
        self.max_tokens = labelled("vllm:request_params_max_tokens", "The max_tokens a request asked for.")
        self.nim_prompt = Histogram(
            "request_prompt_tokens", "Prompt length per request (NIM).", buckets=buckets, registry=r
        )
        self.nim_generation = Histogram(
            "request_generation_tokens", "Output length per request (NIM).", buckets=buckets, registry=r
        )


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            # Labelled now, so scrapers see zeros rather than gaps.
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, m, registry=r).labels(model_name)

        # vLLM's names --------------------------------------------------------------------------
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", TPOT_BUCKETS
        )
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Time between output tokens; older name of vllm:inter_token_latency_seconds.",
            TPOT_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per request: decode time over its output tokens after the first.",
            TPOT_BUCKETS,
        )
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Arrival to first scheduled (WAITING).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "First scheduled to first token.", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "First token to last token.", REQUEST_LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "First scheduled to last token (RUNNING).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests.", [*m, "finished_reason"], registry=r
        )
        self.lora_requests = Counter(
            "nim_lora_requests", "Generation requests per LoRA adapter.", [*m, "lora_name"], registry=r
        )
        # NIM's documented unprefixed names -------------------------------------------------------
        self.nim_prompt_tokens = Counter("prompt_tokens", "Prefill tokens processed (NIM).", registry=r)
        self.nim_generation_tokens = Counter("generation_tokens", "Tokens generated (NIM).", registry=r)
        self.nim_time_to_first_token = Histogram(
            "time_to_first_token_seconds", "Arrival to first token (NIM).", buckets=TTFT_BUCKETS, registry=r
        )
        self.nim_time_per_output_token = Histogram(
            "time_per_output_token_seconds",
            "Time between output tokens (NIM).",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.nim_e2e_latency = Histogram(
            "e2e_request_latency_seconds",
            "Arrival to last token (NIM).",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_finish = Counter("request_finish", "Requests ended, however (NIM).", registry=r)
        self.nim_request_success = Counter(
            "request_success", "Requests ended by stop or length (NIM).", registry=r
        )
        self.request_failure = Counter(
            "request_failure", "Requests the engine failed (an error, not a finish reason).", registry=r
        )
        # Per-request token counts: bucketed by the context length, known once an engine is attached.
        self.request_tokens: _RequestTokenHistograms | None = None

        self.http_requests = Counter(
            "http_requests", "HTTP requests by route and status.", ["method", "route", "status"], registry=r
        )
        self.http_latency = Histogram(
            "http_request_duration_seconds",
            "HTTP handler time to first byte.",
            ["method", "route"],
            buckets=HTTP_BUCKETS,
            registry=r,
        )

    def register(self, collector: Collector) -> None:
        """Add a collector whose series are computed at scrape time (the engine's stats)."""
        self.registry.register(collector)

    def size_for(self, max_model_len: int) -> None:
        """Create the per-request token histograms with vLLM's buckets for this context length.
        Once: a later engine of another context length keeps the first one's buckets."""
        if self.request_tokens is None:
            self.request_tokens = _RequestTokenHistograms(self.registry, self.model_name, max_model_len)

    # Per-request observations (service.telemetry.metering) ---------------------------------------------

    def observe_first_token(self, num_prompt_tokens: int, ttft_seconds: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.nim_prompt_tokens.inc(num_prompt_tokens)
        self.time_to_first_token.observe(ttft_seconds)
        self.nim_time_to_first_token.observe(ttft_seconds)

    def observe_tokens(self, count: int, inter_token_seconds: float | None) -> None:
        """`count` tokens arrived `inter_token_seconds` after the previous ones (None: the first)."""
        self.generation_tokens.inc(count)
        self.nim_generation_tokens.inc(count)
        if inter_token_seconds is None:
            return
        each = inter_token_seconds / count
        per_token = (self.inter_token_latency, self.time_per_output_token, self.nim_time_per_output_token)
        for _ in range(count):
            for series in per_token:
                series.observe(each)

    def observe_finished(self, times: RequestTimes) -> None:
        """A request that ended with a finish reason (stop, length, abort): its latencies and sizes."""
        e2e = times.end - times.arrival
        self.request_success.labels(self.model_name, times.finish_reason).inc()
        self.request_finish.inc()
        if times.finish_reason in ("stop", "length"):
            self.nim_request_success.inc()
        self.e2e_latency.observe(e2e)
        self.nim_e2e_latency.observe(e2e)
        self._observe_sizes(times)
        self._observe_phases(times)

    def observe_failed(self) -> None:
        self.request_failure.inc()
        self.request_finish.inc()

    def observe_adapter_request(self, adapter: str) -> None:
        self.lora_requests.labels(self.model_name, adapter).inc()

    def _observe_sizes(self, times: RequestTimes) -> None:
        tokens = self.request_tokens
        if tokens is None:
            raise RuntimeError("Metrics.size_for was not called: the token histograms have no buckets yet")
        tokens.prompt.observe(times.prompt_tokens)
        tokens.nim_prompt.observe(times.prompt_tokens)
        tokens.generation.observe(times.generated_tokens)
        tokens.nim_generation.observe(times.generated_tokens)
        tokens.max_generation.observe(times.generated_tokens)
        tokens.max_tokens.observe(times.max_tokens)

    def _observe_phases(self, times: RequestTimes) -> None:
        """vLLM's phases: queued (arrival to first scheduled), prefill (to the first token), decode
        (first to last token), inference (first scheduled to last token). A phase whose ends the
        request never reached (no token came; the engine cannot tell when it scheduled) is not
        observed."""
        scheduled, first, last = times.first_scheduled, times.first_token, times.last_token
        if scheduled is not None:
            self.queue_time.observe(scheduled - times.arrival)
        if first is None or last is None:
            return
        decode = last - first
        self.decode_time.observe(decode)
        after_first = times.generated_tokens - 1
        self.request_time_per_output_token.observe(decode / after_first if after_first > 0 else 0.0)
        if scheduled is not None:
            self.prefill_time.observe(first - scheduled)
            self.inference_time.observe(last - scheduled)

    # API-side observations ------------------------------------------------------------------

    def observe_http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_latency.labels(method, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
