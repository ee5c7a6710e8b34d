"""Metering: what an engine reports, turned into the Prometheus series of service.telemetry.metrics.

Engines know nothing of Prometheus. They report two kinds of facts, and this module is the one
place that turns them into series:

- a typed `EngineStats` snapshot (queues, KV blocks, prefix-cache lookups, preemptions, step
  histograms), read at scrape time by `EngineStatsCollector`, so a scrape sees the engine as it
  is now and counters are exactly the engine's cumulative counts;
- timed `RequestOutput` deltas, observed by `MeteredEngine` as they pass to the API: time to
  first token and between tokens (from the engine's own timestamps), token counts, how each
  request ended, its end-to-end latency and vLLM's phases (queued until the engine first
  scheduled it, prefill until its first token, decode until its last; an engine that cannot tell
  when it scheduled a request leaves queue, prefill and inference unobserved). A request the
  client abandons counts as `abort`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from service.engine.protocol import (
    Engine,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    Histogram,
    KVEvent,
    RequestOutput,
)
from service.telemetry.metrics import Metrics, RequestTimes


class EngineStatsCollector(Collector):
    """Series computed from the engine's latest stats snapshot at each scrape.

    Before an engine is attached (the model is loading) the labelled gauges and counters read 0,
    so scrapers see zeros rather than gaps.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: Engine | None = None
        self.info: EngineInfo | None = None

    def attach(self, engine: Engine, info: EngineInfo) -> None:
        self.engine, self.info = engine, info

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats() if self.engine is not None else EngineStats()
        name = self.model_name
        yield from (
            _gauge("vllm:num_requests_running", "Requests generating now.", name, stats.num_running),
            _gauge("vllm:num_requests_waiting", "Requests queued.", name, stats.num_waiting),
            _gauge("vllm:kv_cache_usage_perc", "KV cache blocks in use (0-1).", name, stats.kv_cache_usage),
            _gauge(
                "vllm:gpu_cache_usage_perc",
                "KV cache blocks in use (0-1); older name.",
                name,
                stats.kv_cache_usage,
            ),
            _counter(
                "vllm:num_preemptions", "Requests preempted for KV blocks.", name, stats.num_preemptions
            ),
            _counter(
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                name,
                stats.prefix_queries,
            ),
            _counter(
                "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", name, stats.prefix_hits
            ),
        )
        # NIM's documented unprefixed names.
        yield GaugeMetricFamily("num_requests_running", "Requests generating now.", value=stats.num_running)
        yield GaugeMetricFamily("num_requests_waiting", "Requests queued.", value=stats.num_waiting)
        yield GaugeMetricFamily(
            "gpu_cache_usage_perc", "KV cache blocks in use (0-1).", value=stats.kv_cache_usage
        )
        yield GaugeMetricFamily(
            "num_request_max",
            "Requests the engine runs at once (0 while the model loads).",
            value=self.info.max_num_seqs if self.info is not None else 0,
        )
        yield _histogram(
            "vllm:iteration_tokens_total", "Tokens computed per engine step.", name, stats.step_tokens
        )
        yield _histogram(
            "nim_engine_step_sequences", "Sequences in one engine step.", name, stats.step_sequences
        )
        yield _histogram(
            "nim_engine_step_duration_seconds", "Time of one engine step.", name, stats.step_seconds
        )
        if self.info is not None and self.info.max_loras:
            # The Gateway API Inference Extension routes by it: value = when it was last updated.
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "LoRA adapters of running and waiting requests (value: update time, Unix seconds).",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            lora.add_metric(
                [str(self.info.max_loras), ",".join(stats.lora_running), ",".join(stats.lora_waiting)],
                time.time(),
            )
            yield lora
        if stats.spec_accepted_per_position:  # speculative decoding runs: vLLM's spec_decode counters
            yield from (
                _counter("vllm:spec_decode_num_drafts", "Draft verifications.", name, stats.spec_drafts),
                _counter(
                    "vllm:spec_decode_num_draft_tokens",
                    "Draft tokens verified.",
                    name,
                    stats.spec_draft_tokens,
                ),
                _counter(
                    "vllm:spec_decode_num_accepted_tokens",
                    "Draft tokens accepted.",
                    name,
                    stats.spec_accepted_tokens,
                ),
            )
            per_position = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in their proposal.",
                labels=["model_name", "position"],
            )
            for position, count in enumerate(stats.spec_accepted_per_position):
                per_position.add_metric([name, str(position)], count)
            yield per_position
        if self.info is not None:
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "KV cache configuration (value 1).",
                labels=["block_size", "num_gpu_blocks", "cache_dtype"],
            )
            info.add_metric(
                [str(self.info.kv_block_size), str(self.info.kv_num_blocks), self.info.kv_cache_dtype], 1
            )
            yield info


