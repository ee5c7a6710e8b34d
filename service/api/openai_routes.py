"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from service.api.errors import APIError, error_body, invalid_request, model_not_found
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
    timed_out,
    usage,
)
from service.api.guided import guided_decoding
from service.api.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs, with_top
from service.api.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    FinishReason,
    ModelCard,
    ModelList,
    ResponseMessage,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
)
from service.api.state import ApiLimits, Ready, ServiceState
from service.api.tools import ToolCall, ToolSpec, ToolStream, tool_spec
from service.engine.protocol import GenerationRequest, RequestRefusedError, TokenLogprob
from service.telemetry.tracing import annotate
from service.text.chat_template import ChatTemplate
from service.text.reasoning import ReasoningSplitter, ReasoningTurn, closed
from service.text.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503, 504)
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)
tokens_router = APIRouter(responses=ERROR_RESPONSES)  # vLLM-style paths, for gateways that count tokens


def _state(request: Request) -> ServiceState:
    return request.app.state.service


def _ready_for(state: ServiceState, model: str) -> Ready:
    """The serving model, for `model` naming it or one of its LoRA adapters (else a 404)."""
    ready = state.model
    adapters = ready.adapters if ready is not None else None
    if model != state.served_name and (adapters is None or model not in adapters.names()):
        raise model_not_found(model)
    return state.require_ready()


async def _adapter_for(ready: Ready, model: str) -> str | None:
    """The LoRA adapter `model` names (prepared: read into memory off the event loop), or None for
    the base model. An adapter removed since `_ready_for` is a 404."""
    if model == ready.info.served_name or ready.adapters is None:
        return None
    try:
        await asyncio.to_thread(ready.adapters.prepare, model)
    except KeyError:
        raise model_not_found(model) from None
    return model


async def _check(ready: Ready, requests: list[GenerationRequest]) -> None:
    """400 for what the serving engine would refuse, before anything is admitted or streamed."""
    for request in requests:
        try:
            await ready.engine.check(request)
        except RequestRefusedError as exc:
            raise invalid_request(str(exc), None) from None


