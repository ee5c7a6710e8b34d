"""The unified attention kernel wired into the engine: a step with prefill chunks attends through
one launch per layer (CUDA; here in Triton's interpreter) and gives what the gathered path gives."""

from __future__ import annotations

import asyncio

import pytest

from service.engine.triton_support import available as triton_available
from tests.conftest import TEST_THREADS

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton (pip install triton)")


@pytest.fixture(scope="module")
def engine():
    from service.config_loading import load_settings
    from service.engine.torch.loading import build_engine
    from service.serving import config_for

    settings = load_settings(
        num_threads=TEST_THREADS, kv_cache_max_tokens=4096, max_model_len=512, dtype="float32"
    )
    return build_engine(config_for(settings))


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_the_start_up_check_passes_for_the_models_shape(engine, cache_dtype: str) -> None:
    """The check decode_path runs on CUDA before it lets steps with prefill chunks through the
    kernel, at every launch shape: here on the CPU, in the interpreter, for the embedded model's
    heads and head size (natively under make test-gpu)."""
    from service.engine.torch.kv_pool import KVCacheSpec, KVPool
    from service.engine.torch.startup_checks import check_unified_attention

    spec = engine.core.runner.pool.spec
    device = engine.core.runner.device  # the CPU in Triton's interpreter, or a GPU under make test-gpu
    pool = KVPool(
        KVCacheSpec(1, spec.num_kv_heads, spec.head_dim, spec.block_size, cache_dtype, spec.model_dtype),  # type: ignore[arg-type]
        4,
        device,
    )
    assert check_unified_attention(engine.core.runner.model, pool, device, 64) is None


def test_the_engine_generates_the_same_through_the_unified_kernel(
    engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts prefilled (in chunks, beside decodes of the others) through the unified kernel give
    the greedy tokens, and the prompt logprobs to float32 rounding, of the gathered path."""
    from service.engine.protocol import GenerationRequest, SamplingParams
    from service.engine.torch import paged_attention

    launches = []
    kernel = paged_attention.paged_unified_attention

    def counted(*args, **kwargs):
        launches.append(kwargs["max_query_len"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "paged_unified_attention", counted)

    texts = ("The capital of France is", "One, two, three, four, five,", "Water boils at")
    prompts = [engine.tokenizer.encode(text) for text in texts]
    params = SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=1)

    async def generate(unified: bool) -> list[tuple[list[int], list[float]]]:
        engine.core.runner.unified_steps = unified

        async def one(i: int) -> tuple[list[int], list[float]]:
            await asyncio.sleep(0.05 * i)  # later prompts arrive while earlier ones decode: mixed steps
            request = GenerationRequest(f"u{unified}-{i}", prompts[i], params)
            tokens, logprobs = [], []
            async for out in engine.generate(request):
                tokens.extend(out.token_ids)
                logprobs.extend(p.logprob for p in out.prompt_logprobs or [] if p is not None)
            return tokens, logprobs

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    async def run() -> tuple[list, list]:
        await engine.start()
        try:
            return await generate(False), await generate(True)
        finally:
            await engine.stop()

    gathered, unified = asyncio.run(run())
    layers = engine.core.runner.model.config.num_layers
    assert launches and len(launches) % layers == 0  # every layer of the steps with prefill chunks, no other
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(unified, gathered, strict=True):
        assert tokens == want_tokens
        assert len(logprobs) == len(want_logprobs) > 0
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-3
