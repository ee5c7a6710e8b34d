"""The bodies of vLLM's POST /tokenize and /detokenize."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from service.api.schemas import ChatMessage, Request


class TokenizeRequest(Request):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Request):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str
