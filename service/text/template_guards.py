"""The size-checking guards a template's operations run through (service.text.template_sandbox wires
them into the environment): str.format's fields, the methods of strings, bytes and integers a
template can call, every filter (the ones that may build more than their input are checked first,
`FILTER_CHECKS`; every result is checked and charged), and the operators `+` and `**`.
"""

from __future__ import annotations

import io
import pprint
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jinja2.filters
from jinja2.runtime import Context
from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import _PassArg, pass_context

from service.text.template_budget import MAX_VALUE_CHARS, charge, charged, check_size
from service.text.template_sizes import (
    as_number,
    checked_items,
    count_deleted,
    json_size,
    printf_size,
    repr_size,
    text_size,
)

# --- printf-style `%` and str.format ------------------------------------------------------------------

_FORMAT_SPEC = re.compile(
    r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[_,]?(?:\.(?P<precision>\d+))?[a-zA-Z%]?", re.DOTALL
)


class BoundedFormatting:
    """str.format's fields bounded as they are resolved: a field's conversion (`!r`), then its text
    with its width and precision, are checked before it is written, and the fields' sum with it."""

    _size = 0  # of the fields written so far, in this call

    def vformat(self, format_string: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        self._size = len(format_string)
        return super().vformat(format_string, args, kwargs)  # type: ignore[misc]

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion in ("r", "a"):
            check_size(chars=repr_size(value) * (10 if conversion == "a" else 1), what="format")
        elif conversion == "s":
            check_size(chars=text_size(value), what="format")
        return super().convert_field(value, conversion)  # type: ignore[misc]

    def format_field(self, value: Any, format_spec: str) -> Any:
        match = _FORMAT_SPEC.fullmatch(format_spec)
        width = int(match["width"] or 0) if match else 0
        precision = int(match["precision"] or 0) if match else 0
        body = text_size(value) if isinstance(value, str) else text_size(value) + precision + 330
        size = max(width, body)
        self._size += size
        check_size(chars=self._size, what="format")
        check_size(chars=size, what="format")
        return super().format_field(value, format_spec)  # type: ignore[misc]


class BoundedFormatter(BoundedFormatting, SandboxedFormatter):
    pass


class BoundedEscapeFormatter(BoundedFormatting, SandboxedEscapeFormatter):
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
        return max(n, as_number(arg(0, "width"))), 0
    if name == "expandtabs":
        return n + text.count("\t") * max(as_number(arg(0, "tabsize", 8)), 0), 0
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
        parts = (count_deleted(text, _WHITESPACE) if sep is None else owner.count(sep) if sep else 0) + 1
        return n, min(parts, most + 1) if isinstance(most, int) and most >= 0 else parts
    if name == "splitlines":
        return n, count_deleted(text, _LINE_BREAKS) + 1
    if name in ("upper", "lower", "swapcase", "title", "capitalize", "casefold"):
        return (n if owner.isascii() else 3 * n), 0
    if name in ("encode", "decode"):
        return (4 if arg(1, "errors", "strict") in _SAFE_ERRORS else 10) * n, 0
    if name == "hex":
        return 3 * n, 0
    return None


def check_call(
    obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Refuse a call whose result would be too large, before it is made; the arguments it will be
    made with (an iterator to be consumed whole is read into a bounded list first)."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    what = f"{type(owner).__name__}.{name}" if owner is not None else name
    if isinstance(owner, (str, bytes, bytearray)):
        if name == "join" and args:
            parts = checked_items(args[0], what)
            sizes = sum(text_size(p) for p in parts) + len(owner) * max(len(parts) - 1, 0)
            check_size(chars=sizes, what=what)
            return (parts, *args[1:]), kwargs
        size = _text_method_size(owner, name, args, kwargs)
        if size is not None:
            check_size(chars=size[0], items=size[1], what=what)
    elif isinstance(owner, int) and name == "to_bytes":
        check_size(chars=as_number(args[0] if args else kwargs.get("length", 1)), what=what)
    elif name == "fromkeys" and args:
        return (checked_items(args[0], what), *args[1:]), kwargs
    return args, kwargs


# --- Filters ----------------------------------------------------------------------------------------------

FilterCheck = Callable[..., Any]  # (environment, value, *args, **kwargs) -> value to run on; raises


def _check_text(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    """The filter writes the value's text, rewritten at most a few times over."""
    check_size(chars=text_size(value), what="text")
    return value


def _check_case(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    size = text_size(value)
    check_size(chars=size if isinstance(value, str) and value.isascii() else 3 * size, what="case")
    return value


def _check_escape(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    if not isinstance(value, str):
        check_size(chars=6 * text_size(value), what="escape")
        return value
    extra = 4 * (value.count("&") + value.count('"') + value.count("'")) + 3 * (
        value.count("<") + value.count(">")
    )
    check_size(chars=len(value) + extra, what="escape")
    return value


def _check_center(env: Any, value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> Any:
    check_size(chars=max(text_size(value), as_number(width)), what="center")
    return value


def _check_indent(env: Any, value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> Any:
    indent = len(width) if isinstance(width, str) else as_number(width)
    check_size(chars=indent, what="indent")
    size = text_size(value)
    lines = str(value).count("\n") + 2 if size <= MAX_VALUE_CHARS else 1
    check_size(chars=size + indent * lines, items=lines, what="indent")
    return value


def _check_format(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    check_size(chars=text_size(value), what="format")
    check_size(chars=printf_size(str(value), kwargs or args), what="format")
    return value


def _check_join(env: Any, value: Any, d: Any = "", attribute: Any = None, *args: Any, **kwargs: Any) -> Any:
    items = checked_items(value, "join")
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
    check_size(chars=size + text_size(d) * max(count - 1, 0), what="join")
    return items


def _check_replace(
    env: Any, value: Any, old: Any = "", new: Any = "", count: Any = None, **kwargs: Any
) -> Any:
    check_size(chars=text_size(value), what="replace")
    text = str(value)
    found = len(text) + 1 if not old else text.count(str(old))
    found = min(found, count) if isinstance(count, int) and count >= 0 else found
    check_size(chars=len(text) + found * max(text_size(new) - len(str(old)), 0), what="replace")
    return value


def _check_tojson(env: Any, value: Any, ensure_ascii: Any = False, indent: Any = None,
                  separators: Any = None, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    if not isinstance(indent, (int, str, type(None))):
        indent = None
    glue = sum(text_size(s) for s in separators) if isinstance(separators, (tuple, list)) else 0
    check_size(chars=json_size(value, indent, bool(ensure_ascii), glue), what="tojson")
    return value


class _BoundedStream(io.StringIO):
    """A stream that refuses to hold more than MAX_VALUE_CHARS characters."""

    def write(self, text: str) -> int:
        check_size(chars=self.tell() + len(text), what="pprint")
        return super().write(text)


def bounded_pprint(value: Any) -> str:
    """Jinja's `pprint` (pprint.pformat), written to a bounded stream: its indentation grows with
    the keys it is nested under, which no bound of the value's own text foresees."""
    check_size(chars=repr_size(value), what="pprint")
    stream = _BoundedStream()
    pprint.PrettyPrinter(stream=stream).pprint(value)
    return stream.getvalue()[:-1]  # pprint ends with a new line, pformat does not


def _check_wordwrap(env: Any, value: Any, width: Any = 79, break_long_words: Any = True,
                    wrapstring: Any = None, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    size = text_size(value)
    check_size(chars=size, what="wordwrap")
    text = str(value)
    lines = len(text) // max(as_number(width), 1) + text.count("\n") + 2
    glue = text_size(wrapstring) if wrapstring is not None else 2
    check_size(chars=size + lines * glue, items=lines, what="wordwrap")
    return value


def _check_truncate(env: Any, value: Any, length: Any = 255, killwords: Any = False, end: Any = "...",
                    *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    check_size(chars=text_size(value) + text_size(end), what="truncate")
    return value


def _check_urlize(env: Any, value: Any, trim_url_limit: Any = None, nofollow: Any = False, target: Any = None,
                  rel: Any = None, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    size = text_size(value)
    words = size // 2 + 1
    check_size(
        chars=3 * size + words * (100 + text_size(target) + text_size(rel)), items=words, what="urlize"
    )
    return value


def _check_urlencode(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    check_size(chars=12 * text_size(value), what="urlencode")  # %XX for each of up to 4 bytes
    return value


def _check_xmlattr(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    check_size(chars=6 * text_size(value), what="xmlattr")  # escaped
    return value


def _check_batch(env: Any, value: Any, linecount: Any = 1, *args: Any, **kwargs: Any) -> Any:
    check_size(items=as_number(linecount), what="batch")
    return checked_items(value, "batch")


def _check_slice(env: Any, value: Any, slices: Any = 1, *args: Any, **kwargs: Any) -> Any:
    check_size(items=as_number(slices), what="slice")
    return checked_items(value, "slice")


def _check_items(env: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    """The filter consumes its input whole."""
    return checked_items(value, "filter")


# Filters that may build more than their input (or read it whole), and what checks them first; every
# other filter's result is checked and charged when it exists.
FILTER_CHECKS: dict[str, FilterCheck] = {
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


def bounded_filter(name: str, original: Callable[..., Any], check: FilterCheck | None) -> Callable[..., Any]:
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
        return charged(result, name)

    bounded.__name__ = getattr(original, "__name__", name)
    return bounded


def bounded_sum(env: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's `sum`, bounded: numbers summed at once; sequences added one at a time, each sum
    bounded (the builtin would add them quadratically in one C call)."""
    items = checked_items(iterable, "sum")
    if attribute is not None:
        items = list(map(jinja2.filters.make_attrgetter(env, attribute), items))
    if all(isinstance(item, (int, float)) for item in items) and isinstance(start, (int, float)):
        return sum(items, start)
    total = start
    for item in items:
        total = bounded_add(total, item)
    return total


def bounded_wordcount(value: Any) -> int:
    """Jinja's `wordcount`, counted as it goes rather than from a list of every word."""
    check_size(chars=text_size(value), what="wordcount")
    return sum(1 for _ in re.finditer(r"\w+", str(value)))


# --- Operators ----------------------------------------------------------------------------------------------


def bounded_add(left: Any, right: Any) -> Any:
    if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
        charge(chars=len(left) + len(right), what="+")
    elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        charge(items=len(left) + len(right), what="+")
    return left + right


def power_bits(base: Any, exponent: Any) -> int:
    """About the bits of `base ** exponent` between integers (0 for anything else)."""
    if not isinstance(base, int) or not isinstance(exponent, int) or exponent <= 0 or abs(base) <= 1:
        return 0
    return exponent * base.bit_length()
