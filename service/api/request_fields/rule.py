"""The vocabulary of service.api.request_fields' tables: a request field (honoured, honoured for
some values, or refused), a type of item in a list of typed objects (a content part, a Responses
input item, an Anthropic content block), and the helpers the tables are written with."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Endpoint = Literal["chat", "completions", "responses", "messages", "count_tokens"]
CHAT: frozenset[Endpoint] = frozenset({"chat"})
COMPLETIONS: frozenset[Endpoint] = frozenset({"completions"})
BOTH: frozenset[Endpoint] = CHAT | COMPLETIONS
RESPONSES: frozenset[Endpoint] = frozenset({"responses"})
MESSAGES: frozenset[Endpoint] = frozenset({"messages"})
COUNT_TOKENS: frozenset[Endpoint] = frozenset({"count_tokens"})
ANTHROPIC: frozenset[Endpoint] = MESSAGES | COUNT_TOKENS
Origin = Literal["OpenAI", "vLLM", "NIM", "Anthropic", "Codex"]

# Whether a sent (non-null) value is honoured; it sees the request's other top-level fields too.
Accepts = Callable[[Any, Mapping[str, Any]], bool]

# Where fields are honoured (module paths, for the docs).
GENERATION = "service.api.generation"
CHAT_SERVING = "service.api.chat.serving"
COMPLETIONS_SERVING = "service.api.completions.serving"
SERVING = f"{CHAT_SERVING}, {COMPLETIONS_SERVING}"
GUIDED = "service.api.guided"
TOOLS = "service.api.tools"
LOGPROBS = "service.api.logprobs"
TEMPLATE = "service.text.chat_template"
NO_EFFECT = "nothing to do (the answer does not depend on it)"
CACHE = "service.engine.torch.block_pool"


@dataclass(frozen=True)
class RequestField:
    """One request field on the endpoints it belongs to. `honoured_by` None: refused whatever its
    value; `accepts` set: honoured only for the values it accepts (`honoured_values` says which,
    in words), the others refused because `why`."""

    name: str  # dotted for fields of an object: "stream_options.include_usage"
    endpoints: frozenset[Endpoint]
    origin: Origin
    honoured_by: str | None
    why: str = ""  # why (some values are) refused; for honoured fields, an optional note
    accepts: Accepts | None = None
    honoured_values: str = ""
    example: Any = None  # a value clients send: honoured (for a refused field: refused)
    refused_example: Any = None  # for a field honoured for some values: a refused one

    @property
    def kind(self) -> Literal["honoured", "partly", "refused"]:
        if self.honoured_by is None:
            return "refused"
        return "honoured" if self.accepts is None else "partly"

    def refusal(self, value: Any, body: Mapping[str, Any], param: str | None = None) -> str | None:
        """Why `value` (sent, not null) is refused, in one line, naming `param` (where it was sent:
        the row's name with its list indices); None when it is honoured."""
        where = param or self.name
        if self.honoured_by is None:
            return f"{where} is not supported by this server: {self.why}"
        if self.accepts is not None and not self.accepts(value, body):
            return f"{where} {shown(value)} is not supported by this server: {self.why}"
        return None


@dataclass(frozen=True)
class ContentPart:
    """A chat message content part type: honoured (joined into the message's text) or refused."""

    type: str
    honoured_by: str | None
    why: str = ""


def shown(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def same(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def only(*values: Any) -> Accepts:
    """Honoured for these values (compared as JSON) and no others."""
    return lambda value, body: any(same(value, v) for v in values)


def honoured(name: str, endpoints: frozenset[Endpoint], origin: Origin, by: str, example: Any,
             note: str = "") -> RequestField:  # fmt: skip
    return RequestField(name, endpoints, origin, by, note, example=example)


def refused(
    name: str, endpoints: frozenset[Endpoint], origin: Origin, why: str, example: Any
) -> RequestField:
    return RequestField(name, endpoints, origin, None, why, example=example)


def partly(name: str, endpoints: frozenset[Endpoint], origin: Origin, by: str, accepts: Accepts, values: str,
           why: str, example: Any, refused_example: Any) -> RequestField:  # fmt: skip
    return RequestField(name, endpoints, origin, by, why, accepts, values, example, refused_example)


@dataclass(frozen=True)
class ItemType:
    """One type of the items of a list of typed objects (a Responses input item, a content part, an
    Anthropic content block): honoured (by `honoured_by`), carrying `fields` beyond its type, or
    refused because `why`; `example` is an item of the type clients send."""

    type: str
    honoured_by: str | None
    why: str = ""
    fields: tuple[str, ...] = ()
    example: Any = None


@dataclass(frozen=True)
class MessageField:
    """A field of one chat message beyond `role` and `content`: passed on to the chat template on
    messages of `roles` (service.api.chat.prompt), refused on others; no roles: refused on every
    message, because `note`."""

    name: str
    roles: frozenset[str]
    note: str
