"""A conversation on its way through the engine: the one path every chat-speaking endpoint takes.

`prepare` does, for a validated ChatCompletionRequest, what the engine path needs done once: the
tools checked and their grammar (a forced call), the structured-output constraint, the prompt
rendered by the chat template and tokenized, the context and the operator's caps checked, the
engine requests built and checked by the engine. Chat completions call it with the client's
request; Responses (service.api.responses) and Messages (service.api.messages) with a request
they translated into one, so limits, metering, isolation and the abort on disconnect are the
same for all three. It admits nothing: a ChatRun is admitted when it runs, whole (`results`) or
streamed (`stream`, whose events read `pieces`), and released exactly once however it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import StreamingResponse

from service.api.chat.answer import Answer, ChoiceStream
from service.api.chat.prompt import chat_prompt, template_for, template_inputs
from service.api.chat.protocol import ChatCompletionRequest
from service.api.common import (
    adapter_for,
    check_prompt_logprobs,
    check_requests,
    state_of,
    trace_request,
    trace_result,
    unless_disconnected,
)
from service.api.errors import APIError, invalid_request
from service.api.generation import (
    ChoiceResult,
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
    usage,
)
from service.api.guided import named_guided_decoding
from service.api.schemas import FinishReason, Usage
from service.api.sse import sse, sse_error
from service.api.state import Ready, ServiceState
from service.api.tools import ToolCall, tool_spec
from service.engine.protocol import GenerationRequest, TokenLogprob


@dataclass(frozen=True)
class Delta:
    """A piece of one choice's answer as it streams: thinking and content to send now (either may
    be empty), and the logprobs of the tokens that made it (when asked for)."""

    index: int
    reasoning: str
    content: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Finish:
    """The end of one choice: what was still held back (thinking, content), the tool calls it made,
    and its finish reason ("tool_calls" when it made calls, "length" where max_tokens cut it)."""

    index: int
    reasoning: str
    content: str | None
    calls: list[ToolCall]
    finish_reason: FinishReason | None
    token_ids: list[int]


@dataclass
class ChatRun:
    """One prepared conversation: its engine requests (one per choice), the prompt's tokens, and how
    its answers are read."""

    ready: Ready
    state: ServiceState
    body: ChatCompletionRequest  # as sampled (NIM_SEED applied)
    request_id: str
    requests: list[GenerationRequest]
    prompt: list[int]
    prompt_text: str
    answer: Answer
    choices: list[ChoiceStream] = field(init=False)
    finish_reasons: list[FinishReason | None] = field(init=False)
    cached_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.choices = [ChoiceStream.of(self.answer) for _ in self.requests]
        self.finish_reasons = [None] * len(self.requests)

    async def results(self, request: Request) -> list[ChoiceResult]:
        """Every choice run to its end (admitted, then released); a client that leaves first aborts
        them (499), and NIM_REQUEST_TIMEOUT_SECONDS aborts them with a 504."""
        self.state.admit()
        try:
            timeout_s = self.state.limits.request_timeout_seconds
            return await unless_disconnected(request, collect(self.ready.engine, self.requests, timeout_s))
        finally:
            self.state.release()

    def stream(self, events: AsyncIterator[str],
               render_error: Callable[[APIError], str] = sse_error) -> StreamingResponse:  # fmt: skip
        """`events` (which read `pieces`) as server-sent events, admitted now and released when the
        stream ends; a failure after the first byte is sent as `render_error` makes it."""
        self.state.admit()
        return sse(events, self.state, render_error)

    async def pieces(self) -> AsyncIterator[Delta | Finish]:
        """The choices' answers as the engine's outputs arrive: a Delta for each output that has
        something to send, a Finish at each choice's end. An output the engine ended badly raises
        its APIError (the stream's error event); leaving early aborts every engine request."""
        want_logprobs = bool(self.body.logprobs)
        async for index, out in merged(self.ready.engine, self.requests):
            if ended_badly(out):
                raise engine_error(out)
            choice = self.choices[index]
            choice.completion_tokens = out.num_generated_tokens
            choice.token_ids.extend(out.token_ids)
            self.cached_tokens = out.num_cached_tokens if index == 0 else self.cached_tokens
            logprobs = out.logprobs if want_logprobs and out.logprobs else None
            reasoning, content = choice.feed(out.text)
            if reasoning or content or logprobs:
                yield Delta(index, reasoning, content, logprobs)
            if out.finished:
                finish = client_finish_reason(out)
                reasoning, rest, calls = choice.finish(cut=finish == "length")
                if calls and finish != "length":
                    finish = "tool_calls"
                self.finish_reasons[index] = finish
                yield Finish(index, reasoning, rest, calls, finish, choice.token_ids)

    def streamed_usage(self) -> Usage:
        """The usage of what `pieces` streamed (after it ended), also recorded on the trace span."""
        totals = usage([len(self.prompt)], sum(c.completion_tokens for c in self.choices), self.cached_tokens)
        self.answer.count_reasoning(totals, [c.token_ids for c in self.choices])
        trace_result(totals, list(self.finish_reasons))
        return totals

    def whole_usage(self, results: list[ChoiceResult]) -> Usage:
        """The usage of `results`, also recorded on the trace span."""
        completion_tokens = sum(r.num_generated_tokens for r in results)
        totals = usage([len(self.prompt)], completion_tokens, results[0].num_cached_tokens)
        self.answer.count_reasoning(totals, [r.token_ids for r in results])
        trace_result(totals, [r.finish_reason for r in results])
        return totals


def _forced_tool_param(body: ChatCompletionRequest) -> str:
    """The field whose schema a forced call's grammar enforces: the named function's parameters,
    or every tool's (tool_choice required)."""
    choice = body.tool_choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    for index, tool in enumerate(body.tools or []):
        if name is not None and tool.get("function", {}).get("name") == name:
            return f"tools.{index}.function.parameters"
    return "tools"


async def prepare(ready: Ready, body: ChatCompletionRequest, request: Request,
                  request_id: str | None = None) -> ChatRun:  # fmt: skip
    """`body` (its fields already checked against service.api.request_fields) ready to run: 400s
    name the chat field at fault (callers that translated their request rename them), 429 is left
    to the run. `request_id`: the response's id (default: a chat completion's)."""
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
    named_guided = named_guided_decoding(body)
    constraint_param, guided = named_guided if named_guided is not None else (None, None)
    if tools is not None and tools.forced:
        if guided is not None:
            raise invalid_request("tool_choice required or named cannot be combined with a structured-output "
                                  "constraint (response_format, structured_outputs, guided_*)",
                                  "tool_choice")  # fmt: skip
        guided = tools.guided()
        constraint_param = _forced_tool_param(body)
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

    request_id = request_id or new_id("chatcmpl")
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
    await unless_disconnected(request, check_requests(ready, engine_requests, constraint_param))
    answer = Answer(tools, turn, ready.reasoning is not None)
    return ChatRun(ready, state, body, request_id, engine_requests, prompt, text, answer)
