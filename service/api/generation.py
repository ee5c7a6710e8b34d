"""From a validated request to engine requests, and from engine outputs back to choices.

Shared by chat and completions: prompt length checks, sampling parameters, fanning out `n`
choices (and several prompts) as separate engine requests, and merging their output streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from service.api.errors import APIError, invalid_request
from service.api.schemas import SamplingFields
from service.engine.protocol import Engine, GenerationRequest, RequestOutput, SamplingParams


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str) -> int:
    """Validate lengths; return the number of tokens the completion may take."""
    if num_prompt_tokens == 0:
        raise invalid_request("the prompt is empty", param)
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


def reject_unsupported(request: SamplingFields) -> None:
    """Known OpenAI fields this engine does not implement yet: refuse rather than ignore."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value not in (None, 0, 0.0):
            raise invalid_request(f"{name} is not supported by this server yet", name)
    if request.logit_bias:
        raise invalid_request("logit_bias is not supported by this server yet", "logit_bias")


def sampling_params(request: SamplingFields, max_tokens: int, choice: int) -> SamplingParams:
    # Seeded requests with n > 1 give each choice its own (still reproducible) stream.
    seed = None if request.seed is None else request.seed + choice
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=seed,
        stop=request.stop_list(),
        ignore_eos=request.ignore_eos,
    )


@dataclass
class ChoiceResult:
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    pieces: list[str] = field(default_factory=list)


def engine_error(out: RequestOutput) -> APIError:
    return APIError(
        503, out.error or "generation failed", "server_error", None, "engine_error", {"Retry-After": "5"}
    )


async def merged(
    engine: Engine, requests: Sequence[GenerationRequest]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as one stream of (choice index, output).

    Leaving the iteration early (client gone, error) cancels every producer, which aborts
    its engine request.
    """
    if len(requests) == 1:
        stream = engine.generate(requests[0])
        try:
            async for out in stream:
                yield 0, out
        finally:
            await stream.aclose()
        return

    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def produce(index: int, request: GenerationRequest) -> None:
        stream = engine.generate(request)
        try:
            async for out in stream:
                await queue.put((index, out))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(produce(i, r)) for i, r in enumerate(requests)]
    remaining = len(requests)
    try:
        while remaining:
            index, out = await queue.get()
            if out.finished:
                remaining -= 1
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def collect(engine: Engine, requests: Sequence[GenerationRequest]) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in requests]
    async for index, out in merged(engine, requests):
        if out.error is not None or out.finish_reason == "abort":
            raise engine_error(out)
        result = results[index]
        result.pieces.append(out.text)
        result.num_prompt_tokens = out.num_prompt_tokens
        result.num_generated_tokens = out.num_generated_tokens
        if out.finished:
            result.finish_reason = out.finish_reason
            result.text = "".join(result.pieces)
    return results


def build_requests(
    request_id: str, prompts: Sequence[list[int]], request: SamplingFields, max_tokens: Sequence[int]
) -> list[GenerationRequest]:
    """One engine request per (prompt, choice); choice index = prompt_index * n + j."""
    now = time.monotonic()
    return [
        GenerationRequest(
            request_id=f"{request_id}-{p * request.n + j}",
            prompt_token_ids=prompt,
            sampling=sampling_params(request, max_tokens[p], j),
            arrival_time=now,
        )
        for p, prompt in enumerate(prompts)
        for j in range(request.n)
    ]
