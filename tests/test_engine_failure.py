"""A dead engine: a failure injected into a real step of a real server ends every request in flight
with an error (500 before a stream starts, an error frame inside one), and the process exits
non-zero; requests that reach a dead engine get 503 with Retry-After and readiness turns 503."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from service.api.app import create_app
from service.api.state import ModelInfo, Ready
from service.config_loading import load_settings
from service.engine.protocol import (
    EngineDeadError,
    EngineStats,
    GenerationRequest,
    RequestOutput,
)
from service.telemetry.metrics import Metrics
from tests.conftest import EMBEDDED_NAME, start_server, wait_ready
from tests.test_engine_interface import INFO

# Token ids no chat template or tokenizer produces together: a completion with this prompt makes
# the injected fault fire in the step that first schedules it.
DOOMED_PROMPT = [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9]

FAULT = f"""
from service.engine.torch import model_runner

_execute = model_runner.ModelRunner.execute


def execute(self, plan, *args):
    if any(list(new.prompt_token_ids) == {DOOMED_PROMPT} for new in plan.new_requests):
        raise RuntimeError("injected device fault")
    return _execute(self, plan, *args)


model_runner.ModelRunner.execute = execute
"""


def test_a_step_that_fails_ends_everything_in_flight_and_the_process(tmp_path: Path) -> None:
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(FAULT)
    path = os.pathsep.join(p for p in (str(tmp_path / "inject"), os.environ.get("PYTHONPATH")) if p)
    server = start_server(tmp_path / "log", env={"PYTHONPATH": path})
    try:
        wait_ready(server)
        frames: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": EMBEDDED_NAME, "prompt": "Count:", "max_tokens": 500, "ignore_eos": True}
            with httpx.stream(
                "POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as response:
                for line in response.iter_lines():
                    if line:
                        frames.append(line)
                        started.set()

        worker = threading.Thread(target=stream)
        worker.start()
        assert started.wait(60)
        doomed = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": EMBEDDED_NAME, "prompt": DOOMED_PROMPT, "max_tokens": 4},
            timeout=60,
        )
        worker.join(60)

        assert doomed.status_code == 500
        error = doomed.json()["error"]
        assert error["code"] == "engine_error" and "injected device fault" in error["message"]
        assert frames[-1] == "data: [DONE]"
        last = json.loads(frames[-2].removeprefix("data: "))
        assert "injected device fault" in last["error"]["message"]  # an error frame, not a finish
        assert server.process.wait(30) == 1
        assert "injected device fault" in server.log()
    finally:
        server.stop()


class DyingEngine:
    """Serves one request, then dies the way TorchEngine does: outputs carry the error, later
    submissions raise EngineDeadError, `ready` turns False and `failure` says why."""

    info = INFO

    def __init__(self, racy: bool = False) -> None:
        self.failure: str | None = None
        self.racy = racy  # still reports ready: a request that raced the death to generate()

    @property
    def ready(self) -> bool:
        return self.failure is None or self.racy

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def abort(self, request_id: str) -> None: ...

    async def check(self, request: GenerationRequest) -> None: ...

    def stats(self) -> EngineStats:
        return EngineStats()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        await asyncio.sleep(0)
        self.failure = "RuntimeError: device lost"
        yield RequestOutput(request.request_id, "", [], 3, 0, True, error=f"engine failure: {self.failure}")


@pytest.mark.parametrize("racy", [False, True])
def test_requests_after_death_get_503_with_retry_after(racy: bool) -> None:
    engine = DyingEngine(racy)
    reasons: list[str] = []

    async def bring_up(metrics: Metrics, on_death) -> Ready:
        info = ModelInfo(EMBEDDED_NAME, "fake", INFO, "0" * 64, "fake-profile", {})
        return Ready(engine=engine, tokenizer=_tokenizer(), info=info)

    app = create_app(load_settings(), EMBEDDED_NAME, bring_up, on_fatal=reasons.append)
    body = {"model": EMBEDDED_NAME, "prompt": "Hello", "max_tokens": 2}
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while client.get("/v1/health/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 500 and "device lost" in first.json()["error"]["message"]
        if not racy:
            ready = client.get("/v1/health/ready")
            assert ready.status_code == 503 and "device lost" in ready.json()["error"]["message"]
        late = client.post("/v1/completions", json=body)
        assert late.status_code == 503
        assert late.headers["retry-after"] == "30"
        assert "device lost" in late.json()["error"]["message"]


def _tokenizer():
    from service.store.model_store import embedded_model_path
    from service.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(embedded_model_path())


def test_on_ready_is_called_once_before_the_service_reports_ready() -> None:
    """create_app's on_ready hook (where `serve` freezes its start-up heap) runs once, after the
    model is up and before /v1/health/ready says 200."""
    engine = DyingEngine()
    calls: list[int] = []
    app_ref: list[object] = []

    def on_ready() -> None:
        calls.append(app_ref[0].state.service.phase == "loading")  # type: ignore[attr-defined]

    async def bring_up(metrics: Metrics, on_death) -> Ready:
        info = ModelInfo(EMBEDDED_NAME, "fake", INFO, "0" * 64, "fake-profile", {})
        return Ready(engine=engine, tokenizer=_tokenizer(), info=info)

    app = create_app(load_settings(), EMBEDDED_NAME, bring_up, on_ready=on_ready)
    app_ref.append(app)
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while client.get("/v1/health/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        client.get("/v1/health/ready")
    assert calls == [True]  # once, while the service still said it was loading
