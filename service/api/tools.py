"""OpenAI tool calling: the model's own tool-call format, parsed back into `tool_calls`.

The chat template renders `tools` (as transformers passes them); the model answers in its
family's format, which a parser reads back:

- hermes (Hermes, Qwen2/2.5/3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, possibly after some text;
- llama3_json (Llama 3.1-3.3): a JSON object `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, several separated by `;`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- pythonic (Llama 3.2 / Llama 4 with vLLM's pythonic templates): the whole answer is a Python list of
  calls, `[get_weather(city="Paris"), get_time(zone="UTC")]`, read with Python's `ast`: keyword
  arguments only, each value a literal as `ast.literal_eval` reads it (strings, numbers, True /
  False / None, lists, tuples, dicts); anything else -- a name, an expression, a nested call -- is
  not a call, and nothing is ever evaluated.

A function's `parameters` must be a JSON schema of type object, as OpenAI requires (arguments are
an object of named values). The parser is chosen from the chat template (the markers it renders),
or NIM_TOOL_CALL_PARSER; a template that never reads `tools` cannot show them to the model, and
tools are refused for it.
`tool_choice`: `none` renders no tools and parses nothing; `auto` (the default with tools) parses
the answer, and text that is not a well-formed call of a known function stays content (never an
empty tool_calls list); `required` and a named function constrain the output with a grammar
(service.engine GuidedDecoding: the call's JSON, its parameters' schema, between the format's
markers), so the call always parses and its arguments validate. For pythonic the grammar is EBNF
(`pythonic_grammar`): `[name(arg=value, ...)]` with the function's parameter names, required ones
first, and Python-literal values typed by each parameter's schema where it names a string, integer,
number, boolean or enum (other values: any literal).

A function sent with `strict: true` (the Responses API's agents send every tool so) has its
arguments checked against its schema where no grammar made them (tool_choice auto,
service.api.strict_schema): a call that does not conform is not a call, and stays content.

`parallel_tool_calls: false` promises at most one call. A grammar (required, named) makes exactly
one. Under auto, a hermes answer is stopped at the end of its first call (the close marker is a
stop string), so no second call is ever generated; llama3_json and mistral write all calls as one
unit, so a second call there is dropped, and the drop is logged with the request's id.
"""

from __future__ import annotations

import ast
import json
import keyword
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from service.api.errors import invalid_request
from service.api.strict_schema import conforms
from service.engine.protocol import GuidedDecoding
from service.text.chat_template import ChatTemplate

log = logging.getLogger(__name__)

