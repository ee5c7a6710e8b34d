"""One rule for request fields, held by one table (service.api.request_fields), over real HTTP.

Every row of the table is walked against a real server on both endpoints it belongs to: a
refused field (or a refused value of a field honoured for some values) is a 400 whose `param`
names it; an honoured one is a 200; a field the table does not list is refused as OpenAI refuses
it. vLLM's `structured_outputs` constrains the answer for each of its kinds. A fifth stop string
and an image part get messages that say so. docs/api.md's request-field table is the table's rendering.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from service.api import request_fields
from service.api.chat.protocol import ChatCompletionRequest
from service.api.completions.protocol import CompletionRequest
from service.api.request_fields import FIELDS, Endpoint, RequestField, fields_for, lookup
from service.api.schemas import (
    NVExt,
    SamplingFields,
    StreamOptions,
    StructuredOutputs,
)
from tests.conftest import EMBEDDED_NAME, ServerProcess, start_server, wait_ready

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
# A template that reads what the template-layer fields pass it, so they are honoured on any model.
TEMPLATE = (
    "{% if reasoning_effort %}[{{ reasoning_effort }}]{% endif %}{% if enable_thinking is defined %}"
    "[{{ enable_thinking }}]{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "assistant:"
)
# What an honoured example needs beside it to be a request that can succeed (rows by name).
COMPANIONS: dict[str, dict[str, Any]] = {
    "top_logprobs": {"logprobs": True},
    "tools": {"tool_choice": "none"},
    "tool_choice": {"tools": TOOLS},
    "parallel_tool_calls": {"tools": TOOLS, "tool_choice": "none"},
    "reasoning_effort": {"chat_template": TEMPLATE},
    "chat_template_kwargs": {"chat_template": TEMPLATE},
}
# What a refused example needs beside it to be refused.
REFUSED_COMPANIONS: dict[str, dict[str, Any]] = {
    "spaces_between_special_tokens": {"skip_special_tokens": False},
    "tools.N.function.strict": {"tool_choice": "auto"},
}
# The valid objects a walked row's example is put into (by the row's top-level name); `N` rows
# go into the list's first item.
NESTED_BASES: dict[str, Any] = {
    "tools": TOOLS,
    "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
}
# Fields of structured_outputs other than the constraints need a constraint beside them.
SO_CONSTRAINT = {"choice": ["yes", "no"]}
STRUCTURED_OUTPUTS_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
OVERRIDES: dict[str, Any] = {"model": EMBEDDED_NAME}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # A short context: a request whose max_tokens is null (test_null_is_never_refused) generates to
    # the end of the context unless the model stops, which took over two minutes on a slow host.
    env = {"NIM_TRUST_REQUEST_CHAT_TEMPLATE": "1", "NIM_MAX_MODEL_LEN": "384"}
    proc = start_server(tmp_path_factory.mktemp("request_fields") / "server.log", env=env)
    try:
        wait_ready(proc)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def base_body(endpoint: Endpoint) -> dict[str, Any]:
    body: dict[str, Any] = {"model": EMBEDDED_NAME, "max_tokens": 2, "temperature": 0}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Say hi."}]
    else:
        body["prompt"] = "Hello"
    return body


def request_with(endpoint: Endpoint, row: RequestField, value: Any, refused: bool = False) -> dict[str, Any]:
    """A request sending `value` for `row` (inside its object for a dotted name, in the first item
    of a list for `N`)."""
    body = base_body(endpoint)
    value = OVERRIDES.get(row.name, value)
    companions = REFUSED_COMPANIONS if refused else COMPANIONS
    parent, *path = row.name.split(".")
    body.update(companions.get(parent, {}))
    body.update(companions.get(row.name, {}) if path else {})
    if not path:
        body[row.name] = value
        return body
    inner = json.loads(json.dumps(NESTED_BASES.get(parent, {})))
    if parent == "structured_outputs" and path[0] not in STRUCTURED_OUTPUTS_CONSTRAINTS:
        inner = {**SO_CONSTRAINT, **inner}
    cursor = inner
    for key in path[:-1]:
        cursor = cursor[0] if key == "N" else cursor.setdefault(key, {})
    cursor[path[-1]] = value
    body[parent] = inner
    return body


def sent_as(row: RequestField) -> str:
    """Where `request_with` sends a row's value: its name, the first item for `N`."""
    return row.name.replace(".N.", ".0.")


