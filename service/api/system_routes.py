"""Health, metrics, version and metadata: cheap, unauthenticated, never touching the engine thread."""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

import service
from service.api.errors import error_body
from service.telemetry.metrics import CONTENT_TYPE

router = APIRouter(prefix="/v1")
# Prometheus' and the Gateway API Inference Extension's default scrape path, beside NIM's /v1/metrics.
root_router = APIRouter()


@router.get("/health/live")
async def live() -> dict[str, str]:
    """The process is up and its event loop answers."""
    return {"object": "health.response", "message": "live"}


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    """200 only once the model is loaded and warmed up and the engine is running."""
    state = request.app.state.service
    if state.phase == "ready" and state.model is not None and state.model.engine.ready:
        return JSONResponse({"object": "health.response", "message": "ready"})
    # Not ready: loading, stopping, or failed (the engine's own failure, when it died, says why).
    err = state.not_ready_error()
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), 503, headers=err.headers)


@root_router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    return Response(request.app.state.service.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"release": service.__version__, "api": "1.0.0"}


@router.get("/metadata")
async def metadata(request: Request) -> dict[str, Any]:
    state = request.app.state.service
    info = state.model.info if state.model else None
    return {
        "modelInfo": [
            {
                "modelUrl": info.source if info else None,
                "shortName": state.served_name,
                "architecture": info.engine.architecture if info else None,
                "maxModelLen": info.max_model_len if info else None,
            }
        ],
        "selectedProfile": info.profile() if info else None,
        # The CUDA paths with a proven fallback: used or not, and why (start-up checks, settings).
        "executionPaths": {
            path.name: {"used": path.used, "reason": path.reason, "setting": path.setting}
            for path in (info.engine.paths if info else ())
        },
        "phase": state.phase,
        "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    """Versions of what serves, read from package metadata (importing an engine here is not ours)."""
    versions = {"service": service.__version__, "python": platform.python_version()}
    for package in ("torch", "fastapi", "tensorrt_llm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return versions