def _chat_prompt(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    inputs: _TemplateInputs,
    source: str | None = None,
) -> tuple[str, list[int]]:
    """The conversation's prompt, as text and tokens: rendered by the chat template (the request's
    own `source`, when it sent one, else the model's; with the request's template `inputs`), its
    thinking closed where the request asked for that, then tokenized. Slow for long conversations
    (seconds for megabytes): run it off the event loop."""
    rendered = [_template_message(m, i) for i, m in enumerate(messages)]
    try:
        extra = {**inputs.variables, "tools": tools} if tools is not None else dict(inputs.variables)
        text = tokenizer.apply_chat_template(
            rendered, add_generation_prompt=True, chat_template=source, **extra
        )
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages" if source is None else "chat_template") from None
    if inputs.close_thinking:
        text = closed(text)
    return text, tokenizer.encode(text, add_special_tokens=False)


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates take it: tool calls (arguments as objects) and tool results too."""
    extra = message.model_extra or {}
    content = message.text(f"messages.{index}")
    refusal = extra.get("refusal")
    if not content and message.role == "assistant" and isinstance(refusal, str):
        content = refusal  # an earlier refusal is what the assistant said
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.name:
        out["name"] = message.name
    reasoning = extra.get("reasoning_content", extra.get("reasoning"))
    if message.role == "assistant" and isinstance(reasoning, str):
        out["reasoning_content"] = reasoning  # templates that show earlier thinking read it
    if message.role == "tool" and extra.get("tool_call_id"):
        out["tool_call_id"] = extra["tool_call_id"]
    calls = extra.get("tool_calls")
    if message.role == "assistant" and isinstance(calls, list):
        out["tool_calls"] = [
            _template_call(call, f"messages.{index}.tool_calls.{j}")
            for j, call in enumerate(calls)
            if isinstance(call, dict)
        ]
    return out


def _template_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict):
        raise invalid_request(
            "a tool call's function must be an object {name, arguments}", f"{param}.function"
        )
    function = dict(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError, RecursionError):  # not JSON: the template gets the text
            function["arguments"] = json.loads(arguments)
    return {**call, "type": call.get("type", "function"), "function": function}


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, or, when the client disconnects first, `work` cancelled (which aborts its
    engine requests: an answer nobody will read is not generated to the end) and a 499."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()
        gone.cancel()
        await asyncio.wait((task, gone))  # the engine has been told to abort before we go on
    if task.cancelled():
        log.info("client disconnected; its generation was aborted")
        raise APIError(499, "the client disconnected before the answer was ready", "invalid_request_error",
                       None, "client_disconnected")  # fmt: skip
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    info = state.model.info if state.model else None
    created = info.created if info else int(time.time())
    card = ModelCard(
        id=state.served_name,
        created=created,
        root=info.source if info else None,
        max_model_len=info.max_model_len if info else None,
    )
    adapters = state.model.adapters if state.model else None
    cards = [
        ModelCard(id=name, created=created, root=name, parent=card.id, max_model_len=card.max_model_len)
        for name in (adapters.names() if adapters is not None else ())
    ]
    return ModelList(data=[card, *cards])


# --- Chat ----------------------------------------------------------------------------------------


@router.post("/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ready = _ready_for(_state(request), body.model)
    reject_unsupported(body)
    limits = _state(request).limits
    # A request's own template is compiled here (a second of CPU for the largest), off the event loop
    tool_template = await asyncio.to_thread(_template, ready.tokenizer, body, limits, True)
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
    _check_prompt_logprobs(body, ready)

    max_model_len = ready.info.max_model_len
    num_chars = sum(len(m.text()) for m in body.messages)  # the prompt holds at least these
    check_prompt_chars(num_chars, ready.tokenizer.max_token_chars, max_model_len, "messages", limits)
    tools_shown = body.tools if tools is not None else None
    template = _template(ready.tokenizer, body, limits, tools=tools_shown is not None)
    inputs = _template_inputs(body, template, ready.tokenizer, ready.reasoning is not None)
    text, prompt = await asyncio.to_thread(
        _chat_prompt, ready.tokenizer, body.messages, tools_shown, inputs, body.chat_template
    )
    turn = None
    if ready.reasoning is not None:
        turn = ready.reasoning.for_prompt(text, constrained=guided is not None)
    if guided is not None and turn is not None:  # the constraint starts where the thinking ends
        guided = replace(guided, start_after=turn.start_after, opens_with=turn.opening)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "messages"
    state = _state(request)
    budget = check_context(len(prompt), max_tokens, max_model_len, param, state.limits)

    request_id = new_id("chatcmpl")
    _trace_request("chat", body, request_id, budget)
    logprobs = LogprobRequest(
        sampled=(body.top_logprobs or 0) if body.logprobs else None, prompt=body.prompt_logprobs
    )
    logprobs.check(ready.info.engine.features, "logprobs")
    adapter = await _adapter_for(ready, body.model)
    stop = tools.stop if tools is not None else ()
    engine_requests = build_requests(
        request_id, [prompt], body, [budget], ready.tokenizer.vocab_size, logprobs, adapter, guided, stop
    )
    await _unless_disconnected(request, _check(ready, engine_requests))
    state.admit()
    answer = _Answer(tools, turn, ready.reasoning is not None)
    if body.stream:
        always_usage = state.limits.always_include_usage
        return _sse(_chat_stream(ready, body, request_id, engine_requests, len(prompt), always_usage, answer),
                    state)  # fmt: skip
    try:
        timeout_s = state.limits.request_timeout_seconds
        results = await _unless_disconnected(request, collect(ready.engine, engine_requests, timeout_s))
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
    _trace_result(totals, [r.finish_reason for r in results])
    prompt_entries = None
    if body.prompt_logprobs is not None:
        prompt_entries = prompt_logprobs(
            ready.tokenizer, prompt, results[0].prompt_logprobs, body.prompt_logprobs
        )
    return ChatCompletionResponse(
        id=request_id, model=body.model, choices=choices, usage=totals, prompt_logprobs=prompt_entries
    )


def _check_prompt_logprobs(body: ChatCompletionRequest | CompletionRequest, ready: Ready) -> None:
    """400 for prompt_logprobs the server cannot give (vLLM refuses them when streaming too)."""
    if body.prompt_logprobs is None:
        return
    if body.stream:
        raise invalid_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    if not ready.info.engine.features.prompt_logprobs:
        raise invalid_request("prompt_logprobs are not supported by this server's engine", "prompt_logprobs")


def _template(
    tokenizer: Tokenizer, body: ChatCompletionRequest, limits: ApiLimits, tools: bool
) -> ChatTemplate | None:
    """The chat template the conversation is rendered with: the request's own `chat_template`
    where the operator trusts requests with one (NIM_TRUST_REQUEST_CHAT_TEMPLATE, as vLLM's
    --trust-request-chat-template), else a 400; the model's otherwise."""
    if body.chat_template is None:
        return tokenizer.chat_template_for(tools=tools)
    if not limits.trust_request_chat_template:
        raise invalid_request(
            "a request's own chat_template is refused by this server; its operator may allow it with "
            "NIM_TRUST_REQUEST_CHAT_TEMPLATE=1 (it then runs sandboxed, size- and time-limited)",
            "chat_template",
        )
    try:
        return tokenizer.chat_template_for(tools=tools, source=body.chat_template)
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "chat_template") from None


