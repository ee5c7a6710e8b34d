"""What the API knows about the running service: its limits, metrics, and the model once loaded."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from service.api.errors import APIError, service_unavailable
from service.api.tools import ParserName
from service.config import Settings
from service.engine.protocol import AdapterCatalog, Engine, EngineDeadError, EngineInfo
from service.store.license import ModelLicense
from service.telemetry.metering import EngineStatsCollector
from service.telemetry.metrics import Metrics
from service.text.reasoning import ReasoningConfigError, ReasoningParser, resolve
from service.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class _Seeded(Protocol):
    seed: int | None

    def model_copy(self: SeededT, *, update: dict[str, Any] | None = None, deep: bool = False) -> SeededT: ...


SeededT = TypeVar("SeededT", bound=_Seeded)


@dataclass(frozen=True)
class ApiLimits:
    """The operator's limits on generation requests, read once from the settings."""

    max_pending_requests: int  # running + queued; beyond it 429
    max_prompt_tokens: int | None = None
    max_completion_tokens: int | None = None
    request_timeout_seconds: float | None = None
    always_include_usage: bool = False
    tool_call_parser: ParserName | None = None  # None: recognised from the chat template
    auto_tool_choice: bool = True
    trust_request_chat_template: bool = False  # a request's own `chat_template` is rendered, not refused
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None  # NIM_REASONING_PARSER as set
    seed: int | None = None  # NIM_SEED: seeds the draws of requests that send no seed
    runtime_lora_updating: bool = False  # NIM_ALLOW_RUNTIME_LORA_UPDATING: the load/unload API is on

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiLimits:
        return cls(
            max_pending_requests=settings.pending_limit,
            max_prompt_tokens=settings.max_prompt_tokens,
            max_completion_tokens=settings.max_completion_tokens,
            request_timeout_seconds=settings.request_timeout_seconds,
            always_include_usage=settings.always_include_usage,
            tool_call_parser=settings.tool_call_parser,
            auto_tool_choice=settings.enable_auto_tool_choice,
            trust_request_chat_template=settings.trust_request_chat_template,
            reasoning_parser=settings.reasoning_parser,
            seed=settings.seed,
            runtime_lora_updating=settings.allow_runtime_lora_updating,
        )


@dataclass(frozen=True)
class ModelInfo:
    """The model being served, as /v1/models and /v1/metadata describe it."""

    served_name: str
    source: str
    engine: EngineInfo
    profile_id: str
    profile_name: str
    profile_tags: dict[str, Any]
    selection: tuple[str, ...] = ()  # why this profile, one line each
    created: int = field(default_factory=lambda: int(time.time()))
    license: ModelLicense | None = None  # what the model's files say of their licence (/v1/license)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def profile(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "id": self.profile_id,
            "name": self.profile_name,
            "tags": {**self.profile_tags, "device": engine.device.split(":")[0]},
            "runtime": {
                "engine": engine.engine,
                "device": engine.device,
                "weight_precision": engine.weight_precision,
                "precision_mode": engine.precision_mode,
                "activation_dtype": engine.activation_dtype or None,
                "kv_cache_dtype": engine.kv_cache_dtype,
                "tensor_parallel_size": engine.tensor_parallel_size,
            },
            "selection": list(self.selection),
        }


@dataclass
class Ready:
    engine: Engine
    tokenizer: Tokenizer
    info: ModelInfo
    adapters: AdapterCatalog | None = None  # the LoRA adapters served beside the base model
    # The reasoning format answers are split by (NIM_REASONING_PARSER, or recognised from the chat
    # template); decided once by ServiceState.resolve_reasoning
    reasoning: ReasoningParser | None = field(default=None, init=False)
    reasoning_resolved: bool = field(default=False, init=False)


