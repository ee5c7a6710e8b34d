"""Property-based API fuzzing with Schemathesis against a live server's own /openapi.json.

Each operation gets positive (schema-valid) and negative (schema-violating) requests. Every
answer must be non-5xx and match the schema documented for its status: the success models,
and ErrorResponse for 400/404/413/429/500/503. Streaming answers (stream=true) are
text/event-stream, whose events the schema describes; a custom check also holds them to the SSE
framing OpenAI clients parse. The server must also stay up and log no ERROR or traceback.

Bodies that name a model mostly name an unknown one (a 404 before any generation), so a
`flatmap_body` hook also offers each body naming the served model, and a "repaired" copy kept
within what this server accepts (few tokens, few choices, token ids in the vocabulary), so the
generation paths run too.

Bounded and reproducible: derandomized Hypothesis (a fixed example sequence), no example
database, a few dozen examples per operation, and a server that caps completions at 8 tokens.
No shrinking: a request that crashes the engine takes the server down, and the first failing
request (reported with a curl command) is the reproduction.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import requests
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from service.api.request_fields import Endpoint, lookup
from tests.conftest import EMBEDDED_NAME, ServerProcess, start_server, wait_ready

MAX_COMPLETION_TOKENS = 8
VOCAB_SIZE = 49152  # the embedded SmolLM2 tokenizer's
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
ERROR_LINE = re.compile(r"\bERROR\b|Traceback")

# (method, path, examples: each draws one positive and one negative request)
OPERATIONS = [
    ("POST", "/v1/chat/completions", 40),
    ("POST", "/v1/completions", 40),
    ("POST", "/tokenize", 25),
    ("POST", "/detokenize", 25),
    ("GET", "/v1/models", 3),
    ("GET", "/v1/health/live", 3),
    ("GET", "/v1/health/ready", 3),
    ("GET", "/v1/version", 3),
    ("GET", "/v1/metadata", 3),
]


@dataclass
class FuzzTarget:
    """The server under test; a fresh one replaces it if a previous test crashed it."""

    tmp: pytest.TempPathFactory
    server: ServerProcess | None = None

    def live(self) -> ServerProcess:
        if self.server is not None and not self._ready(self.server):
            self.server.stop()  # a crashed engine: the process is exiting, or about to
            self.server = None
        if self.server is None:
            env = {"NIM_MAX_COMPLETION_TOKENS": str(MAX_COMPLETION_TOKENS), "NIM_MAX_PROMPT_TOKENS": "256"}
            log_path = self.tmp.mktemp("schemathesis") / "server.log"
            self.server = start_server(log_path, env=env)
            wait_ready(self.server)
        return self.server

    @staticmethod
    def _ready(server: ServerProcess) -> bool:
        try:
            return requests.get(f"{server.base_url}/v1/health/ready", timeout=5).status_code == 200
        except requests.ConnectionError:
            return False


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    fuzz = FuzzTarget(tmp_path_factory)
    try:
        fuzz.live()
        yield fuzz
    finally:
        if fuzz.server is not None:
            fuzz.server.stop()


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token(value: Any) -> Any:
    return abs(value) % VOCAB_SIZE if _int(value) else value


def _repaired(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body kept within what this server accepts, so that it reaches the engine."""
    out = dict(body)
    if path == "/tokenize" and ("prompt" in out) == ("messages" in out):
        out.pop("messages", None)
        out["prompt"] = out.get("prompt") or "Hello"
    if path == "/detokenize" and isinstance(out.get("tokens"), list):
        out["tokens"] = [_token(t) for t in out["tokens"]]
    if path not in GENERATION_PATHS:
        return out
    for key in ("max_tokens", "max_completion_tokens"):
        if _int(out.get(key)):
            out[key] = min(max(out[key], 1), MAX_COMPLETION_TOKENS)
    if path == "/v1/completions" and not _int(out.get("max_tokens")):
        out["max_tokens"] = MAX_COMPLETION_TOKENS  # the default, 16, is over this server's cap
    if _int(out.get("n")):
        out["n"] = min(max(out["n"], 1), 2)
    if "best_of" in out:
        out["best_of"] = out.get("n", 1)
    if _int(out.get("min_tokens")):
        out["min_tokens"] = min(max(out["min_tokens"], 0), 2)
    prompt = out.get("prompt")
    if isinstance(prompt, list):
        prompt = [p for p in prompt[:2] if p not in ("", [])]
        prompt = [[_token(t) for t in p] if isinstance(p, list) else _token(p) for p in prompt]
        out["prompt"] = prompt or "Hello"
    elif prompt == "":
        out["prompt"] = "Hello"
    stop = out.get("stop")
    if stop == "" or isinstance(stop, list):
        out["stop"] = [s for s in stop if s][:4] if isinstance(stop, list) else None
    if isinstance(out.get("logit_bias"), dict):
        out["logit_bias"] = {
            k: v for k, v in out["logit_bias"].items() if k.isdigit() and int(k) < VOCAB_SIZE
        }
    if isinstance(out.get("stop_token_ids"), list):
        out["stop_token_ids"] = [_token(t) for t in out["stop_token_ids"]]
    if isinstance(out.get("nvext"), dict):
        out["nvext"] = {k: v for k, v in out["nvext"].items() if not k.startswith("guided_")}
        if _int(out["nvext"].get("min_tokens")):
            out["nvext"]["min_tokens"] = min(max(out["nvext"]["min_tokens"], 0), 2)
    for unsupported in ("suffix", "tools", "tool_choice", "parallel_tool_calls", "response_format"):
        out.pop(unsupported, None)
    # Fields other tests cover (a request's template, reasoning, prompt logprobs, constraints): kept
    # out so that most repaired bodies generate.
    for covered in ("chat_template", "chat_template_kwargs", "reasoning_effort", "prompt_logprobs",
                    "structured_outputs"):  # fmt: skip
        out.pop(covered, None)
    if isinstance(out.get("messages"), list):
        out["messages"] = [_text_only(m) for m in out["messages"]]
    out = _honoured_only(ENDPOINTS[path], out)
    if out.get("top_logprobs") and path == "/v1/chat/completions":
        out["logprobs"] = True
    return out


MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id")
ROLES = ("system", "developer", "user", "assistant", "tool")


def _text_only(message: Any) -> Any:
    """A message of known fields, a known role and text content (a part of another type, an
    unknown key or a tool message without its tool_call_id is refused, as it should be)."""
    if not isinstance(message, dict):
        return message
    out = {k: v for k, v in message.items() if k in MESSAGE_FIELDS}
    if out.get("role") not in ROLES:
        out["role"] = "user"
    if out["role"] == "tool" and not isinstance(out.get("tool_call_id"), str):
        out["tool_call_id"] = "call_0"
    if isinstance(out.get("content"), list):
        parts = out["content"]
        texts = [p.get("text") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        out["content"] = "".join(texts) or "Hello"
    return out


def _honoured_only(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """The body less what service.api.request_fields refuses (unknown fields, refused values)."""

    def kept(name: str, value: Any) -> bool:
        row = lookup(endpoint, name)
        return row is not None and (value is None or row.refusal(value, body) is None)

    out = {}
    for key, value in body.items():
        if not kept(key, value):
            continue
        if key in ("stream_options", "nvext") and isinstance(value, dict):
            value = {k: v for k, v in value.items() if kept(f"{key}.{k}", v)}
        out[key] = value
    return out


def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy:
    """Each body as generated, naming the served model, or naming it and repaired."""
    if not isinstance(body, dict) or context.operation is None or "model" not in body:
        return st.just(body)
    served = {**body, "model": EMBEDDED_NAME}
    repaired = _repaired(context.operation.path, served)
    if context.operation.path not in GENERATION_PATHS:
        return st.sampled_from([body, served, repaired, repaired])
    # Unknown fields are refused (service.api.request_fields), so a served body with the schema's
    # random extra keys is mostly a 400; derandomized draws favour the first elements: repaired first.
    return st.sampled_from([repaired, served, {**repaired, "stream": True}, body])


def sse_well_formed(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """A streamed answer is `data: <json>` events ending in `data: [DONE]`, with no error frame."""
    content_type = (response.headers.get("content-type") or [""])[0]
    if not content_type.startswith("text/event-stream"):
        return None
    events = [e for e in response.text.split("\n\n") if e.strip()]
    assert events, "empty event stream"
    assert all(e.startswith("data: ") for e in events), f"malformed SSE events: {events!r}"
    assert events[-1] == "data: [DONE]", f"stream does not end with [DONE]: {events[-1]!r}"
    expected = "chat.completion.chunk" if case.path == "/v1/chat/completions" else "text_completion"
    for event in events[:-1]:
        payload = json.loads(event.removeprefix("data: "))
        assert "error" not in payload, f"error frame in the stream: {payload}"
        assert payload["object"] == expected, payload
        assert isinstance(payload["choices"], list), payload
    return True


@pytest.fixture(scope="module")
def api_schema(target: FuzzTarget) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict({"max-stream-events": 500, "request-timeout": 60})
    schema = schemathesis.openapi.from_url(f"{target.live().base_url}/openapi.json", config=config)
    schema.hook(flatmap_body)
    return schema


def _log_errors(server: ServerProcess, start: int) -> list[str]:
    return [line for line in server.log()[start:].splitlines() if ERROR_LINE.search(line)]


@pytest.mark.parametrize(
    ("method", "path", "max_examples"),
    [pytest.param(m, p, n, id=f"{m} {p}") for m, p, n in OPERATIONS],
)
def test_api_conforms_to_its_schema(
    target: FuzzTarget, api_schema: schemathesis.BaseSchema, method: str, path: str, max_examples: int
) -> None:
    server = target.live()
    log_start = len(server.log())
    operation = api_schema[path][method]
    statuses: Counter = Counter()
    # Operations without parameters or a body have nothing to get wrong.
    modes = [GenerationMode.POSITIVE] if method == "GET" else list(GenerationMode)

    @hypothesis.settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        for mode in modes:
            case = data.draw(operation.as_strategy(mode), label=mode.value)
            try:
                response = case.call_and_validate(
                    base_url=server.base_url,
                    checks=[not_a_server_error, response_schema_conformance, sse_well_formed],
                )
            except requests.ConnectionError:
                logged = "\n".join(_log_errors(server, log_start)[-20:])
                raise AssertionError(f"the server is down; it logged:\n{logged}") from None
            statuses[response.status_code] += 1
            errors = _log_errors(server, log_start)
            assert not errors, f"{case.as_curl_command()}\nlogged errors:\n" + "\n".join(errors[-20:])

    fuzz()
    assert server.process.poll() is None, "the server exited"
    if path in GENERATION_PATHS:  # the generation code paths really ran, not only 400/404s
        assert statuses[200] >= 5, statuses


# --- Bugs found while fuzzing, one request each (fixed; kept as regressions) -------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"model": EMBEDDED_NAME, "prompt": "a<LONE>b"}),
        ("/v1/completions", {"model": EMBEDDED_NAME, "prompt": "a<LONE>b", "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"model": EMBEDDED_NAME, "messages": [{"role": "user", "content": "a<LONE>"}], "max_tokens": 2},
        ),
        ("/v1/completions", {"model": "a<LONE>", "prompt": "hi", "max_tokens": 2}),
    ],
    ids=["tokenize-prompt", "completions-prompt", "chat-content", "model-name"],
)
def test_lone_surrogates_are_a_client_error(target: FuzzTarget, path: str, body: dict[str, Any]) -> None:
    server = target.live()
    log_start = len(server.log())
    # A lone surrogate: a valid JSON escape, though no UTF-8 text can hold the character.
    raw = json.dumps(body).replace("<LONE>", "\\ud800").encode()
    response = requests.post(
        f"{server.base_url}{path}", data=raw, headers={"content-type": "application/json"}
    )
    errors = "\n".join(_log_errors(server, log_start)[-10:])
    assert response.status_code in (400, 404), f"{response.status_code} {response.text}; logged:\n{errors}"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert not errors, errors


# Regressions: each of these once took the whole engine down.


def _assert_survives(target: FuzzTarget, **fields: Any) -> None:
    server = target.live()
    log_start = len(server.log())
    body = {"model": EMBEDDED_NAME, "prompt": "hi", "max_tokens": 2, **fields}
    try:
        status = requests.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code
    except requests.ConnectionError:
        status = None
    alive = target._ready(server)
    errors = "\n".join(_log_errors(server, log_start)[-10:])
    assert status in (200, 400), f"{fields} -> {status}; logged:\n{errors}"
    assert alive and not errors, f"{fields} -> {status}; logged:\n{errors}"


def test_tiny_temperature_does_not_crash_the_engine(target: FuzzTarget) -> None:
    _assert_survives(target, temperature=5e-324)


def test_tiny_top_p_does_not_crash_the_engine(target: FuzzTarget) -> None:
    _assert_survives(target, top_p=5e-324)


def test_tiny_repetition_penalty_does_not_crash_the_engine(target: FuzzTarget) -> None:
    _assert_survives(target, repetition_penalty=1e-300)


def test_out_of_range_seed_does_not_crash_the_engine(target: FuzzTarget) -> None:
    _assert_survives(target, seed=2**64 - 1, n=2)
