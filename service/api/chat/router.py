"""The route of POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from service.api.chat.protocol import ChatCompletionRequest, ChatCompletionResponse
from service.api.chat.serving import chat_completions
from service.api.errors import ERROR_RESPONSES

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.post("/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    return await chat_completions(body, request)
