"""Multi-LoRA serving through the real server and the official client.

A tiny float32 checkpoint (byte-level tokenizer) is served with NIM_PEFT_SOURCE holding adapters
this file writes in PEFT's layout. What is checked:
- an adapter's greedy tokens and logprobs equal the base model's with merged weights
  W + scale * B @ A, served as a checkpoint of its own (float32: logprobs within 2e-3 nats);
- four adapters and the base model, requested at once (one mixed batch), answer as each does
  alone; with fewer device slots than adapters, requests wait for a slot and answer the same;
  over int8 and int4 weights (bf16 activations) adapters change the answers and mix alike;
- /v1/models lists the adapters with the base model as parent; an unknown adapter is a 404 in
  OpenAI's shape; the gateway metric vllm:lora_requests_info and per-adapter counts are exported;
- the prefix cache never shares blocks across adapters;
- over two tensor-parallel ranks (adapters sharded like their layers) the answers are one rank's;
- adapters added to the source appear at the next rescan, removed ones disappear while a request
  already running with one finishes; a malformed adapter is never listed and the server serves on;
- bad adapters in the source at start (NaN weights, a half-copied file, a rank_pattern that is no
  regex) are refused once with the reason, and the base model answers as it does without them.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from service.engine.lora import TARGETS, block_of, read_adapter
from service.model.config import ModelConfig
from tests import test_lora
from tests.conftest import ServerProcess
from tests.test_quantization import serving
from tests.test_tensor_parallel import _checkpoint
from tests.test_tensor_parallel_serving import _distinct_tokens

NAME = "tiny-lora"
PROMPTS = ["Once upon a time", "The capital of France is", "0123456789", "adapters mixed in a batch"]
TOKENS = 10
ADAPTERS = ("sql", "chat.v2", "legal", "med")
FP32 = {"NIM_MODEL_PROFILE": "torch-generic-fp32-tp1-pp1-throughput"}
LONG = 400  # tokens: a request that outlasts an adapter's removal (~1 s here)
# Adapters the shared source also holds, each refused at start: name -> (how it is spoiled, why)
BAD = {
    "poisoned": "layer 0 down_proj: lora_A holds NaN",
    "half-copied": "adapter_model.safetensors is",
    "bad-regex": "rank_pattern key 'layers.(0' is not a valid regular expression",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = _checkpoint(
        tmp_path_factory.mktemp("lora") / NAME, vocab_size=256, max_position_embeddings=512
    )
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 4  # sharper: fewer near-ties
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _distinct_tokens(directory)
    return directory


def _config(checkpoint: Path) -> ModelConfig:
    return ModelConfig.from_hf_config(json.loads((checkpoint / "config.json").read_text()))


def write_adapter(
    directory: Path, config: ModelConfig, seed: int, rank: int = 8
) -> dict[tuple[int, str], torch.Tensor]:
    """An adapter on all seven projections; returns each one's merged delta scale * B @ A."""
    test_lora.write_adapter(directory, seed, rank, 2.0 * rank, TARGETS, config, std=0.15)
    adapter = read_adapter(directory, directory.name, config, max_rank=64)
    return {key: weights.delta() for key, weights in adapter.modules.items()}


