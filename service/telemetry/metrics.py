"""Prometheus metrics: the series, their names and buckets.

Nothing here observes an engine directly: service.telemetry.metering turns what engines report (typed
stats snapshots and timed outputs) into these series, and the API's middleware observes HTTP
outcomes. Names follow vLLM's (`vllm:*`), which Kubernetes inference gateways and dashboards
already read, plus NIM's documented unprefixed ones. Every `Metrics` owns its registry: no
global state, so tests and several servers in one process never collide.
"""

from __future__ import annotations

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

# Buckets as vLLM uses them, so dashboards built for vLLM read ours unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m, registry=r)
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token.", m, buckets=TTFT_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", m, buckets=E2E_BUCKETS, registry=r
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt length per request.", m, buckets=TOKEN_BUCKETS, registry=r
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Output length per request.",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests.", [*m, "finished_reason"], registry=r
        )
        self.request_failure = Counter(
            "request_failure", "Requests the engine failed (an error, not a finish reason).", registry=r
        )
        self.lora_requests = Counter(
            "nim_lora_requests", "Generation requests per LoRA adapter.", [*m, "lora_name"], registry=r
        )
        # Create every model_name-labelled series now, so scrapers see zeros rather than gaps.
        for metric in (
            self.prompt_tokens, self.generation_tokens, self.time_to_first_token, self.inter_token_latency,
            self.e2e_latency, self.request_prompt_tokens, self.request_generation_tokens,
        ):  # fmt: skip
            metric.labels(model_name)
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

    # Per-request observations (service.telemetry.metering) ---------------------------------------------

    def observe_first_token(self, num_prompt_tokens: int, ttft_seconds: float) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.time_to_first_token.labels(self.model_name).observe(ttft_seconds)

    def observe_tokens(self, count: int, inter_token_seconds: float | None) -> None:
        """`count` tokens arrived `inter_token_seconds` after the previous ones (None: the first)."""
        self.generation_tokens.labels(self.model_name).inc(count)
        if inter_token_seconds is not None:
            for _ in range(count):
                self.inter_token_latency.labels(self.model_name).observe(inter_token_seconds / count)

    def observe_finished(
        self, reason: str, e2e_seconds: float, prompt_tokens: int, output_tokens: int
    ) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e_latency.labels(self.model_name).observe(e2e_seconds)
        self.request_prompt_tokens.labels(self.model_name).observe(prompt_tokens)
        self.request_generation_tokens.labels(self.model_name).observe(output_tokens)

    def observe_failed(self) -> None:
        self.request_failure.inc()

    def observe_adapter_request(self, adapter: str) -> None:
        self.lora_requests.labels(self.model_name, adapter).inc()

    # API-side observations ------------------------------------------------------------------

    def observe_http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_latency.labels(method, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
