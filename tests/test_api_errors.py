"""Every error a client can cause, over real HTTP, in OpenAI's error shape; the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import EMBEDDED_NAME

MESSAGES = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
CALL_AS_STRING = {"id": "call_1", "type": "function", "function": "get_time"}
DEEP: list = []
for _ in range(600):  # nested deeper than a chat template can be handed it
    DEEP = [DEEP]


def assert_error(response: httpx.Response, status: int, type_: str, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_
    assert error["code"] == code
    return error


@pytest.fixture(scope="module")
def http(base_url: str) -> httpx.Client:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unknown_model_is_404(http: httpx.Client, path: str) -> None:
    body = {"model": "no-such-model", "messages": MESSAGES, "prompt": "Hi"}
    error = assert_error(http.post(path, json=body), 404, "invalid_request_error", "model_not_found")
    assert "no-such-model" in error["message"]
    assert error["param"] == "model"


def test_unknown_model_raises_not_found_in_official_client(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": 3.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"top_logprobs": 25, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),  # str.isdigit takes it, int() does not
        ({"logit_bias": {"٣": 1}}, "logit_bias"),  # int() reads it as 3: not a token id as written
        ({"logit_bias": {"１": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # past what int() reads
        (
            {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [CALL_AS_STRING]}]},
            "messages.1.tool_calls.0.function",
        ),
        (  # arguments (given as an object) nested past what a template renders
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [{**CALL, "function": {"name": "get_time", "arguments": DEEP}}],
                    },
                ]
            },
            "messages",
        ),
        (  # an unknown field of a tool call (issue 43)
            {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{**CALL, "extra": 1}]}]},
            "messages.1.tool_calls.0.extra",
        ),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": "get_time"}}, "tool_choice"),
        ({"tools": [TOOL, TOOL]}, "tools.1.function.name"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 10}, "min_tokens"),
        ({"stop_token_ids": [99999999]}, "stop_token_ids"),
        ({"nvext": {"guided_json": "{not json"}}, "nvext.guided_json"),
        ({"nvext": {"guided_whitespace_pattern": " "}}, "nvext.guided_whitespace_pattern"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "nvext": {"guided_choice": ["x"]}}, "nvext.guided_choice"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ],
)
def test_invalid_chat_parameters_are_400(http: httpx.Client, patch: dict, param: str) -> None:
    body = {"model": EMBEDDED_NAME, "messages": MESSAGES, "max_tokens": 4, **patch}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, "invalid_request_error")
    assert error["param"] == param, error


def test_missing_field_is_400(http: httpx.Client) -> None:
    error = assert_error(
        http.post("/v1/chat/completions", json={"model": EMBEDDED_NAME}), 400, "invalid_request_error"
    )
    assert error["param"] == "messages"
    error = assert_error(
        http.post("/v1/completions", json={"model": EMBEDDED_NAME}), 400, "invalid_request_error"
    )
    assert error["param"] == "prompt"


@pytest.mark.parametrize(
    "patch",
    [
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [999999]},
        {"suffix": "x"},
        {"logprobs": 9},
        {"best_of": 3},
        {"logit_bias": {"²": 1}},
    ],
)
def test_invalid_completion_parameters_are_400(http: httpx.Client, patch: dict) -> None:
    body = {"model": EMBEDDED_NAME, "prompt": "Hi", "max_tokens": 4, **patch}
    assert_error(http.post("/v1/completions", json=body), 400, "invalid_request_error")


@pytest.mark.parametrize(
    "raw",
    [b'{"model": "x", "messages": [', b"not json at all", b"", b"[1, 2, 3]", b'"a string"'],
)
def test_malformed_json_is_400(http: httpx.Client, raw: bytes) -> None:
    response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_request_error")


def test_prompt_longer_than_context_names_both_numbers(http: httpx.Client, base_url: str) -> None:
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    long_text = "hello " * (max_len + 10)
    response = http.post(
        "/v1/chat/completions",
        json={"model": EMBEDDED_NAME, "messages": [{"role": "user", "content": long_text}]},
    )
    error = assert_error(response, 400, "invalid_request_error", "context_length_exceeded")
    assert str(max_len) in error["message"]
    prompt_tokens = int(error["message"].split("(")[1].split(" in the prompt")[0])
    assert prompt_tokens > max_len
    assert str(prompt_tokens) in error["message"]

    response = http.post(
        "/v1/completions", json={"model": EMBEDDED_NAME, "prompt": "Hi", "max_tokens": max_len}
    )
    error = assert_error(response, 400, "invalid_request_error", "context_length_exceeded")
    assert str(max_len) in error["message"]


def test_tool_call_arguments_that_are_not_json_reach_the_template_as_text(http: httpx.Client) -> None:
    for arguments in ("not json", "[" * 100_000):  # the second nests past what json.loads reads
        call = {**CALL, "function": {"name": "get_time", "arguments": arguments}}
        messages = [*MESSAGES, {"role": "assistant", "tool_calls": [call]}, {"role": "user", "content": "Hi"}]
        body = {"model": EMBEDDED_NAME, "messages": messages, "max_tokens": 2}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text


def test_unknown_route_and_method(http: httpx.Client) -> None:
    error = assert_error(http.get("/v1/nothing-here"), 404, "invalid_request_error")
    assert "/v1/nothing-here" in error["message"]
    assert_error(http.get("/v1/chat/completions"), 405, "invalid_request_error")


def test_server_keeps_serving_after_errors(http: httpx.Client) -> None:
    for _ in range(3):
        http.post("/v1/chat/completions", content=b"{{{", headers={"content-type": "application/json"})
    ok = http.post(
        "/v1/chat/completions", json={"model": EMBEDDED_NAME, "messages": MESSAGES, "max_tokens": 2}
    )
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] <= 2
