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
    top_k: int = 0  # 0 (or -1): no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; n: the chosen token's plus n alternatives
    prompt_logprobs: int | None = None  # same, for every prompt token after the first
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (no limit) or positive")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")

    @property
    def greedy(self) -> bool:
        # Below this, temperature scaling only overflows; the distribution is the argmax anyway.
        return self.temperature < 1e-5


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, its rank, and the most likely alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


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
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only; None for token 0
    num_cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache


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
