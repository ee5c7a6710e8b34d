"""The bodies of POST /v1/chat/completions (OpenAI's, with vLLM's extensions)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError

from service.api.errors import invalid_request
from service.api.request_fields import Endpoint
from service.api.schemas import ChatLogprobs, ChatMessage, FinishReason, SamplingFields, Usage


class ChatCompletionRequest(SamplingFields):
    endpoint: ClassVar[Endpoint] = "chat"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM extensions: the template a conversation is rendered with and variables passed to it
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def chat_body(fields: dict[str, Any], rename: Callable[[str], str]) -> ChatCompletionRequest:
    """The chat completion another endpoint's request runs as (Responses, Messages), from `fields`
    (None: not sent); a value chat cannot take is a 400 naming that endpoint's field (`rename`)."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        param = rename(".".join(str(p) for p in error.get("loc", ())))
        raise invalid_request(f"{param}: {error['msg']}", param) from None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # a reasoning model's thinking (NIM_REASONING_PARSER)
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's: per prompt token, by token id


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