ParserName = Literal["hermes", "llama3_json", "mistral", "pythonic"]
PARSERS: tuple[ParserName, ...] = ("hermes", "llama3_json", "mistral", "pythonic")
# What starts a call in each format's output.
_MARKERS: dict[ParserName, str] = {
    "hermes": "<tool_call>",
    "mistral": "[TOOL_CALLS]",
    "llama3_json": "<|python_tag|>",
    "pythonic": "<|python_tag|>",
}
# Formats whose call is the whole answer, beginning with this character (after <|python_tag|>).
_WHOLE_ANSWER: dict[ParserName, str] = {"llama3_json": "{", "pythonic": "["}
_HERMES_END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools as the engine needs them: which calls may be made, and how."""

    parser: ParserName
    functions: dict[str, dict[str, Any]]  # name -> parameters schema
    choice: str | None  # "auto", "required", a function name; None: tools are not used
    parallel: bool = True
    strict: frozenset[str] = frozenset()  # functions whose arguments must meet their schema

    def conforms(self, call: ToolCall) -> bool:
        """A call of a strict function has arguments that meet its schema (service.api.strict_schema)."""
        if call.name not in self.strict:
            return True
        try:
            arguments = json.loads(call.arguments)
        except (ValueError, RecursionError):
            return False
        return conforms(arguments, self.functions[call.name])

    @property
    def forced(self) -> bool:
        return self.choice not in (None, "auto")

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings the answer needs: the end of the first call, when only one may be made
        and the format marks where a call ends (hermes; a grammar already makes one call)."""
        if self.parallel or self.forced or self.parser != "hermes":
            return ()
        return (_HERMES_END,)

    def guided(self) -> GuidedDecoding | None:
        """The grammar that makes the answer one call (required / named), or None for auto."""
        if not self.forced:
            return None
        names = list(self.functions) if self.choice == "required" else [str(self.choice)]
        if self.parser == "pythonic":
            return GuidedDecoding("grammar", pythonic_grammar({n: self.functions[n] for n in names}))
        key = "parameters" if self.parser == "llama3_json" else "arguments"
        cases = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, key: self.functions[name]},
                "required": ["name", key],
                "additionalProperties": False,
            }
            for name in names
        ]
        schema = cases[0] if len(cases) == 1 else {"anyOf": cases}
        prefix, suffix = {
            "hermes": ("<tool_call>\n", "\n</tool_call>"),
            "llama3_json": ("", ""),
            "mistral": ("[TOOL_CALLS][", "]"),
        }[self.parser]
        return GuidedDecoding("json_schema", json.dumps(schema), prefix=prefix, suffix=suffix)

    def parse(self, text: str, *, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) from a finished answer; calls is empty when it is not well formed.

        `cut`: the generation was stopped by max_tokens. A call it started and did not finish is
        dropped, never returned as content: the answer is the text before it, with the calls
        finished before it (the finish reason stays "length"; the route decides it).
        """
        if cut:
            start = _unfinished_call(self.parser, text)
            if start is not None:
                before = text[:start]
                kept, finished = self.parse(before) if before.strip() else (None, [])
                return (kept.rstrip() or None if kept is not None else None), finished
        parsed = text
        if self.stop and not cut and text.count("<tool_call>") > text.count(_HERMES_END):
            parsed += _HERMES_END  # the stop string ended the call, and is not in the text
        try:
            calls = _PARSE[self.parser](parsed)
        except RecursionError:  # JSON nested past what json reads: not a call
            calls = None
        if (
            calls is None
            or not calls
            or any(c.name not in self.functions or not self.conforms(c) for c in calls)
        ):
            return text, []
        if not self.parallel and len(calls) > 1:
            log.warning("parallel_tool_calls is false but the model made %d tool calls (%s); only the "
                        "first is returned", len(calls), self.parser)  # fmt: skip
            calls = calls[:1]
        content = text.split("<tool_call>", 1)[0].strip() if self.parser == "hermes" else ""
        return content or None, calls


@dataclass
class ToolStream:
    """One streamed answer under tools: what may go out as content now, and what is held back
    because it is, or may become, a tool call (sent whole, or as content if it does not parse)."""

    spec: ToolSpec
    held: str = ""
    calling: bool = False  # a call's marker was seen: everything after it is held
    emitted: bool = False  # some content went out already

    def feed(self, text: str) -> str:
        """The content that can be streamed now, given the next piece of the answer."""
        buffer = self.held + text
        if self.spec.forced or self.calling:
            self.held = buffer
            return ""
        marker = _MARKERS[self.spec.parser]
        opening = _WHOLE_ANSWER.get(self.spec.parser)
        if opening is not None:  # a call is the whole answer, from its start
            stripped = buffer.lstrip()
            if not self.emitted and (
                stripped[:1] in ("", opening) or marker.startswith(stripped[: len(marker)])
            ):
                self.held = buffer
                return ""
            self.held = ""
            self.emitted = self.emitted or bool(buffer)
            return buffer
        at = buffer.find(marker)
        if at >= 0:
            self.calling, self.held, out = True, buffer[at:], buffer[:at]
        else:  # hold back a tail that may be the start of the marker
            keep = _overlap(buffer, marker)
            self.held, out = buffer[len(buffer) - keep :], buffer[: len(buffer) - keep]
        self.emitted = self.emitted or bool(out)
        return out

    def finish(self, *, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """At the end: (content still to send, the calls) from what was held. `cut`: generation
        was stopped by max_tokens, and a call it left unfinished is dropped (ToolSpec.parse)."""
        if not self.held:
            return None, []
        content, calls = self.spec.parse(self.held, cut=cut)
        if calls or cut:
            return content, calls
        return self.held, []


def _unfinished_call(parser: ParserName, text: str) -> int | None:
    """Where a call that `text` starts but does not finish begins (a marker cut short included);
    None when every call in it is finished, or none was begun."""
    if parser == "hermes":
        at = text.rfind("<tool_call>")
        if at >= 0 and _HERMES_END not in text[at:]:
            return at
        keep = _overlap(text, "<tool_call>")
        return len(text) - keep if keep else None
    if parser == "mistral":
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            keep = _overlap(text.rstrip(), "[TOOL_CALLS]")
            return len(text.rstrip()) - keep if keep else None
        return at if _PARSE["mistral"](text[at:]) is None else None
    if parser == "pythonic":
        body = text.lstrip()
        begun = body.startswith(("[", "<|python_tag|>")) or (bool(body) and "<|python_tag|>".startswith(body))
        return len(text) - len(body) if begun and _parse_pythonic(text) is None else None
    return _unfinished_llama3(text)


def _unfinished_llama3(text: str) -> int | None:
    """llama3_json: the answer is `;`-separated call objects from its start (after an optional
    <|python_tag|>); where the first object that does not decode begins (the tag, when none does)."""
    body = text.lstrip()
    start = len(text) - len(body)
    compact = "".join(body[:40].split())
    if not (
        body.startswith("<|python_tag|>") or compact.startswith('{"name"') or '{"name"'.startswith(compact)
    ):
        return None
    decoder = json.JSONDecoder()
    position = start + (len("<|python_tag|>") if body.startswith("<|python_tag|>") else 0)
    first = True
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            return start if first else None
        try:
            _, position = decoder.raw_decode(text, position)
        except (ValueError, RecursionError):
            return start if first else position
        first = False
        rest = text[position:].lstrip()
        if not rest.startswith(";"):
            return None  # finished (or not the format at all: then it is content)
        position = len(text) - len(rest) + 1


def _overlap(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (shorter than all of it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def tool_spec(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    template: ChatTemplate | None,
    configured: ParserName | None,
    auto_enabled: bool,
) -> ToolSpec | None:
    """The request's tools, checked (400s name the field), or None when no tool is in play.
    `template` is the chat template the conversation will be rendered with."""
    if tool_choice is not None and not tools:
        raise invalid_request("tool_choice needs tools", "tool_choice")
    if not tools:
        return None
    functions: dict[str, dict[str, Any]] = {}
    strict: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise invalid_request(
                "each tool must be {type: function, function: {name, parameters}}", f"tools.{i}"
            )
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise invalid_request(
                "function names are 1-64 letters, digits, '_', '.', '-'", f"tools.{i}.function.name"
            )
        if name in functions:
            raise invalid_request(
                f"two tools are named {name!r}; function names must be unique", f"tools.{i}.function.name"
            )
        functions[name] = _parameters(name, function.get("parameters"), f"tools.{i}.function.parameters")
        if function.get("strict") is True:
            strict.add(name)
    choice = _choice(tool_choice, functions)
    if choice is None:
        return None
    if template is not None and not template.reads("tools"):
        raise invalid_request(
            "this model's chat template does not render tools, so the model would never see them; "
            "describe the tools in a system message and send no tools, or serve a model whose chat "
            "template renders them",
            "tools",
        )
    parser = configured or detect_parser(template.source if template is not None else None)
    if parser is None:
        raise invalid_request(
            "this model's chat template does not render tools in a format this server parses "
            "(hermes, llama3_json, mistral, pythonic); set NIM_TOOL_CALL_PARSER if it uses one of them",
            "tools",
        )
    if parser == "pythonic" and choice != "auto":
        forced = functions if choice == "required" else {choice: functions[choice]}
        unspellable = _not_python_names(forced)
        if unspellable:
            raise invalid_request(
                f"tool_choice {choice}: the pythonic tool-call format writes calls as Python, which cannot "
                f"spell {', '.join(repr(n) for n in unspellable[:5])}; use names that are Python identifiers",
                "tool_choice",
            )
    if choice == "auto" and not auto_enabled:
        raise invalid_request(
            "tool_choice auto is disabled on this server (NIM_ENABLE_AUTO_TOOL_CHOICE=0); use required or a "
            "named function",
            "tool_choice",
        )
    return ToolSpec(parser, functions, choice, parallel_tool_calls is not False, frozenset(strict))


def _parameters(name: str, parameters: Any, param: str) -> dict[str, Any]:
    """A function's parameters schema, checked as OpenAI checks it: a JSON schema of type object
    (absent or `{}`: no parameters). Arguments are always an object of named values, so a schema of
    any other type could never be met (a grammar would force arguments the call cannot carry)."""
    if parameters is None or parameters == {}:
        return {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid_request(f"Invalid schema for function {name!r}: parameters must be a JSON schema",
                              param)  # fmt: skip
    kind = parameters.get("type")
    if kind != "object":
        raise invalid_request(
            f"Invalid schema for function {name!r}: schema must be a JSON Schema of 'type: \"object\"', got "
            f"'type: {json.dumps(kind)}'",
            param,
        )
    return parameters


def detect_parser(template: str | None) -> ParserName | None:
    """The tool-call format a chat template renders, by its markers."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "[func_name1(" in template:  # vLLM's Llama 3.2 / Llama 4 pythonic templates show the format so
        return "pythonic"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return None


def _choice(tool_choice: str | dict[str, Any] | None, functions: dict[str, dict[str, Any]]) -> str | None:
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return "required"
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise invalid_request("a named tool_choice is {type: function, function: {name}}", "tool_choice")
        if name not in functions:
            raise invalid_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return str(name)
    raise invalid_request("tool_choice must be none, auto, required or {type: function, function: {name}}",
                          "tool_choice")  # fmt: skip


def _call(obj: Any, key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_hermes(text: str) -> list[ToolCall] | None:
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, flags=re.DOTALL)
    if not blocks:
        return None
    calls = []
    for block in blocks:
        try:
            call = _call(json.loads(block), "arguments")
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


def _parse_llama3(text: str) -> list[ToolCall] | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            obj, end = decoder.raw_decode(body, position)
        except ValueError:
            return None
        call = _call(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        position = end
        rest = body[position:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return None
        position = len(body) - len(rest) + 1
        while position < len(body) and body[position].isspace():
            position += 1
    return calls


def _parse_mistral(text: str) -> list[ToolCall] | None:
    body = text.strip()
    if not body.startswith("[TOOL_CALLS]"):
        return None
    try:
        items = json.loads(body.removeprefix("[TOOL_CALLS]").strip())
    except ValueError:
        return None
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list):
        return None
    calls = [_call(item, "arguments") for item in items]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


def _parse_pythonic(text: str) -> list[ToolCall] | None:
    """`[name(arg=literal, ...), ...]`, read with `ast` and `ast.literal_eval` (never evaluated)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for argument in node.keywords:
            if argument.arg is None:  # **kwargs
                return None
            try:
                arguments[argument.arg] = ast.literal_eval(argument.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        try:
            encoded = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # a set, bytes, a complex number, inf
            return None
        calls.append(ToolCall(node.func.id, encoded))
    return calls


# The pythonic grammar's values: Python literals, written the way JSON writes them where the two
# agree (double-quoted strings), with Python's True / False / None.
_PYTHON_LITERALS = r"""
py_value ::= py_string | py_number | py_bool | "None" | py_list | py_dict
py_string ::= "\"" py_char* "\""
py_char ::= [^"\\\n\r] | "\\" ["\\bfnrt] | "\\u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]
py_int ::= "-"? ("0" | [1-9] [0-9]*)
py_number ::= py_int ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
py_bool ::= "True" | "False"
py_list ::= "[" (py_value (", " py_value)*)? "]"
py_dict ::= "{" (py_string ": " py_value (", " py_string ": " py_value)*)? "}"
"""


def _value_rule(schema: Any) -> str:
    """The grammar of one argument's value, from its schema where it is simple."""
    if not isinstance(schema, dict):
        return "py_value"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(json.dumps(json.dumps(v)) for v in enum) + ")"
    return {"string": "py_string", "integer": "py_int", "number": "py_number", "boolean": "py_bool"}.get(
        str(schema.get("type")), "py_value"
    )


def _properties(schema: dict[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties")
    return properties if isinstance(properties, dict) else {}


def _not_python_names(functions: dict[str, dict[str, Any]]) -> list[str]:
    """Function and parameter names a Python call cannot spell (`get-weather`, `from`)."""
    names = [*functions, *(p for schema in functions.values() for p in _properties(schema))]
    return [n for n in names if not isinstance(n, str) or not n.isidentifier() or keyword.iskeyword(n)]


def pythonic_grammar(functions: dict[str, dict[str, Any]]) -> str:
    """EBNF for one pythonic call of one of `functions`: `[name(arg=value, ...)]`, the required
    parameters in the schema's order, then the optional ones, each optional (in order)."""
    rules = ['root ::= "[" (' + " | ".join(f"call_{i}" for i in range(len(functions))) + ') "]"']
    for i, (name, schema) in enumerate(functions.items()):
        properties = _properties(schema)
        listed = schema.get("required")
        required = (
            [p for p in listed if isinstance(p, str) and p in properties] if isinstance(listed, list) else []
        )
        optional = [p for p in properties if p not in required]
        spelled = {p: f"{json.dumps(p + '=')} {_value_rule(properties[p])}" for p in properties}
        body = ' ", " '.join(spelled[p] for p in required)
        if body:
            body += "".join(f' (", " {spelled[p]})?' for p in optional)
        elif optional:  # the first argument given is any optional one, the rest in order after it
            starts = [spelled[p] + "".join(f' (", " {spelled[q]})?' for q in optional[j + 1 :])
                      for j, p in enumerate(optional)]  # fmt: skip
            body = "(" + " | ".join(starts) + ")?"
        rules.append(f'call_{i} ::= {json.dumps(name + "(")} {body} ")"')
    return "\n".join(rules) + _PYTHON_LITERALS


_PARSE = {
    "hermes": _parse_hermes,
    "llama3_json": _parse_llama3,
    "mistral": _parse_mistral,
    "pythonic": _parse_pythonic,
}
