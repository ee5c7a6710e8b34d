"""The bodies of POST /v1/responses (OpenAI's Responses API) and of the response object it answers
with, as the openai SDK (3.57) types them: the fields it requires are always sent."""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator

from service.api.request_fields import Endpoint
from service.api.schemas import Request

MAX_METADATA_PAIRS = 16


class ResponsesRequest(Request):
    """What a client sends; every field it sends is also a row of service.api.request_fields."""

    endpoint: ClassVar[Endpoint] = "responses"

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    truncation: str | None = None
    background: bool | None = None
    service_tier: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM's sampling extras
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None
    seed: int | None = None

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if not value:
            raise ValueError("input must be a non-empty string or list of items")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} metadata pairs, got {len(value)}")
        if value is not None and any(len(key) > 64 for key in value):
            raise ValueError("metadata keys are at most 64 characters")
        return value


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache held
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # of output_tokens, the thinking a reasoning parser split off


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str  # one of the SDK's codes: server_error here
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


Status = Literal["completed", "incomplete", "failed", "in_progress", "cancelled", "queued"]


class ResponseObject(BaseModel):
    """A response, echoing what the request asked for. `output` holds `message` (with
    `output_text`), `function_call` and `reasoning` items as the SDK types them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Status
    completed_at: int | None = None
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str = "default"
    store: bool = False
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
