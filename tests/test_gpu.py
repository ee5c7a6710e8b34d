"""The PyTorch engine's CUDA path: the same greedy tokens as on CPU, and decode steps replayed from
CUDA graphs that give exactly what eager decoding gives, through the real engine."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
import torch

from service.config_loading import load_settings
from service.engine.config import step_defaults
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.engine import TorchEngine
from service.engine.torch.loading import build_engine
from service.engine.torch.memory_budget import CudaStepProbe, largest_step
from service.serving import config_for

pytestmark = pytest.mark.gpu

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What planet is known as the red planet?",
    "Translate 'good morning' into Spanish.",
]


def engine_for(**overrides: object) -> TorchEngine:
    return build_engine(config_for(load_settings(**overrides)))


def generate(engine: TorchEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async def run() -> list[list[int]]:
        await engine.start()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

        async def one(i: int) -> list[int]:
            request = GenerationRequest(f"gpu-{i}", prompts[i], params)
            return [t async for out in engine.generate(request) for t in out.token_ids]

        try:
            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        finally:
            await engine.stop()

    return asyncio.run(run())


def greedy_tokens(device: str, dtype: str) -> list[int]:
    engine = engine_for(device=device, dtype=dtype)
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    return generate(engine, [prompt], 24)[0]


def test_cuda_float32_greedy_matches_cpu() -> None:
    assert greedy_tokens("cuda", "float32") == greedy_tokens("cpu", "float32")


def test_cuda_bfloat16_answers(embedded_tokenizer) -> None:
    assert "Paris" in embedded_tokenizer.decode(greedy_tokens("cuda", "bfloat16"))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_graph_replayed_decode_equals_eager_decode(kv_cache_dtype: str) -> None:
    """A batch of 8 (a bucket size, so no padding changes the matmul shapes): the tokens from
    replayed CUDA graphs equal eager decoding's, bit for bit."""
    results = {}
    for eager in (False, True):
        engine = engine_for(device="cuda", enforce_eager=eager, kv_cache_dtype=kv_cache_dtype)
        assert (engine.core.runner.decode_graphs is None) == eager
        template = engine.tokenizer.apply_chat_template
        prompts = [
            engine.tokenizer.encode(template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in QUESTIONS
        ]
        results[eager] = generate(engine, prompts, 48)
    assert results[False] == results[True]


def test_default_capacity_and_measured_kv_pool(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Unset limits on a GPU: 256 sequences and the device's token budget, graphs up to 256; the
    KV pool is sized after the measured reservations (logged), what capture then takes stays
    within the graphs' reservation, and every graph's logits are rows of one buffer."""
    monkeypatch.delenv("NIM_MAX_NUM_SEQS", raising=False)
    monkeypatch.delenv("NIM_MAX_NUM_BATCHED_TOKENS", raising=False)
    with caplog.at_level(logging.INFO):
        engine = engine_for(device="cuda")
        props = torch.cuda.get_device_properties(0)
        expected = step_defaults("cuda", props.total_memory, props.name)
        assert (engine.core.config.max_num_seqs, engine.core.config.max_num_batched_tokens) == (
            256,
            expected.max_num_batched_tokens,
        )
        graphs = engine.core.runner.decode_graphs
        assert graphs is not None and graphs.buckets[-1] == 256
        prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
        assert len(generate(engine, [prompt] * 3, 8)) == 3  # starts (captures graphs) and stops
    reserved = re.search(
        r"reserved ([\d.]+) GiB for the activations .* ([\d.]+) GiB for decode graphs", caplog.text
    )
    taken = re.search(r"captured \d+ CUDA graphs .* taking ([\d.]+) GiB", caplog.text)
    assert reserved is not None and taken is not None, caplog.text
    assert float(reserved.group(1)) > 0
    assert float(taken.group(1)) <= float(reserved.group(2)), caplog.text
    assert graphs.output is not None
    assert all(t.data_ptr() == graphs.output.data_ptr() for t in graphs.logits.values())


def test_probe_peaks_grow_with_the_step() -> None:
    engine = engine_for(device="cuda", max_model_len=2048, max_num_batched_tokens=4096)
    config = engine.core.config
    probe = CudaStepProbe(engine.core.model, config.kv_spec, config.device, config.decode_kernel)
    small = probe.peak_bytes(largest_step(256, 256, 2048))
    large = probe.peak_bytes(largest_step(4096, 256, 2048))
    assert 0 < small < large


def test_graphs_stop_at_the_token_budget() -> None:
    """A decode step never holds more sequences than the budget has tokens: no graph beyond it."""
    engine = engine_for(device="cuda", max_num_seqs=64, max_num_batched_tokens=40)
    graphs = engine.core.runner.decode_graphs
    assert graphs is not None and graphs.buckets[-1] == 40
