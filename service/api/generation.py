"""From a validated request to engine requests, and from engine outputs back to choices.

Shared by chat and completions: prompt length checks, sampling parameters, fanning out `n`
choices (and several prompts) as separate engine requests, and merging their output streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from service.api.errors import APIError, invalid_request, service_unavailable
from service.api.middleware import current_request_id
from service.api.request_fields import check_content_part, check_message_fields, check_request, sent_fields
from service.api.schemas import FinishReason, PromptTokensDetails, SamplingFields, Usage
from service.api.state import ApiLimits
from service.engine.protocol import (
    Engine,
    EngineDeadError,
    EngineFeatures,
    GenerationRequest,
    GuidedDecoding,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)


def new_id(prefix: str) -> str:
    """The response id: the caller's x-request-id when it sent one, so logs and responses agree."""
    return f"{prefix}-{current_request_id() or uuid.uuid4().hex}"


def check_prompt_chars(
    num_chars: int,
    max_token_chars: int,
    max_model_len: int,
    param: str,
    limits: ApiLimits | None = None,
) -> None:
    """400 for prompt text too long to fit whatever its tokens, before it is templated or tokenized
    (megabytes take seconds). No token stands for more than `max_token_chars` characters, so the
    text is at least num_chars / max_token_chars tokens, and the prompt must leave one for the answer."""
    cap = limits.max_prompt_tokens if limits else None
    fits = max_model_len - 1 if cap is None else min(cap, max_model_len - 1)
    if num_chars <= fits * max_token_chars:
        return
    by_context = fits == max_model_len - 1
    raise invalid_request(
        f"The prompt has {num_chars} characters, more than "
        + (f"this model's maximum context length of {max_model_len} tokens" if by_context
           else f"the {fits} tokens this server accepts in a prompt")
        + f" can hold (a token of this model stands for at most {max_token_chars} characters). "
        "Please reduce the length of the prompt.",
        param,
        "context_length_exceeded" if by_context else None,
    )  # fmt: skip


def check_context(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    param: str,
    limits: ApiLimits | None = None,
) -> int:
    """Validate lengths against the context and the operator's caps; return the completion budget."""
    if num_prompt_tokens == 0:
        raise invalid_request("the prompt is empty", param)
    prompt_cap = limits.max_prompt_tokens if limits else None
    if prompt_cap is not None and num_prompt_tokens > prompt_cap:
        raise invalid_request(
            f"the prompt has {num_prompt_tokens} tokens; this server accepts at most {prompt_cap}", param
        )
    completion_cap = limits.max_completion_tokens if limits else None
    if completion_cap is not None:
        if max_tokens is not None and max_tokens > completion_cap:
            raise invalid_request(
                f"max_tokens {max_tokens} exceeds this server's limit of {completion_cap}", "max_tokens"
            )
        max_model_len = min(max_model_len, num_prompt_tokens + completion_cap)
    room = max_model_len - num_prompt_tokens
    if room < 1 or (max_tokens is not None and max_tokens > room):
        requested = num_prompt_tokens + (max_tokens or 0)
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({num_prompt_tokens} in the prompt, {max_tokens or 0} for the completion). "
            "Please reduce the length of the prompt or the completion.",
            param,
            "context_length_exceeded",
        )
    return room if max_tokens is None else max_tokens


@dataclass(frozen=True)
class LogprobRequest:
    """What logprobs a request asked for, in engine terms (None: none)."""

    sampled: int | None = None
    prompt: int | None = None

    def check(self, features: EngineFeatures, param: str) -> None:
        """400 when the serving engine cannot compute what was asked for."""
        if self.sampled is not None and not features.logprobs:
            raise invalid_request("logprobs are not supported by this server's engine", param)
        if self.prompt is not None and not features.prompt_logprobs:
            raise invalid_request(
                "prompt logprobs (echo with logprobs) are not supported by this engine", param
            )


def sampling_params(
    request: SamplingFields,
    max_tokens: int,
    choice: int,
    vocab_size: int,
    logprobs: LogprobRequest,
    guided: GuidedDecoding | None = None,
    extra_stop: tuple[str, ...] = (),
) -> SamplingParams:
    """Map OpenAI/vLLM/nvext fields onto engine parameters; 400 for values the model cannot take.
    `extra_stop` are stop strings the server adds (e.g. the end of a tool call)."""
    nvext = request.nvext
    top_k = request.top_k if request.top_k is not None else (nvext.top_k if nvext else None)
    repetition = request.repetition_penalty
    if repetition is None and nvext is not None:
        repetition = nvext.repetition_penalty
    ignore_eos = request.ignore_eos or bool(nvext and nvext.ignore_eos)
    min_tokens = request.min_tokens or (nvext.min_tokens or 0 if nvext else 0)
    logit_bias = {int(k): v for k, v in (request.logit_bias or {}).items()}
    for name, ids in (("logit_bias", logit_bias), ("stop_token_ids", request.stop_token_ids or [])):
        if any(t >= vocab_size for t in ids):
            raise invalid_request(f"{name} names a token id outside the vocabulary [0, {vocab_size})", name)
    if min_tokens > max_tokens:
        raise invalid_request(f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    # Seeded requests with n > 1 give each choice its own (still reproducible) stream.
    seed = None if request.seed is None else request.seed + choice
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=top_k or 0,
        min_p=request.min_p or 0.0,
        repetition_penalty=repetition or 1.0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias=logit_bias,
        seed=seed,
        stop=tuple(dict.fromkeys((*request.stop_list(), *extra_stop))),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        logprobs=logprobs.sampled,
        prompt_logprobs=logprobs.prompt,
        skip_special_tokens=request.skip_special_tokens,
        guided=guided,
    )


