"""A CPU-time limit on one chat template render, enforced from outside the rendering thread.

A Jinja template compiles to plain Python loops: `{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}`
over a long list runs without calling anything the sandbox could intercept, so hooks inside the
template's reach (the sandbox's `call`, the output chunks) cannot stop every endless render. One
daemon thread, the watchdog, therefore looks at the renders in flight every `_PERIOD_S` and raises
`RenderTimeout` inside any whose thread has used more than its CPU seconds
(`PyThreadState_SetAsyncExc`: the interpreter raises it at the thread's next bytecode boundary; a
single long C call, such as one huge string operation, finishes first).

CPU time, not wall time: on a busy machine a render waiting for the interpreter lock is not
charged, so a legitimate template is never stopped because the engine was busy. Where a thread's
CPU clock cannot be read (no `pthread_getcpuclockid`), wall time is used.

The invariant that keeps the asynchronous exception inside the render: the watchdog raises it only
under `_lock` and only for a render still registered, and the render unregisters under the same
lock, clearing an exception set but not yet raised. So the exception is raised in the rendering
thread between `limited`'s registration and its unregistration, or not at all.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["RenderTimeout", "limited"]

T = TypeVar("T")

_PERIOD_S = 0.05  # how often the watchdog looks at renders in flight


class RenderTimeout(BaseException):
    """Raised inside a render that ran past its CPU seconds (a BaseException, so that no
    `except Exception` in Jinja's code swallows it)."""


@dataclass(eq=False)
class _Render:
    thread_id: int
    clock: Callable[[], float]  # this render's thread's CPU seconds (or wall time)
    deadline: float  # on `clock`
    fired: bool = field(default=False)


def _thread_clock() -> Callable[[], float]:
    """The calling thread's CPU-time clock, readable from any thread."""
    try:
        clock_id = time.pthread_getcpuclockid(threading.get_ident())
        time.clock_gettime(clock_id)
    except (AttributeError, OSError):
        return time.monotonic
    return lambda: time.clock_gettime(clock_id)


def _raise_in(thread_id: int, exception: type[BaseException] | None) -> None:
    """Set (or, with None, clear) the exception a thread raises at its next bytecode boundary."""
    target = ctypes.py_object(exception) if exception is not None else None  # None: NULL, clears
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), target)


class _Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = threading.Condition(self._lock)
        self._renders: set[_Render] = set()
        self._thread: threading.Thread | None = None

    def add(self, render: _Render) -> None:
        with self._lock:
            self._renders.add(render)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="template-watchdog", daemon=True)
                self._thread.start()
            if len(self._renders) == 1:
                self._busy.notify()

    def remove(self, render: _Render) -> None:
        with self._lock:
            self._renders.discard(render)
            if render.fired:  # set but perhaps not raised yet: it must not escape the render
                _raise_in(render.thread_id, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._renders:
                    self._busy.wait()
            time.sleep(_PERIOD_S)
            with self._lock:
                for render in self._renders:
                    if not render.fired and render.clock() > render.deadline:
                        render.fired = True
                        _raise_in(render.thread_id, RenderTimeout)


_WATCHDOG = _Watchdog()


def limited(work: Callable[[], T], cpu_seconds: float) -> T:
    """`work()`, stopped with RenderTimeout once it has used `cpu_seconds` of its thread's CPU time."""
    clock = _thread_clock()
    render = _Render(threading.get_ident(), clock, clock() + cpu_seconds)
    _WATCHDOG.add(render)
    try:
        return work()
    finally:
        _WATCHDOG.remove(render)
