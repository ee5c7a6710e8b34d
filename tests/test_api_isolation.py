"""A request's cost stays with it, over real HTTP: a huge prompt is refused before it is tokenized,
and a large one is tokenized off the event loop (probes keep answering)."""

from __future__ import annotations

import threading
import time

import httpx

from tests.conftest import EMBEDDED_NAME

# No token of the embedded model stands for more than 81 characters, nor for less than one CJK
# character (three bytes, three tokens): 600k of them are allowed by the character bound
# (8191 x 81) and take about a second to tokenize, into far more tokens than the context holds.
LARGE_PROMPT = "猫" * 600_000
HEALTH_STALL_S = 0.5  # what the event loop may take to answer a probe while large prompts are tokenized


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
