"""The routes of Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens. Their
errors are Anthropic's shape, {"type": "error", "error": {"type", "message"}} (service.api.errors)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.api.errors import ANTHROPIC_ERROR_RESPONSES
from service.api.messages.protocol import CountTokensRequest, MessageResponse, MessagesRequest, TokenCount
from service.api.messages.serving import count_tokens, create_message

router = APIRouter(prefix="/v1", responses=ANTHROPIC_ERROR_RESPONSES)


@router.post("/messages", response_model=MessageResponse)
async def create(body: MessagesRequest, request: Request) -> Any:
    return await create_message(body, request)


@router.post("/messages/count_tokens", response_model=TokenCount)
async def count(body: CountTokensRequest, request: Request) -> Any:
    return await count_tokens(body, request)
