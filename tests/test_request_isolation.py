"""Failure domains: what goes wrong in one request ends that request alone.

In process: a fault injected into one row of a mixed batch (its sampling, its output processing,
NaN logits) ends that request with an error; every other request's tokens and logprobs are
bitwise those of a run without it, and the engine goes on. Over HTTP: a constraint that no text
can satisfy fails its own request (400 before the response starts, an error frame in a stream)
while other streams in flight finish and the server stays ready.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from service.engine.output import OutputProcessor
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch import sampler
from service.engine.torch.engine import TorchEngine
from tests.test_engine import make_engine, prompt_of, run_all, wait_idle

POISON_SEED = 987654321  # the injected fault hits the row carrying this seed


@pytest.fixture(scope="module")
def engine() -> Iterator[TorchEngine]:
    engine = make_engine()
    yield engine
    asyncio.run(engine.stop())


def _mixed_batch(engine: TorchEngine) -> list[GenerationRequest]:
    """Greedy and seeded rows with logprobs, prompts of different lengths (prefills beside decodes)."""
    requests = []
    for i in range(6):
        params = SamplingParams(
            max_tokens=12,
            temperature=0.0 if i % 2 else 0.8,
            seed=100 + i,
            logprobs=2,
            ignore_eos=True,
        )
        requests.append(GenerationRequest(f"r{i}", prompt_of(engine, 5 + 7 * i, seed=i), params))
    return requests


def _victim(engine: TorchEngine) -> GenerationRequest:
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=POISON_SEED, logprobs=2, ignore_eos=True)
    return GenerationRequest("victim", prompt_of(engine, 20, seed=99), params)


def _signature(result) -> list[tuple[int, float | None]]:
    return [
        (token, out.logprobs[k].logprob if out.logprobs else None)
        for out in result.outputs
        for k, token in enumerate(out.token_ids)
    ]


# The same tokens, and logprobs equal up to float32 rounding: bitwise on CPUs whose matmuls round a
# row alike at every batch size (AVX-512), within ~1e-5 nats on an AVX2-only CPU in fp32, whose
# float32 matmul rounds a row differently when the batch gains a row.
LOGPROB_ROUNDING = 1e-4


def _same_answer(got, expected) -> bool:
    a, b = _signature(got), _signature(expected)
    return [t for t, _ in a] == [t for t, _ in b] and all(
        (x is None and y is None) or (x is not None and y is not None and abs(x - y) <= LOGPROB_ROUNDING)
        for (_, x), (_, y) in zip(a, b, strict=True)
    )


def _poisoned_filtered_probs(original):
    """The batched filters fail whenever the victim's row is among the rows they filter (the
    sampler then redoes the rows one by one, and only the victim's fails)."""

    def filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected sampling fault")
        return original(logits, params)

    return filtered


def _nan_for_victim(original):
    def sample(logits: torch.Tensor, rows, fused: bool = False):
        for i, row in enumerate(rows):
            if row.params.seed == POISON_SEED:
                logits[i, 7] = float("nan")
        return original(logits, rows, fused)

    return sample


