"""vLLM's probes and NIM's licence endpoint on the session's embedded-model server: /health and
/ping answer 200 with an empty body once the model serves, /version names the release, and
/v1/license returns the embedded model's Apache-2.0 licence in NIM's shape (tests/test_api_security.py
checks the probes stay open behind an API key and the licence does not)."""

from __future__ import annotations

import hashlib

import httpx

import service
from tests.conftest import ServerProcess


def test_vllms_probes(server: ServerProcess) -> None:
    for method in ("GET", "POST"):
        ping = httpx.request(method, f"{server.base_url}/ping", timeout=10)
        assert ping.status_code == 200 and ping.content == b""
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.content == b""
    assert httpx.get(f"{server.base_url}/version", timeout=10).json() == {"version": service.__version__}
    assert httpx.put(f"{server.base_url}/ping", timeout=10).status_code == 405


def test_the_license_of_the_embedded_model(server: ServerProcess) -> None:
    answer = httpx.get(f"{server.base_url}/v1/license", timeout=10)
    assert answer.status_code == 200
    licence = answer.json()
    assert set(licence) == {"name", "path", "sha", "size", "url", "type", "content"}
    assert licence["type"] == "file" and licence["name"] == "LICENSE"
    assert licence["url"] == "https://www.apache.org/licenses/LICENSE-2.0"
    assert "Apache License" in licence["content"] and "Version 2.0" in licence["content"]
    assert licence["size"] == len(licence["content"])
    assert licence["sha"] == hashlib.sha1(licence["content"].encode()).hexdigest()
