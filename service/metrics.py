"""Prometheus metrics, observed where the fact happens.

The engine observes queues, tokens and latencies; the API observes HTTP outcomes. Metric names
follow vLLM's (`vllm:*`), which Kubernetes inference gateways and dashboards already read, plus
NIM's documented unprefixed gauges. Every `Metrics` owns its registry: no global state, so tests
and several servers in one process never collide.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

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

        self.num_requests_running = Gauge(
            "vllm:num_requests_running", "Requests generating now.", m, registry=r
        )
        self.num_requests_waiting = Gauge("vllm:num_requests_waiting", "Requests queued.", m, registry=r)
        self.nim_requests_running = Gauge("num_requests_running", "Requests generating now.", registry=r)
        self.nim_requests_waiting = Gauge("num_requests_waiting", "Requests queued.", registry=r)
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
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV cache blocks in use (0-1).", m, registry=r
        )
        self.gpu_cache_usage = Gauge(
            "vllm:gpu_cache_usage_perc", "KV cache blocks in use (0-1); older name.", m, registry=r
        )
        self.nim_cache_usage = Gauge("gpu_cache_usage_perc", "KV cache blocks in use (0-1).", registry=r)
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Requests preempted for KV blocks.", m, registry=r
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m, registry=r
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", m, registry=r
        )
        self.cache_config_info = Gauge(
            "vllm:cache_config_info",
            "KV cache configuration (value 1).",
            ["block_size", "num_gpu_blocks", "cache_dtype"],
            registry=r,
        )
        self._prefix_seen = (0, 0)
        # Create every model_name-labelled series now, so scrapers see zeros rather than gaps.
        for metric in (
            self.num_requests_running, self.num_requests_waiting, self.prompt_tokens, self.generation_tokens,
            self.time_to_first_token, self.inter_token_latency, self.e2e_latency, self.request_prompt_tokens,
            self.request_generation_tokens, self.kv_cache_usage, self.gpu_cache_usage, self.num_preemptions,
            self.prefix_cache_queries, self.prefix_cache_hits,
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

    # Engine-side observations ---------------------------------------------------------------

    def set_cache_config(self, block_size: int, num_blocks: int, cache_dtype: str) -> None:
        self.cache_config_info.labels(str(block_size), str(num_blocks), cache_dtype).set(1)

    def set_engine_state(
        self, running: int, waiting: int, kv_usage: float, prefix_queries: int, prefix_hits: int
    ) -> None:
        """Called by the engine after each step; counters advance by what changed since last time."""
        self.num_requests_running.labels(self.model_name).set(running)
        self.num_requests_waiting.labels(self.model_name).set(waiting)
        self.nim_requests_running.set(running)
        self.nim_requests_waiting.set(waiting)
        self.kv_cache_usage.labels(self.model_name).set(kv_usage)
        self.gpu_cache_usage.labels(self.model_name).set(kv_usage)
        self.nim_cache_usage.set(kv_usage)
        seen_queries, seen_hits = self._prefix_seen
        if prefix_queries > seen_queries:
            self.prefix_cache_queries.labels(self.model_name).inc(prefix_queries - seen_queries)
        if prefix_hits > seen_hits:
            self.prefix_cache_hits.labels(self.model_name).inc(prefix_hits - seen_hits)
        self._prefix_seen = (max(prefix_queries, seen_queries), max(prefix_hits, seen_hits))

    def observe_preemptions(self, count: int) -> None:
        self.num_preemptions.labels(self.model_name).inc(count)

    def observe_prefill(self, num_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)

    def observe_token(self, first: bool, since_previous: float) -> None:
        self.generation_tokens.labels(self.model_name).inc()
        if first:
            self.time_to_first_token.labels(self.model_name).observe(since_previous)
        else:
            self.inter_token_latency.labels(self.model_name).observe(since_previous)

    def observe_finished(
        self, reason: str, e2e_seconds: float, prompt_tokens: int, output_tokens: int
    ) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e_latency.labels(self.model_name).observe(e2e_seconds)
        self.request_prompt_tokens.labels(self.model_name).observe(prompt_tokens)
        self.request_generation_tokens.labels(self.model_name).observe(output_tokens)

    # API-side observations ------------------------------------------------------------------

    def observe_http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_latency.labels(method, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
