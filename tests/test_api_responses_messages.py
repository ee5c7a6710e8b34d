"""POST /v1/responses and /v1/messages over a real server, with the real SDKs (issue 39).

One server (an API key set, the Responses store on) serves every test here: `openai`
(responses.create, .stream, .parse, a function tool round trip with function_call_output, the
store), the OpenAI Agents SDK (an agent answers; an agent calls a function tool and finishes,
streamed), and `anthropic` (messages.create, .stream, a tool_use round trip, count_tokens, errors,
x-api-key). Streams are validated event by event against the SDKs' own types. Every refused row
of request_fields' tables for the two endpoints is a 400 naming it; an unknown field is refused
as chat refuses one. Small answers (constrained where the SDK needs a finished response).
"""

from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from anthropic import types as anthropic_types
from openai.types import responses as openai_types
from pydantic import BaseModel

from service.api.request_fields import Endpoint, RequestField, fields_for
from service.api.responses.store import ResponseStore
from tests.conftest import EMBEDDED_NAME, ServerProcess, start_server, wait_ready

KEY = "test-key-39"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": WEATHER,
    "strict": True,
}
YES_NO = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


class YesNo(BaseModel):
    answer: typing.Literal["yes", "no"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # One grammar worker: every constrained answer here reuses it (and its compiled grammars)
    env = {"NIM_API_KEY": KEY, "NIM_RESPONSES_STORE_MAX_COUNT": "4", "NIM_GUIDED_COMPILE_WORKERS": "1"}
    proc = start_server(tmp_path_factory.mktemp("responses") / "server.log", env=env)
    try:
        wait_ready(proc)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.base_url, timeout=120, headers=headers) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def _classes_by_type(union: Any) -> dict[str, type[BaseModel]]:
    """The SDK's stream-event union, by each event class's `type` literal (the union's own
    discriminator is SDK metadata pydantic does not use)."""
    out = {}
    for cls in typing.get_args(typing.get_args(union)[0]):
        for literal in typing.get_args(cls.model_fields["type"].annotation):
            out[literal] = cls
    return out


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def validated(events: list[tuple[str, dict[str, Any]]], union: Any) -> None:
    """Each event against its own SDK class, its fields all known to that class."""
    classes = _classes_by_type(union)
    for name, data in events:
        assert name == data["type"], (name, data)
        cls = classes[data["type"]]
        cls.model_validate(data)
        assert set(data) <= set(cls.model_fields), (data["type"], set(data) - set(cls.model_fields))


# --- Responses ---------------------------------------------------------------------------------


def test_a_response_is_the_sdks_response(http: httpx.Client, client: openai.OpenAI) -> None:
    body = {
        "model": EMBEDDED_NAME,
        "input": "Say hi.",
        "instructions": "Be brief.",
        "max_output_tokens": 3,
        "temperature": 0,
        "metadata": {"team": "a"},
        "user": "u-1",
        "store": False,
        "include": [],
    }
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    parsed = openai_types.Response.model_validate(data)
    assert set(data) - set(openai_types.Response.model_fields) == {"store"}  # OpenAI's, not in the type
    assert parsed.status == "incomplete" and parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.output_text and parsed.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert parsed.usage is not None and parsed.usage.output_tokens == 3 and parsed.usage.input_tokens > 5
    assert parsed.metadata == {"team": "a"} and parsed.user == "u-1" and parsed.temperature == 0
    sdk = client.responses.create(
        model=EMBEDDED_NAME, input=[{"role": "user", "content": "Hi"}], max_output_tokens=2
    )
    assert sdk.object == "response" and sdk.output_text


def test_a_streamed_response_is_the_sdks_events(http: httpx.Client, client: openai.OpenAI) -> None:
    # greedy: sampled, the model may end before its 3 tokens (this endpoint takes no ignore_eos)
    body = {
        "model": EMBEDDED_NAME,
        "input": "Say hi.",
        "max_output_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response.read().decode())
    validated(events, openai_types.ResponseStreamEvent)
    kinds = [data["type"] for _, data in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.incomplete" and "response.output_text.done" in kinds
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    with client.responses.stream(
        model=EMBEDDED_NAME, input="Is the sky blue?", max_output_tokens=20, text_format=YesNo
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_parsed is not None
    assert "".join(deltas) == final.output_text


def test_parse_follows_the_schema(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=EMBEDDED_NAME, input="Is water wet?", text_format=YesNo, max_output_tokens=20
    )
    assert parsed.status == "completed" and parsed.output_parsed is not None
    assert parsed.output_parsed.answer in ("yes", "no")


def test_a_function_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=EMBEDDED_NAME,
        input="What is the weather in Paris?",
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=40,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Lima")
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'},
    ]
    second = client.responses.create(model=EMBEDDED_NAME, input=history, tools=[TOOL], max_output_tokens=4)  # type: ignore[arg-type, list-item]
    assert second.output_text and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model=EMBEDDED_NAME,
            max_output_tokens=2,
            input=[  # type: ignore[arg-type]
                {"type": "function_call_output", "call_id": "call_unknown", "output": "x"}
            ],
        )
    assert info.value.param == "input.0.call_id"


def test_the_store_keeps_a_response_for_the_next_turn(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=EMBEDDED_NAME, input="My name is Ada.", max_output_tokens=2, store=True
    )
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=EMBEDDED_NAME, input="What is my name?", max_output_tokens=2, previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + 4
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=EMBEDDED_NAME, input="Hi", previous_response_id=first.id)
    assert info.value.param == "previous_response_id"


