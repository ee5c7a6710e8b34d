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

import httpx
import jsonschema
import openai
import pytest

from service.api.errors import APIError
from service.api.tools import ToolSpec, detect_parser, tool_spec
from service.text.chat_template import ChatTemplate
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
        '<tool_call>{"name": "get_time", "arguments": ' + "[" * 100_000 + "</tool_call>",  # past json's depth
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
    template = ChatTemplate(TEMPLATE)
    assert tool_spec(TOOLS, "none", None, template, None, True) is None
    with pytest.raises(APIError, match="does not render tools in a format"):
        tool_spec(TOOLS, "auto", None, ChatTemplate("{{ tools }}{{ messages }}"), None, True)
    with pytest.raises(APIError, match="not among the tools"):
        tool_spec(TOOLS, {"type": "function", "function": {"name": "nope"}}, None, template, None, True)
    with pytest.raises(APIError, match=r"is \{type: function, function: \{name\}\}"):
        tool_spec(TOOLS, {"type": "function", "function": "get_time"}, None, template, None, True)
    with pytest.raises(APIError, match="NIM_ENABLE_AUTO_TOOL_CHOICE=0"):
        tool_spec(TOOLS, "auto", None, template, None, False)
    with pytest.raises(APIError, match="tool_choice needs tools"):
        tool_spec(None, "required", None, template, None, True)
    required = tool_spec(TOOLS, "required", None, template, None, True)
    assert required is not None and required.guided() is not None
    assert required.guided().prefix == "<tool_call>\n"  # type: ignore[union-attr]


def test_a_template_that_never_reads_tools_refuses_them_even_with_a_configured_parser() -> None:
    blind = ChatTemplate("{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}")  # markers, no tools
    for configured in (None, "hermes"):
        with pytest.raises(
            APIError, match="does not render tools, so the model would never see them"
        ) as info:
            tool_spec(TOOLS, "auto", None, blind, configured, True)  # type: ignore[arg-type]
        assert info.value.param == "tools"
    assert tool_spec(TOOLS, "none", None, blind, "hermes", True) is None  # no tools in play: nothing to show


def test_parameters_are_an_object_schema_or_none() -> None:
    template = ChatTemplate(TEMPLATE)
    for parameters in (None, {}, {"type": "object"}):
        function = {"name": "f"} if parameters is None else {"name": "f", "parameters": parameters}
        spec = tool_spec([{"type": "function", "function": function}], "required", None, template, None, True)
        assert spec is not None and spec.functions["f"]["type"] == "object"
    for parameters in ({"type": "string"}, {"properties": {"a": {}}}, ["a"]):
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        with pytest.raises(APIError, match="Invalid schema for function 'f'") as info:
            tool_spec([tool], "auto", None, template, None, True)
        assert info.value.param == "tools.0.function.parameters"


def test_duplicate_function_names_are_refused() -> None:
    with pytest.raises(APIError, match="two tools are named 'get_time'") as info:
        tool_spec([*TOOLS, TOOLS[1]], "auto", None, ChatTemplate(TEMPLATE), None, True)
    assert info.value.param == "tools.2.function.name"


def test_a_single_call_is_stopped_at_its_end_under_hermes_and_trimmed_elsewhere() -> None:
    one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'  # as the stop string left it
    single = _spec("hermes", parallel=False)
    assert single.stop == ("</tool_call>",)
    assert _spec("hermes").stop == () and _spec("hermes", "required", parallel=False).stop == ()
    assert _spec("llama3_json", parallel=False).stop == () and _spec("mistral", parallel=False).stop == ()
    content, calls = single.parse("Checking. " + one)
    assert content == "Checking." and [c.name for c in calls] == ["get_time"]
    assert _spec("hermes").parse(one) == (one, [])  # unterminated, and no stop string ended it
    assert single.parse('<tool_call>{"name": "get_time", "argu') == (
        '<tool_call>{"name": "get_time", "argu',
        [],
    )
    two = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]'
    assert len(_spec("mistral", parallel=False).parse(two)[1]) == 1


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


