"""Every error leaves the API in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.text.tokenizer import InvalidTextError

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error a handler raises on purpose; rendered as OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def service_unavailable(message: str, retry_after_s: int = 5) -> APIError:
    return APIError(
        503, message, "server_error", None, "service_unavailable", {"Retry-After": str(retry_after_s)}
    )


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": _printable(message), "type": type, "param": _printable(param), "code": code}}


def _printable(text: str | None) -> str | None:
    """Echoed client text may hold lone surrogates, which UTF-8 cannot encode: escape them."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.message, err.type, err.param, err.code), err.status, headers=err.headers
    )


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Drop pydantic's union-branch names (e.g. "str", "list[str]") so `param` is the field path.
    param = ".".join(p for p in loc if not any(ch in p for ch in "[]") and p not in {"str", "int"}) or None
    message = first["msg"].removeprefix("Value error, ")  # our validators' own words
    if first.get("type") == "missing":
        message = "field required"
    elif first.get("type") == "model_attributes_type":
        message = "request body must be a JSON object"
        param = None
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(InvalidTextError)
    async def _invalid_text(request: Request, exc: InvalidTextError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "invalid_request_error"), 400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} not allowed for {request.url.path}"
        else:
            message = str(exc.detail)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            error_body(message, type_), exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "server_error"), 500)