def _merged(checkpoint: Path, deltas: dict[tuple[int, str], torch.Tensor], directory: Path) -> Path:
    shutil.copytree(checkpoint, directory)
    tensors = load_file(checkpoint / "model.safetensors")
    for (layer, module), delta in deltas.items():
        key = f"model.layers.{layer}.{block_of(module)}.{module}.weight"
        tensors[key] = (tensors[key].double() + delta.double()).float()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def source(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    config = _config(checkpoint)
    for seed, name in enumerate(ADAPTERS):
        write_adapter(root / name, config, seed=100 + seed, rank=4 + 4 * seed)
    test_lora.poison(test_lora.write_adapter(root / "poisoned", 200, 8, 16.0, TARGETS, config))
    test_lora.truncate(test_lora.write_adapter(root / "half-copied", 201, 8, 16.0, TARGETS, config))
    test_lora.write_adapter(root / "bad-regex", 202, 8, 16.0, TARGETS, config, rank_pattern={"layers.(0": 4})
    return root


@pytest.fixture(scope="module")
def lora_server(
    checkpoint: Path, source: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    env = {
        **FP32,
        "NIM_MODEL_NAME": str(checkpoint),
        "NIM_PEFT_SOURCE": str(source),
        "NIM_MAX_GPU_LORAS": "4",
        "NIM_MAX_LORA_RANK": "16",
        "NIM_ENABLE_KV_CACHE_REUSE": "1",
    }
    with serving(tmp_path_factory.mktemp("lora-server") / "server.log", env) as server:
        yield server


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(server: ServerProcess, model: str, prompt: str) -> tuple[list[str], list[float]]:
    out = _client(server).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert out.model == model and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert choice.logprobs.token_logprobs is not None
    return choice.logprobs.tokens, [float(x) for x in choice.logprobs.token_logprobs]


def test_an_adapter_answers_as_its_merged_weights(checkpoint: Path, tmp_path: Path) -> None:
    source = tmp_path / "adapters"
    deltas = write_adapter(source / "merged-check", _config(checkpoint), seed=7, rank=8)
    merged = _merged(checkpoint, deltas, tmp_path / NAME)  # same served name as the base
    env = {**FP32, "NIM_MODEL_NAME": str(checkpoint), "NIM_PEFT_SOURCE": str(source)}
    with serving(tmp_path / "lora.log", env) as server:
        adapted = [_greedy(server, "merged-check", p) for p in PROMPTS]
        base = [_greedy(server, NAME, p) for p in PROMPTS]
    with serving(tmp_path / "merged.log", {**FP32, "NIM_MODEL_NAME": str(merged)}) as server:
        want = [_greedy(server, NAME, p) for p in PROMPTS]
    assert [tokens for tokens, _ in base] != [tokens for tokens, _ in want]  # the adapter matters
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(adapted, want, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=2e-3)


def test_four_adapters_and_the_base_in_one_batch_answer_as_each_alone(lora_server: ServerProcess) -> None:
    models = [NAME, *ADAPTERS]
    jobs = [(model, prompt) for model in models for prompt in PROMPTS]
    alone = {job: _greedy(lora_server, *job) for job in jobs}
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = dict(zip(jobs, pool.map(lambda job: _greedy(lora_server, *job), jobs), strict=True))
    for job in jobs:
        assert together[job][0] == alone[job][0], job
        assert together[job][1] == pytest.approx(alone[job][1], abs=1e-3), job
    answers = {model: [alone[(model, p)][0] for p in PROMPTS] for model in models}
    assert len({json.dumps(a) for a in answers.values()}) == len(models)  # each answers its own way
    metrics = httpx.get(f"{lora_server.base_url}/v1/metrics", timeout=10).text
    idle = 'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""}'
    assert idle in metrics
    for adapter in ADAPTERS:
        assert f'nim_lora_requests_total{{lora_name="{adapter}",model_name="{NAME}"}} 8.0' in metrics


def test_models_lists_adapters_and_an_unknown_one_is_a_404(lora_server: ServerProcess) -> None:
    client = _client(lora_server)
    cards = {m.id: m for m in client.models.list().data}
    assert sorted(cards) == sorted([NAME, *ADAPTERS])
    assert all(getattr(cards[a], "parent", None) == NAME for a in ADAPTERS)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert caught.value.code == "model_not_found"
    streamed = client.completions.create(model="legal", prompt="hi", max_tokens=3, stream=True)
    assert {chunk.model for chunk in streamed} == {"legal"}


def test_bad_adapters_are_refused_and_harm_no_one(lora_server: ServerProcess) -> None:
    """The shared source holds adapters with NaN weights, a half-copied weights file and a
    rank_pattern that does not compile: the server started, lists and serves only the good ones,
    logged each refusal once with its reason, and the base model answers a prompt the same before,
    beside an adapter in one batch, and from its prefix cache."""
    client = _client(lora_server)
    assert {m.id for m in client.models.list().data} == {NAME, *ADAPTERS}
    log = lora_server.log()
    for name, why in BAD.items():
        assert log.count(f"LoRA adapter not served: adapter {name}: ") == 1, name
        assert f"adapter {name}: {why}" in log, name
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=2)
    prompt = "Bad adapters must not reach the base model's rows or its cached KV blocks, ever. " * 2

    def answer(model: str) -> tuple[list[str], int]:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        logprobs = out.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens and out.usage is not None
        details = out.usage.prompt_tokens_details
        return logprobs.tokens, (details.cached_tokens or 0) if details is not None else 0

    before, _ = answer(NAME)
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(answer, NAME)
        adapted = pool.submit(answer, "sql")
        assert beside.result()[0] == before and adapted.result()[0] != before
    cached_tokens, cached = answer(NAME)
    assert cached_tokens == before and cached > 0


def test_the_prefix_cache_is_never_shared_across_adapters(lora_server: ServerProcess) -> None:
    prompt = "A long shared preamble that fills several KV blocks of sixteen tokens each, for reuse. " * 2

    def cached(model: str) -> int:
        out = _client(lora_server).completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
        assert out.usage is not None
        details = out.usage.prompt_tokens_details
        return details.cached_tokens if details is not None and details.cached_tokens else 0

    assert cached("sql") == 0
    assert cached("sql") > 0  # the same adapter reuses its blocks
    assert cached(NAME) == 0  # the base model does not see them
    assert cached("med") == 0  # nor does another adapter
    assert cached(NAME) > 0


def test_two_ranks_serve_adapters_as_one(
    lora_server: ServerProcess, checkpoint: Path, source: Path, tmp_path: Path
) -> None:
    jobs = [(model, PROMPTS[i % len(PROMPTS)]) for i, model in enumerate([NAME, *ADAPTERS])]
    alone = [_greedy(lora_server, *job) for job in jobs]
    env = {
        "NIM_MODEL_PROFILE": "torch-generic-fp32-tp2-pp1-throughput",
        "NIM_TENSOR_PARALLEL_SIZE": "2",
        "NIM_MODEL_NAME": str(checkpoint),
        "NIM_PEFT_SOURCE": str(source),
        "NIM_MAX_GPU_LORAS": "2",  # fewer slots than adapters: slots are refilled on every rank
        "NIM_MAX_LORA_RANK": "16",
    }
    with serving(tmp_path / "tp2.log", env) as server, ThreadPoolExecutor(len(jobs)) as pool:
        sharded = list(pool.map(lambda job: _greedy(server, *job), jobs))
    for job, (tokens, logprobs), (want_tokens, want_logprobs) in zip(jobs, sharded, alone, strict=True):
        assert tokens == want_tokens, job
        assert logprobs == pytest.approx(want_logprobs, abs=1e-3), job


@pytest.mark.parametrize("precision", ["int8_wo", "int4_wo"])
def test_adapters_run_over_quantized_weights(
    checkpoint: Path, source: Path, tmp_path: Path, precision: str
) -> None:
    """bf16 activations over int8 / int4 weights: adapters change the answers, and a mixed batch
    answers as each request alone (compared up to each answer's first near-tie, at least half)."""
    env = {
        "NIM_MODEL_PROFILE": f"torch-generic-{precision}-tp1-pp1-throughput",
        "NIM_MODEL_NAME": str(checkpoint),
        "NIM_PEFT_SOURCE": str(source),
        "NIM_MAX_LORA_RANK": "16",
    }
    jobs = [(model, prompt) for model in (NAME, *ADAPTERS[:3]) for prompt in PROMPTS[:2]]
    with serving(tmp_path / "server.log", env) as server:
        alone = [_with_margins(server, *job) for job in jobs]
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = list(pool.map(lambda job: _with_margins(server, *job), jobs))
    assert len({json.dumps([t for t, _ in answer]) for answer in alone[::2]}) == 4  # adapters matter
    compared = 0
    for job, want, got in zip(jobs, alone, together, strict=True):
        clear = next((i for i, (_, margin) in enumerate(want) if margin < 0.1), len(want))
        assert [t for t, _ in got[:clear]] == [t for t, _ in want[:clear]], job
        compared += clear
    assert compared >= len(jobs) * TOKENS // 2


def _with_margins(server: ServerProcess, model: str, prompt: str) -> list[tuple[str, float]]:
    """Each greedy token and its margin over the runner-up (logprob difference)."""
    out = _client(server).completions.create(
        model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    steps = []
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
        best, runner_up = sorted(top.values(), reverse=True)[:2]
        steps.append((token, best - runner_up))
    return steps


def test_requests_wait_for_a_device_slot(checkpoint: Path, source: Path, tmp_path: Path) -> None:
    """One slot, four adapters requested at once: they take turns and answer as with four slots."""
    env = {
        **FP32,
        "NIM_MODEL_NAME": str(checkpoint),
        "NIM_PEFT_SOURCE": str(source),
        "NIM_MAX_GPU_LORAS": "1",
        "NIM_MAX_CPU_LORAS": "2",
        "NIM_MAX_LORA_RANK": "16",
    }
    with serving(tmp_path / "server.log", env) as server:
        alone = {a: _greedy(server, a, PROMPTS[0])[0] for a in ADAPTERS}
        with ThreadPoolExecutor(len(ADAPTERS) * 2) as pool:
            jobs = [*ADAPTERS, *ADAPTERS]
            together = list(pool.map(lambda a: _greedy(server, a, PROMPTS[0])[0], jobs))
        assert together == [alone[a] for a in jobs]
        assert "LoRA adapter med loaded into device slot 0" in server.log()


def test_a_request_parked_on_an_adapter_gone_bad_fails_in_bounded_time(
    checkpoint: Path, tmp_path: Path
) -> None:
    """One slot, one adapter in host memory. `hold` takes the slot; `gone-bad` is prepared and
    waits for the slot; its file is then cut short and `third` pushes it out of host memory. When
    the slot frees, reading `gone-bad` again fails: its request ends with the reason (it used to
    be re-read forever, its client hanging), and the others are served."""
    source = tmp_path / "adapters"
    config = _config(checkpoint)
    for seed, name in enumerate(("hold", "gone-bad", "third")):
        write_adapter(source / name, config, seed=300 + seed)
    env = {
        **FP32,
        "NIM_MODEL_NAME": str(checkpoint),
        "NIM_PEFT_SOURCE": str(source),
        "NIM_PEFT_REFRESH_INTERVAL": "3600",  # no rescan: the engine alone finds the file bad
        "NIM_MAX_GPU_LORAS": "1",
        "NIM_MAX_CPU_LORAS": "1",
        "NIM_MAX_LORA_RANK": "8",
    }
    with (
        serving(tmp_path / "server.log", env) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as http,
    ):

        def complete(model: str, max_tokens: int = TOKENS) -> httpx.Response:
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0}
            return http.post("/v1/completions", json={**body, "ignore_eos": True})

        def waiting(name: str) -> bool:
            info = [
                line
                for line in http.get("/metrics").text.splitlines()
                if line.startswith("vllm:lora_requests_info")
            ]
            return any(f'waiting_lora_adapters="{name}"' in line or f",{name}" in line for line in info)

        with ThreadPoolExecutor(3) as pool:
            held = pool.submit(complete, "hold", LONG)
            deadline = time.monotonic() + 30
            while "hold" not in http.get("/metrics").text.split("running_lora_adapters=")[-1][:40]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            bad = pool.submit(complete, "gone-bad")
            while not waiting("gone-bad"):
                assert time.monotonic() < deadline and not held.done()
                time.sleep(0.01)
            test_lora.truncate(source / "gone-bad")
            third = pool.submit(complete, "third")
            failed = bad.result(timeout=60)
            assert held.result().status_code == 200 and third.result().status_code == 200
        assert failed.status_code == 400, failed.text
        message = failed.json()["error"]["message"]
        assert (
            "LoRA adapter gone-bad cannot be loaded" in message and "adapter_model.safetensors is" in message
        )
        assert complete("gone-bad").status_code == 404  # no longer listed
        assert complete(NAME).status_code == 200


def test_adapters_come_and_go_with_the_source(checkpoint: Path, tmp_path: Path) -> None:
    source = tmp_path / "adapters"
    config = _config(checkpoint)
    write_adapter(source / "first", config, seed=1)
    env = {
        **FP32,
        "NIM_MODEL_NAME": str(checkpoint),
        "NIM_PEFT_SOURCE": str(source),
        "NIM_PEFT_REFRESH_INTERVAL": "0.2",
        "NIM_MAX_LORA_RANK": "8",
    }
    with serving(tmp_path / "server.log", env) as server:
        client = _client(server)

        def listed() -> list[str]:
            return sorted(m.id for m in client.models.list().data)

        def wait_for(names: list[str]) -> None:
            deadline = time.monotonic() + 20
            while listed() != names:
                assert time.monotonic() < deadline, listed()
                time.sleep(0.1)

        assert listed() == ["first", NAME]
        write_adapter(source / "second", config, seed=2)
        write_adapter(source / "too-big", config, seed=3, rank=16)  # above NIM_MAX_LORA_RANK
        (source / "broken").mkdir()
        (source / "broken" / "adapter_config.json").write_text("{not json")
        wait_for(["first", "second", NAME])
        assert _greedy(server, "second", PROMPTS[0])[0]

        # Remove "first" while a request runs with it: the request finishes, new ones are refused.
        stream = client.completions.create(
            model="first", prompt=PROMPTS[1], max_tokens=LONG, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        shutil.rmtree(source / "first")
        wait_for(["second", NAME])
        metrics = httpx.get(f"{server.base_url}/v1/metrics", timeout=10).text
        assert 'running_lora_adapters="first"' in metrics  # still running, after the removal
        rest = list(chunks)
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == LONG
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="first", prompt="hi", max_tokens=2)
        log = server.log()
    assert log.count("rank 16 is above NIM_MAX_LORA_RANK=8") == 1  # reported once, not per rescan
    assert log.count("adapter broken: unreadable adapter_config.json") == 1
