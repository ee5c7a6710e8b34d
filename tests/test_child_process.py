"""The one helper every child process of the engine goes through (service.engine.child): start a
fresh interpreter with a setup, talk plain data over its socket, see it exit, end it in order,
and a child that outlives its parent leaves on its own."""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection

import pytest

from service.engine.child import Child


def echo(setup: str, conn: Connection) -> int:
    """Answers each message with (setup, message) until asked to stop (None)."""
    while (message := conn.recv()) is not None:
        conn.send((setup, message))
    return 7


def stubborn(setup: None, conn: Connection) -> int:
    """Ignores the request to stop and SIGTERM: only SIGKILL ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send("ready")
    while True:
        time.sleep(1)


def failing(setup: None, conn: Connection) -> int:
    raise ValueError("no such checkpoint")


def parent_of_sleeper(setup: None, conn: Connection) -> int:
    """Starts a sleeping grandchild, reports its pid and session, then exits at once."""
    sleeper = Child.start(f"{__name__}:sleeper", None, name="sleeper")
    conn.send((sleeper.pid, os.getsid(sleeper.pid)))
    conn.recv()  # the test has read the pid
    os._exit(0)


def sleeper(setup: None, conn: Connection) -> int:
    while True:
        time.sleep(1)


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie not yet reaped by its new parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_child_answers_and_leaves_when_asked() -> None:
    child = Child.start(f"{__name__}:echo", "set-up", name="echo")
    child.send({"n": 1})
    assert child.poll(10) and child.recv() == ("set-up", {"n": 1})
    assert os.getsid(child.pid) == child.pid  # a session of its own
    assert child.stop(5) == 7 and not child.alive()
    assert child.describe_exit() == f"echo (pid {child.pid}) exited with code 7"
    assert child.stop(5) == 7  # idempotent


def test_an_ordered_kill_ends_a_child_that_ignores_the_request_and_sigterm() -> None:
    child = Child.start(f"{__name__}:stubborn", None, name="stubborn")
    assert child.poll(10) and child.recv() == "ready"
    started = time.monotonic()
    assert child.stop(0.5) == -signal.SIGKILL
    assert time.monotonic() - started < 5
    assert child.describe_exit().endswith("was killed by SIGKILL")


def test_a_failing_target_exits_1() -> None:
    child = Child.start(f"{__name__}:failing", None, name="failing")
    assert child.wait(20) == 1
    with pytest.raises(EOFError):
        child.recv()
    child.close()


def test_a_child_whose_parent_dies_leaves_on_its_own() -> None:
    middle = Child.start(f"{__name__}:parent_of_sleeper", None, name="middle")
    assert middle.poll(20)
    pid, session = middle.recv()
    assert session == pid
    middle.send("seen")
    assert middle.wait(10) == 0
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), "the grandchild outlived its parent"
