"""What one chat-template render may build, and its budget: the bounds on one value (MAX_VALUE_CHARS
characters, MAX_VALUE_ITEMS items) and on all a render builds together (MAX_BUILT_*), checked before a
value is built (`check_size`) and charged to the render's budget when it is (`charge`, `charged`).
A render runs inside `bounded_render`, which gives it a fresh budget on its thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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


def check_size(chars: int = 0, items: int = 0, what: str = "") -> None:
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


def charge(chars: int = 0, items: int = 0, what: str = "") -> None:
    """`check_size`, then charge the value (about to be built, or built) to the render's budget."""
    check_size(chars, items, what)
    budget: _Budget | None = getattr(_local, "budget", None)
    if budget is not None:
        budget.chars += chars
        budget.items += items


def charged(value: Any, what: str) -> Any:
    """`value`, built: checked and charged by its size (strings by characters, containers by items)."""
    if isinstance(value, (str, bytes, bytearray)):
        charge(chars=len(value), what=what)
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        charge(items=len(value), what=what)
    return value
