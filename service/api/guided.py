"""Structured-output fields of a request, from wherever clients put them, as one GuidedDecoding.

Accepted: OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `schema`; `strict`
or not, the schema is enforced), vLLM's `structured_outputs` (`json`, `regex`, `choice`,
`grammar`, `json_object`), NIM's `nvext.guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, and the same four at the top level as vLLM took them before 0.12. Exactly one
constraint may be given, however many of these ways are used. Other options (a backend, a
whitespace pattern, structural tags) are refused by service.api.request_fields before this module
reads the request. Whether the spec is within the limits, can be enforced, can be satisfied and
compiles is the engine's check (a 400 naming the problem; service/engine/guided/).
Schemas keep the client's property order: it is the order the answer's keys come in.
"""

from __future__ import annotations

import json
from typing import Any

from service.api.errors import invalid_request
from service.api.schemas import SamplingFields, StructuredOutputs
from service.engine.protocol import GuidedDecoding

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs' constraints, by the guided_* field each means
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar"}  # fmt: skip


def named_guided_decoding(body: SamplingFields) -> tuple[str, GuidedDecoding] | None:
    """The request's one constraint and the field that carried it (an engine's refusal of the
    constraint names that field), or None; 400 when it gives several or a malformed one."""
    found: list[tuple[str, GuidedDecoding]] = []
    extras = dict(body.model_extra or {})
    response_format = getattr(body, "response_format", None) or extras.pop("response_format", None)
    if response_format is not None:
        parsed = _response_format(response_format)
        if parsed is not None:
            found.append(("response_format", parsed))
    if body.structured_outputs is not None:
        found += _structured_outputs(body.structured_outputs)
    nvext_extras = dict(body.nvext.model_extra or {}) if body.nvext is not None else {}
    for prefix, fields in (("", extras), ("nvext.", nvext_extras)):
        for key in GUIDED_FIELDS:
            if fields.get(key) is not None:
                found.append((prefix + key, _guided_field(prefix + key, key, fields[key])))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise invalid_request(f"give one structured-output constraint, not several ({names})", found[1][0])
    return found[0] if found else None


def _structured_outputs(spec: StructuredOutputs) -> list[tuple[str, GuidedDecoding]]:
    values = {"json": spec.json_, "regex": spec.regex, "choice": spec.choice, "grammar": spec.grammar}
    found = [
        (
            f"structured_outputs.{key}",
            _guided_field(f"structured_outputs.{key}", STRUCTURED_OUTPUTS[key], value),
        )
        for key, value in values.items()
        if value is not None
    ]
    if spec.json_object:
        found.append(("structured_outputs.json_object", GuidedDecoding("json_object")))
    if not found:
        raise invalid_request(
            "structured_outputs needs one of json, regex, choice, grammar, json_object", "structured_outputs"
        )
    return found


def _response_format(value: Any) -> GuidedDecoding | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise invalid_request("response_format must be an object with a type", param)
    kind = value.get("type", "text")
    if kind != "json_schema" and value.get("json_schema") is not None:
        raise invalid_request(
            f"response_format.json_schema is read only with type json_schema, not {kind!r}",
            "response_format.json_schema",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise invalid_request(
                "response_format json_schema needs json_schema.schema, a JSON schema object", param
            )
        return GuidedDecoding("json_schema", json.dumps(spec["schema"]))
    raise invalid_request(
        f"response_format type {kind!r} is not one of text, json_object, json_schema", param
    )


def _guided_field(name: str, key: str, value: Any) -> GuidedDecoding:
    if key == "guided_json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError as exc:
                raise invalid_request(f"{name} is not valid JSON: {exc}", name) from None
        if not isinstance(schema, dict):
            raise invalid_request(f"{name} must be a JSON schema object", name)
        return GuidedDecoding("json_schema", json.dumps(schema))
    if key == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid_request(f"{name} must be a non-empty list of non-empty strings", name)
        return GuidedDecoding("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise invalid_request(f"{name} must be a non-empty string", name)
    return GuidedDecoding("regex" if key == "guided_regex" else "grammar", value)
