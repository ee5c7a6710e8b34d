"""Child processes of the engine: one way to start them, talk to them, watch them and end them.

Three kinds of child use it: the engine process (service.engine.process), the tensor-parallel
ranks (service.engine.torch.tp_group) and the grammar-compile workers (service.engine.guided).

    parent                                            child: a fresh interpreter (python -c)
    Child.start(target, setup) ----- socket pair ---> main(): reads (target, setup), watches its
                                                      parent, calls target(setup, conn)
    child.send / recv / poll <--- pickled plain data ---> conn.send / recv / poll
    child.stop(grace): a None message, then SIGTERM, then SIGKILL, each after `grace` seconds

- Start: `python -c` runs this module's `main` in a new interpreter that inherits nothing but the
  socket (no threads, no listening sockets, no CUDA context, no re-import of the server's __main__
  as multiprocessing's spawn does), in a session of its own unless asked otherwise (a terminal's ^C
  or a signal to the server's process group is the server's to handle: it ends its children).
- Framing: multiprocessing's Connection over the socket (length-prefixed pickles). Only plain
  data crosses: the protocol's dataclasses, tuples, strings; no tensors and no weights.
- Parent watch: the child exits (code 1) when its parent is gone: its socket closes (any recv
  raises EOFError) and a watcher thread checks the parent id once a second, which also catches a
  parent that dies while the child is busy (importing, compiling, loading).
- Exit: `exit_code` and `describe_exit` say how a child ended (its code, or the signal);
  `sentinel` is a file descriptor that turns readable when it has (for waiting on several).
- Ordered kill: `stop` asks first (a None message, which every target treats as "leave now"),
  then terminates, then kills; it is idempotent and safe from any thread.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PARENT_POLL_S = 1.0  # how often a child checks that its parent still runs
_ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds the service package
# The child's whole command line; the trailing comment names the target, so `ps` shows what each is.
_MAIN = (
    "import sys; sys.path.insert(0, {root!r}); from service.engine.child import main; main({fd}, {parent})"
    "  # {target}"
)

Target = Callable[[Any, Connection], int | None]  # (setup, connection) -> exit code (None: 0)


class ChildStartError(RuntimeError):
    """The child process could not be started."""


class Child:
    """A child process started by `start`: its connection, its exit, its end."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], conn: Connection) -> None:
        self.name = name
        self.process = process
        self.conn = conn
        self._lock = threading.Lock()
        self._asked = False
        self.sentinel = os.pidfd_open(process.pid)  # readable once the process has exited

    @classmethod
    def start(
        cls,
        target: str,
        setup: Any,
        *,
        name: str,
        new_session: bool = True,
        env: dict[str, str] | None = None,
    ) -> Child:
        """Start `target` ("package.module:function") in a new interpreter with `setup` (picklable
        plain data); ChildStartError when it cannot be started."""
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _MAIN.format(root=_ROOT, fd=theirs.fileno(), parent=os.getpid(), target=target),
                ],
                pass_fds=(theirs.fileno(),),
                close_fds=True,
                start_new_session=new_session,
                env=env,
            )
        except OSError as exc:
            ours.close()
            raise ChildStartError(f"{name}: cannot start a process: {exc}") from exc
        finally:
            theirs.close()  # the child holds the only other end: its exit closes the socket
        conn = Connection(ours.detach())
        child = cls(name, process, conn)
        try:
            conn.send((target, setup))
        except OSError as exc:
            child.kill()
            raise ChildStartError(f"{name} (pid {process.pid}) exited as it started: {exc}") from exc
        return child

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def send_bytes(self, data: bytes) -> None:
        self.conn.send_bytes(data)

    def recv(self) -> Any:
        return self.conn.recv()

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    @property
    def exit_code(self) -> int | None:
        """Its exit code (a signal as its negative number), or None while it runs."""
        return self.process.poll()

    def alive(self) -> bool:
        return self.exit_code is None

    def describe_exit(self) -> str:
        code = self.exit_code
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"{self.name} (pid {self.pid}) was killed by {signal.Signals(-code).name}"
        return f"{self.name} (pid {self.pid}) exited with code {code}"

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code once it has exited, or None when `timeout` passes first."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def ask_to_stop(self) -> None:
        """Ask it to leave (a None message, once), without waiting: several children can be asked
        together, then each stopped."""
        with self._lock:
            first = not self._asked
            self._asked = True
        if first and self.alive():
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(None)

    def stop(self, grace_s: float, ask: bool = True) -> int:
        """End it: ask (a None message, unless asked already or `ask` is False), then SIGTERM, then
        SIGKILL, each after `grace_s` seconds; its exit code. Idempotent, from any thread."""
        if ask:
            self.ask_to_stop()
        for sends in (None, signal.SIGTERM, signal.SIGKILL):
            if sends is not None and self.alive():
                with contextlib.suppress(ProcessLookupError):
                    self.process.send_signal(sends)
            code = self.wait(grace_s if sends is not signal.SIGKILL else None)
            if code is not None:
                break
        self.close()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL at once (from any thread); `stop`, `reap` or `wait` reaps it."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def reap(self) -> int:
        """SIGKILL (if it still runs), wait for it, close its socket; its exit code."""
        self.kill()
        code = self.process.wait()
        self.close()
        return code

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()
        with contextlib.suppress(OSError):
            os.close(self.sentinel)


# --- The child's side --------------------------------------------------------------------------------


def main(fd: int, parent: int) -> None:
    """A child's whole life: a watch on its parent (named by the parent itself: it may be gone
    before this interpreter has started), its target and setup from the socket, then the target;
    the process ends with the target's code (1 when it raises or the parent is gone), without
    atexit handlers or thread joins that could wait on a parent that is gone."""
    conn = Connection(fd)
    code = 1
    target = "?"
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    try:
        target, setup = conn.recv()
        module, _, function = target.partition(":")
        run: Target = getattr(importlib.import_module(module), function)
        result = run(setup, conn)
        code = 0 if result is None else result
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.error("%s (%s): the parent process is gone; exiting", target_name(), target)
    except BaseException:
        log.exception("%s (%s) failed", target_name(), target)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def target_name() -> str:
    return f"child process {os.getpid()}"


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            log.error("%s: the parent process %d is gone; exiting", target_name(), parent)
            sys.stderr.flush()
            os._exit(1)
        time.sleep(PARENT_POLL_S)
