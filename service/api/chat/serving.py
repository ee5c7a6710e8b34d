"""POST /v1/chat/completions: a conversation through the chat template to the engine, its answer
split into thinking (a reasoning model), content and tool calls, whole or streamed. The engine path
itself is service.api.chat.run's, which Responses and Messages share."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from service.api.chat.answer import Answer
from service.api.chat.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
)
from service.api.chat.run import ChatRun, Delta, prepare
from service.api.common import ready_for, running_usage, state_of
from service.api.generation import reject_unsupported
from service.api.logprobs import chat_logprobs, prompt_logprobs
from service.api.schemas import ChatLogprobs, FinishReason
from service.api.sse import sse_data


async def chat_completions(body: ChatCompletionRequest, request: Request):
    """The chat completion of `body`: a response, or a stream of chunks (SSE)."""
    ready = ready_for(state_of(request), body.model)
    reject_unsupported(body)
    run = await prepare(ready, body, request)
    if body.stream:
        return run.stream(_chat_stream(run, run.state.limits.always_include_usage))
    results = await run.results(request)
    body = run.body
    choices = []
    for i, r in enumerate(results):
        message, finish = run.answer.message(r.text, r.finish_reason)
        chosen = chat_logprobs(ready.tokenizer, r.logprobs) if body.logprobs else None
        choices.append(ChatChoice(index=i, message=message, finish_reason=finish, logprobs=chosen))
    totals = run.whole_usage(results)
    prompt_entries = None
    if body.prompt_logprobs is not None:
        prompt_entries = prompt_logprobs(
            ready.tokenizer, run.prompt, results[0].prompt_logprobs, body.prompt_logprobs
        )
    return ChatCompletionResponse(
        id=run.request_id, model=body.model, choices=choices, usage=totals, prompt_logprobs=prompt_entries
    )


async def _chat_stream(run: ChatRun, always_usage: bool) -> AsyncIterator[str]:
    """Chunks as the engine's deltas arrive: thinking as `reasoning_content` (a reasoning model),
    the answer as `content`. With tools, answer text that is (or may become) a tool call is held
    back and sent, once finished, as tool_calls (or as content, when it does not parse)."""
    body, answer, tokenizer = run.body, run.answer, run.ready.tokenizer
    created = int(time.time())
    include_usage = body.include_usage or always_usage
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    num_prompt = len(run.prompt)

    def chunk(index: int, delta: DeltaMessage, finish: FinishReason | None = None,
              logprobs: ChatLogprobs | None = None) -> str:  # fmt: skip
        so_far = running_usage(num_prompt, run.choices[index].completion_tokens) if continuous else None
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        payload = ChatCompletionChunk(id=run.request_id, created=created, model=body.model, choices=[choice],
                                      usage=so_far)  # fmt: skip
        return sse_data(payload, include_usage=include_usage or continuous)

    for i in range(len(run.requests)):
        yield chunk(i, DeltaMessage(role="assistant", content=""))
    async for piece in run.pieces():
        index = piece.index
        if isinstance(piece, Delta):
            logprobs = chat_logprobs(tokenizer, piece.logprobs) if piece.logprobs else None
            yield chunk(index, _delta(piece.content, piece.reasoning, answer), logprobs=logprobs)
            continue
        reasoning, rest = piece.reasoning, piece.content
        if piece.calls:
            deltas = [c.to_openai(index=j) for j, c in enumerate(piece.calls)]
            yield chunk(
                index, DeltaMessage(content=rest, reasoning_content=reasoning or None, tool_calls=deltas)
            )
        elif reasoning or rest:
            yield chunk(index, DeltaMessage(content=rest, reasoning_content=reasoning or None))
        yield chunk(index, DeltaMessage(), piece.finish_reason)
    totals = run.streamed_usage()
    if include_usage:
        payload = ChatCompletionChunk(
            id=run.request_id, created=created, model=body.model, choices=[], usage=totals
        )
        yield sse_data(payload, include_usage=True)
    yield "data: [DONE]\n\n"


def _delta(content: str, reasoning: str, answer: Answer) -> DeltaMessage:
    """A streamed piece: without a reasoning parser, content as it came (possibly empty beside
    logprobs), as before; with one, each part only when it has text."""
    if answer.turn is None and not answer.reasoning:
        return DeltaMessage(content=content)
    return DeltaMessage(content=content or None, reasoning_content=reasoning or None)