@dataclass
class ServiceState:
    limits: ApiLimits
    metrics: Metrics
    served_name: str
    engine_stats: EngineStatsCollector = field(init=False)
    phase: Literal["loading", "ready", "failed", "stopping"] = "loading"
    model: Ready | None = None
    failure: str | None = None

    in_flight: int = 0  # generation requests being served (streams until their last byte)
    _engine_stop: asyncio.Future[None] | None = field(default=None, init=False, repr=False)
    _seeds: random.Random | None = field(default=None, init=False, repr=False)
    # Runtime LoRA changes one at a time: an adapter's checks and its listing are one step.
    adapter_changes: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.engine_stats = EngineStatsCollector(self.served_name)
        if self.limits.seed is not None:
            self._seeds = random.Random(self.limits.seed)

    def seeded(self, body: SeededT) -> SeededT:
        """`body` as it is sampled: with NIM_SEED (vLLM's --seed), a request that sends no seed gets
        the next seed of the server's own seeded sequence, so the same requests in the same order
        sample the same after a restart; otherwise unchanged (the engine draws a random seed)."""
        if self._seeds is None or body.seed is not None:
            return body
        return body.model_copy(update={"seed": self._seeds.getrandbits(63)})

    def admit(self) -> None:
        """Count one more generation request in, or refuse it (429) when the bounded queue is full."""
        limit = self.limits.max_pending_requests
        if self.in_flight >= limit:
            raise APIError(
                429,
                f"server is at capacity ({limit} requests in flight); retry shortly",
                "rate_limit_error",
                None,
                "rate_limit_exceeded",
                {
                    "Retry-After": "1",
                    "x-ratelimit-limit-requests": str(limit),
                    "x-ratelimit-remaining-requests": "0",
                    "x-ratelimit-reset-requests": "1s",
                },
            )
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def begin_drain(self) -> None:
        """Shutting down: readiness and new requests get 503; what is in flight finishes."""
        self.phase = "stopping"

    async def stop_engine(self) -> None:
        """Stop the engine, once however often asked (the drain's end, then the app's): requests
        still in flight end as aborted, so each stream sends its error frame and [DONE] while its
        connection is still open."""
        if self.model is None:
            return
        if self._engine_stop is None:
            self._engine_stop = asyncio.ensure_future(self.model.engine.stop())
        await asyncio.shield(self._engine_stop)

    def busy(self) -> bool:
        if self.in_flight:
            return True
        if self.model is None:
            return False
        stats = self.model.engine.stats()
        return bool(stats.num_running or stats.num_waiting)

    def require_ready(self) -> Ready:
        if self.phase == "ready" and self.model is not None and self.model.engine.ready:
            if self.model.reasoning_resolved:
                return self.model
            try:
                self.resolve_reasoning(self.model)
            except ReasoningConfigError as exc:  # the model cannot serve as configured
                self.phase, self.failure = "failed", str(exc)
                log.error("%s", exc)
            else:
                return self.model
        raise self.not_ready_error()

    def resolve_reasoning(self, ready: Ready) -> None:
        """Decide, once, how `ready`'s answers are split into reasoning and content, and log it.
        Raises ReasoningConfigError (one line) when NIM_REASONING_PARSER cannot work with its
        tokenizer; a start-up should call this before serving."""
        if ready.reasoning_resolved:
            return
        ready.reasoning, why = resolve(self.limits.reasoning_parser, ready.tokenizer)
        ready.reasoning_resolved = True
        if ready.reasoning is not None:
            log.info("reasoning parser %s (%s): answers carry reasoning_content", ready.reasoning.name, why)
        else:
            log.info("no reasoning parser (%s); NIM_REASONING_PARSER sets one", why)

    def engine_failure(self) -> str | None:
        if self.model is not None and self.model.engine.failure is not None:
            return self.model.engine.failure
        return self.failure

    def not_ready_error(self) -> APIError:
        failure = self.engine_failure()
        if self.phase == "failed" or failure is not None:
            return service_unavailable(f"model failed: {failure or 'engine is not running'}", 30)
        if self.phase == "stopping":
            return service_unavailable("server is shutting down", 5)
        return service_unavailable("model is loading; retry shortly", 5)

    def dead_engine_error(self, exc: EngineDeadError) -> APIError:
        """A request that reached an engine that has died: 503, like readiness says."""
        return service_unavailable(f"model failed: {exc}", 30)
