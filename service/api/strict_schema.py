"""Whether a value meets a JSON schema of the subset OpenAI's strict function tools allow.

Strict schemas (OpenAI's "structured outputs" subset) are built of `type` (one or a list), `enum`,
`const`, `properties` with `required` and `additionalProperties`, `items`, `anyOf` / `oneOf` /
`allOf`, `$ref` into the schema's own `$defs` / `definitions`, and annotations (`title`,
`description`, `default`, ...), which say nothing about validity. A tool call under tool_choice
auto is not constrained while it is generated, so its arguments are checked with this once it is
parsed (service.api.tools): a call of a strict tool whose arguments do not conform is not a call.
A keyword outside the subset (a `pattern`, a `minimum`) is not checked here; the subset is what
strict mode lets a client send.
"""

from __future__ import annotations

from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}
MAX_DEPTH = 64


def conforms(value: Any, schema: Any, root: Any = None, depth: int = 0) -> bool:
    """Whether `value` meets `schema` (a dict, or a boolean schema); `root` holds its `$defs`."""
    root = schema if root is None else root
    if depth > MAX_DEPTH:
        return False
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _resolve(ref, root)
        if target is None or not conforms(value, target, root, depth + 1):
            return False
    if "const" in schema and not _equal(value, schema["const"]):
        return False
    if "enum" in schema and not any(_equal(value, v) for v in schema["enum"] or ()):
        return False
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not any(_is(value, k) for k in kinds):
            return False
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and not any(conforms(value, s, root, depth + 1) for s in options):
            return False
    if isinstance(schema.get("allOf"), list) and not all(
        conforms(value, s, root, depth + 1) for s in schema["allOf"]
    ):
        return False
    if isinstance(value, dict):
        return _object(value, schema, root, depth)
    if isinstance(value, list) and "items" in schema:
        return all(conforms(v, schema["items"], root, depth + 1) for v in value)
    return True


def _object(value: dict[str, Any], schema: dict[str, Any], root: Any, depth: int) -> bool:
    properties: dict[str, Any] = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
    required: list[Any] = schema["required"] if isinstance(schema.get("required"), list) else []
    if any(name not in value for name in required):
        return False
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        if name in properties:
            if not conforms(item, properties[name], root, depth + 1):
                return False
        elif extra is False or (isinstance(extra, dict) and not conforms(item, extra, root, depth + 1)):
            return False
    return True


def _is(value: Any, kind: Any) -> bool:
    types = _TYPES.get(kind) if isinstance(kind, str) else None
    if types is None:
        return True  # an unknown type name constrains nothing here
    if isinstance(value, bool) and kind not in ("boolean",):
        return False  # JSON's true is not the number 1
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, types)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def _resolve(ref: str, root: Any) -> Any:
    """A local reference (`#`, `#/$defs/Name`, `#/definitions/Name`); None for any other."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
