"""The bodies of POST /v1/completions (OpenAI's legacy completions, with vLLM's extensions)."""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field

from service.api.request_fields import Endpoint
from service.api.schemas import MAX_N, CompletionLogprobs, FinishReason, SamplingFields, Usage


class CompletionRequest(SamplingFields):
    endpoint: ClassVar[Endpoint] = "completions"

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    suffix: str | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's: per prompt token, by token id


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