def test_the_store_is_bounded_by_count_and_bytes() -> None:
    store = ResponseStore(max_count=2, max_bytes=400)
    for i in range(3):
        assert store.put({"id": f"r{i}", "output": []}, [{"role": "user", "content": "x"}])
    assert len(store) == 2 and store.get("r2") and store.get("r1")
    assert not store.put({"id": "big", "output": ["x" * 500]}, [])
    store.put({"id": "r3", "output": ["y" * 340]}, [])
    assert len(store) == 1  # the bytes bound dropped the oldest
    off = ResponseStore(max_count=0, max_bytes=1)
    with pytest.raises(Exception, match="not stored on this server"):
        off.get("r1")


def test_agents_answer_and_call_a_tool(server: ServerProcess) -> None:
    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        return json.dumps({"city": city, "temp_c": 21})

    async def run() -> tuple[Any, Any, list[str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
        model = OpenAIResponsesModel(model=EMBEDDED_NAME, openai_client=client)
        settings = ModelSettings(max_tokens=24, temperature=0)
        plain = Agent(
            name="plain",
            instructions="Answer yes or no.",
            model=model,
            output_type=YesNo,
            model_settings=settings,
        )
        answered = await Runner.run(plain, "Is the sky blue?")
        tooled = Agent(
            name="tooled",
            instructions="Use tools.",
            model=model,
            tools=[get_weather],
            output_type=YesNo,
            model_settings=ModelSettings(max_tokens=40, temperature=0, tool_choice="required"),
        )
        streamed = Runner.run_streamed(tooled, "Is it warm in Paris?", max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        return answered, streamed, kinds

    answered, streamed, kinds = asyncio.run(run())
    assert isinstance(answered.final_output, YesNo)
    assert isinstance(streamed.final_output, YesNo)
    items = [item.type for item in streamed.new_items]
    assert "tool_call_item" in items and "tool_call_output_item" in items, items
    assert "raw_response_event" in kinds


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "a"},
                            {"type": "input_image", "image_url": "x"},
                        ],
                    }
                ]
            },
            "input.0.content.1",
        ),
        ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input.0"),
        ({"input": [{"role": "user", "content": "a", "zz": 1}]}, "input.0.zz"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        (  # refused by the engine's constraint check, named as the field that carried it
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "n",
                        "schema": {"type": "number", "multipleOf": 2},
                    }
                }
            },
            "text.format",
        ),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_output_tokens": 10**7}, "max_output_tokens"),
    ],
)
def test_a_responses_field_not_honoured_is_a_400_naming_it(
    http: httpx.Client, patch: dict[str, Any], param: str
) -> None:
    response = http.post("/v1/responses", json={"model": EMBEDDED_NAME, "input": "Hi", **patch})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


# --- Every refused row of both endpoints ---------------------------------------------------------

