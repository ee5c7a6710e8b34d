"""vLLM's probes (GET /health, GET|POST /ping, GET /version) and NIM's GET /v1/license.

The probes answer as vLLM's server does, for load balancers and SageMaker-style checks written for
it: /health and /ping 200 with an empty body while the model serves (503 otherwise: loading,
shutting down or failed, with the reason in this API's error shape and Retry-After), /version
`{"version": ...}`. Like the NIM health endpoints they need no API key and never touch the engine.
/v1/license is NIM's: the served model's licence (service.store.license) as name, path, sha, size,
url, type and content; a 404 where the model's files name none.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import service
from service.api.errors import APIError, ErrorResponse, error_body

router = APIRouter()


class LicenseResponse(BaseModel):
    """NIM's licence record (GET /v1/license)."""

    name: str  # the licence file's basename (or the licence's id)
    path: str  # where it was read
    sha: str  # SHA-1 of the content
    size: int  # characters of the content
    url: str  # where the licence is published ("" unknown)
    type: Literal["file"] = "file"
    content: str


@router.get("/health", response_class=Response, responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    """vLLM's health check: 200, empty, once the model serves; else 503 saying why."""
    state = request.app.state.service
    if state.phase == "ready" and state.model is not None and state.model.engine.ready:
        return Response(status_code=200)
    err = state.not_ready_error()
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), 503, headers=err.headers)


@router.api_route(
    "/ping", methods=["GET", "POST"], response_class=Response, responses={503: {"model": ErrorResponse}}
)
async def ping(request: Request) -> Response:
    """SageMaker's ping, as vLLM serves it: the health check."""
    return await health(request)


@router.get("/version")
async def version() -> dict[str, str]:
    """vLLM's version probe: this server's release."""
    return {"version": service.__version__}


@router.get("/v1/license", response_model=LicenseResponse, responses={404: {"model": ErrorResponse}})
async def model_license(request: Request) -> LicenseResponse:
    """The served model's licence, as its files name it."""
    state = request.app.state.service
    ready = state.require_ready()
    found = ready.info.license
    if found is None:
        raise APIError(
            404,
            f"the licence of {ready.info.served_name} is not known: its files name none (a LICENSE file, "
            "the model card's license, GGUF general.license)",
            "invalid_request_error",
            None,
            "license_not_found",
        )
    return LicenseResponse(
        name=found.name, path=found.path, sha=found.sha, size=found.size, url=found.url, content=found.content
    )