def reject_unsupported(request: SamplingFields) -> None:
    """400 for any field the request sent that service.api.request_fields' table does not honour
    on its endpoint, with that value (top-level fields and those of the objects it walks, chat
    messages' fields by role, their tool calls, and their content parts by type); null is never
    refused. Runs before anything else reads the request."""
    check_request(request.endpoint, request)
    for i, message in enumerate(getattr(request, "messages", None) or ()):
        check_message_fields(message.role, sent_fields(message), f"messages.{i}")
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                check_content_part(part.type, sent_fields(part), f"messages.{i}.content.{j}")


@dataclass
class ChoiceResult:
    text: str = ""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    pieces: list[str] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.pieces.append(out.text)
        self.token_ids.extend(out.token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_generated_tokens = out.num_generated_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = client_finish_reason(out)
            self.text = "".join(self.pieces)


def usage(prompt_lengths: Sequence[int], completion_tokens: int, cached_tokens: int) -> Usage:
    prompt_tokens = sum(prompt_lengths)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def ended_badly(out: RequestOutput) -> bool:
    """The engine failed the request, or cancelled it while its client was still there."""
    return out.error is not None or out.finish_reason == "abort"


def client_finish_reason(out: RequestOutput) -> FinishReason | None:
    """The finish_reason a client sees; only for outputs that did not end badly, so never "abort"."""
    reason = out.finish_reason
    if reason == "abort":
        raise engine_error(out)
    return reason


def engine_error(out: RequestOutput) -> APIError:
    """What the client is told when `ended_badly(out)`."""
    if out.error is not None and out.error_cause == "request":
        return invalid_request(f"generation failed: {out.error}", None, "invalid_generation")
    if out.error is not None:
        return APIError(500, f"generation failed: {out.error}", "server_error", None, "engine_error")
    return service_unavailable("generation was cancelled: the server is shutting down", 5)


async def _outputs(engine: Engine, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
    """One request's outputs; a dead engine is a 503 like readiness reports it."""
    stream = engine.generate(request)
    try:
        async for out in stream:
            yield out
    except EngineDeadError as exc:
        raise service_unavailable(f"model failed: {exc}", 30) from None
    finally:
        await stream.aclose()


async def merged(
    engine: Engine, requests: Sequence[GenerationRequest]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as one stream of (choice index, output).

    Leaving the iteration early (client gone, error) cancels every producer, which aborts
    its engine request.
    """
    if len(requests) == 1:
        stream = _outputs(engine, requests[0])
        try:
            async for out in stream:
                yield 0, out
        finally:
            await stream.aclose()
        return

    queue: asyncio.Queue[tuple[int, RequestOutput] | APIError] = asyncio.Queue()

    async def produce(index: int, request: GenerationRequest) -> None:
        stream = _outputs(engine, request)
        try:
            async for out in stream:
                await queue.put((index, out))
        except APIError as exc:
            await queue.put(exc)
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(produce(i, r)) for i, r in enumerate(requests)]
    remaining = len(requests)
    try:
        while remaining:
            item = await queue.get()
            if isinstance(item, APIError):
                raise item
            index, out = item
            if out.finished:
                remaining -= 1
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def collect(
    engine: Engine, requests: Sequence[GenerationRequest], timeout_s: float | None = None
) -> list[ChoiceResult]:
    """Run requests to completion; past `timeout_s` they are aborted and the caller gets a 504."""
    results = [ChoiceResult() for _ in requests]

    async def run() -> None:
        async for index, out in merged(engine, requests):
            if ended_badly(out):
                raise engine_error(out)
            results[index].add(out)

    try:
        await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        raise timed_out(timeout_s) from None
    return results


def timed_out(timeout_s: float | None) -> APIError:
    return APIError(504, f"generation did not finish within {timeout_s:g} s", "server_error", None, "timeout")


def build_requests(
    request_id: str,
    prompts: Sequence[list[int]],
    request: SamplingFields,
    max_tokens: Sequence[int],
    vocab_size: int,
    logprobs: LogprobRequest,
    adapter: str | None = None,
    guided: GuidedDecoding | None = None,
    extra_stop: tuple[str, ...] = (),
) -> list[GenerationRequest]:
    """One engine request per (prompt, choice); choice index = prompt_index * n + j; all run
    `adapter` (a LoRA adapter's name) or the base model."""
    now = time.monotonic()
    unique = uuid.uuid4().hex[:8]  # callers may reuse an x-request-id; engine ids must not collide
    return [
        GenerationRequest(
            request_id=f"{request_id}-{unique}-{p * request.n + j}",
            prompt_token_ids=prompt,
            sampling=sampling_params(request, max_tokens[p], j, vocab_size, logprobs, guided, extra_stop),
            arrival_time=now,
            adapter=adapter,
        )
        for p, prompt in enumerate(prompts)
        for j in range(request.n)
    ]
