"""Every field a client may send to /v1/chat/completions and /v1/completions, in one table.

The rule, for every field of OpenAI's two request bodies, of vLLM's extensions to them and of NIM's
`nvext` object: it is honoured (the table names the module that honours it), or honoured for some
values only, or refused with a 400 whose `param` names it and whose message says why in one line.
Nothing is accepted and ignored.

- A value is honoured when this server does what it asks. A value that asks for what the server
  does anyway is honoured too: `use_beam_search: false`, `priority: 0`, `store: false`,
  `service_tier: "default"`, `stream_options.include_obfuscation: false` (clients that serialise a
  whole request model send such defaults); a value that asks for anything else is refused.
- `null` means "not sent", for every optional field: never refused (`logit_bias: null`,
  `stream_options: null` are fine). Pydantic (service.api.schemas) checks the types and ranges of
  the fields it declares before this table is read.
- A field the table does not list for the endpoint is refused as OpenAI refuses one:
  `Unrecognized request argument supplied: <name>`. Objects with fields of their own
  (`stream_options`, `nvext`, `structured_outputs`, `response_format` and its `json_schema`,
  `tool_choice`, each of `tools` and its `function`) are walked: their fields are rows here, with
  dotted names (`N` standing for a list item's index: `tools.N.function.name`), refused the same way
  when unknown, naming the item (`tools.0.function.yy`). Free-form values (a JSON schema, template
  variables, `logit_bias`, `metadata`) are not walked.
- Content parts of chat messages are listed by type (CONTENT_PARTS): text only; an image, audio,
  video or file part is refused naming `messages.N.content.M`, and a text or refusal part's fields
  beyond its type and its text are refused naming `messages.N.content.M.<field>`. A message's own
  fields are listed in MESSAGE_FIELDS with the roles whose messages carry them to the chat template:
  each is passed on or refused naming `messages.N.<field>` (also on a role that does not carry it);
  an assistant's tool calls are walked the same way (`messages.N.tool_calls.M.<field>`), and a tool
  message must name the call it answers (`tool_call_id`), as OpenAI requires.

`reject_unsupported` (service.api.generation) applies the table to each request before anything
else is done with it; `markdown_table` renders it for docs/api.md, and the tests walk it whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from service.api.errors import APIError, invalid_request
from service.api.request_fields.chat_rows import (
    CHAT_FIELDS,
    CONTENT_PART_FIELDS,
    CONTENT_PARTS,
    MESSAGE_FIELDS,
    TOOL_CALL_FIELDS,
    TOOL_CALL_FUNCTION_FIELDS,
)
from service.api.request_fields.messages_rows import CONTENT_BLOCKS, MESSAGES_FIELDS
from service.api.request_fields.responses_rows import INPUT_ITEMS, INPUT_PARTS, RESPONSES_FIELDS
from service.api.request_fields.rule import (
    ANTHROPIC,
    BOTH,
    CHAT,
    COMPLETIONS,
    MESSAGES,
    RESPONSES,
    TEMPLATE,
    Endpoint,
    ItemType,
    RequestField,
    shown,
)

__all__ = [
    "CONTENT_BLOCKS",
    "FIELDS",
    "INPUT_ITEMS",
    "INPUT_PARTS",
    "Endpoint",
    "RequestField",
    "check_content_part",
    "check_item",
    "check_message_fields",
    "check_request",
    "fields_for",
    "lookup",
    "markdown_table",
    "sent_fields",
    "unrecognized",
]

FIELDS: tuple[RequestField, ...] = CHAT_FIELDS + RESPONSES_FIELDS + MESSAGES_FIELDS
_BY_NAME: dict[tuple[Endpoint, str], RequestField] = {
    (endpoint, f.name): f for f in FIELDS for endpoint in f.endpoints
}
# Objects (and lists, as `name.N`) whose fields are rows of their own, by endpoint.
_PARENTS: frozenset[tuple[Endpoint, str]] = frozenset(
    (endpoint, name.rsplit(".", 1)[0]) for endpoint, name in _BY_NAME if "." in name
)
_PARTS = {p.type: p for p in CONTENT_PARTS}


def fields_for(endpoint: Endpoint) -> list[RequestField]:
    return [f for f in FIELDS if endpoint in f.endpoints]


def lookup(endpoint: Endpoint, name: str) -> RequestField | None:
    return _BY_NAME.get((endpoint, name))


def unrecognized(name: str) -> APIError:
    return invalid_request(f"Unrecognized request argument supplied: {name}", name)


def check_request(endpoint: Endpoint, request: BaseModel) -> None:
    """400 for the first sent field (null ones are not sent) the table refuses or does not list
    for `endpoint`; objects with rows of their own (stream_options, nvext, structured_outputs,
    response_format, tool_choice, each tool) are walked field by field."""
    fields = sent_fields(request)
    _check(endpoint, fields, {key: _plain(value) for key, value in fields.items()}, "", "")


def sent_fields(model: BaseModel) -> dict[str, Any]:
    """The fields a client sent in an object: declared ones (in declared order), then the others."""
    declared = {
        info.alias or name: getattr(model, name)
        for name, info in type(model).model_fields.items()
        if name in model.model_fields_set
    }
    return {**declared, **(model.model_extra or {})}


def _check(endpoint: Endpoint, fields: Mapping[str, Any], body: Mapping[str, Any], name_prefix: str,
           param_prefix: str) -> None:  # fmt: skip
    """`fields` of the object whose rows begin `name_prefix` ("tools.N.") and which was sent at
    `param_prefix` ("tools.0.")."""
    for key, value in fields.items():
        if value is None:
            continue
        name, param = name_prefix + key, param_prefix + key
        row = lookup(endpoint, name)
        if row is None:
            raise unrecognized(param)
        why = row.refusal(_plain(value), body, param)
        if why is not None:
            raise invalid_request(why, param)
        inner = sent_fields(value) if isinstance(value, BaseModel) else value
        if (endpoint, name) in _PARENTS and isinstance(inner, Mapping):
            _check(endpoint, inner, body, name + ".", param + ".")
        elif (endpoint, name + ".N") in _PARENTS and isinstance(inner, list):
            for i, item in enumerate(inner):
                if isinstance(item, Mapping):
                    _check(endpoint, item, body, name + ".N.", f"{param}.{i}.")


def _plain(value: Any) -> Any:
    """A pydantic object as the JSON it came from (for the value checks and messages)."""
    return value.model_dump(exclude_unset=True, by_alias=True) if isinstance(value, BaseModel) else value


def check_message_fields(role: str, sent: Mapping[str, Any], param: str) -> None:
    """400 for a field of one chat message (`param`: messages.N) that is not carried to the template
    on a message of `role`, or for a tool message that names no call; an assistant's tool calls are
    walked too."""
    for name, value in sent.items():
        if value is None or name in ("role", "content"):
            continue
        field = MESSAGE_FIELDS.get(name)
        if field is None:
            raise unrecognized(f"{param}.{name}")
        if not field.roles:
            raise invalid_request(f"{param}.{name} is not supported by this server: {field.note}",
                                  f"{param}.{name}")  # fmt: skip
        if role not in field.roles:
            raise invalid_request(
                f"{param}.{name} is not read on a {role} message (only on {', '.join(sorted(field.roles))} "
                "messages)",
                f"{param}.{name}",
            )
    if role == "tool" and not isinstance(sent.get("tool_call_id"), str):
        raise invalid_request(
            f"{param}.tool_call_id is required: a tool message answers the tool call it names",
            f"{param}.tool_call_id",
        )
    calls = sent.get("tool_calls")
    for j, call in enumerate(calls if isinstance(calls, list) else ()):
        if isinstance(call, Mapping):
            _check_keys(call, TOOL_CALL_FIELDS, f"{param}.tool_calls.{j}")
            function = call.get("function")
            if isinstance(function, Mapping):
                _check_keys(function, TOOL_CALL_FUNCTION_FIELDS, f"{param}.tool_calls.{j}.function")


def check_content_part(part_type: str, sent: Mapping[str, Any], param: str) -> None:
    """400 for a content part this model cannot take, or a field its type does not have, naming
    `messages.N.content.M` (and the field)."""
    part = _PARTS.get(part_type)
    if part is None:
        known = ", ".join(p.type for p in CONTENT_PARTS if p.honoured_by is not None)
        raise invalid_request(f"content part type {shown(part_type)} is not supported (only {known})", param)
    if part.honoured_by is None:
        raise invalid_request(part.why, param)
    _check_keys(sent, ("type", *CONTENT_PART_FIELDS.get(part_type, ())), param)


def _check_keys(sent: Mapping[str, Any], known: Sequence[str], param: str) -> None:
    for key, value in sent.items():
        if value is not None and key not in known:
            raise unrecognized(f"{param}.{key}")


def check_item(types: Sequence[ItemType], item_type: Any, sent: Mapping[str, Any], param: str,
               what: str) -> ItemType:  # fmt: skip
    """400 for an item of a typed list (a Responses input item or content part, an Anthropic content
    block: `what` says which) whose type is refused or unknown, naming `param`, or for a field its
    type does not have, naming `param`.<field>; the item's type otherwise."""
    by_type = {t.type: t for t in types}
    kind = by_type.get(item_type) if isinstance(item_type, str) else None
    if kind is None:
        known = ", ".join(t.type for t in types if t.honoured_by is not None)
        raise invalid_request(
            f"{param}: {what} type {shown(item_type)} is not supported (only {known})", param
        )
    if kind.honoured_by is None:
        raise invalid_request(f"{param}: {what} type {kind.type} is not supported by this server: {kind.why}",
                              param)  # fmt: skip
    _check_keys(sent, ("type", *kind.fields), param)
    return kind


