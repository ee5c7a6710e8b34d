"""What structured output refuses before compiling, held against the installed xgrammar.

Every JSON-schema keyword the server refuses is one xgrammar would accept and not enforce: for each,
an instance that breaks the keyword (jsonschema says so) is accepted by xgrammar's grammar, so this
list fails, and is corrected, when a new xgrammar starts enforcing one. Schemas as clients write
them (pydantic models, OpenAI strict schemas, tool calls) pass untouched, with no xgrammar warning
(a warning is refused too, in the compile worker). Grammars no text satisfies are told apart from
those some text does.
"""

from __future__ import annotations

import datetime
import enum
import json
import uuid
from typing import Annotated, Literal

import jsonschema
import pydantic
import pytest

from service.engine.guided.language import empty_language
from service.engine.guided.specs import check_spec, unenforced_keyword
from service.engine.protocol import GuidedDecoding

xgrammar = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

# (schema, an instance that breaks the refused keyword, what the refusal names)
IGNORED_BY_XGRAMMAR = [
    ({"type": "string", "not": {"const": "x"}}, '"x"', "'not' at #"),
    ({"type": "string", "if": {"const": "x"}, "then": {"minLength": 3}}, '"x"', "'if' at #"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "[2]", "'contains'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "'uniqueItems'"),
    (
        {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}},
        '{"a": "x"}',
        "'not' at #/properties/a",
    ),
    (
        {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "minLength": 3},
        '"b"',
        "'minLength' beside '$ref'",
    ),
    ({"enum": ["a", "bb"], "minLength": 2}, '"a"', "'minLength' beside 'enum'"),
    ({"const": "a", "maxLength": 0}, '"a"', "'maxLength' beside 'const'"),
    ({"type": "string", "enum": ["a", 1]}, "1", "'type' beside 'enum'"),
    ({"anyOf": [{"type": "string"}], "minLength": 3}, '"b"', "'minLength' beside 'anyOf'"),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [{"required": ["a"]}]},
        '{"a": "x"}',
        "'properties' beside 'allOf'",
    ),
    (
        {"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 1}]},
        "3",
        "'oneOf' (its options may overlap",
    ),
    ({"minLength": 3}, '"b"', "'minLength' in a schema without 'type'"),
    ({"pattern": "^a$"}, '"b"', "'pattern' in a schema without 'type'"),
    ({"minimum": 5}, "1", "'minimum' in a schema without 'type'"),
    ({"minItems": 2}, "[1]", "'minItems' in a schema without 'type'"),
    ({"required": ["a"]}, "{}", "'required' in a schema without 'type'"),
    ({"type": "object", "required": ["a"]}, "{}", "'required' (naming 'a'"),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]},
        '{"a": 1}',
        "naming 'zz'",
    ),
]
# Standard formats xgrammar leaves as any string (jsonschema checks formats only with extra packages).
UNCHECKED_FORMATS = [("iri", '"no pe"'), ("iri-reference", '"no pe"'), ("idn-email", '"nope"'),
                     ("idn-hostname", '"no pe"'), ("regex", '"["')]  # fmt: skip


def _accepts(schema: dict, text: str) -> bool:
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return bool(_is_grammar_accept_string(grammar, text))


@pytest.mark.parametrize(("schema", "breaking", "named"), IGNORED_BY_XGRAMMAR)
def test_each_refused_keyword_is_one_xgrammar_ignores(schema: dict, breaking: str, named: str) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(breaking), schema)
    assert _accepts(schema, breaking), "xgrammar enforces this now: stop refusing it"
    found = unenforced_keyword(schema)
    assert found is not None and named in found, found


@pytest.mark.parametrize(("name", "breaking"), UNCHECKED_FORMATS)
def test_each_refused_format_is_one_xgrammar_ignores(name: str, breaking: str) -> None:
    schema = {"type": "string", "format": name}
    assert _accepts(schema, breaking), "xgrammar enforces this format now: stop refusing it"
    assert unenforced_keyword(schema) == f"'format' {name!r} at #"


