"""Property-based API fuzzing with Schemathesis against a live server's own /openapi.json.

Every generated request must get a non-5xx answer whose body matches the schema documented for
its status (the success models, and ErrorResponse for 400/404/413/429/500/503). Streaming
answers (stream=true) are text/event-stream, which the schema does not describe; a custom check
holds them to the SSE framing the OpenAI clients parse instead.

Bounded and reproducible: a fixed seed, derandomized generation, no example database, a small
`max_examples` per operation, and a server that caps completions at a few tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.conftest import EMBEDDED_NAME, ServerProcess, start_server, wait_ready

MAX_COMPLETION_TOKENS = 8
MAX_EXAMPLES = 40
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/health/live"),
    ("GET", "/v1/health/ready"),
    ("GET", "/v1/version"),
    ("GET", "/v1/metadata"),
]
GENERATION_PATHS = {"/v1/chat/completions", "/v1/completions"}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {
        "NIM_MAX_COMPLETION_TOKENS": str(MAX_COMPLETION_TOKENS),
        "NIM_MAX_PROMPT_TOKENS": "256",
    }
    server = start_server(tmp_path_factory.mktemp("schemathesis") / "server.log", env=env)
    try:
        wait_ready(server)
        yield server
    finally:
        server.stop()


def _servable(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same body, naming the served model and kept cheap, so it reaches the engine."""
    out = {**body, "model": EMBEDDED_NAME}
    if path not in GENERATION_PATHS:
        return out
    for key in ("max_tokens", "max_completion_tokens"):
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_COMPLETION_TOKENS:
            out[key] = MAX_COMPLETION_TOKENS
    if path == "/v1/completions" and "max_tokens" not in out:
        out["max_tokens"] = MAX_COMPLETION_TOKENS  # the default, 16, is over this server's cap
    for key in ("n", "best_of"):
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 2:
            out[key] = 2
    prompt = out.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        out["prompt"] = prompt[:2]
    return out


def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy:
    """Half the bodies as generated (mostly a 404 for an unknown model), half servable."""
    if not isinstance(body, dict) or context.operation is None:
        return st.just(body)
    return st.sampled_from([body, _servable(context.operation.path, body)])


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict({"max-stream-events": 200, "request-timeout": 30})
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json", config=config)
    schema.hook(flatmap_body)
    return schema


def sse_well_formed(ctx: Any, response: Any, case: schemathesis.Case) -> bool | None:
    """A streamed answer is `data: <json>` events ending in `data: [DONE]`, with no server error."""
    content_type = response.headers.get("content-type", [""])[0]
    if not content_type.startswith("text/event-stream"):
        return None
    events = [e for e in response.text.split("\n\n") if e.strip()]
    assert events, "empty event stream"
    assert all(e.startswith("data: ") for e in events), f"malformed SSE events: {events!r}"
    assert events[-1] == "data: [DONE]", f"stream does not end with [DONE]: {events[-1]!r}"
    expected = "chat.completion.chunk" if case.path == "/v1/chat/completions" else "text_completion"
    for event in events[:-1]:
        payload = json.loads(event.removeprefix("data: "))
        assert "error" not in payload, f"error frame in stream: {payload}"
        assert payload["object"] == expected, payload
        assert isinstance(payload["choices"], list), payload
    return True


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_api_conforms_to_its_schema(api_schema: schemathesis.BaseSchema, method: str, path: str) -> None:
    operation = api_schema[path][method]
    cases = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(GenerationMode.NEGATIVE)
    max_examples = MAX_EXAMPLES if path in GENERATION_PATHS or method == "POST" else 10

    @hypothesis.settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.generate, hypothesis.Phase.shrink],
    )
    @hypothesis.given(case=cases)
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=[not_a_server_error, response_schema_conformance, sse_well_formed])

    run()