def post(http: httpx.Client, endpoint: Endpoint, body: dict[str, Any]) -> httpx.Response:
    return http.post(PATHS[endpoint], json=body)


def test_the_table_lists_every_field_the_schemas_declare() -> None:
    """A field the request models read is a row of the table, on each endpoint whose model reads it."""
    models: list[tuple[Endpoint, type[SamplingFields]]] = [
        ("chat", ChatCompletionRequest),
        ("completions", CompletionRequest),
    ]
    nested = {"stream_options": StreamOptions, "nvext": NVExt, "structured_outputs": StructuredOutputs}
    for endpoint, model in models:
        for name, info in model.model_fields.items():
            assert lookup(endpoint, info.alias or name) is not None, (endpoint, name)
        for parent, sub in nested.items():
            for name, info in sub.model_fields.items():
                assert lookup(endpoint, f"{parent}.{info.alias or name}") is not None, (
                    endpoint,
                    parent,
                    name,
                )
    names = [(endpoint, row.name) for row in FIELDS for endpoint in row.endpoints]
    assert len(names) == len(set(names)), "a field is listed twice for one endpoint"
    for row in FIELDS:
        assert row.example is not None or row.kind == "partly", row.name
        if row.kind == "partly":
            body = REFUSED_COMPANIONS.get(row.name, {})
            assert row.refusal(row.refused_example, body) is not None, row.name
        if row.kind != "honoured":
            assert row.why and "\n" not in row.why, row.name


WALK = [(endpoint, row) for endpoint in PATHS for row in fields_for(endpoint)]
REFUSED = [pytest.param(e, r, id=f"{e}:{r.name}") for e, r in WALK if r.kind != "honoured"]
HONOURED = [pytest.param(e, r, id=f"{e}:{r.name}") for e, r in WALK if r.kind != "refused"]


@pytest.mark.parametrize(("endpoint", "row"), REFUSED)
def test_every_refused_field_and_value_is_a_400_naming_it(
    http: httpx.Client, endpoint: Endpoint, row: RequestField
) -> None:
    value = row.example if row.kind == "refused" else row.refused_example
    response = post(http, endpoint, request_with(endpoint, row, value, refused=True))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == sent_as(row), error
    assert sent_as(row) in error["message"] and error["type"] == "invalid_request_error", error
    assert "\n" not in error["message"]


@pytest.fixture(scope="module")
def request_templates(http: httpx.Client) -> bool:
    """Whether the server renders a request's own chat_template (the template work of issue 30)."""
    body = {**base_body("chat"), "chat_template": "{{ 'word ' * 40 }}", "max_tokens": 1}
    response = post(http, "chat", body)
    return response.status_code == 200 and response.json()["usage"]["prompt_tokens"] >= 40


@pytest.mark.parametrize(("endpoint", "row"), HONOURED)
def test_every_honoured_field_and_value_succeeds(
    http: httpx.Client, request_templates: bool, endpoint: Endpoint, row: RequestField
) -> None:
    body = request_with(endpoint, row, row.example)
    if "chat_template" in body and not request_templates:
        pytest.skip("this server does not render a request's chat_template yet")
    response = post(http, endpoint, body)
    assert response.status_code == 200, response.text
    if body.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text
        assert '"error"' not in response.text, response.text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_null_is_never_refused(http: httpx.Client, endpoint: Endpoint) -> None:
    """null means "not sent" for every optional field (the official client sends some)."""
    required = {"model", "messages", "prompt"}
    body = base_body(endpoint)
    names = [row.name for row in fields_for(endpoint)]
    body.update({name: None for name in names if "." not in name and name not in required})
    for parent in ("stream_options", "nvext"):
        body[parent] = {n.split(".")[1]: None for n in names if n.startswith(parent + ".")}
    response = post(http, endpoint, body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("endpoint", "patch", "name"),
    [
        ("chat", {"frobnicate": 1}, "frobnicate"),
        ("completions", {"frobnicate": "x"}, "frobnicate"),
        ("completions", {"tools": TOOLS}, "tools"),  # a chat field on completions
        ("completions", {"max_completion_tokens": 2}, "max_completion_tokens"),
        ("chat", {"suffix": "x"}, "suffix"),  # a completions field on chat
        ("chat", {"nvext": {"frobnicate": 1}}, "nvext.frobnicate"),
        ("chat", {"stream_options": {"frobnicate": True}}, "stream_options.frobnicate"),
        (
            "completions",
            {"structured_outputs": {"regex": "a", "frobnicate": 1}},
            "structured_outputs.frobnicate",
        ),
        ("chat", {"guided_frobnicate": "x"}, "guided_frobnicate"),
        # one level deeper (issue 43): content parts, tools, tool_choice, response_format, tool calls
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "zz": 1}]}]},
            "messages.0.content.0.zz",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "No", "text": "a"}]}]},
            "messages.0.content.0.text",
        ),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f", "yy": 1}}], "tool_choice": "none"},
            "tools.0.function.yy",
        ),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}, "yy": 1}]}, "tools.0.yy"),
        (
            "chat",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time", "xx": 1}}},
            "tool_choice.function.xx",
        ),
        ("chat", {"response_format": {"type": "json_object", "ww": 1}}, "response_format.ww"),
        ("completions", {"response_format": {"type": "json_object", "ww": 1}}, "response_format.ww"),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "vv": 1}}},
            "response_format.json_schema.vv",
        ),
        (
            "chat",
            {
                "messages": [
                    {"role": "user", "content": "What time is it?"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_time", "arguments": "{}", "uu": 1},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": "09:00"},
                ]
            },
            "messages.1.tool_calls.0.function.uu",
        ),
    ],
)
def test_an_unknown_field_is_refused_as_openai_refuses_it(
    http: httpx.Client, endpoint: Endpoint, patch: dict[str, Any], name: str
) -> None:
    response = post(http, endpoint, {**base_body(endpoint), **patch})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == f"Unrecognized request argument supplied: {name}"
    assert error["param"] == name