def _gauge(metric: str, doc: str, model_name: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(metric, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def _counter(metric: str, doc: str, model_name: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(metric, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def _histogram(metric: str, doc: str, model_name: str, histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(metric, doc, labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts, strict=True):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    family.add_metric([model_name], buckets, histogram.total)
    return family


@dataclass
class _Progress:
    """What the meter has seen of one request so far."""

    arrival_time: float
    max_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    ended: bool = False

    def times(self, finish_reason: str, end: float) -> RequestTimes:
        return RequestTimes(
            finish_reason=finish_reason,
            arrival=self.arrival_time,
            end=end,
            first_scheduled=self.first_scheduled_time,
            first_token=self.first_token_time,
            last_token=self.last_time,
            prompt_tokens=self.num_prompt_tokens,
            generated_tokens=self.num_generated_tokens,
            max_tokens=self.max_tokens,
        )


class MeteredEngine:
    """An Engine that observes every request's outputs on their way to the API.

    The per-request token histograms take vLLM's buckets from the engine's context length, so
    metering an engine sizes them (`Metrics.size_for`)."""

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        metrics.size_for(engine.info.max_model_len)

    # Everything but generate passes through.
    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def ready(self) -> bool:
        return self.engine.ready

    @property
    def failure(self) -> str | None:
        return self.engine.failure

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def kv_events(self) -> list[KVEvent]:
        return self.engine.kv_events()

    async def check(self, request: GenerationRequest) -> None:
        await self.engine.check(request)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        progress = _Progress(
            arrival_time=request.arrival_time or time.monotonic(), max_tokens=request.sampling.max_tokens
        )
        if request.adapter is not None:
            self.metrics.observe_adapter_request(request.adapter)
        stream = self.engine.generate(request)
        try:
            async for out in stream:
                self._observe(progress, out)
                yield out
        finally:
            await stream.aclose()
            if not progress.ended:  # the consumer left first: the engine aborts it
                progress.ended = True
                self.metrics.observe_finished(progress.times("abort", time.monotonic()))

    def _observe(self, progress: _Progress, out: RequestOutput) -> None:
        progress.num_prompt_tokens = out.num_prompt_tokens
        progress.num_generated_tokens = out.num_generated_tokens
        if progress.first_scheduled_time is None:
            progress.first_scheduled_time = out.first_scheduled_time
        metrics = self.metrics
        if out.token_ids:
            if progress.last_time is None:
                progress.first_token_time = out.time
                metrics.observe_first_token(out.num_prompt_tokens, out.time - progress.arrival_time)
                metrics.observe_tokens(len(out.token_ids), None)
            else:
                metrics.observe_tokens(len(out.token_ids), out.time - progress.last_time)
            progress.last_time = out.time
        if not out.finished:
            return
        progress.ended = True
        if out.error is not None:
            metrics.observe_failed()
            return
        metrics.observe_finished(progress.times(out.finish_reason or "abort", out.time or time.monotonic()))