BASES: dict[Endpoint, tuple[str, dict[str, Any]]] = {
    "responses": ("/v1/responses", {"model": EMBEDDED_NAME, "input": "Hi", "max_output_tokens": 1}),
    "messages": (
        "/v1/messages",
        {"model": EMBEDDED_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
    ),
    "count_tokens": (
        "/v1/messages/count_tokens",
        {"model": EMBEDDED_NAME, "messages": [{"role": "user", "content": "Hi"}]},
    ),
}
# The valid objects a nested row's value goes into, by endpoint (OpenAI's, or Anthropic's).
NESTED: dict[bool, dict[str, Any]] = {
    True: {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"}},
    False: {
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f"},
    },
}
REFUSED = [(e, r) for e in BASES for r in fields_for(e) if r.kind != "honoured"]


def refused_body(endpoint: Endpoint, row: RequestField) -> dict[str, Any]:
    body = json.loads(json.dumps(BASES[endpoint][1]))
    value = row.example if row.kind == "refused" else row.refused_example
    parent, *path = row.name.split(".")
    if not path:
        return {**body, parent: value}
    inner = json.loads(json.dumps(NESTED[endpoint == "responses"].get(parent, {})))
    cursor = inner
    for key in path[:-1]:
        cursor = cursor[0] if key == "N" else cursor.setdefault(key, {})
    cursor[path[-1]] = value
    return {**body, parent: inner}


def test_every_refused_row_is_a_400_naming_it(http: httpx.Client) -> None:
    for endpoint, row in REFUSED:
        path, _ = BASES[endpoint]
        response = http.post(path, json=refused_body(endpoint, row))
        assert response.status_code == 400, (endpoint, row.name, response.text)
        param = row.name.replace(".N.", ".0.")
        body = response.json()
        if endpoint == "responses":
            assert body["error"]["param"] == param, (row.name, body)
        else:
            assert body["type"] == "error" and param in body["error"]["message"], (row.name, body)


# --- Messages ----------------------------------------------------------------------------------


def test_a_message_is_the_sdks_message(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=EMBEDDED_NAME,
        max_tokens=3,
        system="Be brief.",
        messages=[{"role": "user", "content": "Say hi."}],
        metadata={"user_id": "u-1"},
        extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9},
    )
    assert message.type == "message" and message.content[0].type == "text"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    count = claude.messages.count_tokens(
        model=EMBEDDED_NAME, system="Be brief.", messages=[{"role": "user", "content": "Say hi."}]
    )
    assert count.input_tokens == message.usage.input_tokens


def test_a_stop_sequence_is_named(http: httpx.Client) -> None:
    body = {
        "model": EMBEDDED_NAME,
        "max_tokens": 30,
        "temperature": 0,
        "stop_sequences": [" ", "\n"],
        "messages": [{"role": "user", "content": "Write a long sentence about cats."}],
    }
    whole = http.post("/v1/messages", json=body).json()
    assert whole["stop_reason"] == "stop_sequence" and whole["stop_sequence"] in (" ", "\n"), whole
    assert not whole["content"] or not whole["content"][0]["text"].endswith(whole["stop_sequence"])
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        events = sse_events(response.read().decode())
    delta = next(data for _, data in events if data["type"] == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": whole["stop_sequence"]}
    streamed = "".join(d["delta"].get("text", "") for _, d in events if d["type"] == "content_block_delta")
    assert streamed == "".join(b["text"] for b in whole["content"])


def test_a_streamed_message_is_the_sdks_events(http: httpx.Client, claude: anthropic.Anthropic) -> None:
    body = {
        "model": EMBEDDED_NAME,
        "max_tokens": 3,
        "stream": True,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    with http.stream("POST", "/v1/messages", json=body) as response:
        events = sse_events(response.read().decode())
    validated(events, anthropic_types.RawMessageStreamEvent)
    kinds = [data["type"] for _, data in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    # Greedy: the Messages API samples at temperature 1 by default, and a sampled end of turn
    # within 3 tokens would make the stop reason end_turn.
    with claude.messages.stream(
        model=EMBEDDED_NAME,
        max_tokens=3,
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={"temperature": 0},
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.content[0].text == text  # type: ignore[union-attr]


def test_a_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tools = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER}]
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(
        model=EMBEDDED_NAME,
        max_tokens=40,
        tools=tools,
        tool_choice={"type": "any"},  # type: ignore[arg-type]
        messages=messages,
    )
    assert first.stop_reason == "tool_use", first
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Lima")  # type: ignore[index]
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21C"}]},
    ]
    second = claude.messages.create(model=EMBEDDED_NAME, max_tokens=3, tools=tools, messages=messages)  # type: ignore[arg-type]
    assert second.usage.input_tokens > first.usage.input_tokens
    with (
        claude.messages.stream(
            model=EMBEDDED_NAME,
            max_tokens=40,
            tools=tools,
            tool_choice={"type": "any"},  # type: ignore[arg-type]
            messages=messages[:1],
        ) as stream
    ):
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"


def test_errors_are_anthropics_and_x_api_key_is_accepted(
    server: ServerProcess, claude: anthropic.Anthropic
) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model=EMBEDDED_NAME,
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}],
                }
            ],
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "messages.0.content.0" in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(
            model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    body = {"model": EMBEDDED_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    assert (
        httpx.post(
            f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60
        ).status_code
        == 200
    )
    denied = httpx.post(
        f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=60
    )
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    missing = httpx.post(
        f"{server.base_url}/v1/messages", json={**body, "max_tokens": None}, headers={"x-api-key": KEY}
    )
    assert missing.status_code == 400 and missing.json()["type"] == "error"
