"""The PyTorch engine's CUDA path: same greedy tokens as on CPU, through the real engine."""

from __future__ import annotations

import asyncio

import pytest

from service.config import load_settings
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.loading import build_engine
from service.serving import config_for

pytestmark = pytest.mark.gpu

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def greedy_tokens(device: str, dtype: str) -> list[int]:
    settings = load_settings(device=device, dtype=dtype)
    engine = build_engine(config_for(settings))

    async def run() -> list[int]:
        await engine.start()
        prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
        request = GenerationRequest("gpu-test", prompt, SamplingParams(max_tokens=24, temperature=0))
        tokens = [t async for out in engine.generate(request) for t in out.token_ids]
        await engine.stop()
        return tokens

    return asyncio.run(run())


def test_cuda_float32_greedy_matches_cpu() -> None:
    assert greedy_tokens("cuda", "float32") == greedy_tokens("cpu", "float32")


def test_cuda_bfloat16_answers(embedded_tokenizer) -> None:
    assert "Paris" in embedded_tokenizer.decode(greedy_tokens("cuda", "bfloat16"))