@pytest.mark.parametrize("fault", ["sampling", "nan_logits", "output_processing"])
def test_a_fault_in_one_row_ends_that_request_and_no_other(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    batch = _mixed_batch(engine)
    engine.core.pool.reset_cache()
    clean = run_all(engine, batch)
    wait_idle(engine)

    if fault == "sampling":
        monkeypatch.setattr(sampler, "filtered_probs", _poisoned_filtered_probs(sampler.filtered_probs))
    elif fault == "nan_logits":
        from service.engine.torch import model_runner

        monkeypatch.setattr(model_runner, "sample", _nan_for_victim(model_runner.sample))
    else:
        original = OutputProcessor.process

        def process(self: OutputProcessor, token_id: int):
            if self.params.seed == POISON_SEED and self.num_generated == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
            return original(self, token_id)

        monkeypatch.setattr(OutputProcessor, "process", process)

    engine.core.pool.reset_cache()
    victim = _victim(engine)
    together = run_all(engine, [*batch[:3], victim, *batch[3:]])
    wait_idle(engine)  # nothing leaked: no running, no waiting, every block free

    failed = together["victim"].outputs[-1]
    assert failed.finished and failed.error, failed
    assert failed.error_cause == ("engine" if fault != "sampling" else "request")
    for request in batch:
        assert _same_answer(together[request.request_id], clean[request.request_id]), request.request_id
        assert together[request.request_id].finish_reason == "length"
    assert engine.ready and engine.failure is None

    monkeypatch.undo()  # the engine goes on serving, the victim too
    again = run_all(engine, [_victim(engine)])["victim"]
    assert again.finish_reason == "length" and len(again.token_ids) == 12


def test_a_grammar_dead_end_at_run_time_ends_that_request_alone(engine: TorchEngine) -> None:
    """The API refuses constraints no text satisfies before they run (tests/test_structured_output);
    one that reaches the step anyway (here submitted past the check) ends its own request when its
    mask allows no token, and the rest of the batch is unchanged."""
    from service.engine.protocol import GuidedDecoding

    batch = _mixed_batch(engine)
    engine.core.pool.reset_cache()
    clean = run_all(engine, batch)
    dead_end = GenerationRequest(
        "dead-end",
        prompt_of(engine, 9, seed=7),
        SamplingParams(max_tokens=5, temperature=0.0, guided=GuidedDecoding("regex", "a[^\\s\\S]")),
    )
    engine.core.pool.reset_cache()
    together = run_all(engine, [*batch[:2], dead_end, *batch[2:]])
    wait_idle(engine)
    failed = together["dead-end"].outputs[-1]
    assert failed.error_cause == "request"
    assert (
        failed.error
        == "the regular expression admits no token after 1 generated tokens: no text can satisfy it"
    )
    assert together["dead-end"].token_ids == engine.tokenizer.encode("a", False)
    for request in batch:
        assert _same_answer(together[request.request_id], clean[request.request_id]), request.request_id
    assert engine.ready


CHAT = {"model": "smollm2-135m-instruct", "max_tokens": 5, "temperature": 0}
UNSATISFIABLE = {"guided_regex": "a[^\\s\\S]"}  # after "a", no character at all


def _stream(client: httpx.Client, path: str, body: dict) -> tuple[int, list[dict]]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, [response.json()]
        events = [
            json.loads(line[len("data: ") :])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        return 200, events


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_constraint_no_text_satisfies_fails_its_own_request(base_url: str, path: str) -> None:
    body = {**CHAT, **UNSATISFIABLE}
    if path == "/v1/completions":
        body["prompt"] = "Say something:"
    else:
        body["messages"] = [{"role": "user", "content": "Say something."}]
    long_body = {
        "model": CHAT["model"],
        "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=base_url, timeout=60) as client:
        alone = _stream(client, "/v1/chat/completions", long_body)[1]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            bystander = pool.submit(_stream, client, "/v1/chat/completions", long_body)
            plain = client.post(path, json=body)
            streamed_status, streamed = _stream(client, path, body)
            status, events = bystander.result()

        assert plain.status_code == 400, plain.text
        error = plain.json()["error"]
        assert "regular expression" in error["message"] and "no text" in error["message"], error
        assert error["type"] == "invalid_request_error"
        if streamed_status == 200:  # the stream had started: an error frame, not a dropped stream
            assert "error" in streamed[-1] and "no text" in streamed[-1]["error"]["message"]
        else:
            assert streamed_status == 400
        # The other stream in flight finished, token for token as it does alone.
        assert status == 200 and "error" not in events[-1]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"])
        assert text == "".join(c["choices"][0]["delta"].get("content") or "" for c in alone if c["choices"])
        assert client.get("/v1/health/ready").status_code == 200
        metrics = client.get("/v1/metrics").text
        assert "num_requests_running 0.0" in metrics


def test_a_request_whose_keys_turned_nan_leaves_no_trace(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN in a request's keys and values (an overflow in its own computation) ends it; its blocks
    are unpublished and zeroed before reuse, since attention reads a block's unwritten tail as
    masked entries that contribute zero only while finite: later requests answer as before."""
    from service.engine.torch import model_runner

    batch = _mixed_batch(engine)
    engine.core.pool.reset_cache()
    clean = run_all(engine, batch)
    wait_idle(engine)
    victim = _victim(engine)
    original = model_runner.sample
    poisoned_blocks: list[int] = []

    def sample(logits: torch.Tensor, rows, fused: bool = False):
        for i, row in enumerate(rows):
            if row.params.seed == POISON_SEED:
                poisoned_blocks[:] = [block.block_id for block in engine.core.kv.block_tables["victim"]]
                for layer in engine.core.kv_pool.data:
                    layer[:, :, poisoned_blocks] = float("nan")
                logits[i, 0] = float("nan")
        return original(logits, rows, fused)

    monkeypatch.setattr(model_runner, "sample", sample)
    failed = run_all(engine, [victim])["victim"].outputs[-1]
    monkeypatch.undo()
    assert failed.error and failed.error_cause == "engine"
    wait_idle(engine)
    # Unpublished: the same prompt again finds nothing cached.
    again = run_all(engine, [GenerationRequest("again", victim.prompt_token_ids, victim.sampling)])["again"]
    assert again.outputs[-1].num_cached_tokens == 0 and not again.outputs[-1].error
    assert all(bool(torch.isfinite(layer[:, :, poisoned_blocks]).all()) for layer in engine.core.kv_pool.data)
    engine.core.pool.reset_cache()
    after = run_all(engine, batch)
    for request in batch:
        assert _same_answer(after[request.request_id], clean[request.request_id]), request.request_id
    wait_idle(engine)
