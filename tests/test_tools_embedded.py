"""Tool calls on the default (embedded) model, out of the box, over HTTP with the official client.

SmolLM2-135M-Instruct's own chat template renders no tools; the server ships a Hermes-style
tool_use template for it (service/text/templates/smollm2_tool_use.jinja), so `tool_choice:
required` and a named function work with no setting: the grammar makes the call, which must
parse, name an offered function and carry arguments that validate against its schema, streamed
and not. Without tools the conversation renders exactly as the model's own template renders it.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from service.config_loading import load_settings
from service.serving import embedded_tool_template, use_chat_templates
from service.store.model_store import embedded_model_path
from service.text.chat_template import ChatTemplate
from service.text.tokenizer import Tokenizer
from tests.conftest import EMBEDDED_NAME, start_server, wait_ready

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Osaka"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": name.replace("_", " "), "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]


def test_the_tool_template_renders_like_the_models_own_without_tools() -> None:
    own = Tokenizer.from_gguf(embedded_model_path()).templates["default"]
    tools = ChatTemplate(embedded_tool_template())
    for messages in (
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
    ):
        for prompt in (True, False):
            assert tools.render(messages, prompt) == ChatTemplate(own).render(messages, prompt)
    rendered = tools.render([{"role": "user", "content": "Hi"}], True, None, tools=TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]) in rendered and "<tool_call>" in rendered


def test_the_tool_template_follows_the_models_template_not_how_it_was_named() -> None:
    """Issue 44: the embedded GGUF served by path answered a tools request with 400 "this model's
    chat template does not render tools"; the shipped template goes with SmolLM2's own template."""
    settings = load_settings(sources={})
    smollm2 = Tokenizer.from_gguf(embedded_model_path())
    use_chat_templates(settings, smollm2)
    assert smollm2.templates["tool_use"] == embedded_tool_template()
    other = Tokenizer.from_gguf(embedded_model_path())
    other.replace_templates({"default": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    use_chat_templates(settings, other)
    assert "tool_use" not in other.templates


def test_the_embedded_gguf_served_by_path_takes_tools(tmp_path) -> None:
    """Served by its path (under the file's stem as its name), the same model answers a forced call."""
    proc = start_server(tmp_path / "server.log", args=[str(embedded_model_path())])
    try:
        wait_ready(proc)
        [card] = httpx.get(f"{proc.base_url}/v1/models", timeout=10).json()["data"]
        assert card["id"] == embedded_model_path().stem
        reply = _client(proc).chat.completions.create(
            model=card["id"],
            messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            max_tokens=60,
            temperature=0,
        )
        [call] = reply.choices[0].message.tool_calls or []
        _check(call, set(SCHEMAS))
    finally:
        proc.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check(call, allowed: set[str]) -> None:
    assert call.type == "function" and call.id and call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_required_and_named_calls_work_on_the_default_model(server, stream: bool, choice: object) -> None:
    client = _client(server)
    allowed = {"get_time"} if isinstance(choice, dict) else set(SCHEMAS)
    messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    kwargs = {"model": EMBEDDED_NAME, "messages": messages, "tools": TOOLS, "tool_choice": choice}
    kwargs.update(max_tokens=60, temperature=0)
    if not stream:
        reply = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        first = reply.choices[0]
        assert first.finish_reason == "tool_calls" and not first.message.content, first
        [call] = first.message.tool_calls or []
        _check(call, allowed)
        return
    chunks = list(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    [call] = [t for d in deltas for t in (d.tool_calls or [])]
    _check(call, allowed)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tools_reach_the_prompt_and_a_round_trip_renders(server) -> None:
    """The tools are in what the model sees (the prompt grows by their description), and a
    conversation carrying a call and its result is accepted."""
    body = {"model": EMBEDDED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    plain = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).json()
    with_tools = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={**body, "tools": TOOLS}, timeout=60
    ).json()
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50
    client = _client(server)
    messages: list[dict] = [{"role": "user", "content": "Time in Tokyo?"}]
    first = client.chat.completions.create(
        model=EMBEDDED_NAME,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=60,  # type: ignore[arg-type]
    )
    [call] = first.choices[0].message.tool_calls or []
    messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"time": "09:00"}'})
    reply = client.chat.completions.create(
        model=EMBEDDED_NAME,
        messages=messages,
        tools=TOOLS,
        max_tokens=20,  # type: ignore[arg-type]
    )
    message = reply.choices[0].message
    assert message.tool_calls is None or len(message.tool_calls) > 0


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "answer"}}])
def test_parameters_that_are_not_an_object_schema_are_refused(server, choice: object) -> None:
    """As OpenAI refuses them (issue 43): arguments are an object of named values, so a string
    schema could never be met; the grammar used to force `"arguments": "Paris"`, which the parser
    then failed to read, and the answer came back as prose with no tool_calls."""
    tool = {"type": "function", "function": {"name": "answer", "parameters": {"type": "string"}}}
    body = {
        "model": EMBEDDED_NAME,
        "messages": [{"role": "user", "content": "The capital of France?"}],
        "tools": [tool],
        "tool_choice": choice,
        "max_tokens": 16,
    }
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools.0.function.parameters", error
    assert "'type: \"object\"'" in error["message"] and "got 'type: \"string\"'" in error["message"], error
