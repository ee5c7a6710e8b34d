"""Tool calling: the parsers on model output, and the round trip over HTTP with the official client.

The HTTP tests serve a tiny float32 checkpoint whose chat template renders tools in the Hermes
format (`<tool_call>` blocks); its random weights never call a tool on their own, so `required`
and a named function (enforced by a grammar) are what make calls here: the call must parse, name
an offered function and carry arguments that validate against its parameters, streamed and not.
`auto` must never answer with an empty tool_calls list. The parsers are checked on the outputs
of each family (hermes, llama3_json, mistral), malformed ones included.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from service.api.errors import APIError
from service.api.tools import ToolSpec, detect_parser, tool_spec
from tests.test_quantization import _byte_level_tokenizer, serving
from tests.test_tensor_parallel import _checkpoint

NAME = "tiny-tools"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Osaka"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TEMPLATE = (
    "{%- if tools %}system: you may call {{ tools | map(attribute='function.name') | join(', ') }}\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>\n"
    '{%- elif m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n'
    "{%- else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{%- endfor %}assistant:"
)


def _spec(parser: str, choice: str = "auto", parallel: bool = True) -> ToolSpec:
    return ToolSpec(parser, SCHEMAS, choice, parallel)  # type: ignore[arg-type]


def test_hermes_calls_parse_and_malformed_ones_stay_content() -> None:
    spec = _spec("hermes")
    call = '{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}'
    text = f"Let me check.\n<tool_call>\n{call}\n</tool_call>"
    content, calls = spec.parse(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Lima", "days": 2})
    ]
    two = text + '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    assert len(spec.parse(two)[1]) == 2 and len(_spec("hermes", parallel=False).parse(two)[1]) == 1
    for bad in (
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        "no call at all",
    ):
        assert spec.parse(bad) == (bad, [])


def test_llama3_and_mistral_calls_parse() -> None:
    llama = _spec("llama3_json")
    content, calls = llama.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "CET"})
    ]
    one = '{"name": "get_time", "parameters": {"zone": "CET"}}'
    multi = f"{one}; {one}"
    assert len(llama.parse(multi)[1]) == 2
    assert llama.parse('{"name": "get_time", "parameters": {"zone": "CET"}} and more')[1] == []
    mistral = _spec("mistral")
    _, calls = mistral.parse(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}]'
    )
    assert [c.name for c in calls] == ["get_weather"]
    assert mistral.parse("[TOOL_CALLS][{broken")[1] == []


def test_the_format_is_recognised_from_the_template_and_bad_requests_are_400s() -> None:
    assert detect_parser(TEMPLATE) == "hermes"
    assert detect_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert tool_spec(TOOLS, "none", None, TEMPLATE, None, True) is None
    with pytest.raises(APIError, match="does not render tools"):
        tool_spec(TOOLS, "auto", None, "{{ messages }}", None, True)
    with pytest.raises(APIError, match="not among the tools"):
        tool_spec(TOOLS, {"type": "function", "function": {"name": "nope"}}, None, TEMPLATE, None, True)
    with pytest.raises(APIError, match="NIM_ENABLE_AUTO_TOOL_CHOICE=0"):
        tool_spec(TOOLS, "auto", None, TEMPLATE, None, False)
    with pytest.raises(APIError, match="tool_choice needs tools"):
        tool_spec(None, "required", None, TEMPLATE, None, True)
    required = tool_spec(TOOLS, "required", None, TEMPLATE, None, True)
    assert required is not None and required.guided() is not None
    assert required.guided().prefix == "<tool_call>\n"  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("tools") / NAME
    _checkpoint(directory, vocab_size=256, max_position_embeddings=1024)
    _byte_level_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    env = {"NIM_MODEL_NAME": str(directory), "NIM_MODEL_PROFILE": "torch-generic-fp32-tp1-pp1-throughput"}
    with serving(tmp_path_factory.mktemp("tools-log") / "server.log", env) as process:
        yield process


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call, allowed: set[str]) -> dict:
    assert call.type == "function" and call.id and call.function.name in allowed
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_required_and_named_calls_always_parse(server, stream: bool, choice: object) -> None:
    client = _client(server)
    allowed = {"get_weather"} if isinstance(choice, dict) else set(SCHEMAS)
    messages = [{"role": "user", "content": "What will the weather be in Lima?"}]
    for seed in range(3):
        kwargs = {"model": NAME, "messages": messages, "tools": TOOLS, "tool_choice": choice}
        kwargs.update(max_tokens=160, temperature=1.0, seed=seed)
        if not stream:
            reply = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
            choice0 = reply.choices[0]
            assert choice0.finish_reason == "tool_calls", choice0
            [call] = choice0.message.tool_calls or []
            _check_call(call, allowed)
            continue
        chunks = list(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not "".join(d.content or "" for d in deltas)  # nothing streamed as content
        [call] = [t for d in deltas for t in (d.tool_calls or [])]
        assert call.index == 0
        _check_call(call, allowed)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_tool_round_trip_and_auto_never_answers_an_empty_list(server) -> None:
    client = _client(server)
    messages: list[dict] = [{"role": "user", "content": "Weather in Osaka for 3 days?"}]
    first = client.chat.completions.create(
        model=NAME,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=160,  # type: ignore[arg-type]
    )
    [call] = first.choices[0].message.tool_calls or []
    messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'})
    for _ in range(2):
        reply = client.chat.completions.create(
            model=NAME,
            messages=messages,
            tools=TOOLS,
            max_tokens=40,  # type: ignore[arg-type]
        )
        message = reply.choices[0].message
        assert message.tool_calls is None or len(message.tool_calls) > 0
        if message.tool_calls is None:
            assert reply.choices[0].finish_reason in ("stop", "length") and message.content is not None
        else:
            assert reply.choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model=NAME, messages=messages, tools=TOOLS, max_tokens=4,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip


def test_streamed_text_is_held_back_only_where_a_call_may_start() -> None:
    from service.api.tools import ToolStream

    stream = ToolStream(_spec("hermes"))
    pieces = [
        "Let me ",
        "check.<tool",
        "_call>\n",
        '{"name": "get_time", ',
        '"arguments": {"zone": "UTC"}}',
        "\n</tool_call>",
    ]
    sent = "".join(stream.feed(p) for p in pieces)
    assert sent == "Let me check."  # "<tool" was held until it turned out to be the marker
    content, calls = stream.finish()
    assert content is None and [c.name for c in calls] == ["get_time"]
    plain = ToolStream(_spec("hermes"))
    assert "".join(plain.feed(p) for p in ["a <tool", "box> b"]) == "a <toolbox> b"  # not a marker after all
    broken = ToolStream(_spec("hermes"))
    assert broken.feed("<tool_call>{oops") == "" and broken.finish() == ("<tool_call>{oops", [])
    llama = ToolStream(_spec("llama3_json"))
    assert llama.feed('{"name": "get_time", "parameters": {"zone": "CET"}}') == ""
    assert [c.name for c in llama.finish()[1]] == ["get_time"]
    words = ToolStream(_spec("llama3_json"))
    assert words.feed("Hello {") == "Hello {"  # an answer that starts with words is content
