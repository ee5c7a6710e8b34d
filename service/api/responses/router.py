"""The routes of OpenAI's Responses API: POST /v1/responses, and GET, DELETE and cancel of a
stored response."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.api.errors import ERROR_RESPONSES, invalid_request
from service.api.responses.protocol import DeletedResponse, ResponseObject, ResponsesRequest
from service.api.responses.serving import cancel_response, create_response, delete_response, retrieve_response

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.post("/responses", response_model=ResponseObject)
async def create(body: ResponsesRequest, request: Request) -> Any:
    return await create_response(body, request)


@router.get("/responses/{response_id}", response_model=ResponseObject)
async def retrieve(response_id: str, request: Request, stream: bool = False) -> Any:
    if stream:
        raise invalid_request("a stored response is not replayed as events here: retrieve it whole", "stream")
    return retrieve_response(response_id, request)


@router.delete("/responses/{response_id}", response_model=DeletedResponse)
async def delete(response_id: str, request: Request) -> Any:
    return delete_response(response_id, request)


@router.post("/responses/{response_id}/cancel", response_model=ResponseObject)
async def cancel(response_id: str, request: Request) -> Any:
    cancel_response(response_id, request)
