"""Upper bounds of sizes, computed before a value is built: `text_size` (exact for a string, from the
digits of a number, summed over a container's items with room for their quoting), the size of a
value's JSON or repr, and `printf_size` for printf-style `%` (`*` widths included).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any

from jinja2.runtime import Undefined
from jinja2.utils import Namespace

from service.text.template_budget import MAX_VALUE_CHARS, MAX_VALUE_ITEMS, check_size

_CONTROLS = dict.fromkeys(range(32))  # str.translate deletes them
_OTHER_OBJECT_CHARS = 256  # the text of a loop, macro, range, generator, ...: a short repr


def count_deleted(text: str, table: dict[int, None]) -> int:
    """How many characters of `text` the deletion `table` names (one C pass)."""
    return len(text) - len(text.translate(table))


def _quoted_size(text: str) -> int:
    """An upper bound of len(repr(text)): quotes, and escapes for backslashes, quotes, controls
    (4 characters each at most) and other unprintable characters (10 at most)."""
    size = len(text) + 2 + text.count("\\") + text.count("'")
    if text.isprintable():
        return size
    controls = count_deleted(text, _CONTROLS)
    return size + 3 * controls + (0 if text.isascii() else 9 * (len(text) - controls))


def _json_string_size(text: str, ensure_ascii: bool) -> int:
    """An upper bound of len(json.dumps(text))."""
    size = len(text) + 2 + text.count("\\") + text.count('"') + 5 * count_deleted(text, _CONTROLS)
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


def repr_size(value: Any) -> int:
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


def json_size(value: Any, indent: Any, ensure_ascii: bool, separators: int = 0) -> int:
    """An upper bound of len(json.dumps(value, indent=indent)): every item on a line of its own,
    indented to its depth, when `indent` is given; `separators`: their length, where given."""
    width = len(indent) if isinstance(indent, str) else max(int(indent), 0) if indent is not None else 0

    def atom(item: Any, nested: bool) -> int | None:
        if isinstance(item, str):
            return _json_string_size(item, ensure_ascii)
        return _atom_text(item, nested)

    return _walk(value, MAX_VALUE_CHARS, atom, 4 + separators, width + (1 if indent is not None else 0))


def checked_items(value: Any, what: str) -> Any:
    """`value` to be iterated whole: a sized collection as it is (refused over MAX_VALUE_ITEMS),
    an iterator read into a list up to that many."""
    if isinstance(value, (str, bytes, bytearray)):
        check_size(items=len(value), what=what)
        return value
    if isinstance(value, Sized):
        check_size(items=len(value), what=what)
        return value
    if isinstance(value, Iterable):
        items = list(itertools.islice(value, MAX_VALUE_ITEMS + 1))
        check_size(items=len(items), what=what)
        return items
    return value


def as_number(value: Any) -> int:
    """An int argument (a width, a count), 0 for what is not one (the operation fails on it)."""
    return value if isinstance(value, int) else 0


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

        width = as_number(take()) if match["width"] == "*" else int(match["width"] or 0)
        precision = as_number(take()) if match["precision"] == "*" else int(match["precision"] or 0)
        value = mapping.get(match["key"]) if mapping is not None and match["key"] is not None else take()
        kind = match["type"]
        if kind in ("s", "r", "a"):
            body = text_size(value) if kind == "s" else repr_size(value) * (10 if kind == "a" else 1)
        elif isinstance(value, int) and kind in "diouxXc":
            body = value.bit_length() + 4  # at most one character a bit (binary is not offered)
        else:
            body = 330  # a float in full, or a character
        size += max(abs(width), body + precision)
        if size > MAX_VALUE_CHARS:
            break
    return size
