"""Every metric series NIM documents (unprefixed) and vLLM's per-request series (queue, prefill,
decode and inference phases, time per output token, token counts) move as a real server serves
chats and completions, streamed and not, with vLLM's buckets; both /v1/metrics and /metrics."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from service.engine.config import CPU_MAX_NUM_SEQS
from tests.conftest import EMBEDDED_NAME

# vLLM's buckets, as vllm/v1/metrics/loggers.py declares them (written out here, not imported from
# the service, so a drifting constant fails this test).
VLLM_TTFT = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
VLLM_TPOT = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0,
]  # fmt: skip
VLLM_REQUEST_LATENCY = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip

LABEL = f'{{model_name="{EMBEDDED_NAME}"}}'
# histogram -> vLLM's buckets (None: 1-2-5 up to the context length) and its label set ("" = none)
HISTOGRAMS: dict[str, tuple[list[float] | None, str]] = {
    "vllm:time_to_first_token_seconds": (VLLM_TTFT, LABEL),
    "vllm:inter_token_latency_seconds": (VLLM_TPOT, LABEL),
    "vllm:time_per_output_token_seconds": (VLLM_TPOT, LABEL),
    "vllm:request_time_per_output_token_seconds": (VLLM_TPOT, LABEL),
    "vllm:e2e_request_latency_seconds": (VLLM_REQUEST_LATENCY, LABEL),
    "vllm:request_queue_time_seconds": (VLLM_REQUEST_LATENCY, LABEL),
    "vllm:request_prefill_time_seconds": (VLLM_REQUEST_LATENCY, LABEL),
    "vllm:request_decode_time_seconds": (VLLM_REQUEST_LATENCY, LABEL),
    "vllm:request_inference_time_seconds": (VLLM_REQUEST_LATENCY, LABEL),
    "vllm:request_prompt_tokens": (None, LABEL),
    "vllm:request_generation_tokens": (None, LABEL),
    "vllm:request_max_num_generation_tokens": (None, LABEL),
    "vllm:request_params_max_tokens": (None, LABEL),
    # NIM's documented names
    "time_to_first_token_seconds": (VLLM_TTFT, ""),
    "time_per_output_token_seconds": (VLLM_TPOT, ""),
    "e2e_request_latency_seconds": (VLLM_REQUEST_LATENCY, ""),
    "request_prompt_tokens": (None, ""),
    "request_generation_tokens": (None, ""),
}
SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?P<labels>\{[^}]*\})? (?P<value>\S+)$")


def scrape(url: str) -> dict[str, float]:
    response = httpx.get(url)
    assert response.status_code == 200
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        match = SAMPLE.match(line)
        if match:
            values[match["name"] + (match["labels"] or "")] = float(match["value"])
    return values


def one_two_five(limit: int) -> list[float]:
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return [float(b) for b in out]
            out.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class Sent:
    max_tokens: int
    prompt_tokens: int
    completion_tokens: int


def send_requests(base_url: str) -> list[Sent]:
    """Two completions and two chats, one of each streamed; ignore_eos makes each generate
    exactly max_tokens tokens (finish_reason length)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    usage = {"include_usage": True}
    sent = []
    out = client.completions.create(
        model=EMBEDDED_NAME, prompt="Once upon a time", max_tokens=5, temperature=0, extra_body=extra
    )
    assert out.usage is not None
    sent.append(Sent(5, out.usage.prompt_tokens, out.usage.completion_tokens))
    chunks = list(
        client.completions.create(
            model=EMBEDDED_NAME,
            prompt="The weather today",
            max_tokens=6,
            stream=True,
            stream_options=usage,
            extra_body=extra,
        )
    )
    final = chunks[-1].usage
    assert final is not None
    sent.append(Sent(6, final.prompt_tokens, final.completion_tokens))
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(
        model=EMBEDDED_NAME, messages=messages, max_tokens=4, temperature=0, extra_body=extra
    )  # type: ignore[arg-type]
    assert chat.usage is not None
    sent.append(Sent(4, chat.usage.prompt_tokens, chat.usage.completion_tokens))
    stream = list(
        client.chat.completions.create(
            model=EMBEDDED_NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=7,
            stream=True,
            stream_options=usage,
            extra_body=extra,
        )
    )
    last = stream[-1].usage
    assert last is not None
    sent.append(Sent(7, last.prompt_tokens, last.completion_tokens))
    assert all(s.completion_tokens == s.max_tokens for s in sent), sent
    return sent


@pytest.fixture(scope="module")
def run(base_url: str) -> tuple[dict[str, float], dict[str, float], list[Sent]]:
    before = scrape(f"{base_url}/v1/metrics")
    sent = send_requests(base_url)
    return before, scrape(f"{base_url}/v1/metrics"), sent


def test_both_paths_serve_the_same_series(base_url: str) -> None:
    names = {key.split("{")[0] for key in scrape(f"{base_url}/v1/metrics")}
    assert names == {key.split("{")[0] for key in scrape(f"{base_url}/metrics")}


