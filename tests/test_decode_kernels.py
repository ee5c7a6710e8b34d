"""The CUDA decode path's pieces: the Triton paged-decode attention kernel against dense attention
(under TRITON_INTERPRET=1 where no GPU is present, natively on one), and the batch buckets."""

from __future__ import annotations

import math
import random

import pytest
import torch

from service.engine.torch.cuda_graphs import batch_buckets
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.triton_attention import paged_decode_attention
from service.engine.triton_support import available as triton_available
from tests.conftest import TEST_THREADS

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton (pip install triton)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 16


def _case(cache_dtype: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, lens: list[int]):
    spec = KVCacheSpec(1, kv_heads, head_dim, BLOCK, cache_dtype, dtype)  # type: ignore[arg-type]
    num_blocks = sum(math.ceil(n / BLOCK) for n in lens) + 4
    pool = KVPool(spec, num_blocks, DEVICE)
    free = list(range(num_blocks))
    random.Random(len(lens)).shuffle(free)
    width = max(math.ceil(n / BLOCK) for n in lens) + 2  # padded, as the graphs pad tables
    tables = []
    for n in lens:
        table = [free.pop() for _ in range(math.ceil(n / BLOCK))]
        k = torch.randn(n, kv_heads, head_dim, device=DEVICE).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, device=DEVICE).to(dtype)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)], device=DEVICE)
        pool.write(0, slots, k, v)
        tables.append(table + [pool.scratch_block] * (width - len(table)))
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE).to(dtype)
    return pool, q, tables


def _dense(pool: KVPool, q: torch.Tensor, tables: list[list[int]], lens: list[int]) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in float32 over the cache as stored (dequantized)."""
    out = []
    kv_heads = pool.spec.num_kv_heads
    for i, n in enumerate(lens):
        blocks = torch.tensor(tables[i][: math.ceil(n / BLOCK)], device=DEVICE)
        keys, values = pool.gather(0, pool.head_block_ids(blocks), torch.float32)  # [Hkv, L, D]
        keys, values = keys[:, :n], values[:, :n]
        queries = q[i].float().view(kv_heads, -1, q.shape[-1])  # [Hkv, G, D]
        scores = torch.einsum("hgd,hnd->hgn", queries, keys) / math.sqrt(q.shape[-1])
        out.append(torch.einsum("hgn,hnd->hgd", scores.softmax(-1), values).reshape(q.shape[1:]))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "tolerance"),
    [
        ("auto", torch.float32, 1e-5),
        ("auto", torch.bfloat16, 2e-2),
        ("int8", torch.bfloat16, 2e-2),
        ("fp8", torch.bfloat16, 2e-2),
    ],
)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 8, 32), (32, 8, 128)])
def test_paged_decode_matches_dense_attention(
    cache_dtype: str, dtype: torch.dtype, tolerance: float, heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(0)
    lens = [1, 15, 16, 17, 64, 65, 200]  # single token, block and tile edges, several tiles
    pool, q, tables = _case(cache_dtype, dtype, heads, kv_heads, head_dim, lens)
    scales = pool.scales[0] if pool.scales is not None else None
    got = paged_decode_attention(
        q,
        pool.data[0],
        scales,
        cache_dtype,
        torch.tensor(tables, dtype=torch.int64, device=DEVICE),
        torch.tensor(lens, dtype=torch.int64, device=DEVICE),
        1 / math.sqrt(head_dim),
    )
    want = _dense(pool, q, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - want).abs().max() <= tolerance * max(1.0, float(want.abs().max()))


def test_batch_buckets_cover_every_batch_size() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(100)[-3:] == [80, 96, 100]
    for max_batch in (1, 3, 8, 20, 64, 100, 256):
        buckets = batch_buckets(max_batch)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
        assert all(any(b >= n for b in buckets) for n in range(1, max_batch + 1))


def test_the_engine_decodes_the_same_through_the_kernel() -> None:
    """The runner's kernel path (block tables padded with the scratch block, context lengths)
    gives the same greedy tokens as the gather path, through the real engine (float32)."""
    import asyncio

    from service.config_loading import load_settings
    from service.engine.protocol import GenerationRequest, SamplingParams
    from service.engine.torch.loading import build_engine
    from service.serving import config_for

    settings = load_settings(
        num_threads=TEST_THREADS, kv_cache_max_tokens=4096, max_model_len=512, dtype="float32"
    )
    engine = build_engine(config_for(settings))

    async def generate(kernel: bool) -> list[list[int]]:
        engine.core.runner.decode_kernel = kernel
        prompts = [engine.tokenizer.encode(text) for text in ("The capital of France is", "One, two,")]
        params = SamplingParams(max_tokens=6, temperature=0.0)

        async def one(i: int) -> list[int]:
            request = GenerationRequest(f"k{kernel}-{i}", prompts[i], params)
            return [t async for out in engine.generate(request) for t in out.token_ids]

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        await engine.start()
        try:
            return await generate(False), await generate(True)
        finally:
            await engine.stop()

    gathered, kernel = asyncio.run(run())
    assert kernel == gathered


def test_graph_inputs_reproduce_the_eager_step() -> None:
    """What a decode graph replays (the staged input buffer, padded to its bucket with rows that
    write only to the scratch block) gives the eager step's logits; runs eagerly here, captured
    on a GPU."""
    from service.config_loading import load_settings
    from service.engine.protocol import GenerationRequest, SamplingParams
    from service.engine.torch.cuda_graphs import CudaGraphDecoder
    from service.engine.torch.loading import build_core
    from service.serving import config_for

    settings = load_settings(
        num_threads=TEST_THREADS, kv_cache_max_tokens=2048, max_model_len=256, dtype="float32"
    )
    core = build_core(config_for(settings))  # driven by hand: add, step, then plan a step
    core.runner.decode_kernel = True  # as on CUDA, where the graphs' attention is the kernel
    decoder = CudaGraphDecoder(core.model, core.kv_pool, 8, 256, core.config.device)
    prompts = [core.tokenizer.encode(text) for text in ("The capital of France is", "One, two,", "Hi")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        assert core.add_request(GenerationRequest(f"g{i}", prompt, params)) == []
    with torch.inference_mode():
        assert len(core.step()) == 3  # prefill all three: each its first token
        scheduled = core.scheduler.schedule()
        plan = core.planner.plan(scheduled)
        assert decoder.fits(plan) and plan.num_sequences == 3
        scratch = core.kv_pool.data[0][:, :, core.kv_pool.scratch_block].clone()
        eager, _ = core.runner.forward(plan)
        bucket = decoder.stage(plan)
        assert bucket == 4  # one padding row
        replayed = decoder.forward(bucket)[: plan.num_sequences]
    assert torch.allclose(replayed, eager, atol=1e-4, rtol=1e-4)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    # The padding row wrote where nothing else lives.
    assert not torch.equal(core.kv_pool.data[0][:, :, core.kv_pool.scratch_block], scratch)