def test_the_official_client_sees_a_refusal_as_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=EMBEDDED_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            service_tier="flex",
        )
    assert info.value.param == "service_tier" and "one service tier" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=EMBEDDED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, store=True
        )
    assert info.value.param == "store"
    reply = client.chat.completions.create(
        model=EMBEDDED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, store=False,
        service_tier="auto", logit_bias=None, stream_options=None, metadata={"team": "a"}, user="u",
    )  # fmt: skip
    assert reply.choices[0].finish_reason in ("stop", "length")


# --- structured_outputs ----------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    # Bounded, so a sampled answer of the 135M model ends within max_tokens (an unbounded integer
    # may run on in digits at temperature 1)
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_outputs_constrain_the_answer(client: openai.OpenAI) -> None:
    def chat(
        spec: dict[str, Any], prompt: str, max_tokens: int = 60, seed: int = 0
    ) -> tuple[str, str | None]:
        reply = client.chat.completions.create(
            model=EMBEDDED_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=1.0, seed=seed, extra_body={"structured_outputs": spec},
        )  # fmt: skip
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason

    text, finish = chat({"json": SCHEMA}, "Describe a person.")
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    text, _ = chat({"json": json.dumps(SCHEMA)}, "Describe a person.", seed=1)  # a schema as a string
    jsonschema.validate(json.loads(text), SCHEMA)
    for seed in range(2):
        text, _ = chat({"regex": r"[0-9]{3}-[0-9]{4}"}, "A phone number:", max_tokens=12, seed=seed)
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
        text, _ = chat({"choice": ["red", "green", "blue"]}, "A colour:", max_tokens=6, seed=seed)
        assert text in ("red", "green", "blue"), text
        text, _ = chat({"grammar": 'root ::= "yes" | "no" | "maybe"'}, "Raining?", max_tokens=6, seed=seed)
        assert text in ("yes", "no", "maybe"), text
    text, finish = chat({"json_object": True}, "Some JSON please.", max_tokens=40)
    if finish == "stop":
        assert isinstance(json.loads(text), dict), text
    reply = client.completions.create(
        model=EMBEDDED_NAME, prompt="My favourite colour is", max_tokens=6, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )  # fmt: skip
    assert reply.choices[0].text in ("red", "green")


@pytest.mark.parametrize(
    ("patch", "param", "message"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice", "not several"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex", "not several"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs.regex",
            "not several",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "needs one of"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
        ({"structured_outputs": {"json": "{no"}}, "structured_outputs.json", "not valid JSON"),
        (
            {"structured_outputs": {"regex": "a", "backend": "outlines"}},
            "structured_outputs.backend",
            "xgrammar",
        ),
    ],
)
def test_structured_outputs_take_exactly_one_constraint(
    http: httpx.Client, patch: dict[str, Any], param: str, message: str
) -> None:
    response = post(http, "chat", {**base_body("chat"), **patch})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


