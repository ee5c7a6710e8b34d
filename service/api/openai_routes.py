"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from service.api.errors import APIError, error_body, invalid_request, model_not_found
from service.api.generation import (
    build_requests,
    check_context,
    collect,
    engine_error,
    merged,
    new_id,
    reject_unsupported,
)
from service.api.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    Usage,
)
from service.api.state import Ready, ServiceState
from service.engine.protocol import GenerationRequest
from service.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)

ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 404, 413, 429, 500, 503)}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


def _state(request: Request) -> ServiceState:
    return request.app.state.service


def _ready_for(state: ServiceState, model: str) -> Ready:
    if model != state.served_name:
        raise model_not_found(model)
    return state.require_ready()


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    info = state.model.info if state.model else None
    card = ModelCard(
        id=state.served_name,
        created=info.created if info else int(time.time()),
        root=info.source if info else None,
        max_model_len=info.max_model_len if info else None,
    )
    return ModelList(data=[card])


@router.post("/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ready = _ready_for(_state(request), body.model)
    reject_unsupported(body)
    if body.logprobs:
        raise invalid_request("logprobs are not supported by this server yet", "logprobs")
    if body.tools and body.tool_choice != "none":
        raise invalid_request("tool calling is not supported by this server yet", "tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise invalid_request("response_format other than text is not supported yet", "response_format")

    messages = [
        {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in body.messages
    ]
    try:
        prompt_text = ready.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from None
    prompt = ready.tokenizer.encode(prompt_text, add_special_tokens=False)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "messages"
    budget = check_context(len(prompt), max_tokens, ready.info.max_model_len, param)

    request_id = new_id("chatcmpl")
    engine_requests = build_requests(request_id, [prompt], body, [budget])
    if body.stream:
        return _sse(_chat_stream(ready, body, request_id, engine_requests, len(prompt)))

    results = await collect(ready.engine, engine_requests)
    completion_tokens = sum(r.num_generated_tokens for r in results)
    return ChatCompletionResponse(
        id=request_id,
        model=body.model,
        choices=[
            ChatChoice(index=i, message=ResponseMessage(content=r.text), finish_reason=r.finish_reason)
            for i, r in enumerate(results)
        ],
        usage=Usage(
            prompt_tokens=len(prompt),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt) + completion_tokens,
        ),
    )


async def _chat_stream(
    ready: Ready,
    body: ChatCompletionRequest,
    request_id: str,
    requests: list[GenerationRequest],
    num_prompt: int,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        payload = ChatCompletionChunk(
            id=request_id, created=created, model=body.model, choices=choices, usage=usage
        )
        return _sse_data(payload, include_usage=body.include_usage)

    for i in range(len(requests)):
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    completion_tokens = [0] * len(requests)
    async for index, out in merged(ready.engine, requests):
        if out.error is not None or out.finish_reason == "abort":
            yield _sse_error(engine_error(out))
            return
        completion_tokens[index] = out.num_generated_tokens
        if out.text:
            yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(content=out.text))])
        if out.finished:
            yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason=out.finish_reason)])
    if body.include_usage:
        total = sum(completion_tokens)
        usage = Usage(prompt_tokens=num_prompt, completion_tokens=total, total_tokens=num_prompt + total)
        yield chunk([], usage)
    yield "data: [DONE]\n\n"


@router.post("/completions", response_model=CompletionResponse)
async def completions(body: CompletionRequest, request: Request):
    ready = _ready_for(_state(request), body.model)
    reject_unsupported(body)
    if body.logprobs is not None:
        raise invalid_request("logprobs are not supported by this server yet", "logprobs")
    if body.suffix:
        raise invalid_request("suffix is not supported by this model", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise invalid_request("best_of other than n is not supported by this server yet", "best_of")

    prompts = _completion_prompts(body, ready)
    vocab = ready.tokenizer.vocab_size
    for prompt in prompts:
        if any(not 0 <= t < vocab for t in prompt):
            raise invalid_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    budgets = [check_context(len(p), body.max_tokens, ready.info.max_model_len, "prompt") for p in prompts]
    echoes = [ready.tokenizer.decode(p, skip_special_tokens=False) if body.echo else "" for p in prompts]

    request_id = new_id("cmpl")
    engine_requests = build_requests(request_id, prompts, body, budgets)
    num_prompt = sum(len(p) for p in prompts)
    if body.stream:
        return _sse(_completion_stream(ready, body, request_id, engine_requests, echoes, num_prompt))

    results = await collect(ready.engine, engine_requests)
    completion_tokens = sum(r.num_generated_tokens for r in results)
    return CompletionResponse(
        id=request_id,
        model=body.model,
        choices=[
            CompletionChoice(index=i, text=echoes[i // body.n] + r.text, finish_reason=r.finish_reason)
            for i, r in enumerate(results)
        ],
        usage=Usage(
            prompt_tokens=num_prompt,
            completion_tokens=completion_tokens,
            total_tokens=num_prompt + completion_tokens,
        ),
    )


def _completion_prompts(body: CompletionRequest, ready: Ready) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)  # type: ignore[arg-type]
    else:
        texts = None
    if texts is not None:
        if not texts:
            raise invalid_request("prompt must not be empty", "prompt")
        return [ready.tokenizer.encode(t, add_special_tokens=True) for t in texts]
    if not prompt:
        raise invalid_request("prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[union-attr]


async def _completion_stream(
    ready: Ready,
    body: CompletionRequest,
    request_id: str,
    requests: list[GenerationRequest],
    echoes: list[str],
    num_prompt: int,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        payload = CompletionResponse(
            id=request_id, created=created, model=body.model, choices=choices, usage=usage
        )
        return _sse_data(payload, include_usage=body.include_usage)

    if body.echo:
        for i in range(len(requests)):
            yield chunk([CompletionChoice(index=i, text=echoes[i // body.n], finish_reason=None)])
    completion_tokens = [0] * len(requests)
    async for index, out in merged(ready.engine, requests):
        if out.error is not None or out.finish_reason == "abort":
            yield _sse_error(engine_error(out))
            return
        completion_tokens[index] = out.num_generated_tokens
        if out.text or out.finished:
            yield chunk([CompletionChoice(index=index, text=out.text, finish_reason=out.finish_reason)])
    if body.include_usage:
        total = sum(completion_tokens)
        usage = Usage(prompt_tokens=num_prompt, completion_tokens=total, total_tokens=num_prompt + total)
        yield chunk([], usage)
    yield "data: [DONE]\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(_guard(events), media_type="text/event-stream", headers=SSE_HEADERS)


async def _guard(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A failure mid-stream becomes an error frame: the status line has already gone out."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        yield _sse_error(exc)
    except Exception:
        log.exception("stream failed")
        yield _sse_error(APIError(500, "internal server error", "server_error"))


def _sse_data(payload: BaseModel, include_usage: bool) -> str:
    exclude: set[str] | None = None if include_usage else {"usage"}
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


def _sse_error(err: APIError) -> str:
    """An error frame (the official client raises on it), then the end of the stream."""
    return f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\ndata: [DONE]\n\n"
