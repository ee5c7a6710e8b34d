"""The one interface every engine implements, and the values that cross it.

The API layer turns an HTTP request into a `GenerationRequest` (token ids plus `SamplingParams`)
and consumes `RequestOutput` deltas; it knows nothing of blocks, batches or threads. Engines
know nothing of HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0


@dataclass(frozen=True)
class RequestOutput:
    """What a request produced since its previous output (a delta), plus running totals."""

    request_id: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_generated_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; requests cannot be served until the process restarts."""


class Engine(Protocol):
    """An inference engine. `generate` may be called from the event loop thread only."""

    @property
    def ready(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    async def start(self) -> None:
        """Load, warm up, and begin serving; returns once ready."""

    async def stop(self) -> None:
        """Abort what is in flight and release resources."""

    def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request; iterate its outputs until one with `finished=True`.

        Closing the iterator early (client gone) aborts the request.
        """
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...
