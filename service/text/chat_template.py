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

Every render, the model's own template included, is limited: RENDER_CPU_SECONDS of its thread's CPU
time (service.text.render_limit stops a template that loops without end, output or not) and
MAX_RENDERED_CHARS of output (counted chunk by chunk as Jinja generates it; a repetition `*` or a
power `**` that would build a larger value is refused before it is computed). A template a request
brings (`chat_template`, when the operator trusts requests with it) is also limited to
MAX_TEMPLATE_BYTES of source and compiled once per distinct source (`TemplateCache`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from service.text.render_limit import RenderTimeout, limited
from service.util import one_line

__all__ = [
    "MAX_RENDERED_CHARS",
    "MAX_TEMPLATE_BYTES",
    "NO_CHAT_TEMPLATE",
    "RENDER_CPU_SECONDS",
    "ChatTemplate",
    "ChatTemplateError",
    "TemplateCache",
]

NO_CHAT_TEMPLATE = "model has no chat template; use /v1/completions or set a chat template"

MAX_TEMPLATE_BYTES = 64 * 1024  # a request's own chat_template source, in UTF-8 bytes
RENDER_CPU_SECONDS = 2.0  # CPU time one render may take (a real template takes milliseconds)
# Characters one render may produce, and items any one value it builds may hold: twice the largest
# request body (NIM_MAX_REQUEST_BYTES' default), so no conversation a request can carry is refused.
MAX_RENDERED_CHARS = 32 * 1024 * 1024
_MAX_POWER_BITS = 1 << 16  # `a ** b` between integers: the largest result, in bits


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
        template, wants_parts, variables = None, False, frozenset[str]()
        try:
            ast = env.parse(source)
            template, wants_parts = env.from_string(ast), _iterates_content(ast)
            variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        except TemplateSyntaxError as exc:
            self._error = f"chat template is invalid: {exc.message} (line {exc.lineno})"
        except (RecursionError, SyntaxError, MemoryError):  # Jinja's parser, or Python's compiler
            self._error = "chat template is invalid: nested too deeply to compile"
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
        template = self._template
        if template is None:
            raise ChatTemplateError(self._error)
        try:
            conversation = _prepare_messages(messages, self._wants_parts)
            variables: dict[str, Any] = {
                "tools": None,
                "documents": None,
                **(special_tokens or {}),
                **_plain(extra),
                "messages": conversation,
                "add_generation_prompt": add_generation_prompt,
            }
        except RecursionError:
            raise ChatTemplateError("messages or tools are nested too deeply to render") from None
        try:
            return limited(lambda: _generate(template, variables), RENDER_CPU_SECONDS)
        except RenderTimeout:
            raise ChatTemplateError(
                f"chat template took over {RENDER_CPU_SECONDS:g} s of CPU time to render; stopped"
            ) from None
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


def _generate(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """The rendered text, chunk by chunk, stopped once it passes MAX_RENDERED_CHARS."""
    chunks: list[str] = []
    size = 0
    for chunk in template.generate(**variables):
        size += len(chunk)
        if size > MAX_RENDERED_CHARS:
            raise ChatTemplateError(f"chat template rendered over {MAX_RENDERED_CHARS} characters; stopped")
        chunks.append(chunk)
    return "".join(chunks)


class TemplateCache:
    """Compiled templates of request-given sources, least recently used out, bounded by count and by
    the bytes of source held (compiling a template costs far more than a cache lookup). Thread-safe:
    conversations are rendered on worker threads."""

    def __init__(self, max_entries: int = 64, max_bytes: int = 4 * 1024 * 1024) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._templates: OrderedDict[str, ChatTemplate] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._templates)

    @property
    def nbytes(self) -> int:
        """UTF-8 bytes of the sources held."""
        return self._bytes

    def get(self, source: str) -> ChatTemplate:
        """The compiled `source`; ChatTemplateError when it is over MAX_TEMPLATE_BYTES or does not
        compile (such a source is kept too, so it is not compiled again)."""
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"chat_template is {size} bytes, over the {MAX_TEMPLATE_BYTES} limit")
        with self._lock:
            template = self._templates.get(source)
            if template is not None:
                self._templates.move_to_end(source)
        if template is None:
            template = ChatTemplate(source)  # outside the lock: other requests' lookups go on
            self._put(source, size, template)
        if template.error is not None:
            raise ChatTemplateError(template.error)
        return template

    def _put(self, source: str, size: int, template: ChatTemplate) -> None:
        with self._lock:
            if source in self._templates:
                return
            self._templates[source] = template
            self._bytes += size
            while len(self._templates) > self.max_entries or self._bytes > self.max_bytes:
                evicted, _ = self._templates.popitem(last=False)
                self._bytes -= len(evicted.encode("utf-8", "surrogatepass"))


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


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, whose `*` and `**` refuse to build a value too large to hold."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for value, times in ((left, right), (right, left)):
                sized = isinstance(value, (str, list, tuple)) and isinstance(times, int)
                if sized and len(value) * times > MAX_RENDERED_CHARS:
                    raise ChatTemplateError(
                        f"chat template built a value of over {MAX_RENDERED_CHARS} items; stopped"
                    )
        elif operator == "**" and _power_bits(left, right) > _MAX_POWER_BITS:
            raise ChatTemplateError(f"chat template computed a power of over {_MAX_POWER_BITS} bits; stopped")
        return super().call_binop(context, operator, left, right)


def _power_bits(base: Any, exponent: Any) -> int:
    """About the bits of `base ** exponent` between integers (0 for anything else)."""
    if not isinstance(base, int) or not isinstance(exponent, int) or exponent <= 0 or abs(base) <= 1:
        return 0
    return exponent * base.bit_length()


_ENV: _TemplateEnvironment | None = None


def _jinja_env() -> _TemplateEnvironment:
    """The environment transformers renders chat templates in (less its `{% generation %}` tag)."""
    global _ENV
    if _ENV is None:
        env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
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
