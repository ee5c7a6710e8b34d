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
