"""The paged KV pool and attention over it, checked against dense causal attention.

Tolerances: float32 caches match the dense reference to 1e-5; int8 / fp8 caches (per token and
head scales) to a relative error stated per test.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.paged_attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillChunk,
    decode_mask,
    prefill_mask,
)
from service.util import cdiv

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def spec(cache_dtype: str, model_dtype: torch.dtype = torch.float32, layers: int = 1) -> KVCacheSpec:
    return KVCacheSpec(layers, KV_HEADS, DIM, BLOCK, cache_dtype, model_dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cache_dtype", "tolerance"), [("auto", 0.0), ("int8", 0.02), ("fp8", 0.08)])
def test_pool_write_then_gather_round_trips(cache_dtype: str, tolerance: float) -> None:
    torch.manual_seed(0)
    pool = KVPool(spec(cache_dtype), num_blocks=8, device=torch.device("cpu"))
    slots = torch.tensor([5, 6, 7, 8, 20, 31])  # blocks 1, 2, 5, 7
    k, v = torch.randn(6, KV_HEADS, DIM), torch.randn(6, KV_HEADS, DIM)
    pool.write(0, slots, k, v)
    keys, values = pool.gather(0, pool.head_block_ids(torch.arange(8)), torch.float32)  # [H, 32, D]
    for got, want in ((keys, k), (values, v)):
        picked = got[:, slots].transpose(0, 1)  # [6, H, D]
        error = ((picked - want).abs().amax(dim=-1) / want.abs().amax(dim=-1)).max()
        assert error <= tolerance + 1e-7


def test_quantized_caches_hold_about_twice_the_tokens() -> None:
    """The embedded model's shape (30 layers, 3 kv heads, head_dim 64): one fp16 scale per 64 codes."""

    def embedded(cache_dtype: str) -> int:
        return KVCacheSpec(30, 3, 64, 16, cache_dtype, torch.bfloat16).bytes_per_token()  # type: ignore[arg-type]

    assert embedded("auto") == 2 * 30 * 3 * 64 * 2  # 2 x layers x kv_heads x head_dim x bytes(bf16)
    for quantized in ("int8", "fp8"):
        assert embedded("auto") / embedded(quantized) >= 1.9, quantized


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full causal attention of one sequence: q [S, Hq, D], k/v [S, Hkv, D] -> [S, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize(("cache_dtype", "tolerance"), [("auto", 1e-5), ("int8", 3e-2), ("fp8", 1e-1)])
def test_mixed_step_matches_dense_attention(cache_dtype: str, tolerance: float) -> None:
    """Decodes, a fresh prefill and a continued prefill in one step == per-sequence dense attention."""
    torch.manual_seed(1)
    rng = random.Random(1)
    pool = KVPool(spec(cache_dtype), num_blocks=64, device=torch.device("cpu"))
    free = list(range(64))
    rng.shuffle(free)

    # (tokens already cached, new tokens this step)
    layout = [(9, 1), (3, 1), (14, 1), (0, 7), (6, 5)]
    seqs = []
    for cached, new in layout:
        total = cached + new
        table = [free.pop() for _ in range(cdiv(total, BLOCK))]
        q = torch.randn(total, HEADS, DIM)
        k = torch.randn(total, KV_HEADS, DIM)
        v = torch.randn(total, KV_HEADS, DIM)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(total)])
        if cached:
            pool.write(0, slots[:cached], k[:cached], v[:cached])
        seqs.append((cached, new, table, q, k, v, slots))

    rows_q, rows_k, rows_v, step_slots = [], [], [], []
    for cached, _new, _, q, k, v, slots in seqs:
        rows_q.append(q[cached:])
        rows_k.append(k[cached:])
        rows_v.append(v[cached:])
        step_slots.append(slots[cached:])
    decodes = [s for s in seqs if s[1] == 1]
    width = max(cdiv(c + n, BLOCK) for c, n, *_ in decodes)
    padded = [b for _, _, t, *_ in decodes for b in t[:width] + [0] * (width - min(len(t), width))]
    prefills, start = [], len(decodes)
    for cached, new, table, *_ in seqs[len(decodes) :]:
        mask = prefill_mask(cached, new, len(table) * BLOCK, torch.device("cpu"), torch.float32)
        prefills.append(
            PrefillChunk(start, new, cached + new, pool.head_block_ids(torch.tensor(table)), mask)
        )
        start += new
    meta = AttentionMetadata(
        slot_mapping=torch.cat(step_slots),
        num_decodes=len(decodes),
        decode_block_ids=pool.head_block_ids(torch.tensor(padded)),
        decode_mask=decode_mask(torch.tensor([c + n for c, n, *_ in decodes]), width * BLOCK, torch.float32),
        prefills=tuple(prefills),
    )
    out = PagedAttention(pool, meta, HEADS, DIM)(0, torch.cat(rows_q), torch.cat(rows_k), torch.cat(rows_v))

    row = 0
    for cached, new, _, q, k, v, _ in seqs:
        want = dense_reference(q, k, v)[cached:]
        got = out[row : row + new]
        assert (got - want).abs().max() <= tolerance * max(1.0, float(want.abs().max())), cache_dtype
        row += new


def test_a_run_of_blocks_is_read_in_place_as_gathered() -> None:
    """A lone decode whose blocks are one ascending run reads a view of the pool: the same keys
    and values a gather copies out, without the copy."""
    pool = KVPool(spec("auto", layers=2), num_blocks=8, device=torch.device("cpu"))
    for layer in range(2):
        pool.data[layer].copy_(torch.randn_like(pool.data[layer]))
    for layer in range(2):
        run = pool.run_pair(layer, 3, 4)
        gathered = pool.gather_pair(layer, pool.head_block_ids(torch.arange(3, 7)), torch.float32)
        assert torch.equal(run, gathered)
        assert run.untyped_storage().data_ptr() == pool.data[layer].untyped_storage().data_ptr()
