"""Small helpers that each have exactly one home."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: how many b-sized pieces hold a."""
    return -(-a // b)


def one_line(exc: BaseException, *, with_type: bool = False, limit: int | None = None) -> str:
    """An exception as one line for a user-facing message: whitespace collapsed, optionally the
    exception's type in front and the text cut at `limit` characters; the type alone if no text."""
    raw = str(exc)
    if limit is not None:
        raw = raw[: 4 * limit]  # collapsing a huge message first would copy all of it
    text = " ".join(raw.split())
    if limit is not None:
        text = text[:limit]
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if with_type else text


async def on_new_thread(fn: Callable[..., T], *args: object, name: str = "worker") -> T:
    """Run blocking `fn(*args)` on a thread of its own that ends with it (not a pooled one).

    For PyTorch work on CPUs: each thread that runs parallel ops keeps its own OpenMP thread
    pool for as long as it lives, and once more threads are pooled than there are cores, GNU
    OpenMP stops spinning between parallel regions, which made every CPU decode step about 1.6x
    slower. Work done here leaves no pool behind.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # the caller was cancelled meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the caller
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await done


def freeze_startup_heap() -> None:
    """Collect once, then put every surviving object out of the cyclic collector's reach: what a
    process builds before it serves (modules, torch's registries, the model, the tokenizer: ~280,000
    objects for the embedded model) lives as long as the process, and each full collection walked
    all of it, a pause of ~140 ms on 2 cores (the engine's step waits on the GIL meanwhile). As vLLM's
    engine core does after start-up. Called once per serving process, just before it serves."""
    gc.collect()
    gc.freeze()
