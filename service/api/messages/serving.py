"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on chat's engine path
(service.api.chat.run), as vLLM serves it.

A request is checked field by field against service.api.request_fields, translated into the chat
completion it runs as (service.api.messages.convert), prepared and run as chat completions are --
the chat template, the operator's limits, admission, metering, the abort when the client leaves --
and its answer read back as content blocks: `thinking` (with a reasoning parser), `text`, and a
`tool_use` block per tool call. `stop_reason` is `end_turn`, `max_tokens`, `tool_use`, or
`stop_sequence` with the `stop_sequence` that ended the answer (the engine is asked to keep a
matched stop string in the text, which is taken off here, so the one that matched is known).
`stream: true` sends Anthropic's events, each with its `event:` line: `message_start`, for each
block `content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` (stop_reason, usage) and `message_stop`; a failure after
the first event is an `error` event. Errors are Anthropic's shape (service.api.errors).
count_tokens renders the conversation as a generation would and counts its tokens, generating
nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from service.api.chat.run import ChatRun, Delta, prepare
from service.api.common import ready_for, state_of
from service.api.errors import APIError, anthropic_body, params_renamed
from service.api.generation import new_id
from service.api.messages.convert import chat_request, messages_param
from service.api.messages.protocol import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    StopReason,
    TokenCount,
)
from service.api.request_fields import check_request
from service.api.schemas import FinishReason, Usage
from service.api.tools import ToolCall

_STOP_REASONS: dict[str | None, StopReason] = {"length": "max_tokens", "tool_calls": "tool_use"}


async def create_message(body: MessagesRequest, request: Request) -> Any:
    """The message answering `body`, or its events (SSE)."""
    ready = ready_for(state_of(request), body.model)
    check_request("messages", body)
    with params_renamed(messages_param):
        chat = chat_request(body, ready.reasoning is not None)
        run = await prepare(ready, chat, request, new_id("msg"))
    if body.stream:
        return run.stream(_events(run, body), _error_event)
    results = await run.results(request)
    text, stop = _without_stop(results[0].text, body.stop_sequences, results[0].finish_reason)
    message, finish = run.answer.message(text, results[0].finish_reason)
    content: list[dict[str, Any]] = []
    if message.reasoning_content:
        content.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        content.append({"type": "text", "text": message.content})
    for call in message.tool_calls or ():
        function = call["function"]
        content.append(_tool_use(function["name"], function["arguments"]))
    return MessageResponse(
        id=run.request_id,
        model=body.model,
        content=content,
        stop_reason="stop_sequence" if stop else _stop_reason(finish),
        stop_sequence=stop,
        usage=_usage(run.whole_usage(results)),
    )


async def count_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
    ready = ready_for(state_of(request), body.model)
    check_request("count_tokens", body)
    with params_renamed(messages_param):
        run = await prepare(ready, chat_request(body, ready.reasoning is not None), request)
    return TokenCount(input_tokens=len(run.prompt))


def _without_stop(text: str, stops: list[str] | None, finish: FinishReason | None) -> tuple[str, str | None]:
    """The answer without the stop sequence that ended it, and that sequence (None: none did)."""
    if finish == "stop":
        for stop in stops or ():
            if text.endswith(stop):
                return text[: len(text) - len(stop)], stop
    return text, None


def _stop_reason(finish: FinishReason | None) -> StopReason:
    return _STOP_REASONS.get(finish, "end_turn")


def _tool_use(name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": name,
        "input": json.loads(arguments),
    }


def _usage(totals: Usage) -> MessageUsage:
    cached = totals.prompt_tokens_details.cached_tokens if totals.prompt_tokens_details else 0
    return MessageUsage(
        input_tokens=totals.prompt_tokens,
        output_tokens=totals.completion_tokens,
        cache_read_input_tokens=cached,
    )


def _event(kind: str, **fields: Any) -> str:
    data = json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


def _error_event(err: APIError) -> str:
    """A failure after the first event (sse's render_error): Anthropic's error event."""
    return f"event: error\ndata: {json.dumps(anthropic_body(err.status, err.message))}\n\n"


class _Blocks:
    """The content blocks of a streamed message, opened and closed in turn."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def write(self, kind: str, text: str) -> list[str]:
        out = []
        if self.open != kind:
            out += self.close()
            self.index += 1
            self.open = kind
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": kind, "text": ""}
            )
            out.append(_event("content_block_start", index=self.index, content_block=block))
        if text:
            delta = (
                {"type": "thinking_delta", "thinking": text}
                if kind == "thinking"
                else {"type": "text_delta", "text": text}
            )
            out.append(_event("content_block_delta", index=self.index, delta=delta))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def tool_use(self, call: ToolCall) -> list[str]:
        out = self.close()
        self.index += 1
        block = {**_tool_use(call.name, call.arguments), "input": {}}
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        return [
            *out,
            _event("content_block_start", index=self.index, content_block=block),
            _event("content_block_delta", index=self.index, delta=delta),
            _event("content_block_stop", index=self.index),
        ]


async def _events(run: ChatRun, body: MessagesRequest) -> AsyncIterator[str]:
    stops = body.stop_sequences or []
    hold = max((len(s) for s in stops), default=0)  # a stop sequence may be arriving: held back
    usage = MessageUsage(input_tokens=len(run.prompt), output_tokens=0)
    start = MessageResponse(id=run.request_id, model=body.model, content=[], stop_reason=None, usage=usage)
    yield _event("message_start", message=start.model_dump(mode="json"))
    blocks, held = _Blocks(), ""
    stop_reason: StopReason = "end_turn"
    stop: str | None = None
    async for piece in run.pieces():
        if piece.reasoning:
            for out in blocks.write("thinking", piece.reasoning):
                yield out
        held += piece.content or ""
        if isinstance(piece, Delta):
            ready_text, held = held[: max(len(held) - hold, 0)], held[max(len(held) - hold, 0) :]
            if ready_text:
                for out in blocks.write("text", ready_text):
                    yield out
            continue
        held, stop = _without_stop(held, stops, piece.finish_reason)
        if held:
            for out in blocks.write("text", held):
                yield out
        for call in piece.calls:
            for out in blocks.tool_use(call):
                yield out
        stop_reason = "stop_sequence" if stop else _stop_reason(piece.finish_reason)
    for out in blocks.close():
        yield out
    totals = run.streamed_usage()
    yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop},
                 usage={"output_tokens": totals.completion_tokens})  # fmt: skip
    yield _event("message_stop")