# Template variables the server sets itself: not to be replaced through chat_template_kwargs.
_RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


@dataclass(frozen=True)
class _TemplateInputs:
    """What a request adds to its chat template's rendering: variables the template reads, and
    whether the prompt must end with the thinking closed (`enable_thinking: false` with a reasoning
    parser: service.text.reasoning.closed)."""

    variables: dict[str, Any]
    close_thinking: bool = False


def _template_inputs(
    body: ChatCompletionRequest, template: ChatTemplate | None, tokenizer: Tokenizer, reasoning: bool
) -> _TemplateInputs:
    """The request's extra chat template variables (chat_template_kwargs, reasoning_effort), each
    one the template reads; a 400 naming the field for any other. `enable_thinking` is the
    exception where the model has a reasoning parser (`reasoning`): false closes the thinking
    whether or not the template reads it, true asks for what the model does anyway."""
    variables: dict[str, Any] = {}
    close_thinking = False
    reserved = _RESERVED_VARIABLES | tokenizer.template_tokens.keys()
    for key, value in (body.chat_template_kwargs or {}).items():
        param = f"chat_template_kwargs.{key}"
        if key in reserved:
            raise invalid_request(f"{key} is set by the server and cannot be passed in chat_template_kwargs",
                                  param)  # fmt: skip
        if key == "reasoning_effort" and body.reasoning_effort is not None:
            raise invalid_request("reasoning_effort is given twice (also as the request field)", param)
        reads = template is not None and template.reads(key)
        if key == "enable_thinking" and reasoning:
            if not isinstance(value, bool):
                raise invalid_request(f"enable_thinking is true or false, not {json.dumps(value)}", param)
            close_thinking = not value
            if not reads:
                continue
        elif not reads:
            raise invalid_request(
                f"this model's chat template does not read {key}, so passing it would have no effect", param
            )
        variables[key] = value
    if body.reasoning_effort is not None:
        if template is None or not template.reads("reasoning_effort"):
            raise invalid_request(
                "this model's chat template does not read reasoning_effort, so it would have no effect",
                "reasoning_effort",
            )
        variables["reasoning_effort"] = body.reasoning_effort
    return _TemplateInputs(variables, close_thinking)


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
        so_far = _running_usage(num_prompt, choices[index].completion_tokens) if continuous else None
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        payload = ChatCompletionChunk(id=request_id, created=created, model=body.model, choices=[choice],
                                      usage=so_far)  # fmt: skip
        return _sse_data(payload, include_usage=include_usage or continuous)

    for i in range(len(requests)):
        yield chunk(i, DeltaMessage(role="assistant", content=""))
    finish_reasons: list[str | None] = [None] * len(requests)
    cached = 0
    async for index, out in merged(ready.engine, requests):
        if ended_badly(out):
            yield _sse_error(engine_error(out))
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
    _trace_result(totals, finish_reasons)
    if include_usage:
        payload = ChatCompletionChunk(
            id=request_id, created=created, model=body.model, choices=[], usage=totals
        )
        yield _sse_data(payload, include_usage=True)
    yield "data: [DONE]\n\n"


