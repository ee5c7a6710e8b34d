"""What every generation endpoint does around its own work: find the model a request names (or its
LoRA adapter), ask the engine whether it would run the requests, give up when the client leaves,
and record the request on its trace span."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from service.api.errors import APIError, invalid_request, model_not_found
from service.api.schemas import SamplingFields, Usage
from service.api.state import Ready, ServiceState
from service.engine.protocol import ConstraintRefusedError, GenerationRequest, RequestRefusedError
from service.telemetry.tracing import annotate

log = logging.getLogger(__name__)
T = TypeVar("T")


def state_of(request: Request) -> ServiceState:
    return request.app.state.service


def ready_for(state: ServiceState, model: str) -> Ready:
    """The serving model, for `model` naming it or one of its LoRA adapters (else a 404)."""
    ready = state.model
    adapters = ready.adapters if ready is not None else None
    if model != state.served_name and (adapters is None or model not in adapters.names()):
        raise model_not_found(model)
    return state.require_ready()


async def adapter_for(ready: Ready, model: str) -> str | None:
    """The LoRA adapter `model` names (prepared: read into memory off the event loop), or None for
    the base model. An adapter removed since `_ready_for` is a 404."""
    if model == ready.info.served_name or ready.adapters is None:
        return None
    try:
        await asyncio.to_thread(ready.adapters.prepare, model)
    except KeyError:
        raise model_not_found(model) from None
    return model


async def check_requests(
    ready: Ready, requests: list[GenerationRequest], constraint_param: str | None = None
) -> None:
    """400 for what the serving engine would refuse, before anything is admitted or streamed; a
    refused structured-output constraint names `constraint_param`, the field that carried it."""
    for request in requests:
        try:
            await ready.engine.check(request)
        except ConstraintRefusedError as exc:
            raise invalid_request(str(exc), constraint_param) from None
        except RequestRefusedError as exc:
            raise invalid_request(str(exc), None) from None


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, or, when the client disconnects first, `work` cancelled (which aborts its
    engine requests: an answer nobody will read is not generated to the end) and a 499."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
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


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def check_prompt_logprobs(body: SamplingFields, ready: Ready) -> None:
    """400 for prompt_logprobs the server cannot give (vLLM refuses them when streaming too)."""
    if body.prompt_logprobs is None:
        return
    if body.stream:
        raise invalid_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    if not ready.info.engine.features.prompt_logprobs:
        raise invalid_request("prompt_logprobs are not supported by this server's engine", "prompt_logprobs")


def running_usage(num_prompt: int, completion_tokens: int) -> Usage:
    """vLLM's continuous_usage_stats: each chunk's choice's tokens so far."""
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=completion_tokens,
        total_tokens=num_prompt + completion_tokens,
    )


def trace_request(operation: str, body: SamplingFields, response_id: str,
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


def trace_result(totals: Usage, finish_reasons: list[str | None]) -> None:
    annotate(
        {
            "gen_ai.usage.input_tokens": totals.prompt_tokens,
            "gen_ai.usage.output_tokens": totals.completion_tokens,
            "gen_ai.response.finish_reasons": [r or "" for r in finish_reasons],
        }
    )
