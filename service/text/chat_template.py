"""Chat templates: a conversation rendered to prompt text the way Hugging Face transformers does it.

Chat templates are Jinja source written and tested by model authors against transformers'
`apply_chat_template`, and clients compare our prompts with what transformers (or vLLM, which uses
the same code) produces. A different rendering -- a stray newline from other whitespace settings,
HTML-escaped JSON, a missing global -- gives the model a prompt it was not trained on. So
`ChatTemplate` reproduces transformers' environment: Jinja's `ImmutableSandboxedEnvironment` with
`trim_blocks`, `lstrip_blocks` and the loop-control extension; the globals `raise_exception`,
`strftime_now`, `dict` and a `namespace` that refuses underscore-prefixed attributes; a `tojson`
filter that does not HTML-escape; and messages whose None-valued keys are dropped, with reasoning
also offered as `reasoning_content` and `thinking`.

Differences from transformers: the `{% generation %}` tag is not supported; a content given as a
list of parts may hold only text parts, and a template that expects a string content gets the
parts' texts joined (transformers would fail on it). Templates run in the immutable sandbox and only
ever see copies made of plain builtins, so they cannot reach Python internals or mutate caller data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from service.util import one_line

__all__ = ["NO_CHAT_TEMPLATE", "ChatTemplate", "ChatTemplateError"]

NO_CHAT_TEMPLATE = "model has no chat template; use /v1/completions or set a chat template"


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, or refused to render these messages."""


class ChatTemplate:
    """One chat template, compiled once and rendered per request.

    Construction never fails: a template that does not compile raises ChatTemplateError, with the
    reason, each time it is rendered (so a model with a broken template still serves completions).
    """

    def __init__(self, source: str) -> None:
        self.source = source
        env = _jinja_env()
        self._error: str | None = None  # why it does not compile
        try:
            ast = env.parse(source)
            template, wants_parts = env.from_string(ast), _iterates_content(ast)
            variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        except TemplateSyntaxError as exc:
            template, wants_parts, variables = None, False, frozenset()
            self._error = f"chat template is invalid: {exc.message} (line {exc.lineno})"
        self._template: jinja2.Template | None = template
        self._wants_parts = wants_parts  # pass list content through instead of joining its text
        self._variables = variables

    def reads(self, variable: str) -> bool:
        """Whether the template reads the variable `variable` (e.g. `tools`): one it never names
        cannot show what is passed in it to the model."""
        return variable in self._variables

    @property
    def error(self) -> str | None:
        """Why the template does not compile; None when it does."""
        return self._error

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        special_tokens: Mapping[str, str] | None = None,
        /,
        **extra: Any,
    ) -> str:
        """Render a conversation to prompt text exactly as transformers' `apply_chat_template` would.

        `special_tokens` are the strings templates see as `bos_token`, `eos_token`, ...; `extra`
        becomes template variables (`tools`, `documents`, `enable_thinking`, ...) and may override
        them. Raises ChatTemplateError, with a one-line reason, when the template does not compile,
        the messages are malformed, or the template refuses them (`raise_exception`) or fails while
        rendering -- including sandbox violations.
        """
        if self._template is None:
            raise ChatTemplateError(self._error)
        try:
            conversation = _prepare_messages(messages, self._wants_parts)
            variables: dict[str, Any] = {
                "tools": None,
                "documents": None,
                **(special_tokens or {}),
                **_plain(extra),
            }
        except RecursionError:
            raise ChatTemplateError("messages or tools are nested too deeply to render") from None
        try:
            return self._template.render(
                messages=conversation, add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError:
            raise
        except SecurityError as exc:
            raise ChatTemplateError(f"chat template attempted an unsafe operation: {one_line(exc)}") from exc
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {one_line(exc)}") from exc
        except Exception as exc:  # a template can trip any Python error (TypeError on str + list, ...)
            raise ChatTemplateError(
                f"chat template failed to render: {one_line(exc, with_type=True)}"
            ) from exc


# ---------------------------------------------------------------------------------------------
# The Jinja environment
# ---------------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` HTML-escapes; templates are written against transformers' version, which does not.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
            )


_ENV: ImmutableSandboxedEnvironment | None = None


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (less its `{% generation %}` tag)."""
    global _ENV
    if _ENV is None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["dict"] = _TemplateDict()
        env.globals["namespace"] = _TemplateNamespace
        _ENV = env
    return _ENV


def _reads_content(node: nodes.Node, aliases: set[str]) -> bool:
    for sub in [node, *node.find_all((nodes.Getitem, nodes.Getattr, nodes.Name))]:
        if isinstance(sub, nodes.Getitem) and isinstance(sub.arg, nodes.Const) and sub.arg.value == "content":
            return True
        if isinstance(sub, nodes.Getattr) and sub.attr == "content":
            return True
        if isinstance(sub, nodes.Name) and sub.name in aliases:
            return True
    return False


def _iterates_content(ast: nodes.Template) -> bool:
    """Whether the template loops over a message's content, i.e. expects a list of content parts.

    Same idea as vLLM's content-format detection: `{% for part in message['content'] %}` (or over
    a variable set from it) means the template wants OpenAI-style parts; otherwise it wants a string.
    """
    aliases: set[str] = set()
    for assign in ast.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _reads_content(assign.node, set()):
            aliases.add(assign.target.name)
    return any(_reads_content(loop.iter, aliases) for loop in ast.find_all(nodes.For))


# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A copy made only of JSON-like builtins, so a template never sees methods of caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _content_text(parts: Sequence[Any], index: int) -> list[str]:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ChatTemplateError(
                f"messages[{index}].content[{j}]: only text content parts are supported, got {kind!r}"
            )
        texts.append(part["text"])
    return texts


def _prepare_messages(messages: Any, wants_parts: bool) -> list[dict[str, Any]]:
    """The conversation as transformers hands it to a template, with content parts resolved.

    Like transformers: keys whose value is None are dropped, everything is copied to plain builtins,
    and reasoning is also offered as `reasoning_content` and `thinking`. A content given as a list
    of parts may only hold text parts; it stays a list for templates that loop over parts (what
    transformers always passes) and becomes the parts' texts concatenated with no separator for
    templates that expect a string (transformers would fail on those).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role', 'content'} objects")
    prepared = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            texts = _content_text(content, i)
            if not wants_parts:
                message["content"] = "".join(texts)
        message = _plain(message)
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared
