"""Structured output over HTTP with the official client, on the embedded model (xgrammar).

100 generations against a set of JSON schemas (nested objects, enums, arrays with bounds, numbers
with bounds, required fields), requested concurrently so constrained and unconstrained rows share
batches, must all parse and validate (jsonschema); choice and regex requests always conform;
json_object answers parse; bad schemas, regexes and grammars are 400s naming the problem, and the
server serves on. A request cut short by max_tokens reports finish_reason "length". Constraints no
text can satisfy, and JSON schemas asking for what xgrammar would not enforce, are 400s naming the
constraint or keyword, on chat and completions, streamed or not (never a stream that fails later).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import EMBEDDED_NAME

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"type": "string", "enum": ["France", "Japan", "Peru", "Kenya"]},
            "population_millions": {"type": "number", "minimum": 0, "maximum": 40},
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 1,
                "maxItems": 3,
            },
            "done": {"type": "boolean"},
        },
        "required": ["title", "tags", "done"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "status": {"type": "string", "enum": ["open", "shipped", "closed"]},
                },
                "required": ["id", "status"],
                "additionalProperties": False,
            },
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["order", "priority"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    "Describe a person.",
    "Tell me about a big city.",
    "Make a to-do item.",
    "Report on an order.",
    "Write some JSON.",
]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client: openai.OpenAI, prompt: str, **extra: object):
    return client.chat.completions.create(
        model=EMBEDDED_NAME, messages=[{"role": "user", "content": prompt}], **extra
    )


def test_a_hundred_generations_match_their_schemas(client: openai.OpenAI) -> None:
    jobs = [(SCHEMAS[i % len(SCHEMAS)], PROMPTS[i % len(PROMPTS)], i) for i in range(100)]

    def run(job: tuple[dict, str, int]) -> tuple[dict, str, str | None]:
        schema, prompt, i = job
        reply = _chat(
            client,
            prompt,
            max_tokens=120,
            temperature=0.8,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
        )
        choice = reply.choices[0]
        return schema, choice.message.content or "", choice.finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    for schema, text, finish in results:
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), schema)


def test_choices_regexes_and_json_objects_conform(client: openai.OpenAI) -> None:
    choices = ["red", "green", "blue"]
    for seed in range(6):
        reply = client.completions.create(
            model=EMBEDDED_NAME, prompt="My favourite colour is", max_tokens=8, temperature=1.0, seed=seed,
            extra_body={"nvext": {"guided_choice": choices}},
        )  # fmt: skip
        assert reply.choices[0].text in choices and reply.choices[0].finish_reason == "stop"
    pattern = r"\d{3}-\d{3}-\d{4}"
    for seed in range(4):
        reply = client.completions.create(
            model=EMBEDDED_NAME, prompt="Call me at", max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"guided_regex": pattern},
        )  # fmt: skip
        assert re.fullmatch(pattern, reply.choices[0].text), reply.choices[0].text
    grammar = 'root ::= "yes" | "no" | "maybe"'
    reply = _chat(client, "Is it raining?", max_tokens=5, extra_body={"nvext": {"guided_grammar": grammar}})
    assert reply.choices[0].message.content in ("yes", "no", "maybe")
    reply = _chat(client, "Some JSON please.", max_tokens=60, response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    # streamed, the pieces join into a conforming answer
    stream = _chat(
        client, "Describe a person.", max_tokens=80, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[0])


def test_a_constrained_answer_cut_short_says_length(client: openai.OpenAI) -> None:
    reply = _chat(
        client, "Tell me about a big city.", max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[1]}},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"guided_regex": "[a-"}, "invalid regular expression"),
        ({"nvext": {"guided_grammar": "root ::= "}}, "invalid grammar"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
            "invalid JSON schema",
        ),
        (
            {"guided_choice": ["a"], "ignore_eos": True},
            "ignore_eos cannot be combined with structured output",
        ),
    ],
)
def test_what_does_not_compile_is_a_400_and_serving_goes_on(
    client: openai.OpenAI, extra: dict, message: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model=EMBEDDED_NAME, prompt="x", max_tokens=4, extra_body=extra)
    assert client.completions.create(model=EMBEDDED_NAME, prompt="x", max_tokens=2).choices


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        ("{}", True),
        ('{\n  "a": [1, "x"],\n  "b": {"c": null}\n}', True),
        ('["an array"]', False),  # JSON, but OpenAI's JSON mode promises an object
        ('"a string"', False),
        ("42", False),
    ],
)
def test_json_object_mode_admits_objects_only(text: str, accepted: bool) -> None:
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from service.engine.guided.specs import JSON_OBJECT_SCHEMA

    grammar = xgrammar.Grammar.from_json_schema(JSON_OBJECT_SCHEMA)
    assert _is_grammar_accept_string(grammar, text) is accepted


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


REFUSED = [
    ({"guided_regex": "a[^\\s\\S]"}, "the regular expression admits no token sequence"),
    ({"nvext": {"guided_grammar": "root ::= root"}}, "the grammar admits no token sequence"),
    # A $ref chain with nothing in it: found empty here, or (xgrammar >= 0.2.9) refused by xgrammar.
    ({"guided_json": {"$ref": "#"}}, ("the JSON schema admits no token sequence", "Circular $ref chain")),
    (
        {"nvext": {"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                   "$ref": "#/$defs/a"}}},
        ("rules that can never end: defs_a, defs_b", "Circular $ref chain"),
    ),
    (_schema({"type": "object", "properties": {"code": {"type": "string", "pattern": "[^\\s\\S]"}},
              "required": ["code"]}), "the JSON schema admits no token sequence"),
    (_schema({"type": "string", "not": {"const": "x"}}), "keyword 'not' at #"),
    (_schema({"allOf": [{"type": "string"}, {"type": "integer"}]}), "allOf with multiple options"),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "'uniqueItems'"),
    ({"guided_json": {"type": "number", "multipleOf": 0.5}}, "multipleOf is not supported for type:number"),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("extra", "message"), REFUSED)
def test_what_no_text_satisfies_or_xgrammar_would_ignore_is_a_400(
    base_url: str, extra: dict, message: str | tuple[str, ...], path: str, stream: bool
) -> None:
    body: dict = {"model": EMBEDDED_NAME, "max_tokens": 4, "stream": stream, **extra}
    if path == "/v1/completions":
        body["prompt"] = "Say something:"
    else:
        body["messages"] = [{"role": "user", "content": "Say something."}]
    with httpx.Client(base_url=base_url, timeout=120) as client:
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        told = (message,) if isinstance(message, str) else message
        assert any(m in error["message"] for m in told), error["message"]
        assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
        assert error["param"] == _constraint_field(extra)  # issue 44: it was null
        assert client.get("/v1/health/ready").status_code == 200


def _constraint_field(extra: dict) -> str:
    [(key, value)] = extra.items()
    return f"nvext.{next(iter(value))}" if key == "nvext" else key


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ("required", "tools"),
        ({"type": "function", "function": {"name": "pick"}}, "tools.1.function.parameters"),
    ],
    ids=["required", "named"],
)
def test_a_forced_calls_refused_schema_is_named(base_url: str, choice: object, param: str) -> None:
    """The grammar of a forced call enforces the tools' parameters: its refusal names them."""
    unique = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    tools = [
        {"type": "function", "function": {"name": name, "parameters": unique}} for name in ("other", "pick")
    ]
    body = {"model": EMBEDDED_NAME, "max_tokens": 4, "tools": tools, "tool_choice": choice,
            "messages": [{"role": "user", "content": "Pick."}]}  # fmt: skip
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "'uniqueItems'" in error["message"] and error["param"] == param, error