def test_the_refusal_is_one_line_naming_keyword_and_place() -> None:
    guided = GuidedDecoding("json_schema", json.dumps({"type": "object", "properties": {"a/b": {"not": {}}}}))
    with pytest.raises(ValueError) as caught:
        check_spec(guided, 65536)
    message = str(caught.value)
    assert "\n" not in message and "'not' at #/properties/a~1b" in message, message


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=40)
    city: str


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int = pydantic.Field(ge=0, le=9)


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    good: bool


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=20)
    age: int = pydantic.Field(ge=0, le=130)
    email: str | None = None
    colour: Colour
    tags: list[str] = pydantic.Field(min_length=1, max_length=3)
    scores: dict[str, int]
    home: Address
    previous: list[Address] = []
    born: datetime.date
    id: uuid.UUID
    pet: Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]
    ratio: float = pydantic.Field(gt=0, lt=1)


ENFORCEABLE = [
    Person.model_json_schema(),
    {  # OpenAI strict mode
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": ["string", "null"], "enum": ["c", "f", None]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    {  # a forced choice of two tool calls (service/api/tools.py)
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": {"type": "object", "properties": {}}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in ("get_weather", "get_time")
        ]
    },
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # a list that may end
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
    {"type": "string", "format": "no-such-format"},  # not a standard format: an annotation
    {"oneOf": [{"type": "string"}, {"type": "integer"}]},
]


@pytest.mark.parametrize("schema", ENFORCEABLE)
def test_schemas_as_clients_write_them_pass(schema: dict, capfd: pytest.CaptureFixture[str]) -> None:
    assert unenforced_keyword(schema) is None
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "Warning" in line]
    # nor would the worker refuse it (a oneOf xgrammar cannot prove disjoint, unenforced_keyword did)
    assert all("oneOf" in line for line in warnings), warnings
    assert empty_language(grammar) is None


@pytest.mark.parametrize(
    ("grammar", "empty"),
    [
        (lambda: xgrammar.Grammar.from_regex(r"a[^\s\S]"), True),
        (lambda: xgrammar.Grammar.from_regex(r"a[^\s\S]|b"), False),
        (lambda: xgrammar.Grammar.from_regex(r"\d{3}-\d{4}"), False),
        (lambda: xgrammar.Grammar.from_ebnf("root ::= root"), True),
        (lambda: xgrammar.Grammar.from_ebnf('root ::= "a" root'), True),
        (lambda: xgrammar.Grammar.from_ebnf('root ::= "a" root | "b"'), False),
        (lambda: xgrammar.Grammar.from_ebnf('root ::= "a"{0,3} [^\\x00-\\U0010ffff]'), True),
        (lambda: xgrammar.Grammar.from_json_schema('{"$ref": "#"}'), True),
        (
            lambda: xgrammar.Grammar.from_json_schema(
                json.dumps(
                    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
                )
            ),
            True,
        ),
        (lambda: xgrammar.Grammar.from_json_schema('{"type": "string", "pattern": "[^\\\\s\\\\S]"}'), True),
        (
            lambda: xgrammar.Grammar.from_json_schema(
                json.dumps(
                    {"type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\s\\S]"}}}
                )
            ),
            False,  # the property is optional: {} satisfies it
        ),
        (
            lambda: xgrammar.Grammar.from_json_schema(
                json.dumps({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]})
            ),
            True,  # every object must hold another, forever
        ),
    ],
)
def test_an_empty_language_is_told(grammar, empty: bool) -> None:
    try:
        built = grammar()
    except RuntimeError as exc:  # xgrammar >= 0.2.9 refuses a $ref chain with nothing in it itself
        assert empty and "Circular $ref chain" in str(exc), exc
        return
    why = empty_language(built)
    assert (why is not None) is empty, why
    if empty:
        assert "can never end" in why


def test_a_grammar_in_a_form_it_does_not_read_is_given_the_benefit_of_the_doubt() -> None:
    class Opaque:
        def serialize_json(self) -> str:
            return '{"something": "else"}'

    assert empty_language(Opaque()) is None
