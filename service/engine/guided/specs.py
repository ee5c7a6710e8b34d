"""What a structured-output spec may be, told before anything compiles: its size, the JSON-schema
keywords xgrammar would accept and silently not enforce; the xgrammar Grammar a spec becomes; and
the errors a refused spec gets."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from service.engine.protocol import GuidedDecoding


class GrammarError(ValueError):
    """A schema, regex, grammar or choice list that is refused (it does not compile, cannot be
    enforced, admits no text, or is over a limit); the message says why, in one line."""


class GuidedUnavailableError(RuntimeError):
    """xgrammar is not installed, or its compile worker cannot start: no structured output."""


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


# response_format json_object: any object (arbitrary properties and values), never an array or scalar.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


# --- What a spec may be, told before compiling ------------------------------------------------


def spec_bytes(guided: GuidedDecoding) -> int:
    """The size NIM_MAX_GUIDED_SPEC_BYTES limits: the spec and any literal text around it, in UTF-8."""
    return sum(
        len(text.encode("utf-8", "surrogatepass")) for text in (guided.spec, guided.prefix, guided.suffix)
    )


def check_spec(guided: GuidedDecoding, max_bytes: int) -> None:
    """GrammarError when `guided` is over the size limit, or is a JSON schema that asks for what
    xgrammar would not enforce. Cheap: runs before any compile."""
    name = NAMES[guided.kind]
    size = spec_bytes(guided)
    if size > max_bytes:
        raise GrammarError(
            f"the {name} is {size} bytes, over NIM_MAX_GUIDED_SPEC_BYTES={max_bytes}; make it smaller"
        )
    if guided.kind != "json_schema":
        return
    try:
        schema = json.loads(guided.spec)
    except RecursionError:
        raise GrammarError("invalid JSON schema: nested too deeply") from None
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None
    found = unenforced_keyword(schema)
    if found is not None:
        raise GrammarError(
            f"JSON schema keyword {found} is not enforced by structured output (xgrammar would "
            "ignore it): remove it or say it another way"
        )


# Keywords xgrammar accepts and ignores wherever they are (checked against the installed version
# by tests/test_guided_keywords.py, which fails when one starts being enforced).
_NEVER_ENFORCED = ("not", "if", "then", "else", "contains", "$dynamicRef", "$recursiveRef")
# Standard formats xgrammar treats as any string (it enforces the others it knows: date-time,
# date, time, duration, email, hostname, ipv4, ipv6, uri, uri-reference, uuid, ...). Formats
# outside the standard are annotations, as JSON Schema says, and pass.
_UNENFORCED_FORMATS = frozenset({"iri", "iri-reference", "idn-email", "idn-hostname", "regex"})
# xgrammar reads the first of these a schema has and drops that schema's other assertions.
_BRANCHES = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_ASSERTIONS = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
        "uniqueItems", "contains", "items", "prefixItems", "additionalItems", "unevaluatedItems",
        "maxProperties", "minProperties", "required", "dependentRequired", "dependencies",
        "dependentSchemas", "properties", "patternProperties", "additionalProperties",
        "unevaluatedProperties", "propertyNames", "allOf", "anyOf", "oneOf", "$ref",
    }
)  # fmt: skip
# Bounds xgrammar applies only once it knows the instance's type: from `type`, or, for arrays and
# objects, from `items` / `prefixItems` and `properties` / `additionalProperties`.
_TYPED = ("pattern", "minLength", "maxLength", "format", "minimum", "maximum", "exclusiveMinimum",
          "exclusiveMaximum", "multipleOf")  # fmt: skip
_ARRAY_BOUNDS = ("minItems", "maxItems")
_OBJECT_BOUNDS = ("required", "minProperties", "maxProperties", "patternProperties", "propertyNames",
                  "dependentRequired", "dependentSchemas")  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "unevaluatedItems",
                  "unevaluatedProperties", "propertyNames", "contains", "not", "if", "then",
                  "else")  # fmt: skip
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of `schema` (or of any schema inside it) that xgrammar would accept and not
    enforce, with where it is ("'not' at #/properties/a"); None when there is none."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        found = _unenforced_here(node, schema)
        if found is not None:
            return f"{found} at {path}"
        children: list[tuple[Any, str]] = []
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children += [(sub, f"{path}/{key}/{_escape(name)}") for name, sub in node[key].items()]
        children += [
            (node[key], f"{path}/{key}") for key in _SCHEMA_VALUES if isinstance(node.get(key), dict)
        ]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                children += [(sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key])]
        stack += reversed(children)
    return None


def _unenforced_here(node: dict[str, Any], root: Any) -> str | None:
    for key in _NEVER_ENFORCED:
        if key in node:
            return f"'{key}'"
    if node.get("uniqueItems") is True:
        return "'uniqueItems'"
    if node.get("format") in _UNENFORCED_FORMATS:
        return f"'format' {node['format']!r}"
    if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"], root):
        return "'oneOf' (its options may overlap, and xgrammar enforces it as anyOf: say anyOf)"
    branch = next((key for key in _BRANCHES if key in node), None)
    if branch is not None:
        dropped = sorted(key for key in _ASSERTIONS & node.keys() if key != branch)
        if dropped == ["type"] and _type_is_implied(node, branch):
            return None
        return f"'{dropped[0]}' beside '{branch}'" if dropped else None
    if "type" not in node:
        bounds = list(_TYPED)
        if "items" not in node and "prefixItems" not in node:
            bounds += _ARRAY_BOUNDS
        if "properties" not in node and "additionalProperties" not in node:
            bounds += _OBJECT_BOUNDS
        for key in bounds:
            if key in node:
                return f"'{key}' in a schema without 'type'"
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list):
        known = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if name not in known]
        if missing:
            return f"'required' (naming {missing[0]!r}, which 'properties' does not define)"
    return None


def _type_is_implied(node: dict[str, Any], branch: str) -> bool:
    """Whether `type` beside `branch` says nothing the branch does not (so dropping it is harmless)."""
    declared = node["type"] if isinstance(node["type"], list) else [node["type"]]
    checks = [_JSON_TYPES[t] for t in declared if isinstance(t, str) and t in _JSON_TYPES]
    if branch in ("const", "enum"):
        values = [node["const"]] if branch == "const" else node["enum"]
        return isinstance(values, list) and all(any(check(v) for check in checks) for v in values)
    if branch in ("anyOf", "oneOf") and isinstance(node[branch], list):
        for option in node[branch]:
            types = option.get("type") if isinstance(option, dict) else None
            types = types if isinstance(types, list) else [types]
            if not all(t in declared or (t == "integer" and "number" in declared) for t in types):
                return False
        return True
    return False


def _disjoint(options: list[Any], root: Any) -> bool:
    """Whether no instance can match two of `options` (so oneOf means anyOf): their types are
    apart, or they all require one property to hold different constants (a discriminator)."""
    resolved = [_resolve(option, root) for option in options]
    if not all(isinstance(option, dict) for option in resolved):
        return False
    kinds = [_types(option) for option in resolved]
    if all(kinds) and all(not (a & b) for i, a in enumerate(kinds) for b in kinds[i + 1 :]):
        return True
    first = resolved[0].get("properties")
    for name in first if isinstance(first, dict) else ():
        constants = []
        for option in resolved:
            properties, required = option.get("properties"), option.get("required")
            value = _resolve(properties.get(name), root) if isinstance(properties, dict) else None
            if not isinstance(required, list) or name not in required or not isinstance(value, dict):
                break
            if "const" not in value:
                break
            constants.append(json.dumps(value["const"], sort_keys=True))
        else:
            if len(set(constants)) == len(constants):
                return True
    return False


def _types(schema: dict[str, Any]) -> frozenset[str]:
    declared = schema.get("type")
    names = set(declared if isinstance(declared, list) else [declared] if isinstance(declared, str) else [])
    if "number" in names:
        names.add("integer")
    return frozenset(names)


def _resolve(node: Any, root: Any) -> Any:
    """`node`, or what its local `$ref` ("#/$defs/a") points at (None when it points nowhere)."""
    for _ in range(32):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str):
            return node
        if not ref.startswith("#"):
            return None
        node = root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
    return None


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def build_grammar(xgrammar: Any, guided: GuidedDecoding) -> Any:
    """The xgrammar Grammar of `guided`; GrammarError when it does not parse."""
    grammar = xgrammar.Grammar
    try:
        if guided.kind == "json_schema":
            parts = [grammar.from_json_schema(guided.spec, any_whitespace=False)]
            if guided.prefix:
                parts.insert(0, grammar.from_ebnf(f"root ::= {json.dumps(guided.prefix)}"))
            if guided.suffix:
                parts.append(grammar.from_ebnf(f"root ::= {json.dumps(guided.suffix)}"))
            return parts[0] if len(parts) == 1 else grammar.concat(*parts)
        if guided.kind == "json_object":  # OpenAI's JSON mode: an object, not any JSON value
            return grammar.from_json_schema(JSON_OBJECT_SCHEMA)
        if guided.kind == "regex":
            return grammar.from_regex(guided.spec)
        if guided.kind == "choice":
            choices = json.loads(guided.spec)
            return grammar.from_ebnf("root ::= " + " | ".join(json.dumps(choice) for choice in choices))
        return grammar.from_ebnf(guided.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(f"invalid {NAMES[guided.kind]}: {first_line(exc)}") from exc


NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}


def first_line(exc: BaseException) -> str:
    """The library's message without its log prefix ("[12:00:00] /path/file.cc:83: ")."""
    text = str(exc).strip() or type(exc).__name__
    return LOG_PREFIX.sub("", text.splitlines()[0])[:300]


LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
