"""The OpenAI API over real HTTP, with the official client, against the embedded model."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.conftest import EMBEDDED_NAME

# A question whose greedy answer has a clear margin at every token (over 1 nat), so it is the
# same on a CPU and a GPU; "What is the capital of France?" ties within 0.1 nat on the first.
CAPITAL = [{"role": "user", "content": "Name the capital of France."}]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy_answer(client: openai.OpenAI) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=EMBEDDED_NAME, messages=CAPITAL, temperature=0, max_tokens=40)


def chat_prompt_tokens(tokenizer, messages) -> list[int]:
    return tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [EMBEDDED_NAME]


def test_chat_names_paris(greedy_answer, embedded_tokenizer) -> None:
    choice = greedy_answer.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert greedy_answer.object == "chat.completion"
    assert greedy_answer.id.startswith("chatcmpl-")
    usage = greedy_answer.usage
    assert usage.prompt_tokens == len(chat_prompt_tokens(embedded_tokenizer, CAPITAL))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if choice.finish_reason == "stop":
        # The end-of-turn token counts as generated but is not part of the text.
        generated = embedded_tokenizer.encode(choice.message.content, add_special_tokens=False)
        assert usage.completion_tokens == len(generated) + 1
    else:
        assert choice.finish_reason == "length"
        assert usage.completion_tokens == 40


def test_length_finish_counts_exactly(client: openai.OpenAI) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        out = client.chat.completions.create(
            model=EMBEDDED_NAME,
            messages=[{"role": "user", "content": "Write a long story about a dragon."}],
            temperature=0,
            **{field: 7},
        )
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 7


def test_streaming_matches_non_streaming(client: openai.OpenAI, greedy_answer) -> None:
    stream = client.chat.completions.create(
        model=EMBEDDED_NAME,
        messages=CAPITAL,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_answer.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [greedy_answer.choices[0].finish_reason]
    assert chunks[-1].choices == []
    streamed_usage, first_usage = chunks[-1].usage, greedy_answer.usage
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(streamed_usage, key) == getattr(first_usage, key)
    # The same prompt again: its full blocks come from the prefix cache.
    assert streamed_usage.prompt_tokens_details.cached_tokens >= 16
    assert all(c.usage is None for c in chunks[:-1])


def test_async_client_concurrent_requests(base_url: str, greedy_answer) -> None:
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        calls = [
            client.chat.completions.create(
                model=EMBEDDED_NAME, messages=CAPITAL, temperature=0, max_tokens=40
            )
            for _ in range(4)
        ]
        results = await asyncio.gather(*calls)
        await client.close()
        return [r.choices[0].message.content for r in results]

    # Greedy output does not depend on what else is being generated at the same time.
    assert asyncio.run(run()) == [greedy_answer.choices[0].message.content] * 4


def test_async_streaming(base_url: str, greedy_answer) -> None:
    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = await client.chat.completions.create(
            model=EMBEDDED_NAME, messages=CAPITAL, temperature=0, max_tokens=40, stream=True
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await client.close()
        return "".join(pieces)

    assert asyncio.run(run()) == greedy_answer.choices[0].message.content


def test_stop_string_truncates_output(client: openai.OpenAI, greedy_answer) -> None:
    full = greedy_answer.choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    out = client.chat.completions.create(
        model=EMBEDDED_NAME, messages=CAPITAL, temperature=0, max_tokens=40, stop=[stop, "zzzz-never"]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == full[: full.index(stop)]
    streamed = client.chat.completions.create(
        model=EMBEDDED_NAME, messages=CAPITAL, temperature=0, max_tokens=40, stop=stop, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[: full.index(stop)]
    )


def test_seed_reproduces_and_differs(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.chat.completions.create(
            model=EMBEDDED_NAME,
            messages=[{"role": "user", "content": "Tell me a random word."}],
            temperature=1.0,
            max_tokens=16,
            seed=seed,
        )
        return out.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert len({sample(s) for s in (1, 2, 3, 4)} | {first}) > 1


def test_tiny_top_p_is_greedy(client: openai.OpenAI, greedy_answer) -> None:
    out = client.chat.completions.create(
        model=EMBEDDED_NAME, messages=CAPITAL, temperature=1.5, top_p=1e-6, max_tokens=40, seed=7
    )
    assert out.choices[0].message.content == greedy_answer.choices[0].message.content


def test_n_choices(client: openai.OpenAI) -> None:
    def run():
        return client.chat.completions.create(
            model=EMBEDDED_NAME, messages=CAPITAL, temperature=1.0, max_tokens=8, n=3, seed=5
        )

    out = run()
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert 3 <= out.usage.completion_tokens <= 24
    assert sum(c.finish_reason == "length" for c in out.choices) * 8 <= out.usage.completion_tokens
    # Seeded choices are reproducible, and each choice has its own stream.
    assert [c.message.content for c in run().choices] == [c.message.content for c in out.choices]
    assert len({c.message.content for c in out.choices}) > 1


def test_content_parts_are_accepted(client: openai.OpenAI, greedy_answer) -> None:
    out = client.chat.completions.create(
        model=EMBEDDED_NAME,
        messages=[{"role": "user", "content": [{"type": "text", "text": CAPITAL[0]["content"]}]}],
        temperature=0,
        max_tokens=40,
    )
    assert out.choices[0].message.content == greedy_answer.choices[0].message.content


def test_completions(client: openai.OpenAI, embedded_tokenizer) -> None:
    prompt = "The capital of France is"
    out = client.completions.create(model=EMBEDDED_NAME, prompt=prompt, temperature=0, max_tokens=8)
    assert out.object == "text_completion"
    assert out.usage.prompt_tokens == len(embedded_tokenizer.encode(prompt))
    text = out.choices[0].text
    assert "Paris" in text

    echoed = client.completions.create(
        model=EMBEDDED_NAME, prompt=prompt, temperature=0, max_tokens=8, echo=True
    )
    assert echoed.choices[0].text == prompt + text

    ids = embedded_tokenizer.encode(prompt)
    by_ids = client.completions.create(model=EMBEDDED_NAME, prompt=ids, temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == text

    two = client.completions.create(
        model=EMBEDDED_NAME, prompt=[prompt, "One plus one equals"], temperature=0, max_tokens=8
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == text

    stream = client.completions.create(
        model=EMBEDDED_NAME,
        prompt=prompt,
        temperature=0,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_sse_wire_format(base_url: str) -> None:
    body = {"model": EMBEDDED_NAME, "messages": CAPITAL, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert chunk["object"] == "chat.completion.chunk"
        assert "usage" not in chunk  # only with stream_options.include_usage


def test_template_fields_the_embedded_template_does_not_read_are_refused(client: openai.OpenAI) -> None:
    """SmolLM2's template reads neither reasoning_effort nor enable_thinking: each is a 400 naming
    the field, not a 200 without effect; so is a request's own template (NIM_TRUST_... unset)."""
    cases: list[tuple[dict, str]] = [
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        (
            {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
            "chat_template_kwargs.enable_thinking",
        ),
        ({"extra_body": {"chat_template": "{{ messages[0].content }}"}}, "chat_template"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=EMBEDDED_NAME, messages=CAPITAL, max_tokens=2, **fields)
        assert caught.value.body["param"] == param  # type: ignore[index]


def test_prompt_logprobs_on_chat_equal_the_echoed_prompt(client: openai.OpenAI, embedded_tokenizer) -> None:
    """vLLM's prompt_logprobs on chat: per prompt token (None first), by token id; the same numbers
    completions' echo with logprobs gives for the same tokens."""
    prompt = chat_prompt_tokens(embedded_tokenizer, CAPITAL)
    out = client.chat.completions.create(
        model=EMBEDDED_NAME, messages=CAPITAL, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    entries = out.model_extra["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    echo = client.completions.create(model=EMBEDDED_NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=1)
    want = echo.choices[0].logprobs.token_logprobs[1 : len(prompt)]
    got = [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], prompt[1:], strict=True)]
    assert got == pytest.approx(want, abs=1e-4)
    assert all(any(e["rank"] == 1 for e in entry.values()) for entry in entries[1:])


def test_continuous_usage_stats_on_completions(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=EMBEDDED_NAME,
            prompt="The capital of France is",
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    *answer, last = chunks
    assert last.usage.completion_tokens == 5 and not last.choices
    counts = [chunk.usage.completion_tokens for chunk in answer]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 2
    assert all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in answer)
