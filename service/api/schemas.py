"""OpenAI request and response bodies (the subset this service implements, validated strictly).

Unknown fields are accepted and ignored (clients and gateways add their own, e.g. `user`,
`metadata`); known fields this service does not implement yet are rejected with a clear 400 by
the route, never silently ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_SEQUENCES = 4
MAX_N = 16
MAX_TOKEN_ID_DIGITS = 18  # far beyond any vocabulary, and within what int() reads


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk, not only the last


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class NVExt(BaseModel):
    """NIM's request extension object; the sampling knobs it carries mirror the top-level extras."""

    model_config = ConfigDict(extra="allow")

    top_k: Annotated[int, Field(ge=-1)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None


class SamplingFields(_Request):
    """Fields shared by chat and completions requests (OpenAI's, then vLLM's extras)."""

    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    nvext: NVExt | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids written in ASCII digits (str.isdigit also takes "²" and "٣", which
        int() refuses or reads as another id); 18 digits at most, so int() always reads them."""
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                shown = key if len(key) <= 24 else key[:24] + "..."
                raise ValueError(f"logit_bias keys must be token ids (digits 0-9), got {shown!r}")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
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


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    suffix: str | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None


# --- Responses ---------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # of completion_tokens, those the reasoning parser put in reasoning_content


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "system"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class TokenizeRequest(_Request):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str
