"""Chat templates: a conversation rendered to prompt text the way Hugging Face transformers does it.

Chat templates are Jinja source written and tested by model authors against transformers'
`apply_chat_template`, and clients compare our prompts with what transformers (or vLLM, which uses
the same code) produces. A different rendering -- a stray newline from other whitespace settings,
HTML-escaped JSON, a missing global -- gives the model a prompt it was not trained on. So
`ChatTemplate` reproduces transformers' environment (service.text.template_sandbox): Jinja's
`ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks` and the loop-control extension;
the globals `raise_exception`, `strftime_now`, `dict` and a `namespace` that refuses
underscore-prefixed attributes; a `tojson` filter that does not HTML-escape; and messages whose
None-valued keys are dropped, with reasoning also offered as `reasoning_content` and `thinking`.

Differences from transformers: the `{% generation %}` tag is not supported; a content given as a
list of parts may hold only text parts, and a template that expects a string content gets the
parts' texts joined (transformers would fail on it). Templates run in the immutable sandbox and only
ever see copies made of plain builtins, so they cannot reach Python internals or mutate caller data.

Every template, the model's own included, is compiled and rendered under one bound. Compiling
evaluates nothing (no constant is folded: what a compiled template holds is its source's literals and
Jinja's code for it) and is stopped past RENDER_CPU_SECONDS of CPU. A render is stopped past
RENDER_CPU_SECONDS of its thread's CPU time (service.text.render_limit stops a template that loops
without end, output or not) and at MAX_RENDERED_CHARS of output, and every value it builds is
bounded before it is built, each and together (service.text.template_sandbox: a hostile template
costs its own request at most RENDER_CPU_SECONDS and MAX_BUILT_CHARS characters and
MAX_BUILT_ITEMS items of memory, and the server answers in the meantime). A template a request
brings (`chat_template`, when the operator trusts requests with it) is also limited to
MAX_TEMPLATE_BYTES of source and compiled once per distinct source (`TemplateCache`, bounded by
what its compiled templates hold).
"""

from __future__ import annotations

import threading
import traceback
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

from service.text.render_limit import RenderTimeout, limited
from service.text.template_sandbox import (
    MAX_BUILT_CHARS,
    MAX_BUILT_ITEMS,
    MAX_VALUE_CHARS,
    ChatTemplateError,
    bounded_render,
    jinja_env,
)
from service.util import one_line