def _delta(content: str, reasoning: str, answer: _Answer) -> DeltaMessage:
    """A streamed piece: without a reasoning parser, content as it came (possibly empty beside
    logprobs), as before; with one, each part only when it has text."""
    if answer.turn is None and not answer.reasoning:
        return DeltaMessage(content=content)
    return DeltaMessage(content=content or None, reasoning_content=reasoning or None)


def _running_usage(num_prompt: int, completion_tokens: int) -> Usage:
    """vLLM's continuous_usage_stats: each chunk's choice's tokens so far."""
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=completion_tokens,
        total_tokens=num_prompt + completion_tokens,
    )


# --- Completions ---------------------------------------------------------------------------------


@router.post("/completions", response_model=CompletionResponse)
async def completions(body: CompletionRequest, request: Request):
    ready = _ready_for(_state(request), body.model)
    reject_unsupported(body)  # suffix and best_of other than n included

    state = _state(request)
    max_model_len = ready.info.max_model_len
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    for text in texts:
        if isinstance(text, str):
            check_prompt_chars(
                len(text), ready.tokenizer.max_token_chars, max_model_len, "prompt", state.limits
            )
    prompts = await asyncio.to_thread(_completion_prompts, body, ready)
    budgets = [check_context(len(p), body.max_tokens, max_model_len, "prompt", state.limits) for p in prompts]
    vocab = ready.tokenizer.vocab_size
    for prompt in prompts:  # after the length check: each is at most the context
        if any(not 0 <= t < vocab for t in prompt):
            raise invalid_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    echoes = [ready.tokenizer.decode(p, skip_special_tokens=False) if body.echo else "" for p in prompts]

    request_id = new_id("cmpl")
    _trace_request("text_completion", body, request_id, budgets[0])
    _check_prompt_logprobs(body, ready)
    echoed = body.logprobs if body.echo and body.logprobs is not None else None
    asked = [n for n in (echoed, body.prompt_logprobs) if n is not None]
    logprobs = LogprobRequest(sampled=body.logprobs, prompt=max(asked) if asked else None)
    logprobs.check(ready.info.engine.features, "logprobs")
    adapter = await _adapter_for(ready, body.model)
    guided = guided_decoding(body)
    engine_requests = build_requests(request_id, prompts, body, budgets, vocab, logprobs, adapter, guided)
    await _unless_disconnected(request, _check(ready, engine_requests))
    state.admit()
    if body.stream:
        return _sse(
            _completion_stream(
                ready, body, request_id, engine_requests, prompts, echoes, state.limits.always_include_usage
            ),
            state,
        )
    try:
        timeout_s = state.limits.request_timeout_seconds
        results = await _unless_disconnected(request, collect(ready.engine, engine_requests, timeout_s))
    finally:
        state.release()
    choices = []
    for i, r in enumerate(results):
        prompt = prompts[i // body.n]
        choice_logprobs = None
        if body.logprobs is not None:
            ids = list(r.token_ids)
            entries: list[TokenLogprob | None] = list(r.logprobs)
            if body.echo:
                echoed_entries = with_top(r.prompt_logprobs or [None] * len(prompt), body.logprobs)
                ids, entries = [*prompt, *ids], [*echoed_entries, *entries]
            choice_logprobs = completion_logprobs(ready.tokenizer, ids, entries)
        prompt_entries = None
        if body.prompt_logprobs is not None:
            prompt_entries = prompt_logprobs(ready.tokenizer, prompt, r.prompt_logprobs, body.prompt_logprobs)
        choices.append(
            CompletionChoice(
                index=i,
                text=echoes[i // body.n] + r.text,
                finish_reason=r.finish_reason,
                logprobs=choice_logprobs,
                prompt_logprobs=prompt_entries,
            )
        )
    completion_tokens = sum(r.num_generated_tokens for r in results)
    cached = sum(r.num_cached_tokens for i, r in enumerate(results) if i % body.n == 0)
    totals = usage([len(p) for p in prompts], completion_tokens, cached)
    _trace_result(totals, [r.finish_reason for r in results])
    return CompletionResponse(id=request_id, model=body.model, choices=choices, usage=totals)


def _completion_prompts(body: CompletionRequest, ready: Ready) -> list[list[int]]:
    """The prompts' tokens (slow for long texts: run it off the event loop)."""
    # Validation made the prompt a string or a list of one kind: strings, token ids or token id lists.
    prompt = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompt:
        raise invalid_request("prompt must not be empty", "prompt")
    texts = [p for p in prompt if isinstance(p, str)]
    if texts:
        if any(not t for t in texts):
            raise invalid_request("prompt must not be empty", "prompt")
        return [ready.tokenizer.encode(t, add_special_tokens=True) for t in texts]
    token_ids = [t for t in prompt if isinstance(t, int)]
    if token_ids:
        return [token_ids]
    return [list(p) for p in prompt if isinstance(p, list)]


async def _completion_stream(
    ready: Ready,
    body: CompletionRequest,
    request_id: str,
    requests: list[GenerationRequest],
    prompts: list[list[int]],
    echoes: list[str],
    always_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = body.include_usage or always_usage
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

    def chunk(choice: CompletionChoice) -> str:
        so_far = None
        if continuous:  # vLLM's continuous_usage_stats: this choice's tokens so far
            so_far = _running_usage(len(prompts[choice.index // body.n]), completion_tokens[choice.index])
        payload = CompletionResponse(
            id=request_id, created=created, model=body.model, choices=[choice], usage=so_far
        )
        return _sse_data(payload, include_usage=include_usage or continuous)

    completion_tokens = [0] * len(requests)
    cached = [0] * len(requests)
    echoed = [not body.echo] * len(requests)
    finish_reasons: list[str | None] = [None] * len(requests)
    async for index, out in merged(ready.engine, requests):
        if ended_badly(out):
            yield _sse_error(engine_error(out))
            return
        completion_tokens[index] = out.num_generated_tokens
        cached[index] = out.num_cached_tokens
        text, ids = out.text, list(out.token_ids)
        entries: list[TokenLogprob | None] = list(out.logprobs or [])
        if not echoed[index]:  # the prompt goes out with the choice's first chunk
            prompt = prompts[index // body.n]
            text = echoes[index // body.n] + text
            if body.logprobs is not None:
                echoed_entries = with_top(out.prompt_logprobs or [None] * len(prompt), body.logprobs)
                ids, entries = [*prompt, *ids], [*echoed_entries, *entries]
            echoed[index] = True
        logprobs = completion_logprobs(ready.tokenizer, ids, entries) if body.logprobs is not None else None
        if out.finished:
            finish_reasons[index] = out.finish_reason
        if text or out.finished or logprobs:
            finish = client_finish_reason(out)
            yield chunk(CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=logprobs))
    cached_total = sum(c for i, c in enumerate(cached) if i % body.n == 0)
    totals = usage([len(p) for p in prompts], sum(completion_tokens), cached_total)
    _trace_result(totals, finish_reasons)
    if include_usage:
        payload = CompletionResponse(
            id=request_id, created=created, model=body.model, choices=[], usage=totals
        )
        yield _sse_data(payload, include_usage=True)
    yield "data: [DONE]\n\n"


# --- Tracing (GenAI semantic conventions; nothing happens when tracing is off) -------------------


def _trace_request(operation: str, body: ChatCompletionRequest | CompletionRequest, response_id: str,
                   max_tokens: int) -> None:  # fmt: skip
    annotate(
        {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "nim-torch",
            "gen_ai.request.model": body.model,
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": body.temperature,
            "gen_ai.request.top_p": body.top_p,
            "gen_ai.request.seed": body.seed,
            "gen_ai.request.choice.count": body.n if body.n != 1 else None,
            "gen_ai.response.id": response_id,
            "gen_ai.response.model": body.model,
        }
    )


def _trace_result(totals: Usage, finish_reasons: list[str | None]) -> None:
    annotate(
        {
            "gen_ai.usage.input_tokens": totals.prompt_tokens,
            "gen_ai.usage.output_tokens": totals.completion_tokens,
            "gen_ai.response.finish_reasons": [r or "" for r in finish_reasons],
        }
    )


# --- Server-sent events --------------------------------------------------------------------------


def _sse(events: AsyncIterator[str], state: ServiceState) -> StreamingResponse:
    """Stream events; the admission slot is released exactly once, however the stream ends
    (finished, failed, client gone before or after the first byte)."""
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.release()

    guarded = _guard(events, release, state.limits.request_timeout_seconds)
    return StreamingResponse(
        guarded, media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(release)
    )


async def _guard(
    events: AsyncIterator[str], release: Callable[[], None], timeout_s: float | None
) -> AsyncIterator[str]:
    """A failure mid-stream becomes an error frame: the status line has already gone out."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        async for event in events:
            yield event
            if deadline is not None and time.monotonic() > deadline:
                yield _sse_error(timed_out(timeout_s))
                return
    except APIError as exc:
        yield _sse_error(exc)
    except Exception:
        log.exception("stream failed")
        yield _sse_error(APIError(500, "internal server error", "server_error"))
    finally:
        if hasattr(events, "aclose"):
            await events.aclose()  # aborts the engine requests if the stream ended early
        release()


def _sse_data(payload: BaseModel, include_usage: bool) -> str:
    exclude: set[str] | None = None if include_usage else {"usage"}
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


def _sse_error(err: APIError) -> str:
    """An error frame (the official client raises on it), then the end of the stream."""
    return (
        f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n" + "data: [DONE]\n\n"
    )


# --- Tokens (vLLM-compatible) --------------------------------------------------------------------


@tokens_router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    ready = _ready_for(_state(request), body.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("send exactly one of prompt or messages", "prompt")
    tokens = await asyncio.to_thread(_tokens, ready.tokenizer, body)
    return TokenizeResponse(count=len(tokens), max_model_len=ready.info.max_model_len, tokens=tokens)


def _tokens(tokenizer: Tokenizer, body: TokenizeRequest) -> list[int]:
    """What /tokenize counts (slow for long texts: run it off the event loop)."""
    if body.messages is None:
        return tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
    messages = [{"role": m.role, "content": m.text(f"messages.{i}")} for i, m in enumerate(body.messages)]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


@tokens_router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ready = _ready_for(_state(request), body.model)
    vocab = ready.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise invalid_request(f"token ids must be in [0, {vocab})", "tokens")
    return DetokenizeResponse(prompt=ready.tokenizer.decode(body.tokens, skip_special_tokens=False))
