"""Small helpers that each have exactly one home."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: how many b-sized pieces hold a."""
    return -(-a // b)


def one_line(exc: BaseException, *, with_type: bool = False, limit: int | None = None) -> str:
    """An exception as one line for a user-facing message: whitespace collapsed, optionally the
    exception's type in front and the text cut at `limit` characters; the type alone if no text."""
    text = " ".join(str(exc).split())
    if limit is not None:
        text = text[:limit]
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if with_type else text
