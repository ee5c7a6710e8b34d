"""What the API knows about the running service: settings, metrics, and the model once loaded."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from service.api.errors import APIError, service_unavailable
from service.config import Settings
from service.engine.protocol import Engine
from service.metrics import Metrics
from service.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """The model being served, as /v1/models and /v1/metadata describe it."""

    served_name: str
    source: str
    architecture: str
    max_model_len: int
    precision: str  # what the engine actually runs in
    device: str
    profile_id: str
    profile_name: str
    profile_tags: dict[str, Any]
    selection: tuple[str, ...] = ()  # why this profile, one line each
    created: int = field(default_factory=lambda: int(time.time()))

    def profile(self) -> dict[str, Any]:
        return {
            "id": self.profile_id,
            "name": self.profile_name,
            "tags": {**self.profile_tags, "device": self.device},
            "selection": list(self.selection),
        }


@dataclass
class Ready:
    engine: Engine
    tokenizer: Tokenizer
    info: ModelInfo


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics
    served_name: str
    phase: Literal["loading", "ready", "failed", "stopping"] = "loading"
    model: Ready | None = None
    failure: str | None = None

    in_flight: int = 0  # generation requests being served (streams until their last byte)

    def admit(self) -> None:
        """Count one more generation request in, or refuse it (429) when the bounded queue is full."""
        limit = self.settings.pending_limit
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

    def busy(self) -> bool:
        if self.in_flight:
            return True
        if self.model is None:
            return False
        stats = self.model.engine.stats()
        return bool(stats.num_running or stats.num_waiting)

    def require_ready(self) -> Ready:
        if self.phase == "ready" and self.model is not None and self.model.engine.ready:
            return self.model
        raise self.not_ready_error()

    def not_ready_error(self) -> APIError:
        if self.phase == "failed" or (self.model is not None and not self.model.engine.ready):
            return service_unavailable(f"model failed: {self.failure or 'engine is not running'}", 30)
        if self.phase == "stopping":
            return service_unavailable("server is shutting down", 5)
        return service_unavailable("model is loading; retry shortly", 5)