def iter_rows() -> Iterator[tuple[Endpoint, RequestField]]:
    for row in FIELDS:
        for endpoint in sorted(row.endpoints):
            yield endpoint, row


# --- The table in docs/api.md --------------------------------------------------------------------

_ENDPOINT_NAMES = {
    BOTH: "both",
    CHAT: "chat",
    COMPLETIONS: "completions",
    RESPONSES: "responses",
    MESSAGES: "messages",
    ANTHROPIC: "messages, count_tokens",
}
# The typed lists of the Responses and Messages bodies, as docs/api.md shows them.
ITEM_TABLES: tuple[tuple[str, Sequence[ItemType]], ...] = (
    ("responses `input` item type", INPUT_ITEMS),
    ("responses message content part type", INPUT_PARTS),
    ("messages content block type", CONTENT_BLOCKS),
)


def markdown_table(rows: Sequence[RequestField] = FIELDS) -> str:
    """The table as docs/api.md shows it, between `<!-- request-fields:start -->` and
    `<!-- request-fields:end -->` (a test holds the two together)."""
    lines = [
        "| field | endpoints | from | honoured | by / why |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        where = _ENDPOINT_NAMES[row.endpoints]
        lines.append(f"| `{row.name}` | {where} | {row.origin} | {_status(row)} | {_reason(row)} |")
    lines += ["", "| content part type | honoured | by / why |", "|---|---|---|"]
    for part in CONTENT_PARTS:
        status = "yes" if part.honoured_by is not None else "refused"
        reason = (
            part.why
            if part.honoured_by is None
            else f"{part.honoured_by}" + (f"; {part.why}" if part.why else "")
        )
        lines.append(f"| `{part.type}` | {status} | {reason} |")
    lines += ["", "| message field | carried on | by / why |", "|---|---|---|"]
    for field in MESSAGE_FIELDS.values():
        roles = ", ".join(sorted(field.roles)) if field.roles else "refused"
        by = TEMPLATE + "; " if field.roles else ""
        lines.append(f"| `{field.name}` | {roles} | {by}{field.note} |")
    for title, types in ITEM_TABLES:
        lines += ["", f"| {title} | honoured | fields | by / why |", "|---|---|---|---|"]
        for kind in types:
            status = "yes" if kind.honoured_by is not None else "refused"
            by = f"{kind.honoured_by}; {kind.why}" if kind.honoured_by is not None else kind.why
            fields = ", ".join(f"`{f}`" for f in kind.fields)
            lines.append(f"| `{kind.type}` | {status} | {fields} | {by} |")
    return "\n".join(lines) + "\n"


def _status(row: RequestField) -> str:
    if row.kind == "refused":
        return "refused"
    if row.kind == "partly":
        return f"only {row.honoured_values}"
    return "yes"


def _reason(row: RequestField) -> str:
    if row.kind == "refused":
        return row.why
    where = row.honoured_by or ""
    if row.kind == "partly":
        return f"{where}; {row.why}"
    return where + (f"; {row.why}" if row.why else "")
