"""API keys (env and a reloaded keys file), request ids, CORS, and /tokenize /detokenize over HTTP."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import EMBEDDED_NAME, ServerProcess, start_server, wait_ready

CHAT = {"model": EMBEDDED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("# one key per line\nfile-key-1\n")
    return path


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, keys_file: Path) -> Iterator[ServerProcess]:
    env = {
        "NIM_API_KEY": "env-key-1,env-key-2",
        "NIM_API_KEYS_FILE": str(keys_file),
        "NIM_CORS_ALLOW_ORIGINS": "https://app.example.com",
        "NIM_CORS_EXPOSE_HEADERS": "X-Request-Id,X-Ratelimit-Limit-Requests",
        "NIM_CORS_MAX_AGE": "120",
    }
    server = start_server(tmp_path_factory.mktemp("secured") / "log", env=env)
    try:
        wait_ready(server)
        yield server
    finally:
        server.stop()


def post(
    server: ServerProcess, path: str, body: dict, key: str | None = None, **headers: str
) -> httpx.Response:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("key", [None, "wrong", "env-key-1x", "env-key-"])
def test_missing_or_wrong_key_is_401_in_openai_shape(secured: ServerProcess, key: str | None) -> None:
    response = post(secured, "/v1/chat/completions", CHAT, key)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert httpx.get(f"{secured.base_url}/v1/models").status_code == 401
    basic = httpx.get(f"{secured.base_url}/v1/models", headers={"Authorization": "Basic ZW52LWtleS0xOg=="})
    assert basic.status_code == 401


def test_env_and_file_keys_are_accepted(secured: ServerProcess) -> None:
    for key in ("env-key-1", "env-key-2", "file-key-1"):
        assert post(secured, "/v1/chat/completions", CHAT, key).status_code == 200, key
    client = openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key="env-key-2", max_retries=0)
    assert client.models.list().data[0].id == EMBEDDED_NAME
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key="nope", max_retries=0).models.list()


def test_keys_file_is_reloaded_without_restart(secured: ServerProcess, keys_file: Path) -> None:
    keys_file.write_text("rotated-key\n")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if post(secured, "/v1/chat/completions", CHAT, "rotated-key").status_code == 200:
            break
        time.sleep(0.3)
    assert post(secured, "/v1/chat/completions", CHAT, "rotated-key").status_code == 200
    assert post(secured, "/v1/chat/completions", CHAT, "file-key-1").status_code == 401
    assert post(secured, "/v1/chat/completions", CHAT, "env-key-1").status_code == 200


def test_health_and_metrics_stay_open(secured: ServerProcess) -> None:
    for path in (
        "/v1/health/live",
        "/v1/health/ready",
        "/v1/metrics",
        "/metrics",
        "/v1/version",
        "/openapi.json",
        "/health",  # vLLM's probes, open as vLLM keeps them
        "/ping",
        "/version",
    ):
        assert httpx.get(f"{secured.base_url}{path}").status_code == 200, path
    assert httpx.post(f"{secured.base_url}/ping").status_code == 200
    assert httpx.get(f"{secured.base_url}/v1/license").status_code == 401  # NIM's licence: behind the key
    licence = httpx.get(f"{secured.base_url}/v1/license", headers={"Authorization": "Bearer env-key-1"})
    assert licence.status_code == 200 and "Apache License" in licence.json()["content"]


def test_request_id_is_echoed_and_used(secured: ServerProcess) -> None:
    response = post(secured, "/v1/chat/completions", CHAT, "env-key-1", **{"x-request-id": "gateway-abc.123"})
    assert response.headers["x-request-id"] == "gateway-abc.123"
    assert response.json()["id"] == "chatcmpl-gateway-abc.123"
    generated = post(secured, "/v1/chat/completions", CHAT, "env-key-1")
    assert len(generated.headers["x-request-id"]) == 32
    assert generated.json()["id"] == f"chatcmpl-{generated.headers['x-request-id']}"
    unsafe = post(
        secured, "/v1/chat/completions", CHAT, "env-key-1", **{"x-request-id": "bad id\twith spaces"}
    )
    assert unsafe.headers["x-request-id"] != "bad id\twith spaces"
    # Two requests reusing one id both succeed (engine ids stay unique).
    again = post(secured, "/v1/chat/completions", CHAT, "env-key-1", **{"x-request-id": "gateway-abc.123"})
    assert again.status_code == 200
    assert httpx.get(f"{secured.base_url}/v1/health/live").headers["x-request-id"]


def test_cors(secured: ServerProcess) -> None:
    preflight = httpx.options(
        f"{secured.base_url}/v1/chat/completions",
        headers={
            "Origin": "https://app.example.com",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example.com"
    assert preflight.headers["access-control-max-age"] == "120"  # NIM_CORS_MAX_AGE
    simple = httpx.get(f"{secured.base_url}/v1/health/live", headers={"Origin": "https://app.example.com"})
    exposed = simple.headers["access-control-expose-headers"].lower()
    assert "x-request-id" in exposed and "x-ratelimit-limit-requests" in exposed  # NIM_CORS_EXPOSE_HEADERS
    other = httpx.options(
        f"{secured.base_url}/v1/chat/completions",
        headers={"Origin": "https://evil.example.com", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in other.headers


def test_tokenize_and_detokenize(secured: ServerProcess, embedded_tokenizer) -> None:
    tokens = post(secured, "/tokenize", {"model": EMBEDDED_NAME, "prompt": "Hello world"}, "env-key-1").json()
    assert tokens["tokens"] == embedded_tokenizer.encode("Hello world") and tokens["count"] == len(
        tokens["tokens"]
    )
    assert tokens["max_model_len"] == 8192
    chat = post(
        secured, "/tokenize", {"model": EMBEDDED_NAME, "messages": CHAT["messages"]}, "env-key-1"
    ).json()
    usage = post(secured, "/v1/chat/completions", CHAT, "env-key-1").json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    text = post(
        secured, "/detokenize", {"model": EMBEDDED_NAME, "tokens": tokens["tokens"]}, "env-key-1"
    ).json()
    assert text["prompt"] == "Hello world"
    bad = post(secured, "/detokenize", {"model": EMBEDDED_NAME, "tokens": [10**9]}, "env-key-1")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(secured, "/tokenize", {"model": EMBEDDED_NAME, "prompt": "x"}).status_code == 401


def test_json_logs_carry_request_id_trace_context_and_timings(tmp_path: Path) -> None:
    server = start_server(tmp_path / "log", env={"NIM_JSONL_LOGGING": "1"})
    try:
        wait_ready(server)
        traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        secret = "the prompt must never reach the logs"
        body = {"model": EMBEDDED_NAME, "messages": [{"role": "user", "content": secret}], "max_tokens": 2}
        headers = {"x-request-id": "trace-me-1", "traceparent": traceparent, "tracestate": "vendor=abc"}
        assert (
            httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers).status_code
            == 200
        )
    finally:
        server.stop()
    records = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    access = [r for r in records if r["logger"] == "service.access" and r.get("request_id") == "trace-me-1"]
    assert len(access) == 1
    entry = access[0]
    assert entry["status"] == 200 and entry["path"] == "/v1/chat/completions" and entry["duration_ms"] > 0
    assert entry["traceparent"] == traceparent and entry["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert entry["tracestate"] == "vendor=abc"
    assert secret not in server.log()
