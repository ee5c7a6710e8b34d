"""The compile worker: a child process (service.engine.child) that checks and compiles one spec at a
time for this vocabulary, under a time limit the parent enforces by killing it.

Parent side, `CompileWorker`: started when first needed and again after it is killed; `compile`
sends one GuidedDecoding and waits for its answer at most the limit; `kill` may come from any
thread (a request cancelled while its spec compiles). Child side, `serve`: the vocabulary arrives
with the start, before xgrammar (and with it torch) is imported; then one spec at a time, each
answered ("ok", seconds, grammar bytes, resident bytes) or ("refused", message).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import IO, Any

from service.engine.child import Child, ChildStartError
from service.engine.guided.language import empty_language
from service.engine.guided.specs import NAMES, GrammarError, build_grammar, first_line
from service.engine.protocol import GuidedDecoding

WORKER_START_TIMEOUT_S = 120.0  # a worker not ready by then (imports, vocabulary) has failed
UNKNOWN_GRAMMAR_BYTES = 1 << 20  # the cache's charge for a grammar whose xgrammar reports no size

# The vocabulary a worker compiles for: each token's bytes, the vocabulary size, the stop tokens.
Vocabulary = tuple[list[bytes], int, list[int]]


class WorkerFailedError(RuntimeError):
    """The worker did not start (not the spec's fault: the request gets a 500)."""


class CompileCrashedError(RuntimeError):
    """The worker died compiling (the spec's doing, or its request's cancel); the exit code."""


class CompileWorker:
    """One compile process, used by one job at a time. Started when first needed and again after it
    is killed; `kill` may come from any thread."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self._vocabulary = vocabulary
        self._child: Child | None = None
        self._ready = False
        self._lock = threading.Lock()  # held briefly: the child against kill() and reap()

    @property
    def pid(self) -> int | None:
        child = self._child
        return child.pid if child is not None else None

    @property
    def ready(self) -> bool:
        """Whether a compile can start at once (its start-up is over, or its ready message waits)."""
        child = self._child
        if child is None or not child.alive():
            return False
        return self._ready or child.poll(0)

    def start(self) -> None:
        """A fresh process, given its vocabulary (it reads that before its slow imports)."""
        self.reap()
        try:
            child = Child.start(f"{__name__}:serve", self._vocabulary, name="grammar-compile worker")
        except ChildStartError as exc:
            raise WorkerFailedError(f"the compile worker did not start: {exc}") from None
        with self._lock:
            self._child, self._ready = child, False

    def compile(self, guided: GuidedDecoding, timeout_s: float) -> tuple[Any, ...]:
        """The worker's answer for `guided`; TimeoutError (the worker is killed) past `timeout_s`,
        counted from when the spec is sent; CompileCrashedError when it dies compiling, and
        WorkerFailedError when it cannot start."""
        child = self._ensure_ready()
        try:
            child.send(guided)
            answered = child.poll(timeout_s)
            if answered:
                return tuple(child.recv())
        except (EOFError, OSError):
            raise CompileCrashedError(self.reap()) from None
        self.reap()
        raise TimeoutError  # outside the try: TimeoutError is an OSError

    def _ensure_ready(self) -> Child:
        child = self._child
        if child is None or not child.alive():
            self.start()
            child = self._child
        assert child is not None
        if not self._ready:
            try:
                if not child.poll(WORKER_START_TIMEOUT_S):
                    raise TimeoutError
                child.recv()  # ("ready", pid)
            except (TimeoutError, EOFError, OSError):
                code = self.reap()
                raise WorkerFailedError(f"the compile worker did not start (code {code})") from None
            self._ready = True
        return child

    def kill(self) -> int | None:
        """SIGKILL, from any thread; the job's thread then reaps. The pid killed, if any."""
        with self._lock:
            child = self._child
            if child is None or not child.alive():
                return None
            child.kill()
            return child.pid

    def reap(self) -> int | None:
        """Kill (if alive), wait for and forget the process; its exit code."""
        with self._lock:
            child, self._child, self._ready = self._child, None, False
        return child.reap() if child is not None else None


# --- The worker process --------------------------------------------------------------------------


def serve(vocabulary: Vocabulary, conn: Connection) -> int:
    """A compile worker's life (a child process's target): xgrammar for `vocabulary`, then one spec
    at a time until asked to stop (None) or its parent is gone."""
    os.dup2(2, 1)  # stray prints go to the log
    tokens, vocab_size, stop_token_ids = vocabulary
    import xgrammar  # imports torch: seconds, after the vocabulary has arrived

    info = xgrammar.TokenizerInfo(
        tokens, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", os.getpid()))
    with tempfile.TemporaryFile() as warnings:
        while (guided := conn.recv()) is not None:
            conn.send(compile_checked(xgrammar, compiler, guided, warnings))
    return 0


def compile_checked(
    xgrammar: Any, compiler: Any, guided: GuidedDecoding, warnings: IO[bytes]
) -> tuple[Any, ...]:
    """Refuse what does not parse, what xgrammar warns it ignores, and what admits no text; else
    compile (the parent compiles again: this is the timed, killable check)."""
    name = NAMES[guided.kind]
    started = time.perf_counter()
    try:
        with _capture_stderr(warnings):
            grammar = build_grammar(xgrammar, guided)
        _refuse_warnings(name, warnings)
        why = empty_language(grammar)
        if why is not None:
            raise GrammarError(
                f"the {name} admits no token sequence that completes it: no text can satisfy it ({why})"
            )
        with _capture_stderr(warnings):
            compiled = compiler.compile_grammar(grammar)
        _refuse_warnings(name, warnings)
    except GrammarError as exc:
        return ("refused", str(exc))
    except (RuntimeError, ValueError, TypeError) as exc:
        return ("refused", f"invalid {name}: {first_line(exc)}")
    return ("ok", time.perf_counter() - started, memory_bytes(compiled), _resident_bytes())


@contextlib.contextmanager
def _capture_stderr(into: IO[bytes]) -> Iterator[None]:
    """File descriptor 2 (where xgrammar's C++ code logs its warnings) into `into`, for a while."""
    sys.stderr.flush()
    into.seek(0)
    into.truncate()
    saved = os.dup(2)
    os.dup2(into.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _refuse_warnings(name: str, captured: IO[bytes]) -> None:
    captured.seek(0)
    text = captured.read().decode("utf-8", "replace")
    for line in text.splitlines():
        if "Warning: " in line and "oneOf" not in line:  # oneOf: told apart before (specs._disjoint)
            warning = line.split("Warning: ", 1)[1].strip()[:300]
            raise GrammarError(
                f"the {name} cannot be enforced as written: xgrammar would ignore part of it ({warning})"
            )


def _resident_bytes() -> int:
    """This process's resident memory (0 where /proc does not say)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_bytes(compiled: Any) -> int:
    """What a compiled grammar holds, as xgrammar estimates it (a fixed charge where it does not)."""
    size = getattr(compiled, "memory_size_bytes", None)
    return int(size) if isinstance(size, int) else UNKNOWN_GRAMMAR_BYTES
