"""A request's cost stays with it, over real HTTP: a huge prompt is refused before it is tokenized,
a large one is tokenized off the event loop (probes keep answering), and a non-streamed request
whose client has gone stops generating."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.conftest import EMBEDDED_NAME

# No token of the embedded model stands for more than 81 characters, nor for less than one CJK
# character (three bytes, three tokens): 600k of them are allowed by the character bound
# (8191 x 81) and take about a second to tokenize, into far more tokens than the context holds.
LARGE_PROMPT = "猫" * 600_000
HEALTH_STALL_S = 0.5  # what the event loop may take to answer a probe while large prompts are tokenized


def gauge(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/v1/metrics", timeout=10).text
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + "{")).rsplit(" ", 1)[1])


def test_a_huge_prompt_is_refused_before_it_is_tokenized(base_url: str) -> None:
    huge = "hello world " * 900_000  # 10.8 MB: seconds to tokenize
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ("/v1/completions", {"prompt": huge}),
    ):
        started = time.monotonic()
        response = httpx.post(f"{base_url}{path}", json={"model": EMBEDDED_NAME, **body}, timeout=60)
        elapsed = time.monotonic() - started
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and "characters" in error["message"], error
        assert error["param"] == ("messages" if "chat" in path else "prompt")
        assert elapsed < 2.5, f"{path}: refused after {elapsed:.2f} s"


def test_probes_answer_while_large_prompts_are_tokenized(base_url: str) -> None:
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get("/v1/health/live").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        started = time.monotonic()
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": LARGE_PROMPT}]}),
            ("/v1/completions", {"prompt": LARGE_PROMPT}),
            ("/tokenize", {"prompt": LARGE_PROMPT}),
        ):
            response = httpx.post(f"{base_url}{path}", json={"model": EMBEDDED_NAME, **body}, timeout=120)
            if path == "/tokenize":
                assert response.status_code == 200 and response.json()["count"] > 1_000_000
            else:  # tokenized, then found too long
                assert response.status_code == 400, response.text
                assert response.json()["error"]["code"] == "context_length_exceeded"
        busy = time.monotonic() - started
    finally:
        done.set()
        prober.join()
    assert max(latencies) < HEALTH_STALL_S, f"a probe waited {max(latencies):.2f} s (of {busy:.2f} s busy)"
    assert len(latencies) > 10, (latencies, busy)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to a million."}]}),
        ("/v1/completions", {"prompt": "Count:", "n": 2}),
    ],
    ids=["chat", "completions-n2"],
)
def test_a_request_whose_client_left_stops_generating(base_url: str, path: str, body: dict) -> None:
    # Thousands of tokens: tens of seconds on a CPU, longer than the client waits by far.
    request = {"model": EMBEDDED_NAME, "max_tokens": 6000, "ignore_eos": True, "temperature": 0, **body}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}{path}", json=request, timeout=httpx.Timeout(10, read=1.5))
    gave_up = time.monotonic()
    while gauge(base_url, "vllm:num_requests_running") or gauge(base_url, "vllm:num_requests_waiting"):
        assert time.monotonic() - gave_up < 5, "the engine still generates for a client that left"
        time.sleep(0.05)
    ok = httpx.post(f"{base_url}{path}", json={**request, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2 * body.get("n", 1)
