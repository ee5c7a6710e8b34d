"""Every error leaves the API in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, but
on Anthropic's Messages API (/v1/messages...), where it is Anthropic's: {"type": "error", "error":
{"type", "message"}}, its type by the status (a 503 is `overloaded_error`, with its Retry-After)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
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


@contextlib.contextmanager
def params_renamed(rename: Callable[[str], str]) -> Iterator[None]:
    """An APIError raised inside names its `param` as `rename` says: an endpoint that translates its
    request into another (Responses and Messages into a chat completion) names its own fields."""
    try:
        yield
    except APIError as exc:
        if exc.param is not None:
            exc.param = rename(exc.param)
        raise


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


ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": _printable(message)}}


def body_for(path: str, status: int, message: str, type: str, param: str | None = None,
             code: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The error body a client of `path` reads: Anthropic's on the Messages API, else OpenAI's."""
    if path.startswith(ANTHROPIC_PATHS):  # Anthropic's error has no param: the message names it
        return anthropic_body(status, message if param is None or param in message else f"{param}: {message}")
    return error_body(message, type, param, code)


def _printable(text: str | None) -> str | None:
    """Echoed client text may hold lone surrogates, which UTF-8 cannot encode: escape them."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(err: APIError, path: str = "") -> JSONResponse:
    body = body_for(path, err.status, err.message, err.type, err.param, err.code)
    return JSONResponse(body, err.status, headers=err.headers)


# pydantic's names for union branches in an error's loc, beside "list[...]" and the like
_BRANCH_NAMES = frozenset({"str", "int", "float", "bool", "none"})


def _is_branch(part: object) -> bool:
    """A union branch's name in a loc (e.g. "str", "list[str]", "ContentPart"), not a field name."""
    return isinstance(part, str) and (
        any(ch in part for ch in "[]") or part in _BRANCH_NAMES or part[:1].isupper()
    )


def _wrong_branch(error: Mapping[str, Any]) -> bool:
    """An error saying only that the value is not of one union branch's type (a list sent where
    the union also takes a string): never the interesting one when another branch says more."""
    loc = error.get("loc", ())
    return bool(loc) and _is_branch(loc[-1]) and str(error.get("type", "")).endswith("_type")


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # A union's value fails every branch; the branch the value's type matches says what is wrong.
    first = next((e for e in errors if not _wrong_branch(e)), errors[0])
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    # Drop pydantic's union-branch names (e.g. "str", "list[str]") so `param` is the field path.
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not _is_branch(p)) or None
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
        return error_response(exc, request.url.path)

    @app.exception_handler(InvalidTextError)
    async def _invalid_text(request: Request, exc: InvalidTextError) -> JSONResponse:
        return JSONResponse(body_for(request.url.path, 400, str(exc), "invalid_request_error"), 400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return JSONResponse(body_for(request.url.path, 400, message, "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} not allowed for {request.url.path}"
        else:
            message = str(exc.detail)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = body_for(request.url.path, exc.status_code, message, type_)
        return JSONResponse(body, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return JSONResponse(body_for(request.url.path, 500, "internal server error", "server_error"), 500)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# What each API route declares it may answer with, for the OpenAPI document.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503, 504)
}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: str = "error"
    error: AnthropicErrorDetail


ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": AnthropicErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503, 504)
}
