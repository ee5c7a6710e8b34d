"""Structured-output compiles under limits, over HTTP against servers of this module's own.

A constraint over NIM_MAX_GUIDED_SPEC_BYTES is a 400 naming the setting, before anything compiles;
one that takes longer than NIM_GUIDED_COMPILE_TIMEOUT_SECONDS to compile is a 400 naming that,
its worker process killed, and a plain chat right after is answered at once; a client that leaves
while its constraint compiles gets the compile stopped (its worker killed, the slot free); and a
stop signal does not wait for a compile: the server exits within uvicorn's few seconds for open
connections, its workers with it.

The slow constraint is an object with thousands of optional properties, which xgrammar takes
minutes to compile (2,000 take 16 s on one core; the time grows about with their cube).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import EMBEDDED_NAME, ServerProcess, process_alive, start_server, wait_ready

TIMEOUT_S = 6  # the limited server's NIM_GUIDED_COMPILE_TIMEOUT_SECONDS
PLAIN = {"model": EMBEDDED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def _slow_schema(tag: str) -> dict:
    """~36 KB of schema that compiles for minutes (`tag` keeps each test's spec its own)."""
    return {"type": "object", "properties": {f"{tag}{i}": {} for i in range(3000)}}


def _chat(extra: dict) -> dict:
    return {**PLAIN, "max_tokens": 5, **extra}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("guided") / "server.log",
        env={"NIM_GUIDED_COMPILE_TIMEOUT_SECONDS": str(TIMEOUT_S)},
    )
    try:
        wait_ready(proc)
        _warm(proc.base_url)
        yield proc
    finally:
        proc.stop()


def _warm(base_url: str) -> None:
    """Both compile workers started and ready (they start with the first constrained request)."""
    with httpx.Client(base_url=base_url, timeout=120) as client:
        threads = [
            threading.Thread(
                target=client.post,
                args=("/v1/chat/completions",),
                kwargs={"json": _chat({"guided_regex": p})},
            )
            for p in ("[ab]", "[cd]")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _plain_chat_seconds(client: httpx.Client) -> float:
    started = time.monotonic()
    response = client.post("/v1/chat/completions", json=PLAIN)
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def _workers_of(pid: int) -> set[int]:
    """The server's compile worker processes."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid and b"service.engine.guided.worker:serve" in cmdline:
            found.add(int(entry.name))
    return found


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_regex": "a" * 70_000},
        {"nvext": {"guided_choice": ["x" * 99] * 700}},
        {"guided_grammar": 'root ::= "' + "a" * 70_000 + '"'},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": {"type": "string", "description": "d" * 70_000}},
            }
        },
    ],
    ids=["regex", "choice", "grammar", "json_schema"],
)
def test_an_oversize_constraint_is_a_400_naming_the_setting(limited: ServerProcess, extra: dict) -> None:
    with httpx.Client(base_url=limited.base_url, timeout=60) as client:
        started = time.monotonic()
        response = client.post("/v1/chat/completions", json=_chat(extra))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "over NIM_MAX_GUIDED_SPEC_BYTES=65536" in error["message"], error
        assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
        assert time.monotonic() - started < 10


def test_a_compile_past_the_time_limit_is_a_400_and_serving_goes_on(limited: ServerProcess) -> None:
    body = _chat({"response_format": {"type": "json_schema", "json_schema": {
        "name": "slow", "schema": _slow_schema("t")}}})  # fmt: skip
    with httpx.Client(base_url=limited.base_url, timeout=TIMEOUT_S + 60) as client:
        started = time.monotonic()
        response = client.post("/v1/chat/completions", json=body)
        elapsed = time.monotonic() - started
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert f"NIM_GUIDED_COMPILE_TIMEOUT_SECONDS={TIMEOUT_S}" in message, message
        assert TIMEOUT_S <= elapsed < TIMEOUT_S + 20, elapsed
        assert _plain_chat_seconds(client) < 5  # its worker is gone, not compiling beside the engine
        assert f"compile passed {TIMEOUT_S} s and was stopped" in limited.log()
        # the same constraint again is refused at once (refusals are remembered)
        started = time.monotonic()
        assert client.post("/v1/completions", json={**body, "prompt": "x"}).status_code == 400
        assert time.monotonic() - started < 3


def test_a_client_that_leaves_stops_its_compile(limited: ServerProcess) -> None:
    body = _chat({"guided_json": _slow_schema("d")})
    with httpx.Client(base_url=limited.base_url, timeout=2) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=body)  # gives up after 2 s, mid-compile
    deadline = time.monotonic() + TIMEOUT_S - 2  # well before the time limit would have stopped it
    killed = None
    while killed is None and time.monotonic() < deadline:
        killed = re.search(
            r"request cancelled while its JSON schema compiled; worker (\d+) killed", limited.log()
        )
        time.sleep(0.1)
    assert killed is not None, limited.log()[-3000:]
    assert not process_alive(int(killed.group(1)))  # killed and reaped: no zombie
    with httpx.Client(base_url=limited.base_url, timeout=60) as client:
        assert _plain_chat_seconds(client) < 5
        # the slot it held is free: another constraint compiles at once
        response = client.post("/v1/chat/completions", json=_chat({"guided_regex": "[xyz]"}))
        assert response.status_code == 200, response.text


def test_a_stop_signal_does_not_wait_for_a_compile(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.log", env={"NIM_GUIDED_COMPILE_TIMEOUT_SECONDS": "300"})
    workers: set[int] = set()
    try:
        wait_ready(server)
        _warm(server.base_url)
        workers = _workers_of(server.process.pid)
        assert workers, "no compile workers"

        def compile_slowly() -> None:
            with (
                httpx.Client(base_url=server.base_url, timeout=60) as client,
                contextlib.suppress(httpx.HTTPError),
            ):
                client.post("/v1/chat/completions", json=_chat({"guided_json": _slow_schema("s")}))

        thread = threading.Thread(target=compile_slowly, daemon=True)
        thread.start()
        time.sleep(2)  # compiling now
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        try:
            code = server.process.wait(20)
        except Exception:
            pytest.fail(f"still running 20 s after SIGTERM:\n{server.log()[-3000:]}")
        assert time.monotonic() - started < 15
        assert code == 0, server.log()[-3000:]
        deadline = time.monotonic() + 3
        while any(process_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(process_alive(pid) for pid in workers), "compile workers outlived the server"
    finally:
        server.stop()
        for pid in workers:  # never leave one behind, even on failure
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