def test_histograms_have_vllms_buckets(base_url: str) -> None:
    after = scrape(f"{base_url}/v1/metrics")
    max_model_len = httpx.get(f"{base_url}/v1/models").json()["data"][0]["max_model_len"]
    for name, (buckets, label) in HISTOGRAMS.items():
        expected = buckets if buckets is not None else one_two_five(max_model_len)
        bounds = [
            re.search(r'le="([^"]+)"', key)[1]  # type: ignore[index]
            for key in after
            if key.startswith(f"{name}_bucket{{") and (label[1:-1] in key)
        ]
        assert bounds[-1] == "+Inf", name
        assert [float(b) for b in bounds[:-1]] == expected, name


def test_every_series_moves_as_requests_are_served(
    run: tuple[dict[str, float], dict[str, float], list[Sent]],
) -> None:
    before, after, sent = run

    def delta(key: str) -> float:
        assert key in after, f"{key} is not exported"
        return after[key] - before.get(key, 0.0)

    n = len(sent)
    prompt = sum(s.prompt_tokens for s in sent)
    generated = sum(s.completion_tokens for s in sent)
    for name, (_, label) in HISTOGRAMS.items():
        count = delta(f"{name}_count{label}")
        per_token = name.endswith(("inter_token_latency_seconds", "time_per_output_token_seconds"))
        per_token = per_token and "request_time" not in name
        assert count == (generated - n if per_token else n), name
        assert delta(f"{name}_sum{label}") > 0, name
    for name, value in {
        "vllm:prompt_tokens_total": prompt,
        "vllm:generation_tokens_total": generated,
        "vllm:request_prompt_tokens_sum": prompt,
        "vllm:request_generation_tokens_sum": generated,
        "vllm:request_max_num_generation_tokens_sum": generated,
        "vllm:request_params_max_tokens_sum": sum(s.max_tokens for s in sent),
    }.items():
        assert delta(name + LABEL) == value, name
    for name, value in {
        "prompt_tokens_total": prompt,
        "generation_tokens_total": generated,
        "request_prompt_tokens_sum": prompt,
        "request_generation_tokens_sum": generated,
        "request_finish_total": n,
        "request_success_total": n,
        "request_failure_total": 0,
    }.items():
        assert delta(name) == value, name
    assert delta(f'vllm:request_success_total{{finished_reason="length",model_name="{EMBEDDED_NAME}"}}') == n
    # NIM's gauges are there; num_request_max is the engine's batch limit (NIM_MAX_NUM_SEQS).
    for gauge in ("num_requests_running", "num_requests_waiting", "gpu_cache_usage_perc"):
        assert gauge in after, gauge
    assert after["num_request_max"] == CPU_MAX_NUM_SEQS  # the CPU default (NIM_MAX_NUM_SEQS unset)


def test_phases_add_up(run: tuple[dict[str, float], dict[str, float], list[Sent]]) -> None:
    """queue + prefill = time to first token; prefill + decode = inference; all within e2e."""
    before, after, _ = run

    def total(name: str, label: str = LABEL) -> float:
        key = f"{name}_sum{label}"
        return after[key] - before.get(key, 0.0)

    queue = total("vllm:request_queue_time_seconds")
    prefill = total("vllm:request_prefill_time_seconds")
    decode = total("vllm:request_decode_time_seconds")
    inference = total("vllm:request_inference_time_seconds")
    ttft, e2e = total("vllm:time_to_first_token_seconds"), total("vllm:e2e_request_latency_seconds")
    assert queue >= 0 and prefill > 0 and decode > 0
    assert queue + prefill == pytest.approx(ttft, abs=1e-6)
    assert prefill + decode == pytest.approx(inference, abs=1e-6)
    assert queue + inference == pytest.approx(e2e, abs=1e-6)
    assert total("time_to_first_token_seconds", "") == pytest.approx(ttft, abs=1e-9)
    assert total("e2e_request_latency_seconds", "") == pytest.approx(e2e, abs=1e-9)


def test_the_running_gauge_agrees_with_answers_and_aborts(base_url: str) -> None:
    """A client that has its whole answer never scrapes a gauge still counting it, and a request
    counted as aborted is no longer counted as running (issue 43: the engine published a step's
    stats after releasing its outputs, and an abort was counted before the engine had taken it)."""
    body = {"model": EMBEDDED_NAME, "prompt": "One, two,", "max_tokens": 2, "stream": True}
    running = []
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for _ in range(5):
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                assert "[DONE]" in response.read().decode()
            running.append(scrape(f"{base_url}/v1/metrics")["num_requests_running"])
        assert running == [0.0] * 5

        aborted = f'vllm:request_success_total{{finished_reason="abort",model_name="{EMBEDDED_NAME}"}}'
        before = scrape(f"{base_url}/v1/metrics").get(aborted, 0.0)
        long_body = {**body, "max_tokens": 2000, "ignore_eos": True}
        for _ in range(4):
            with client.stream("POST", "/v1/completions", json=long_body) as response:
                next(response.iter_lines())  # the first event, then the client leaves
        deadline = time.monotonic() + 10
        while True:
            now = scrape(f"{base_url}/v1/metrics")
            gone = now.get(aborted, 0.0) - before
            assert gone + now["num_requests_running"] <= 4, (gone, now["num_requests_running"])
            if gone == 4 or time.monotonic() > deadline:
                break
        assert gone == 4 and now["num_requests_running"] == 0
