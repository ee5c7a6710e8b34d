"""The PyTorch engine's CUDA path: the same greedy tokens as on CPU, and decode steps replayed from
CUDA graphs that give exactly what eager decoding gives, through the real engine."""

from __future__ import annotations

import asyncio

import pytest

from service.config import load_settings
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.engine import TorchEngine
from service.engine.torch.loading import build_engine
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
        assert (engine.runner.decode_graphs is None) == eager
        template = engine.tokenizer.apply_chat_template
        prompts = [
            engine.tokenizer.encode(template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in QUESTIONS
        ]
        results[eager] = generate(engine, prompts, 48)
    assert results[False] == results[True]
