"""The Jinja environment chat templates run in, and the bounds on what a template may build.

The environment is transformers': Jinja's `ImmutableSandboxedEnvironment` with `trim_blocks`,
`lstrip_blocks` and the loop-control extension; the globals `raise_exception`, `strftime_now`,
`dict` and a `namespace` that refuses underscore-prefixed attributes; a `tojson` filter that does
not HTML-escape (service.text.chat_template says why each matters).

A template is code, from a model's author or (where the operator trusts requests with it) from a
client, and Jinja lets one operation build a value of any size: `'x'|center(1000000000)`,
`'%1000000000d' % 1`, `messages|tojson(indent=300000000)`, `'{:>1000000000}'.format(x)`. One such
operation is one long C call: it holds the interpreter lock (the server's event loop and its health
probes wait) and takes gigabytes before anything can look at its size. So, here:

1. Nothing is evaluated while compiling. Jinja folds constant expressions when it compiles (its
   optimizer, and the compiler's own constant output), outside any render's limits and into the
   compiled code a cache keeps. The optimizer is off; every binary operator is intercepted and every
   filter and the output step take the render's context, which makes Jinja leave each to run time.
   A compiled template holds the template's literals and the code Jinja writes for it, no more.
2. Every operation that can build a value larger than its operands checks, before building it, an
   upper bound of its size: the operators `+ * % **` and `~`, every filter, the methods of strings,
   bytes and integers a template can call (`center`, `zfill`, `expandtabs`, `replace`, `join`,
   `translate`, `split`, `to_bytes`, ...), `str.format` (each field once its width and precision
   are resolved), printf-style `%` (`*` widths included), and the text of a value (output, `~`,
   `string`, `%s`, `join`). No value may hold more than MAX_VALUE_CHARS characters or, for a list,
   tuple or dict, MAX_VALUE_ITEMS items.
3. Each value so built, and each piece of output (literal text included: output gathered by a
   `{% set %}` block or a macro is held until it is joined), is charged to the render's budget:
   MAX_BUILT_CHARS characters and MAX_BUILT_ITEMS items in all. What a render holds beside its
   input is what it built, so at most MAX_BUILT_CHARS characters (4 bytes each at most) and
   MAX_BUILT_ITEMS items (a slot, and an object where the item is a new one).

Sizes are upper bounds from the operands (`text_size`: exact for a string, from the digits of a
number, summed over a container's items with room for their quoting); an operation that only
rewrites its input (case, escaping, trimming) is bounded by a small multiple of it, and its result
is checked and charged when it exists. With service.text.render_limit's CPU-time watchdog this
bounds a render: every operation is a bounded one (tens of milliseconds of one C call at most, on a
value of MAX_VALUE_CHARS), so the interpreter lock changes hands between them and the server answers
while a template runs; a render stops at its CPU seconds or the first bound it passes, and what it
built is freed then. A render runs inside `bounded_render`, which gives it its budget.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import pprint
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.filters
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.nodes import Concat
from jinja2.runtime import Context, Undefined, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace, _PassArg, pass_context
from markupsafe import Markup

__all__ = [
    "MAX_BUILT_CHARS",
    "MAX_BUILT_ITEMS",
    "MAX_VALUE_CHARS",
    "MAX_VALUE_ITEMS",
    "ChatTemplateError",
    "TemplateEnvironment",
    "bounded_render",
    "jinja_env",
    "printf_size",
    "text_size",
]

# Characters one value may hold: twice the largest request body (NIM_MAX_REQUEST_BYTES' default),
# so no conversation a request can carry is refused. It is also the most a render may output.
MAX_VALUE_CHARS = 32 * 1024 * 1024
MAX_VALUE_ITEMS = 1 << 20  # items one list, tuple or dict may hold (sorting a million in C: ~0.5 s)
MAX_BUILT_CHARS = 4 * MAX_VALUE_CHARS  # characters all the values one render builds hold together
MAX_BUILT_ITEMS = 4 * MAX_VALUE_ITEMS
MAX_POWER_BITS = 1 << 16  # `a ** b` between integers: the largest result, in bits
MAX_MESSAGE_CHARS = 1000  # of a template's own error message (raise_exception)


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, or refused to render these messages."""


# --- The render's budget ------------------------------------------------------------------------------


@dataclass
class _Budget:
    chars: int = 0
    items: int = 0