# --- The two messages the issue names --------------------------------------------------------------


def test_a_fifth_stop_string_names_the_limit(http: httpx.Client, client: openai.OpenAI) -> None:
    for endpoint in PATHS:
        response = post(http, endpoint, {**base_body(endpoint), "stop": ["a", "b", "c", "d", "e"]})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "stop" and "at most 4 stop sequences" in error["message"], error
    with pytest.raises(openai.BadRequestError, match="at most 4 stop sequences"):
        client.completions.create(
            model=EMBEDDED_NAME, prompt="Hi", max_tokens=2, stop=["1", "2", "3", "4", "5"]
        )


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            "images are not supported",
        ),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio is not supported"),
        ({"type": "file", "file": {"file_id": "file-1"}}, "files are not supported"),
        ({"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}, "video is not supported"),
        ({"type": "hologram"}, 'content part type "hologram" is not supported'),
    ],
)
def test_a_non_text_part_says_what_is_not_supported(
    client: openai.OpenAI, part: dict[str, Any], message: str
) -> None:
    content = [{"type": "text", "text": "What is this?"}, part]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=EMBEDDED_NAME, messages=[{"role": "user", "content": content}], max_tokens=2
        )  # type: ignore[misc]
    assert message in info.value.message, info.value.message
    assert info.value.param == "messages.0.content.1"


def test_text_and_refusal_parts_are_read(client: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Say no."}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": [{"type": "text", "text": "Again."}]},
    ]
    reply = client.chat.completions.create(model=EMBEDDED_NAME, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens > 10


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("colour", "blue", "Unrecognized request argument supplied: messages.1.colour"),
        ("function_call", {"name": "f", "arguments": "{}"}, "deprecated by OpenAI"),
        ("audio", {"id": "audio-1"}, "audio is not supported"),
    ],
)
def test_a_message_field_the_template_does_not_get_is_refused(
    http: httpx.Client, field: str, value: Any, message: str
) -> None:
    body = {
        **base_body("chat"),
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", field: value},
            {"role": "user", "content": "Again"},
        ],
    }
    response = post(http, "chat", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == f"messages.1.{field}", error


@pytest.mark.parametrize(
    ("messages", "param", "message"),
    [
        (
            [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "09:00"}],
            "messages.1.tool_call_id",
            "messages.1.tool_call_id is required",
        ),
        (
            [{"role": "user", "content": "Hi", "tool_call_id": "call_1"}],
            "messages.0.tool_call_id",
            "not read on a user message",
        ),
        (
            [{"role": "user", "content": "Hi", "tool_calls": []}],
            "messages.0.tool_calls",
            "not read on a user message",
        ),
    ],
    ids=["tool-without-call-id", "call-id-on-user", "tool-calls-on-user"],
)
def test_a_message_field_is_required_or_refused_by_role(
    http: httpx.Client, messages: list[dict[str, Any]], param: str, message: str
) -> None:
    """A tool result names its call, as OpenAI requires; a field only some roles carry to the
    template is refused on the others, not dropped (issue 43)."""
    response = post(http, "chat", {**base_body("chat"), "messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "refusal"])
def test_an_assistant_messages_thinking_and_refusal_reach_the_template(
    http: httpx.Client, field: str
) -> None:
    """Shown by a request template that prints each message's content and reasoning_content: the
    prompt grows by the words the field carries (a refusal stands in for missing content)."""
    template = "{% for m in messages %}{{ m.content }} {{ m.reasoning_content or '' }} {% endfor %}"

    def prompt_tokens(extra: dict[str, Any]) -> int:
        assistant = {"role": "assistant", "content": "" if field == "refusal" else "Hello", **extra}
        body = {
            **base_body("chat"),
            "chat_template": template,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi"}, assistant, {"role": "user", "content": "Go"}],
        }
        response = post(http, "chat", body)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens"])

    words = " ".join(["thinking"] * 12)
    assert prompt_tokens({field: words}) >= prompt_tokens({}) + 10  # about a token a word


# --- docs/api.md -----------------------------------------------------------------------------------

START, END = "<!-- request-fields:start -->", "<!-- request-fields:end -->"


def test_the_api_doc_shows_the_table() -> None:
    text = API_DOC.read_text()
    assert START in text and END in text, "docs/api.md lost its request-field markers"
    shown = text[text.index(START) + len(START) : text.index(END)]
    assert shown.strip() == request_fields.markdown_table().strip()
