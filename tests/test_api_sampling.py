"""Every sampling parameter over real HTTP, on the embedded model."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import openai
import pytest

from service.host import cpu_has_fast_bf16
from tests.conftest import EMBEDDED_NAME

STORY = [{"role": "user", "content": "Write a short story about a cat who learns to fly."}]
# A question whose greedy answer has a clear margin at every token (over 1 nat), so it is the
# same on a CPU and a GPU; "What is the capital of France?" ties within 0.1 nat on the first.
CAPITAL = [{"role": "user", "content": "Name the capital of France."}]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, messages=STORY, **kwargs):
    params = {"model": EMBEDDED_NAME, "messages": messages, "max_tokens": 24, "temperature": 0, **kwargs}
    return client.chat.completions.create(**params)


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI):
    return chat(client)


def test_top_k_1_and_min_p_1_are_greedy(client: openai.OpenAI, greedy) -> None:
    # top_k=1 is greedy even where logits tie exactly (the story's 4th token does: two bf16
    # logits of 21.5); min_p=1 keeps every tie of the maximum, so it is checked on a prompt
    # with a clear margin.
    want = greedy.choices[0].message.content
    assert chat(client, temperature=1.5, seed=3, extra_body={"top_k": 1}).choices[0].message.content == want
    nvext = chat(client, temperature=1.5, seed=3, extra_body={"nvext": {"top_k": 1}})
    assert nvext.choices[0].message.content == want
    capital = chat(client, CAPITAL).choices[0].message.content
    min_p = chat(client, CAPITAL, temperature=1.5, seed=3, extra_body={"min_p": 1.0})
    assert min_p.choices[0].message.content == capital


def test_temperature_sampling_varies_and_seed_reproduces(client: openai.OpenAI) -> None:
    outs = {chat(client, temperature=1.0, seed=s).choices[0].message.content for s in range(4)}
    assert len(outs) > 1
    assert chat(client, temperature=1.0, seed=9).choices[0].message.content == (
        chat(client, temperature=1.0, seed=9).choices[0].message.content
    )


def test_seed_reproduces_whatever_else_is_in_the_batch(base_url: str) -> None:
    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)

        def seeded():
            return client.chat.completions.create(
                model=EMBEDDED_NAME, messages=STORY, max_tokens=24, temperature=0.8, top_p=0.9, seed=77
            )

        alone = await seeded()
        noise = [
            client.completions.create(model=EMBEDDED_NAME, prompt="x " * (5 + 30 * i), max_tokens=10 + i)
            for i in range(6)
        ]
        *_, together = await asyncio.gather(*noise, seeded())
        await client.close()
        return alone.choices[0].message.content, together.choices[0].message.content

    alone, together = asyncio.run(run())
    assert alone == together


def test_penalties_change_repetitive_output(client: openai.OpenAI) -> None:
    prompt = [{"role": "user", "content": "Repeat the word 'cat' twenty times."}]
    plain = chat(client, prompt, max_tokens=30).choices[0].message.content
    for extra in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ):
        penalised = chat(client, prompt, max_tokens=30, **extra).choices[0].message.content
        assert penalised != plain, extra
        assert penalised.lower().count("cat") <= plain.lower().count("cat"), extra


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, embedded_tokenizer, greedy) -> None:
    forced_id = embedded_tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = chat(client, max_tokens=5, logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content.split() == ["banana"] * 5
    first = embedded_tokenizer.encode(greedy.choices[0].message.content, add_special_tokens=False)[0]
    banned = chat(client, max_tokens=5, logit_bias={str(first): -100})
    assert embedded_tokenizer.encode(banned.choices[0].message.content, add_special_tokens=False)[0] != first


def test_stop_token_ids_min_tokens_and_ignore_eos(client: openai.OpenAI, embedded_tokenizer) -> None:
    answer = chat(client, CAPITAL, max_tokens=30)
    assert answer.choices[0].finish_reason == "stop"
    ids = embedded_tokenizer.encode(answer.choices[0].message.content, add_special_tokens=False)
    stopped = chat(client, CAPITAL, max_tokens=30, extra_body={"stop_token_ids": [ids[2]]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == embedded_tokenizer.decode(ids[:2])
    assert stopped.usage.completion_tokens == 3  # the stop token is counted, not shown

    at_least = chat(client, CAPITAL, max_tokens=30, extra_body={"min_tokens": 15})
    assert at_least.usage.completion_tokens >= 15
    endless = chat(client, CAPITAL, max_tokens=20, extra_body={"ignore_eos": True})
    assert endless.usage.completion_tokens == 20 and endless.choices[0].finish_reason == "length"


def test_include_stop_str_in_output(client: openai.OpenAI) -> None:
    full = chat(client, CAPITAL, max_tokens=30).choices[0].message.content
    stop = "Paris"
    assert stop in full
    cut = chat(client, CAPITAL, max_tokens=30, stop=[stop]).choices[0].message.content
    kept = chat(client, CAPITAL, max_tokens=30, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert cut == full[: full.index(stop)]
    assert kept.choices[0].message.content == cut + stop


def test_chat_logprobs(client: openai.OpenAI, greedy) -> None:
    out = chat(client, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(out.choices[0].message.content[:10])
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-4)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    assert out.choices[0].message.content == greedy.choices[0].message.content

    stream = chat(client, logprobs=True, top_logprobs=1, stream=True)
    streamed = [
        c
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert [c.token for c in streamed] == [c.token for c in content]


def test_completion_logprobs_with_echo(client: openai.OpenAI, embedded_tokenizer) -> None:
    prompt = "The capital of France is"
    out = client.completions.create(
        model=EMBEDDED_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    lp = out.choices[0].logprobs
    num_prompt = len(embedded_tokenizer.encode(prompt))
    assert len(lp.tokens) == num_prompt + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)


def test_prefix_cache_hits_show_in_usage(client: openai.OpenAI) -> None:
    system = {"role": "system", "content": "You are a meticulous assistant. " * 20}
    first = chat(client, [system, {"role": "user", "content": "Say one word."}], max_tokens=2)
    second = chat(client, [system, {"role": "user", "content": "Say two words."}], max_tokens=2)
    assert first.usage.prompt_tokens > 100
    assert second.usage.prompt_tokens_details.cached_tokens >= 96


def test_client_disconnect_aborts_generation(base_url: str) -> None:
    body = {
        "model": EMBEDDED_NAME,
        "prompt": "Count forever:",
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 6:
                break  # leaving the block closes the connection mid-stream

    def gauge(name: str) -> float:
        text = httpx.get(f"{base_url}/v1/metrics").text
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if gauge("vllm:num_requests_running") == 0 and gauge("vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.05)
    assert gauge("vllm:num_requests_running") == 0
    assert gauge("vllm:kv_cache_usage_perc") == 0
    text = httpx.get(f"{base_url}/v1/metrics").text
    assert 'vllm:request_success_total{finished_reason="abort"' in text


def test_engine_metrics_are_exposed(base_url: str) -> None:
    text = httpx.get(f"{base_url}/v1/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "gpu_cache_usage_perc",
        "num_requests_running",
        "num_requests_waiting",
    ):
        assert any(line.startswith(name) for line in text.splitlines()), name
    info = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    # An auto KV cache holds the activation dtype: bfloat16 where the CPU has bf16 instructions
    # (int4 weights), float32 where it lacks them (fp32 or int4 weights alike).
    activations = "bfloat16" if cpu_has_fast_bf16() else "float32"
    assert 'block_size="16"' in info and "num_gpu_blocks=" in info and f'cache_dtype="{activations}"' in info