_local = threading.local()  # .budget: the render on this thread's (renders run one per thread)


@contextlib.contextmanager
def bounded_render() -> Iterator[None]:
    """A render on this thread: what it builds is charged to a fresh budget."""
    outer = getattr(_local, "budget", None)
    _local.budget = _Budget()
    try:
        yield
    finally:
        _local.budget = outer


def _check(chars: int = 0, items: int = 0, what: str = "") -> None:
    """Refuse a value of `chars` characters or `items` items before it is built (naming the
    operation, `what`): over the bound of one value, or of what the render may build in all."""
    if chars > MAX_VALUE_CHARS:
        raise ChatTemplateError(
            f"chat template would build a value of over {MAX_VALUE_CHARS} characters ({what}); stopped"
        )
    if items > MAX_VALUE_ITEMS:
        raise ChatTemplateError(
            f"chat template would build a value of over {MAX_VALUE_ITEMS} items ({what}); stopped"
        )
    budget: _Budget | None = getattr(_local, "budget", None)
    if budget is None:  # not rendering: compiling evaluates nothing that comes here
        return
    if budget.chars + chars > MAX_BUILT_CHARS:
        raise ChatTemplateError(
            f"chat template would build over {MAX_BUILT_CHARS} characters in all ({what}); stopped"
        )
    if budget.items + items > MAX_BUILT_ITEMS:
        raise ChatTemplateError(
            f"chat template would build over {MAX_BUILT_ITEMS} items in all ({what}); stopped"
        )


def _charge(chars: int = 0, items: int = 0, what: str = "") -> None:
    """`_check`, then charge the value (about to be built, or built) to the render's budget."""
    _check(chars, items, what)
    budget: _Budget | None = getattr(_local, "budget", None)
    if budget is not None:
        budget.chars += chars
        budget.items += items


def _charged(value: Any, what: str) -> Any:
    """`value`, built: checked and charged by its size (strings by characters, containers by items)."""
    if isinstance(value, (str, bytes, bytearray)):
        _charge(chars=len(value), what=what)
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        _charge(items=len(value), what=what)
    return value


# --- Sizes ----------------------------------------------------------------------------------------------

_CONTROLS = dict.fromkeys(range(32))  # str.translate deletes them
_OTHER_OBJECT_CHARS = 256  # the text of a loop, macro, range, generator, ...: a short repr


def _count_deleted(text: str, table: dict[int, None]) -> int:
    """How many characters of `text` the deletion `table` names (one C pass)."""
    return len(text) - len(text.translate(table))


def _quoted_size(text: str) -> int:
    """An upper bound of len(repr(text)): quotes, and escapes for backslashes, quotes, controls
    (4 characters each at most) and other unprintable characters (10 at most)."""
    size = len(text) + 2 + text.count("\\") + text.count("'")
    if text.isprintable():
        return size
    controls = _count_deleted(text, _CONTROLS)
    return size + 3 * controls + (0 if text.isascii() else 9 * (len(text) - controls))


def _json_string_size(text: str, ensure_ascii: bool) -> int:
    """An upper bound of len(json.dumps(text))."""
    size = len(text) + 2 + text.count("\\") + text.count('"') + 5 * _count_deleted(text, _CONTROLS)
    if ensure_ascii and not text.isascii():
        size += 11 * len(text)  # \\uXXXX, twice for a character past the BMP
    return size


def text_size(value: Any, limit: int = MAX_VALUE_CHARS) -> int:
    """An upper bound of len(str(value)), or limit + 1 once past `limit` (the walk stops there)."""
    return _walk(value, limit, _atom_text, 2, 0)


def _atom_text(value: Any, nested: bool) -> int | None:
    """The text size of a value that holds no others (nested: as its repr inside a container);
    None for a container."""
    if isinstance(value, str):
        return _quoted_size(value) if nested else len(value)
    if isinstance(value, (bytes, bytearray)):
        return 4 * len(value) + 14
    if value is None or isinstance(value, (bool, float)):
        return 32
    if isinstance(value, int):
        return value.bit_length() * 3 // 10 + 2
    if isinstance(value, Undefined):
        return 16 if nested else 0
    if isinstance(value, (list, tuple, set, frozenset, dict, Namespace)) or _is_view(value):
        return None
    return _OTHER_OBJECT_CHARS


