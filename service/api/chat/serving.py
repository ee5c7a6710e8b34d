"""POST /v1/chat/completions: a conversation through the chat template to the engine, its answer
split into thinking (a reasoning model), content and tool calls, whole or streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request

from service.api.chat.prompt import chat_prompt, template_for, template_inputs
from service.api.chat.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    ResponseMessage,
)
from service.api.common import (
    adapter_for,
    check_prompt_logprobs,
    check_requests,
    ready_for,
    running_usage,
    state_of,
    trace_request,
    trace_result,
    unless_disconnected,
)
from service.api.errors import invalid_request
from service.api.generation import (
    LogprobRequest,
    build_requests,
    check_context,
    check_prompt_chars,
    client_finish_reason,
    collect,
    ended_badly,
    engine_error,
    merged,
    new_id,
    reject_unsupported,
    usage,
)
from service.api.guided import guided_decoding
from service.api.logprobs import chat_logprobs, prompt_logprobs
from service.api.schemas import ChatLogprobs, CompletionTokensDetails, FinishReason, Usage
from service.api.sse import sse, sse_data, sse_error
from service.api.state import Ready
from service.api.tools import ToolCall, ToolSpec, ToolStream, tool_spec
from service.engine.protocol import GenerationRequest
from service.text.reasoning import ReasoningSplitter, ReasoningTurn


async def chat_completions(body: ChatCompletionRequest, request: Request):
    """The chat completion of `body`: a response, or a stream of chunks (SSE)."""
    ready = ready_for(state_of(request), body.model)
    reject_unsupported(body)
    limits = state_of(request).limits
    # A request's own template is compiled here (a second of CPU for the largest), off the event loop
    tool_template = await asyncio.to_thread(template_for, ready.tokenizer, body, limits, True)
    tools = tool_spec(
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        tool_template,
        limits.tool_call_parser,
        limits.auto_tool_choice,
    )
    guided = guided_decoding(body)
    if tools is not None and tools.forced:
        if guided is not None:
            raise invalid_request("tool_choice required or named cannot be combined with a structured-output "
                                  "constraint (response_format, structured_outputs, guided_*)",
                                  "tool_choice")  # fmt: skip
        guided = tools.guided()
    if body.top_logprobs and not body.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
    check_prompt_logprobs(body, ready)

    max_model_len = ready.info.max_model_len
    num_chars = sum(len(m.text()) for m in body.messages)  # the prompt holds at least these
    check_prompt_chars(num_chars, ready.tokenizer.max_token_chars, max_model_len, "messages", limits)
    tools_shown = body.tools if tools is not None else None
    template = template_for(ready.tokenizer, body, limits, tools=tools_shown is not None)
    inputs = template_inputs(body, template, ready.tokenizer, ready.reasoning is not None)
    text, prompt = await asyncio.to_thread(
        chat_prompt, ready.tokenizer, body.messages, tools_shown, inputs, body.chat_template
    )
    turn = None
    if ready.reasoning is not None:
        turn = ready.reasoning.for_prompt(text, constrained=guided is not None)
    if guided is not None and turn is not None:  # the constraint starts where the thinking ends
        guided = replace(guided, start_after=turn.start_after, opens_with=turn.opening)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "messages"
    state = state_of(request)
    budget = check_context(len(prompt), max_tokens, max_model_len, param, state.limits)

    request_id = new_id("chatcmpl")
    trace_request("chat", body, request_id, budget)
    logprobs = LogprobRequest(
        sampled=(body.top_logprobs or 0) if body.logprobs else None, prompt=body.prompt_logprobs
    )
    logprobs.check(ready.info.engine.features, "logprobs")
    adapter = await adapter_for(ready, body.model)
    stop = tools.stop if tools is not None else ()
    body = state.seeded(body)
    engine_requests = build_requests(
        request_id, [prompt], body, [budget], ready.tokenizer.vocab_size, logprobs, adapter, guided, stop
    )
    await unless_disconnected(request, check_requests(ready, engine_requests))
    state.admit()
    answer = _Answer(tools, turn, ready.reasoning is not None)
    if body.stream:
        always_usage = state.limits.always_include_usage
        return sse(_chat_stream(ready, body, request_id, engine_requests, len(prompt), always_usage, answer),
                    state)  # fmt: skip
    try:
        timeout_s = state.limits.request_timeout_seconds
        results = await unless_disconnected(request, collect(ready.engine, engine_requests, timeout_s))
    finally:
        state.release()
    choices = []
    for i, r in enumerate(results):
        message, finish = answer.message(r.text, r.finish_reason)
        chosen = chat_logprobs(ready.tokenizer, r.logprobs) if body.logprobs else None
        choices.append(ChatChoice(index=i, message=message, finish_reason=finish, logprobs=chosen))
    completion_tokens = sum(r.num_generated_tokens for r in results)
    totals = usage([len(prompt)], completion_tokens, results[0].num_cached_tokens)
    answer.count_reasoning(totals, [r.token_ids for r in results])
    trace_result(totals, [r.finish_reason for r in results])
    prompt_entries = None
    if body.prompt_logprobs is not None:
        prompt_entries = prompt_logprobs(
            ready.tokenizer, prompt, results[0].prompt_logprobs, body.prompt_logprobs
        )
    return ChatCompletionResponse(
        id=request_id, model=body.model, choices=choices, usage=totals, prompt_logprobs=prompt_entries
    )


@dataclass(frozen=True)
class _Answer:
    """How a chat answer's text becomes a message: its thinking split off (a reasoning model: `turn`,
    None when the prompt closed the thinking), then tool calls read from what is left (the answer,
    never the thinking)."""

    tools: ToolSpec | None
    turn: ReasoningTurn | None
    reasoning: bool  # the model has a reasoning parser: usage counts reasoning_tokens

    def message(self, text: str, finish: FinishReason | None) -> tuple[ResponseMessage, FinishReason | None]:
        """The message of a finished answer, and its finish reason: "tool_calls" when it made
        calls, "length" still where max_tokens cut it (a call it left unfinished is dropped)."""
        reasoning, content = self.turn.split(text) if self.turn is not None else (None, text)
        if self.tools is not None and content:
            cut = finish == "length"
            parsed, calls = self.tools.parse(content, cut=cut)
            if calls or cut:
                calls_out = [c.to_openai() for c in calls] or None
                message = ResponseMessage(content=parsed, reasoning_content=reasoning, tool_calls=calls_out)
                return message, finish if cut or not calls else "tool_calls"
        return ResponseMessage(content=content, reasoning_content=reasoning), finish

    def count_reasoning(self, totals: Usage, token_ids: list[list[int]]) -> None:
        """usage.completion_tokens_details.reasoning_tokens, for a model with a reasoning parser."""
        if self.reasoning:
            counted = sum(self.turn.count_tokens(ids) for ids in token_ids) if self.turn is not None else 0
            totals.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=counted)


@dataclass
class _ChoiceStream:
    """One streamed choice: its thinking split off as it arrives, tool calls held back."""

    answer: _Answer
    splitter: ReasoningSplitter | None
    tools: ToolStream | None
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0

    @classmethod
    def of(cls, answer: _Answer) -> _ChoiceStream:
        splitter = answer.turn.splitter() if answer.turn is not None else None
        return cls(answer, splitter, ToolStream(answer.tools) if answer.tools is not None else None)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to send now for the next piece of text."""
        reasoning, content = self.splitter.feed(text) if self.splitter is not None else ("", text)
        return reasoning, content if self.tools is None else self.tools.feed(content)

    def finish(self, cut: bool) -> tuple[str, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) still to send at the end; `cut`: by max_tokens (a call
        left unfinished is dropped)."""
        reasoning, content = self.splitter.finish() if self.splitter is not None else ("", "")
        if self.tools is None:
            return reasoning, content or None, []
        shown = self.tools.feed(content)
        rest, calls = self.tools.finish(cut=cut)
        return reasoning, (shown + (rest or "")) or None, calls


async def _chat_stream(
    ready: Ready,
    body: ChatCompletionRequest,
    request_id: str,
    requests: list[GenerationRequest],
    num_prompt: int,
    always_usage: bool,
    answer: _Answer,
) -> AsyncIterator[str]:
    """Chunks as the engine's deltas arrive: thinking as `reasoning_content` (a reasoning model),
    the answer as `content`. With tools, answer text that is (or may become) a tool call is held
    back and sent, once finished, as tool_calls (or as content, when it does not parse)."""
    created = int(time.time())
    include_usage = body.include_usage or always_usage
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    choices = [_ChoiceStream.of(answer) for _ in requests]

    def chunk(index: int, delta: DeltaMessage, finish: FinishReason | None = None,
              logprobs: ChatLogprobs | None = None) -> str:  # fmt: skip
        so_far = running_usage(num_prompt, choices[index].completion_tokens) if continuous else None
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        payload = ChatCompletionChunk(id=request_id, created=created, model=body.model, choices=[choice],
                                      usage=so_far)  # fmt: skip
        return sse_data(payload, include_usage=include_usage or continuous)

    for i in range(len(requests)):
        yield chunk(i, DeltaMessage(role="assistant", content=""))
    finish_reasons: list[str | None] = [None] * len(requests)
    cached = 0
    async for index, out in merged(ready.engine, requests):
        if ended_badly(out):
            yield sse_error(engine_error(out))
            return
        choice = choices[index]
        choice.completion_tokens = out.num_generated_tokens
        choice.token_ids.extend(out.token_ids)
        cached = out.num_cached_tokens if index == 0 else cached
        logprobs = chat_logprobs(ready.tokenizer, out.logprobs) if body.logprobs and out.logprobs else None
        reasoning, content = choice.feed(out.text)
        if reasoning or content or logprobs:
            yield chunk(index, _delta(content, reasoning, answer), logprobs=logprobs)
        if out.finished:
            finish = client_finish_reason(out)
            reasoning, rest, calls = choice.finish(cut=finish == "length")
            if calls:
                deltas = [c.to_openai(index=j) for j, c in enumerate(calls)]
                yield chunk(
                    index, DeltaMessage(content=rest, reasoning_content=reasoning or None, tool_calls=deltas)
                )
                finish = finish if finish == "length" else "tool_calls"
            elif reasoning or rest:
                yield chunk(index, DeltaMessage(content=rest, reasoning_content=reasoning or None))
            finish_reasons[index] = finish
            yield chunk(index, DeltaMessage(), finish)
    totals = usage([num_prompt], sum(c.completion_tokens for c in choices), cached)
    answer.count_reasoning(totals, [c.token_ids for c in choices])
    trace_result(totals, finish_reasons)
    if include_usage:
        payload = ChatCompletionChunk(
            id=request_id, created=created, model=body.model, choices=[], usage=totals
        )
        yield sse_data(payload, include_usage=True)
    yield "data: [DONE]\n\n"


def _delta(content: str, reasoning: str, answer: _Answer) -> DeltaMessage:
    """A streamed piece: without a reasoning parser, content as it came (possibly empty beside
    logprobs), as before; with one, each part only when it has text."""
    if answer.turn is None and not answer.reasoning:
        return DeltaMessage(content=content)
    return DeltaMessage(content=content or None, reasoning_content=reasoning or None)