def _two_calls_regex() -> tuple[str, str]:
    """Two hermes calls as the answer, forced by a regex (random weights never call on their own),
    and the text of the first call alone."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    escaped = "".join("\\" + ch if ch in "\\.^$*+?{}[]|()" else ch for ch in call).replace("\n", "\\n")
    return escaped + "\\n" + escaped, call


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_stops_after_the_first_call(server, stream: bool) -> None:
    """Not one call kept and the rest generated and dropped: generation ends with the first call."""
    regex, first = _two_calls_regex()
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "What time is it in UTC and CET?"}],
        "tools": TOOLS,
        "guided_regex": regex,
        "max_tokens": 400,
        "stream_options": {"include_usage": True} if stream else None,
    }
    for parallel, expected in ((True, 2), (False, 1)):
        kwargs = {**body, "parallel_tool_calls": parallel}
        if not stream:
            reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=kwargs, timeout=120).json()
            choice = reply["choices"][0]
            calls, finish, used = choice["message"]["tool_calls"], choice["finish_reason"], reply["usage"]
        else:
            with httpx.stream(
                "POST", f"{server.base_url}/v1/chat/completions", json={**kwargs, "stream": True}, timeout=120
            ) as r:
                chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
            deltas = [c["choices"][0] for c in chunks if c["choices"]]
            calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
            finish, used = deltas[-1]["finish_reason"], chunks[-1]["usage"]
            assert not "".join(d["delta"].get("content") or "" for d in deltas)
        assert finish == "tool_calls" and len(calls) == expected, (parallel, calls)
        assert all(json.loads(c["function"]["arguments"]) == {"zone": "UTC"} for c in calls)
        if not parallel:  # the byte-level vocabulary: about one token per byte of the first call
            assert used["completion_tokens"] <= len(first.encode()) + 2, used


def test_duplicate_tool_names_are_a_400_naming_the_name(server) -> None:
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [TOOLS[0], TOOLS[1], {"type": "function", "function": {"name": "get_time"}}],
        "max_tokens": 4,
    }
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "get_time" in error["message"] and error["param"] == "tools.2.function.name"


def test_deeply_nested_parameters_are_never_a_500(server) -> None:
    for depth in (300, 600, 900):  # the last nears what the request's JSON parser reads
        parameters: dict = {"type": "string"}
        for _ in range(depth):
            parameters = {"type": "array", "items": parameters}
        parameters = {"type": "object", "properties": {"x": parameters}}  # arguments are an object
        tool = {"type": "function", "function": {"name": "deep", "parameters": parameters}}
        for choice in ("auto", "required"):
            body = {
                "model": NAME,
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [tool],
                "tool_choice": choice,
                "max_tokens": 2,
            }
            response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
            assert response.status_code in (200, 400), (depth, choice, response.text)


def test_a_call_cut_by_max_tokens_is_dropped_not_returned_as_content() -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    hermes = _spec("hermes")
    assert hermes.parse('Let me check.\n<tool_call>\n{"name": "get_ti', cut=True) == ("Let me check.", [])
    assert hermes.parse('<tool_call>\n{"name": "get_ti', cut=True) == (None, [])
    assert hermes.parse("Let me check.<tool_c", cut=True) == ("Let me check.", [])  # a marker cut short
    content, calls = hermes.parse(f"Sure.{call}\n<tool_call>\n{{", cut=True)
    assert content == "Sure." and [c.name for c in calls] == ["get_time"]  # the finished call is kept
    assert hermes.parse("Just words, cut", cut=True) == ("Just words, cut", [])
    assert hermes.parse('<tool_call>\n{"name": "get_ti') == ('<tool_call>\n{"name": "get_ti', [])  # not cut
    forced = _spec("hermes", choice="required", parallel=False)
    assert forced.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Li', cut=True) == (
        None,
        [],
    )

    llama = _spec("llama3_json")
    finished = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert llama.parse('<|python_tag|>{"name": "get_time", "param', cut=True) == (None, [])
    assert llama.parse('  {"na', cut=True) == (None, [])
    content, calls = llama.parse(finished + '; {"name": "get_weather", "parameters": {"ci', cut=True)
    assert content is None and [c.name for c in calls] == ["get_time"]
    assert llama.parse("{ is how a set starts", cut=True) == ("{ is how a set starts", [])  # not a call

    mistral = _spec("mistral")
    assert mistral.parse('[TOOL_CALLS][{"name": "get_time", "arguments": {"zo', cut=True) == (None, [])
    assert mistral.parse("Hello [TOOL_CA", cut=True) == ("Hello", [])


def test_a_streamed_call_cut_by_max_tokens_sends_nothing_of_it() -> None:
    from service.api.tools import ToolStream

    stream = ToolStream(_spec("hermes"))
    sent = "".join(stream.feed(p) for p in ["Checking. ", "<tool_call>\n", '{"name": "get_time", "argu'])
    assert sent == "Checking. " and stream.finish(cut=True) == (None, [])
    short = ToolStream(_spec("hermes"))
    assert short.feed("Checking. <tool") == "Checking. " and short.finish(cut=True) == (None, [])
    words = ToolStream(_spec("hermes"))
    assert words.feed("A long answer <to") == "A long answer " and words.finish(cut=False) == ("<to", [])
    llama = ToolStream(_spec("llama3_json"))
    assert llama.feed('{"name": "get_time", "parameters": {"zone": ') == ""
    assert llama.finish(cut=True) == (None, [])


# ---------------------------------------------------------------------------------------------
# pythonic (Llama 3.2 / Llama 4): `[name(arg=literal, ...)]`
# ---------------------------------------------------------------------------------------------

# A ChatML template (so the embedded model can be served with it) that renders tools the way vLLM's
# tool_chat_template_llama3.2_pythonic.jinja does: the format spelled out with func_name1(...).
PYTHONIC_TEMPLATE = (
    "<|im_start|>system\n"
    "{%- if tools %}You have access to the following functions. To call functions, please respond with a "
    "python list of the calls. Respond in the format [func_name1(params_name1=params_value1, "
    "params_name2=params_value2...), func_name2(params)] Do not use variables.\n\n"
    "{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{% endif %}"
    "You are a helpful assistant.<|im_end|>\n"
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}<|im_start|>assistant\n["
    "{%- for c in m.tool_calls %}{{ c.function.name }}("
    "{%- for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}"
    "{% if not loop.last %}, {% endif %}"
    "{%- endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}<|im_start|>assistant\n"
)


def test_pythonic_calls_parse_with_literals_only() -> None:
    spec = _spec("pythonic")
    content, calls = spec.parse("[get_weather(city=\"Lima\", days=2), get_time(zone='UTC')]")
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Lima", "days": 2}),
        ("get_time", {"zone": "UTC"}),
    ]
    nested = spec.parse('<|python_tag|>[get_time(zone="CET", extra=[1, (2, 3), {"a": None, "b": True}])]')[1]
    assert json.loads(nested[0].arguments) == {"zone": "CET", "extra": [1, [2, 3], {"a": None, "b": True}]}
    for bad in (
        '[get_time(zone=__import__("os").getcwd())]',  # a call as a value: never evaluated
        "[get_time(zone=UTC)]",  # a name, not a literal
        "[get_weather(days=1 + 1)]",  # an expression
        '[get_time("UTC")]',  # positional
        "[get_time(**{'zone': 'UTC'})]",
        "[os.system(cmd='ls')]",  # not a plain name
        '[launch_rockets(when="now")]',  # not offered
        "[get_time(zone={1, 2})]",  # a set has no JSON
        "[get_time(zone=1e999)]",  # inf has no JSON
        "[]",
        'get_time(zone="UTC")',  # not a list
        'Sure: [get_time(zone="UTC")]',  # text first: content (the format is the whole answer)
        "[" * 500 + "]" * 500,
    ):
        assert spec.parse(bad) == (bad, []), bad
    assert spec.parse('[get_time(zone="UTC"), get_weather(city="Li', cut=True) == (None, [])
    assert _spec("pythonic", parallel=False).parse('[get_time(zone="UTC"), get_time(zone="CET")]')[1][
        0
    ].name == ("get_time")


def test_pythonic_is_recognised_and_streamed_calls_are_held_back() -> None:
    from service.api.tools import ToolStream

    assert detect_parser(PYTHONIC_TEMPLATE) == "pythonic"
    template = ChatTemplate(PYTHONIC_TEMPLATE)
    spec = tool_spec(TOOLS, "auto", None, template, None, True)
    assert spec is not None and spec.parser == "pythonic"
    stream = ToolStream(_spec("pythonic"))
    assert "".join(stream.feed(p) for p in [" [get_t", 'ime(zone="UTC")', "]"]) == ""
    content, calls = stream.finish()
    assert content is None and [c.name for c in calls] == ["get_time"]
    dashed = [{"type": "function", "function": {"name": "get-time", "parameters": TIME}}]
    assert tool_spec(dashed, "auto", None, template, None, True) is not None  # it can never be called
    with pytest.raises(APIError, match="cannot spell 'get-time'"):
        tool_spec(dashed, "required", None, template, None, True)
    keyword = [
        {
            "type": "function",
            "function": {"name": "convert", "parameters": {"type": "object", "properties": {"from": {}}}},
        }
    ]
    with pytest.raises(APIError, match="cannot spell 'from'"):
        tool_spec(keyword, {"type": "function", "function": {"name": "convert"}}, None, template, None, True)
    words = ToolStream(_spec("pythonic"))
    assert words.feed("It is [noon]") == "It is [noon]"  # an answer that starts with words is content
    odd = ToolStream(_spec("pythonic"))
    assert odd.feed("[citation needed]") == "" and odd.finish() == ("[citation needed]", [])


def test_the_pythonic_grammar_accepts_calls_and_refuses_the_rest() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    guided = _spec("pythonic", choice="required").guided()
    assert guided is not None and guided.kind == "grammar"
    grammar = xgrammar.Grammar.from_ebnf(guided.spec)
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "</s>"]
    info = xgrammar.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(grammar)

    def accepts(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return (
            matcher.accept_string(text) and matcher.accept_token(len(vocab) - 1) and matcher.is_terminated()
        )

    for good in (
        '[get_weather(city="Paris", days=3)]',
        '[get_time(zone="UTC")]',
        '[get_weather(city="Lima", days=-1)]',
    ):
        assert accepts(good), good
        assert _spec("pythonic").parse(good)[1], good
    for bad in (
        '[get_weather(city="Rome", days=3)]',  # not in the enum
        '[get_time(zone="UTC"), get_time(zone="UTC")]',  # one call only
        "[get_time()]",  # a required argument missing
        '[get_weather(days=3, city="Paris")]',  # required ones first, in the schema's order
        "[get_time(zone=UTC)]",
    ):
        assert not accepts(bad), bad


@pytest.fixture(scope="module")
def pythonic_server(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("pythonic")
    (directory / "pythonic.jinja").write_text(PYTHONIC_TEMPLATE)
    env = {"NIM_CHAT_TEMPLATE": str(directory / "pythonic.jinja")}
    with serving(directory / "server.log", env) as process:
        yield process


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_pythonic_call_comes_back_as_tool_calls(pythonic_server, stream: bool) -> None:
    """The embedded model served with a pythonic template: the grammar writes `[get_weather(...)]`,
    which is parsed into tool_calls whose arguments validate."""
    from tests.conftest import EMBEDDED_NAME

    client = _client(pythonic_server)
    kwargs = {
        "model": EMBEDDED_NAME,
        "messages": [{"role": "user", "content": "What will the weather be in Lima in 3 days?"}],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40,
        "temperature": 0,
    }
    if not stream:
        reply = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        [call] = reply.choices[0].message.tool_calls or []
    else:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not "".join(d.content or "" for d in deltas)
        [call] = [t for d in deltas for t in (d.tool_calls or [])]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    _check_call(call, {"get_weather"})