def _repr_size(value: Any) -> int:
    """An upper bound of len(repr(value))."""
    return _quoted_size(value) if isinstance(value, str) else text_size(value)


def _is_view(value: Any) -> bool:
    return isinstance(value, (type({}.keys()), type({}.values()), type({}.items())))


def _children(value: Any) -> Iterable[Any]:
    if isinstance(value, Namespace):
        value = value._Namespace__attrs
    if isinstance(value, dict):
        return itertools.chain.from_iterable(value.items())
    return value


def _walk(value: Any, limit: int, atom: Callable[[Any, bool], int | None], per_item: int, indent: int) -> int:
    """Sum `atom` over `value` and everything it holds, `per_item` for each item's separators and
    (with `indent`) a new line indented to its depth; limit + 1 once past `limit`."""
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        size = atom(item, depth > 0)
        if size is None:  # a container: its brackets, then its items a level deeper
            size = 16
            stack.extend((child, depth + 1) for child in _children(item))
        total += size + per_item + (indent * depth + 1 if indent else 0)
        if total > limit:
            return limit + 1
    return total


def _json_size(value: Any, indent: Any, ensure_ascii: bool, separators: int = 0) -> int:
    """An upper bound of len(json.dumps(value, indent=indent)): every item on a line of its own,
    indented to its depth, when `indent` is given; `separators`: their length, where given."""
    width = len(indent) if isinstance(indent, str) else max(int(indent), 0) if indent is not None else 0

    def atom(item: Any, nested: bool) -> int | None:
        if isinstance(item, str):
            return _json_string_size(item, ensure_ascii)
        return _atom_text(item, nested)

    return _walk(value, MAX_VALUE_CHARS, atom, 4 + separators, width + (1 if indent is not None else 0))


def _items(value: Any, what: str) -> Any:
    """`value` to be iterated whole: a sized collection as it is (refused over MAX_VALUE_ITEMS),
    an iterator read into a list up to that many."""
    if isinstance(value, (str, bytes, bytearray)):
        _check(items=len(value), what=what)
        return value
    if isinstance(value, Sized):
        _check(items=len(value), what=what)
        return value
    if isinstance(value, Iterable):
        items = list(itertools.islice(value, MAX_VALUE_ITEMS + 1))
        _check(items=len(items), what=what)
        return items
    return value


def _number(value: Any) -> int:
    """An int argument (a width, a count), 0 for what is not one (the operation fails on it)."""
    return value if isinstance(value, int) else 0


# --- printf-style `%` and str.format ------------------------------------------------------------------

_PRINTF = re.compile(
    r"%(?:\((?P<key>[^)]*)\))?[-#0 +]*(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d+))?[hlL]?(?P<type>.?)",
    re.DOTALL,
)


def printf_size(template: str | bytes | bytearray, args: Any) -> int:
    """An upper bound of len(template % args), widths, precisions and `*` included."""
    text = template.decode("latin-1") if isinstance(template, (bytes, bytearray)) else template
    positional = list(args) if isinstance(args, tuple) else [args]
    mapping = args if isinstance(args, Mapping) else None
    size = len(text)
    for match in _PRINTF.finditer(text):
        if match["type"] == "%":
            continue

        def take() -> Any:
            return positional.pop(0) if positional else None

        width = _number(take()) if match["width"] == "*" else int(match["width"] or 0)
        precision = _number(take()) if match["precision"] == "*" else int(match["precision"] or 0)
        value = mapping.get(match["key"]) if mapping is not None and match["key"] is not None else take()
        kind = match["type"]
        if kind in ("s", "r", "a"):
            body = text_size(value) if kind == "s" else _repr_size(value) * (10 if kind == "a" else 1)
        elif isinstance(value, int) and kind in "diouxXc":
            body = value.bit_length() + 4  # at most one character a bit (binary is not offered)
        else:
            body = 330  # a float in full, or a character
        size += max(abs(width), body + precision)
        if size > MAX_VALUE_CHARS:
            break
    return size


_FORMAT_SPEC = re.compile(
    r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[_,]?(?:\.(?P<precision>\d+))?[a-zA-Z%]?", re.DOTALL
)