__all__ = [
    "MAX_BUILT_CHARS",
    "MAX_BUILT_ITEMS",
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
RENDER_CPU_SECONDS = 2.0  # CPU time one compile, or one render, may take (a real template: milliseconds)
MAX_RENDERED_CHARS = MAX_VALUE_CHARS  # characters one render may produce
_MAX_REASON_CHARS = 300  # of an error's own text in a refusal


class ChatTemplate:
    """One chat template, compiled once and rendered per request.

    Construction never fails: a template that does not compile raises ChatTemplateError, with the
    reason, each time it is rendered (so a model with a broken template still serves completions).
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self._error: str | None = None  # why it does not compile
        self._template: jinja2.Template | None = None
        self._wants_parts = False  # pass list content through instead of joining its text
        self._variables = frozenset[str]()
        self.code_chars = 0  # of the Python code Jinja wrote for it: what the compiled template holds
        try:
            limited(self._compile, RENDER_CPU_SECONDS)
        except TemplateSyntaxError as exc:
            self._error = f"chat template is invalid: {exc.message} (line {exc.lineno})"
        except (RecursionError, SyntaxError, MemoryError):  # Jinja's parser, or Python's compiler
            self._error = "chat template is invalid: nested too deeply to compile"
        except RenderTimeout:
            self._error = f"chat template took over {RENDER_CPU_SECONDS:g} s of CPU time to compile; stopped"

    def _compile(self) -> None:
        env = jinja_env()
        ast = env.parse(self.source)
        code = env.compile(ast, raw=True)  # nothing is evaluated: constants are not folded
        compiled = compile(code, "<template>", "exec")
        self._template = env.template_class.from_code(env, compiled, env.make_globals(None))
        self._wants_parts = _iterates_content(ast)
        self._variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.code_chars = len(code)

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
        except BaseException as exc:  # each is said in one line, or re-raised
            failure = _failure(exc)
            _let_go(exc)
            cause = None if isinstance(exc, (ChatTemplateError, RenderTimeout)) else exc
        error = ChatTemplateError(failure)
        error.__cause__ = cause  # its traceback dropped
        raise error  # outside the handler: nothing of the render is kept with it


def _failure(exc: BaseException) -> str:
    """Why a render failed, in one line; re-raises what is not the template's failure."""
    if isinstance(exc, RenderTimeout):
        return f"chat template took over {RENDER_CPU_SECONDS:g} s of CPU time to render; stopped"
    if isinstance(exc, ChatTemplateError):
        return one_line(exc, limit=_MAX_REASON_CHARS)
    if isinstance(exc, SecurityError):
        return f"chat template attempted an unsafe operation: {one_line(exc, limit=_MAX_REASON_CHARS)}"
    if isinstance(exc, TemplateError):
        return f"chat template failed to render: {one_line(exc, limit=_MAX_REASON_CHARS)}"
    if isinstance(exc, Exception):  # a template can trip any Python error (TypeError on str + list, ...)
        return f"chat template failed to render: {one_line(exc, with_type=True, limit=_MAX_REASON_CHARS)}"
    raise exc


def _let_go(exc: BaseException | None) -> None:
    """Drop what a failed render's exceptions hold: their tracebacks' frames keep the template's
    variables (all it built), and Jinja's rewritten traceback ties them in a cycle that only the
    cyclic collector would free, some time later; a render stopped for its size would keep its
    memory until then."""
    while exc is not None:
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc = exc.__context__


def _generate(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """The rendered text, chunk by chunk, stopped once it passes MAX_RENDERED_CHARS; what the
    template builds on the way is bounded by its render's budget."""
    chunks: list[str] = []
    size = 0
    with bounded_render():
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > MAX_RENDERED_CHARS:
                raise ChatTemplateError(f"chat template rendered over {MAX_RENDERED_CHARS} characters")
            chunks.append(chunk)
        return "".join(chunks)


class TemplateCache:
    """Compiled templates of request-given sources, least recently used out, bounded by count and by
    what they hold: each is charged its source's UTF-8 bytes and the characters of the code Jinja
    wrote for it (nothing folded in: about the source's size). Compiling a template costs far more
    than a cache lookup. Thread-safe: conversations are rendered on worker threads."""

    def __init__(self, max_entries: int = 64, max_bytes: int = 4 * 1024 * 1024) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._templates: OrderedDict[str, tuple[ChatTemplate, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._templates)

    @property
    def nbytes(self) -> int:
        """What the templates held are charged, together."""
        return self._bytes

    def get(self, source: str) -> ChatTemplate:
        """The compiled `source`; ChatTemplateError when it is over MAX_TEMPLATE_BYTES or does not
        compile (such a source is kept too, so it is not compiled again)."""
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"chat_template is {size} bytes, over the {MAX_TEMPLATE_BYTES} limit")
        with self._lock:
            entry = self._templates.get(source)
            if entry is not None:
                self._templates.move_to_end(source)
        template = entry[0] if entry is not None else None
        if template is None:
            template = ChatTemplate(source)  # outside the lock: other requests' lookups go on
            self._put(source, size + template.code_chars, template)
        if template.error is not None:
            raise ChatTemplateError(template.error)
        return template

    def _put(self, source: str, size: int, template: ChatTemplate) -> None:
        with self._lock:
            if source in self._templates:
                return
            self._templates[source] = (template, size)
            self._bytes += size
            while len(self._templates) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, evicted) = self._templates.popitem(last=False)
                self._bytes -= evicted


# ---------------------------------------------------------------------------------------------
# What templates read
# ---------------------------------------------------------------------------------------------


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
