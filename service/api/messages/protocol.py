"""The bodies of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), and
of the message they answer with, as the anthropic SDK (2.14) types them."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator

from service.api.request_fields import Endpoint
from service.api.schemas import MAX_STOP_SEQUENCES, Request


class CountTokensRequest(Request):
    """What count_tokens takes: a conversation, without what only generation reads."""

    endpoint: ClassVar[Endpoint] = "count_tokens"

    model: str
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    endpoint: ClassVar[Endpoint] = "messages"

    max_tokens: Annotated[int, Field(ge=1)]
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(value)}")
        if value is not None and any(not s for s in value):
            raise ValueError("stop sequences must be non-empty strings")
        return value


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0  # prompt tokens the prefix cache held


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(BaseModel):
    """A message: `content` holds `text`, `thinking` (with a reasoning parser) and `tool_use` blocks."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int