class _BoundedFormatting:
    """str.format's fields bounded as they are resolved: a field's conversion (`!r`), then its text
    with its width and precision, are checked before it is written, and the fields' sum with it."""

    _size = 0  # of the fields written so far, in this call

    def vformat(self, format_string: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        self._size = len(format_string)
        return super().vformat(format_string, args, kwargs)  # type: ignore[misc]

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion in ("r", "a"):
            _check(chars=_repr_size(value) * (10 if conversion == "a" else 1), what="format")
        elif conversion == "s":
            _check(chars=text_size(value), what="format")
        return super().convert_field(value, conversion)  # type: ignore[misc]

    def format_field(self, value: Any, format_spec: str) -> Any:
        match = _FORMAT_SPEC.fullmatch(format_spec)
        width = int(match["width"] or 0) if match else 0
        precision = int(match["precision"] or 0) if match else 0
        body = text_size(value) if isinstance(value, str) else text_size(value) + precision + 330
        size = max(width, body)
        self._size += size
        _check(chars=self._size, what="format")
        _check(chars=size, what="format")
        return super().format_field(value, format_spec)  # type: ignore[misc]


class _Formatter(_BoundedFormatting, SandboxedFormatter):
    pass


class _EscapeFormatter(_BoundedFormatting, SandboxedEscapeFormatter):
    pass


# --- Methods a template can call ------------------------------------------------------------------------

_WHITESPACE = dict.fromkeys(ord(c) for c in " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2028\u2029\u3000")
_WHITESPACE.update(dict.fromkeys(range(0x2000, 0x200B)))
_WHITESPACE.update({0x202F: None, 0x205F: None})
_LINE_BREAKS = dict.fromkeys(ord(c) for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
_SAFE_ERRORS = ("strict", "ignore", "replace", "surrogateescape", "surrogatepass")


def _text_method_size(owner: str | bytes | bytearray, name: str, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[int, int] | None:  # fmt: skip
    """(characters, items) a string or bytes method would build at most, for the methods whose
    result may outgrow its receiver by more than a small factor; None for the others."""

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    n = len(owner)
    text = owner if isinstance(owner, str) else owner.decode("latin-1")
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(n, _number(arg(0, "width"))), 0
    if name == "expandtabs":
        return n + text.count("\t") * max(_number(arg(0, "tabsize", 8)), 0), 0
    if name == "replace":
        old, new, count = arg(0, "old", ""), arg(1, "new", ""), arg(2, "count", -1)
        if not isinstance(old, (str, bytes)) or not isinstance(new, (str, bytes)):
            return None
        found = n + 1 if not old else owner.count(old)  # type: ignore[arg-type]
        found = min(found, count) if isinstance(count, int) and count >= 0 else found
        return n + found * max(len(new) - len(old), 0), 0
    if name == "translate":
        table = arg(0, "table")
        longest = max((len(v) for v in table.values() if isinstance(v, (str, bytes))), default=1) if (
            isinstance(table, Mapping)) else 1  # fmt: skip
        return n * max(longest, 1), 0
    if name in ("split", "rsplit"):
        sep, most = arg(0, "sep"), arg(1, "maxsplit", -1)
        parts = (_count_deleted(text, _WHITESPACE) if sep is None else owner.count(sep) if sep else 0) + 1
        return n, min(parts, most + 1) if isinstance(most, int) and most >= 0 else parts
    if name == "splitlines":
        return n, _count_deleted(text, _LINE_BREAKS) + 1
    if name in ("upper", "lower", "swapcase", "title", "capitalize", "casefold"):
        return (n if owner.isascii() else 3 * n), 0
    if name in ("encode", "decode"):
        return (4 if arg(1, "errors", "strict") in _SAFE_ERRORS else 10) * n, 0
    if name == "hex":
        return 3 * n, 0
    return None


def _check_call(
    obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Refuse a call whose result would be too large, before it is made; the arguments it will be
    made with (an iterator to be consumed whole is read into a bounded list first)."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    what = f"{type(owner).__name__}.{name}" if owner is not None else name
    if isinstance(owner, (str, bytes, bytearray)):
        if name == "join" and args:
            parts = _items(args[0], what)
            sizes = sum(text_size(p) for p in parts) + len(owner) * max(len(parts) - 1, 0)
            _check(chars=sizes, what=what)
            return (parts, *args[1:]), kwargs
        size = _text_method_size(owner, name, args, kwargs)
        if size is not None:
            _check(chars=size[0], items=size[1], what=what)
    elif isinstance(owner, int) and name == "to_bytes":
        _check(chars=_number(args[0] if args else kwargs.get("length", 1)), what=what)
    elif name == "fromkeys" and args:
        return (_items(args[0], what), *args[1:]), kwargs
    return args, kwargs


# --- Filters ----------------------------------------------------------------------------------------------

FilterCheck = Callable[..., Any]  # (environment, value, *args, **kwargs) -> value to run on; raises


def _check_text(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    """The filter writes the value's text, rewritten at most a few times over."""
    _check(chars=text_size(value), what="text")
    return value


def _check_case(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    size = text_size(value)
    _check(chars=size if isinstance(value, str) and value.isascii() else 3 * size, what="case")
    return value


def _check_escape(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    if not isinstance(value, str):
        _check(chars=6 * text_size(value), what="escape")
        return value
    extra = 4 * (value.count("&") + value.count('"') + value.count("'")) + 3 * (
        value.count("<") + value.count(">")
    )
    _check(chars=len(value) + extra, what="escape")
    return value


def _check_center(env: Any, value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> Any:
    _check(chars=max(text_size(value), _number(width)), what="center")
    return value


def _check_indent(env: Any, value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> Any:
    indent = len(width) if isinstance(width, str) else _number(width)
    _check(chars=indent, what="indent")
    size = text_size(value)
    lines = str(value).count("\n") + 2 if size <= MAX_VALUE_CHARS else 1
    _check(chars=size + indent * lines, items=lines, what="indent")
    return value


def _check_format(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    _check(chars=text_size(value), what="format")
    _check(chars=printf_size(str(value), kwargs or args), what="format")
    return value


def _check_join(env: Any, value: Any, d: Any = "", attribute: Any = None, *args: Any, **kwargs: Any) -> Any:
    items = _items(value, "join")
    parts: Iterable[Any] = items
    if attribute is not None:
        parts = map(jinja2.filters.make_attrgetter(env, attribute), items)
    size = 0
    count = 0
    for part in parts:
        size += text_size(part)
        count += 1
        if size > MAX_VALUE_CHARS:
            break
    _check(chars=size + text_size(d) * max(count - 1, 0), what="join")
    return items


def _check_replace(
    env: Any, value: Any, old: Any = "", new: Any = "", count: Any = None, **kwargs: Any
) -> Any:
    _check(chars=text_size(value), what="replace")
    text = str(value)
    found = len(text) + 1 if not old else text.count(str(old))
    found = min(found, count) if isinstance(count, int) and count >= 0 else found
    _check(chars=len(text) + found * max(text_size(new) - len(str(old)), 0), what="replace")
    return value


def _check_tojson(env: Any, value: Any, ensure_ascii: Any = False, indent: Any = None,
                  separators: Any = None, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    if not isinstance(indent, (int, str, type(None))):
        indent = None
    glue = sum(text_size(s) for s in separators) if isinstance(separators, (tuple, list)) else 0
    _check(chars=_json_size(value, indent, bool(ensure_ascii), glue), what="tojson")
    return value


class _BoundedStream(io.StringIO):
    """A stream that refuses to hold more than MAX_VALUE_CHARS characters."""

    def write(self, text: str) -> int:
        _check(chars=self.tell() + len(text), what="pprint")
        return super().write(text)


def _pprint(value: Any) -> str:
    """Jinja's `pprint` (pprint.pformat), written to a bounded stream: its indentation grows with
    the keys it is nested under, which no bound of the value's own text foresees."""
    _check(chars=_repr_size(value), what="pprint")
    stream = _BoundedStream()
    pprint.PrettyPrinter(stream=stream).pprint(value)
    return stream.getvalue()[:-1]  # pprint ends with a new line, pformat does not


def _check_wordwrap(env: Any, value: Any, width: Any = 79, break_long_words: Any = True,
                    wrapstring: Any = None, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    size = text_size(value)
    _check(chars=size, what="wordwrap")
    text = str(value)
    lines = len(text) // max(_number(width), 1) + text.count("\n") + 2
    glue = text_size(wrapstring) if wrapstring is not None else 2
    _check(chars=size + lines * glue, items=lines, what="wordwrap")
    return value


def _check_truncate(env: Any, value: Any, length: Any = 255, killwords: Any = False, end: Any = "...",
                    *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    _check(chars=text_size(value) + text_size(end), what="truncate")
    return value


def _check_urlize(env: Any, value: Any, trim_url_limit: Any = None, nofollow: Any = False, target: Any = None,
                  rel: Any = None, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    size = text_size(value)
    words = size // 2 + 1
    _check(chars=3 * size + words * (100 + text_size(target) + text_size(rel)), items=words, what="urlize")
    return value


def _check_urlencode(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    _check(chars=12 * text_size(value), what="urlencode")  # %XX for each of up to 4 bytes
    return value


def _check_xmlattr(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    _check(chars=6 * text_size(value), what="xmlattr")  # escaped
    return value


def _check_batch(env: Any, value: Any, linecount: Any = 1, *args: Any, **kwargs: Any) -> Any:
    _check(items=_number(linecount), what="batch")
    return _items(value, "batch")


def _check_slice(env: Any, value: Any, slices: Any = 1, *args: Any, **kwargs: Any) -> Any:
    _check(items=_number(slices), what="slice")
    return _items(value, "slice")


def _check_items(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    """The filter consumes its input whole."""
    return _items(value, "filter")


# Filters that may build more than their input (or read it whole), and what checks them first; every
# other filter's result is checked and charged when it exists.
_CHECKS: dict[str, FilterCheck] = {
    "center": _check_center,
    "indent": _check_indent,
    "format": _check_format,
    "join": _check_join,
    "replace": _check_replace,
    "tojson": _check_tojson,
    "wordwrap": _check_wordwrap,
    "truncate": _check_truncate,
    "urlize": _check_urlize,
    "batch": _check_batch,
    "slice": _check_slice,
    "string": _check_text,
    "safe": _check_text,
    "trim": _check_text,
    "striptags": _check_text,
    "urlencode": _check_urlencode,
    "xmlattr": _check_xmlattr,
    "e": _check_escape,
    "escape": _check_escape,
    "forceescape": _check_escape,
    "upper": _check_case,
    "lower": _check_case,
    "title": _check_case,
    "capitalize": _check_case,
    **dict.fromkeys(("list", "sort", "unique", "groupby", "dictsort", "min", "max", "reverse"), _check_items),
}


def _bounded_filter(name: str, original: Callable[..., Any], check: FilterCheck | None) -> Callable[..., Any]:
    """`original`, checked before it runs and its result charged after; it takes the render's
    context, which keeps Jinja from running it while compiling."""
    passes = _PassArg.from_obj(original)

    @pass_context
    def bounded(context: Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        if check is not None:
            value = check(context.environment, value, *args, **kwargs)
        if passes is _PassArg.context:
            result = original(context, value, *args, **kwargs)
        elif passes is _PassArg.eval_context:
            result = original(context.eval_ctx, value, *args, **kwargs)
        elif passes is _PassArg.environment:
            result = original(context.environment, value, *args, **kwargs)
        else:
            result = original(value, *args, **kwargs)
        return _charged(result, name)

    bounded.__name__ = getattr(original, "__name__", name)
    return bounded


def _sum(env: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's `sum`, bounded: numbers summed at once; sequences added one at a time, each sum
    bounded (the builtin would add them quadratically in one C call)."""
    items = _items(iterable, "sum")
    if attribute is not None:
        items = list(map(jinja2.filters.make_attrgetter(env, attribute), items))
    if all(isinstance(item, (int, float)) for item in items) and isinstance(start, (int, float)):
        return sum(items, start)
    total = start
    for item in items:
        total = _add(total, item)
    return total


def _wordcount(value: Any) -> int:
    """Jinja's `wordcount`, counted as it goes rather than from a list of every word."""
    _check(chars=text_size(value), what="wordcount")
    return sum(1 for _ in re.finditer(r"\w+", str(value)))


# --- Operators ----------------------------------------------------------------------------------------------


def _add(left: Any, right: Any) -> Any:
    if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
        _charge(chars=len(left) + len(right), what="+")
    elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        _charge(items=len(left) + len(right), what="+")
    return left + right


def _power_bits(base: Any, exponent: Any) -> int:
    """About the bits of `base ** exponent` between integers (0 for anything else)."""
    if not isinstance(base, int) or not isinstance(exponent, int) or exponent <= 0 or abs(base) <= 1:
        return 0
    return exponent * base.bit_length()


# --- The environment ---------------------------------------------------------------------------------------


class _CodeGenerator(CodeGenerator):
    """Jinja's compiler, with `~` joined by the environment (which bounds it) and literal output
    charged to the render (it may be gathered, many times over, by a loop in a `{% set %}` block)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.join_text(context, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _output_const_repr(self, group: Iterable[Any]) -> str:
        return f"environment.literal({super()._output_const_repr(group)})"


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox whose every value-building operation is bounded (see the module)."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})  # none is folded at compile

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            return _add(left, right)
        if operator == "*":
            for value, times in ((left, right), (right, left)):
                if isinstance(value, (str, bytes, list, tuple)) and isinstance(times, int):
                    size = len(value) * max(times, 0)
                    _charge(
                        **({"chars": size} if isinstance(value, (str, bytes)) else {"items": size}), what="*"
                    )
        elif operator == "%" and isinstance(left, (str, bytes, bytearray)):
            _charge(chars=printf_size(left, right), what="%")
        elif operator == "**" and _power_bits(left, right) > MAX_POWER_BITS:
            raise ChatTemplateError(f"chat template computed a power of over {MAX_POWER_BITS} bits; stopped")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _check_call(__obj, args, kwargs)
        return _charged(super().call(__context, __obj, *args, **kwargs), getattr(__obj, "__name__", "call"))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format and format_map through the bounded formatter (Jinja's own, sandboxed)."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        owner: str = value.__self__
        formatter: _BoundedFormatting
        if isinstance(owner, Markup):
            formatter = _EscapeFormatter(self, escape=owner.escape)
        else:
            formatter = _Formatter(self)
        is_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if not is_map:
                return type(owner)(formatter.vformat(owner, args, kwargs))
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one argument and no keywords")
            return type(owner)(formatter.vformat(owner, (), args[0]))

        bounded.__name__ = value.__name__
        return bounded

    def handle_exception(self, source: str | None = None) -> NoReturn:
        """Re-raise a render's exception as it is. Jinja rewrites its traceback to show template
        lines, with frames made to hold the template's variables, tied to the exception in a cycle:
        all the render built would stay in memory until the cyclic collector ran (our refusals
        name no template line)."""
        raise  # the exception being handled: this runs inside Jinja's except

    def join_text(self, context: Context, parts: Sequence[Any]) -> str:
        """`a ~ b ~ ...`: each part's text, joined."""
        _charge(chars=sum(text_size(p) for p in parts), what="~")
        return markup_join(parts) if context.eval_ctx.autoescape else str_join(parts)

    @staticmethod
    def literal(text: str) -> str:
        """A piece of the template's own text, output."""
        _charge(chars=len(text), items=1, what="output")
        return text


@pass_context
def _output(context: Context, value: Any) -> Any:
    """The finalize step: an output value's text is checked and charged before it is written."""
    _charge(chars=text_size(value), items=1, what="output")
    return value


def _raise_exception(message: Any) -> None:
    text = str(message) if isinstance(message, str) else "raise_exception"
    raise ChatTemplateError(text[:MAX_MESSAGE_CHARS])


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # Jinja's own `tojson` HTML-escapes; templates are written against transformers' version, which does not.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: Any) -> str:
    # strftime writes up to 256 characters per format character (Python's time.strftime stops there)
    _check(chars=256 * text_size(fmt), what="strftime_now")
    return datetime.now().strftime(fmt)


def _lipsum(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> Any:
    _check(chars=_number(n) * (_number(max) * 16 + 32), items=_number(n), what="lipsum")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*(_items(a, "dict") for a in args), **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(_items(keys, "dict.fromkeys"), value)


class _TemplateNamespace(Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
            )


_ENV: TemplateEnvironment | None = None
_ENV_LOCK = threading.Lock()


def jinja_env() -> TemplateEnvironment:
    """The environment transformers renders chat templates in (less its `{% generation %}` tag),
    bounded."""
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            env = TemplateEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[jinja2.ext.loopcontrols],
                optimized=False,
                finalize=_output,
            )
            env.filters["tojson"] = _tojson
            env.filters["pprint"] = _pprint
            env.filters["sum"] = pass_context(lambda context, *a, **k: _sum(context.environment, *a, **k))
            env.filters["wordcount"] = _wordcount
            env.filters = {
                name: _bounded_filter(name, original, _CHECKS.get(name))
                for name, original in env.filters.items()
            }
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.globals["lipsum"] = _lipsum
            env.globals["dict"] = _TemplateDict()
            env.globals["namespace"] = _TemplateNamespace
            _ENV = env
        return _ENV
