"""POST /v1/responses: OpenAI's Responses API on chat's engine path (service.api.chat.run).

A request is checked field by field against service.api.request_fields (a field it does not
honour is a 400 naming it), translated into the chat completion it runs as (service.api.responses
.items), prepared and run as chat completions are -- the chat template, the operator's limits,
admission, metering, the abort when the client leaves -- and its answer read back as output items:
the thinking as a `reasoning` item (with a reasoning parser), the text as a `message`, each tool
call as a `function_call` whose `call_id` a `function_call_output` answers. A 400 from the chat
path names this body's field (`max_output_tokens`, not `max_completion_tokens`). `stream: true`
sends the events of service.api.responses.stream. GET, DELETE and cancel of a response, and
`previous_response_id`, read the bounded store (service.api.responses.store), when it is on.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request

from service.api.chat.run import ChatRun, prepare
from service.api.common import ready_for, state_of
from service.api.errors import invalid_request, params_renamed
from service.api.generation import new_id
from service.api.request_fields import check_request
from service.api.responses.items import (
    assistant_turn,
    chat_request,
    conversation,
    echoed_tools,
    output_items,
    responses_param,
    with_instructions,
)
from service.api.responses.protocol import (
    DeletedResponse,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from service.api.responses.store import STORE_OFF, ResponseStore
from service.api.responses.stream import ResponseStream
from service.api.schemas import Usage


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses_store


async def create_response(body: ResponsesRequest, request: Request) -> Any:
    """The response to `body`: a ResponseObject, or its events (SSE)."""
    ready = ready_for(state_of(request), body.model)
    check_request("responses", body)
    store = store_of(request)
    if body.store and not store.enabled:
        raise invalid_request(f"store is true, but {STORE_OFF}", "store")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = store.get(body.previous_response_id, "previous_response_id").conversation
    with params_renamed(responses_param):
        turns = conversation(body, history)
        chat = chat_request(body, with_instructions(turns, body.instructions))
        response_id = new_id("resp")
        run = await prepare(ready, chat, request, response_id)
    skeleton = _skeleton(body, response_id, run)

    def keep(response: ResponseObject) -> None:
        if body.store:
            store.put(response.model_dump(mode="json"), [*turns, assistant_turn(response.output)])

    if body.stream:
        stream = ResponseStream(run, skeleton, _streamed_usage, keep)
        return run.stream(stream.events(), stream.failed)
    results = await run.results(request)
    message, finish = run.answer.message(results[0].text, results[0].finish_reason)
    cut = finish == "length"
    output = output_items(message, cut, run.answer.reasoning)
    update: dict[str, Any] = {"output": output, "usage": response_usage(run.whole_usage(results))}
    if cut:
        update |= {
            "status": "incomplete",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens"),
        }
    else:
        update |= {"status": "completed", "completed_at": int(time.time())}
    response = skeleton.model_copy(update=update)
    keep(response)
    return response


def _skeleton(body: ResponsesRequest, response_id: str, run: ChatRun) -> ResponseObject:
    """The response as it starts: in progress, no output, the request's settings echoed."""
    sampled = run.body
    reasoning = {"effort": None, "summary": None, **(body.reasoning or {})}
    return ResponseObject(
        id=response_id,
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        metadata=body.metadata or {},
        model=body.model,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        reasoning=reasoning,
        store=bool(body.store),
        temperature=1.0 if sampled.temperature is None else sampled.temperature,
        text={"format": {"type": "text"}, **(body.text or {})},
        tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
        tools=echoed_tools(body.tools),
        top_p=1.0 if sampled.top_p is None else sampled.top_p,
        user=body.user,
        safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key,
    )


def response_usage(totals: Usage) -> ResponseUsage:
    cached = totals.prompt_tokens_details.cached_tokens if totals.prompt_tokens_details else 0
    reasoning = totals.completion_tokens_details.reasoning_tokens if totals.completion_tokens_details else 0
    return ResponseUsage(
        input_tokens=totals.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=totals.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
        total_tokens=totals.total_tokens,
    )


def _streamed_usage(run: ChatRun) -> ResponseUsage:
    return response_usage(run.streamed_usage())


def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    return store_of(request).get(response_id).response


def delete_response(response_id: str, request: Request) -> DeletedResponse:
    store_of(request).delete(response_id)
    return DeletedResponse(id=response_id)


def cancel_response(response_id: str, request: Request) -> None:
    """Only a background response can be cancelled, and none runs in the background here."""
    store_of(request).get(response_id)
    raise invalid_request("Cannot cancel a synchronous response: it has finished already", "response_id")
