"""The route of POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from service.api.completions.protocol import CompletionRequest, CompletionResponse
from service.api.completions.serving import completions
from service.api.errors import ERROR_RESPONSES

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.post("/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request):
    return await completions(body, request)
