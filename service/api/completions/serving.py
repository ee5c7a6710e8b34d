"""POST /v1/completions: prompts (text or token ids) to the engine, whole or streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request

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
from service.api.completions.protocol import CompletionChoice, CompletionRequest, CompletionResponse
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
from service.api.guided import named_guided_decoding
from service.api.logprobs import completion_logprobs, prompt_logprobs, with_top
from service.api.sse import sse, sse_data, sse_error
from service.api.state import Ready
from service.engine.protocol import GenerationRequest, TokenLogprob


async def completions(body: CompletionRequest, request: Request):
    """The completions of `body`: a response, or a stream of chunks (SSE)."""
    ready = ready_for(state_of(request), body.model)
    reject_unsupported(body)  # suffix and best_of other than n included

    state = state_of(request)
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
    trace_request("text_completion", body, request_id, budgets[0])
    check_prompt_logprobs(body, ready)
    echoed = body.logprobs if body.echo and body.logprobs is not None else None
    asked = [n for n in (echoed, body.prompt_logprobs) if n is not None]
    logprobs = LogprobRequest(sampled=body.logprobs, prompt=max(asked) if asked else None)
    logprobs.check(ready.info.engine.features, "logprobs")
    adapter = await adapter_for(ready, body.model)
    named_guided = named_guided_decoding(body)
    constraint_param, guided = named_guided if named_guided is not None else (None, None)
    body = state.seeded(body)
    engine_requests = build_requests(request_id, prompts, body, budgets, vocab, logprobs, adapter, guided)
    await unless_disconnected(request, check_requests(ready, engine_requests, constraint_param))
    state.admit()
    if body.stream:
        return sse(
            _completion_stream(
                ready, body, request_id, engine_requests, prompts, echoes, state.limits.always_include_usage
            ),
            state,
        )
    try:
        timeout_s = state.limits.request_timeout_seconds
        results = await unless_disconnected(request, collect(ready.engine, engine_requests, timeout_s))
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
    trace_result(totals, [r.finish_reason for r in results])
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
            so_far = running_usage(len(prompts[choice.index // body.n]), completion_tokens[choice.index])
        payload = CompletionResponse(
            id=request_id, created=created, model=body.model, choices=[choice], usage=so_far
        )
        return sse_data(payload, include_usage=include_usage or continuous)

    completion_tokens = [0] * len(requests)
    cached = [0] * len(requests)
    echoed = [not body.echo] * len(requests)
    finish_reasons: list[str | None] = [None] * len(requests)
    async for index, out in merged(ready.engine, requests):
        if ended_badly(out):
            yield sse_error(engine_error(out))
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
    trace_result(totals, finish_reasons)
    if include_usage:
        payload = CompletionResponse(
            id=request_id, created=created, model=body.model, choices=[], usage=totals
        )
        yield sse_data(payload, include_usage=True)
    yield "data: [DONE]\n\n"
