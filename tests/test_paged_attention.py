"""The paged KV pool and attention over it, checked against dense causal attention (full, or over a
sliding window, with the default or a given score scale).

Tolerances: float32 caches match the dense reference to 1e-5; int8 / fp8 caches (per token and
head scales) to a relative error stated per test.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from service.engine.models.attention import CausalAttention
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.paged_attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillChunk,
    decode_mask,
    prefill_mask,
)
from service.engine.triton_support import available as triton_available
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


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of one sequence, written out (scores, mask, softmax): q [S, Hq, D], k/v
    [S, Hkv, D] -> [S, Hq, D]; with `window`, query p sees keys p - window < j <= p only."""
    length, heads, dim = q.shape
    group = heads // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [S, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q, keys) * (dim**-0.5 if scale is None else scale)
    positions = torch.arange(length)
    visible = positions[None, :] <= positions[:, None]
    if window is not None:
        visible &= positions[None, :] > positions[:, None] - window
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def test_dense_reference_is_causal_attention() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(9, HEADS, DIM), torch.randn(9, KV_HEADS, DIM), torch.randn(9, KV_HEADS, DIM)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(dense_reference(q, k, v), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(CausalAttention()(0, q, k, v), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("window", "scale"), [(1, None), (3, 0.5), (8, None), (100, 0.2)])
def test_causal_attention_honours_window_and_scale(window: int, scale: float | None) -> None:
    torch.manual_seed(2)
    q, k, v = torch.randn(20, HEADS, DIM), torch.randn(20, KV_HEADS, DIM), torch.randn(20, KV_HEADS, DIM)
    got = CausalAttention()(0, q, k, v, window=window, scale=scale)
    torch.testing.assert_close(got, dense_reference(q, k, v, window, scale), atol=1e-5, rtol=1e-5)
    if window < 20:  # the window changes the answer: the reference is not trivially the same
        assert not torch.allclose(got, dense_reference(q, k, v, None, scale), atol=1e-3)


def test_a_window_must_see_the_query_itself() -> None:
    q = torch.zeros(2, HEADS, DIM)
    with pytest.raises(ValueError, match="window 0 must be at least 1"):
        CausalAttention()(0, q, q[:, :KV_HEADS], q[:, :KV_HEADS], window=0)


# (tokens already cached, new tokens this step): three decodes, a fresh prefill, a continued one,
# and one that starts mid-tile and crosses two PREFILL_TILE boundaries.
LAYOUT = [(9, 1), (3, 1), (14, 1), (0, 7), (6, 5), (27, 41)]


@pytest.mark.parametrize(
    ("cache_dtype", "tolerance", "window", "scale"),
    [
        ("auto", 1e-5, None, None),
        ("int8", 3e-2, None, None),
        ("fp8", 1e-1, None, None),
        ("auto", 1e-5, 1, None),
        ("auto", 1e-5, 5, 0.3),
        ("auto", 1e-5, 8, None),
        ("int8", 3e-2, 8, None),
    ],
)
def test_mixed_step_matches_dense_attention(
    cache_dtype: str, tolerance: float, window: int | None, scale: float | None
) -> None:
    """Decodes, a fresh prefill and continued prefills in one step == per-sequence dense attention,
    full or over a sliding window, with the default or a given scale."""
    torch.manual_seed(1)
    rng = random.Random(1)
    pool = KVPool(spec(cache_dtype), num_blocks=64, device=torch.device("cpu"))
    free = list(range(64))
    rng.shuffle(free)
    layout = LAYOUT
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
    attention = PagedAttention(pool, meta, HEADS, DIM)
    rows = torch.cat(rows_q), torch.cat(rows_k), torch.cat(rows_v)
    out = attention(0, *rows, window=window, scale=scale)
    if window is not None:  # a second layer of the same window reuses the step's narrowed masks
        masks = dict(attention._windowed)
        assert torch.equal(attention(0, *rows, window=window, scale=scale), out)
        assert all(attention._windowed[key] is mask for key, mask in masks.items())

    row = 0
    for cached, new, _, q, k, v, _ in seqs:
        want = dense_reference(q, k, v, window, scale)[cached:]
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


def _decode_case(
    lens: list[int], contiguous: bool = False
) -> tuple[KVPool, list[list[int]], torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Each request's cached keys/values (all but its last token) and, per request, its full
    q/k/v; blocks shuffled (or one ascending run from block 2 when `contiguous`)."""
    torch.manual_seed(3)
    pool = KVPool(spec("auto"), num_blocks=128, device=torch.device("cpu"))
    free = list(range(2, 128)) if contiguous else random.Random(3).sample(range(128), 128)
    tables, slots, seqs = [], [], []
    for total in lens:
        table = [free.pop(0) for _ in range(cdiv(total, BLOCK))]
        q, k, v = (
            torch.randn(total, HEADS, DIM),
            torch.randn(total, KV_HEADS, DIM),
            torch.randn(total, KV_HEADS, DIM),
        )
        seq_slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(total)])
        pool.write(0, seq_slots[:-1], k[:-1], v[:-1])
        tables.append(table)
        slots.append(seq_slots[-1])
        seqs.append((q, k, v))
    return pool, tables, torch.stack(slots), seqs


def _check_decodes(out: torch.Tensor, seqs: list, window: int | None, scale: float | None) -> None:
    for i, (q, k, v) in enumerate(seqs):
        want = dense_reference(q, k, v, window, scale)[-1]
        torch.testing.assert_close(out[i], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 1, 4, 6, 70])
def test_a_run_of_blocks_decodes_over_its_window(window: int | None) -> None:
    lens = [37]
    pool, tables, slots, seqs = _decode_case(lens, contiguous=True)
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decodes=1,
        decode_block_ids=None,
        decode_mask=decode_mask(torch.tensor(lens), len(tables[0]) * BLOCK, torch.float32),
        prefills=(),
        decode_block_run=(tables[0][0], len(tables[0])),
    )
    q, k, v = (torch.stack([s[j][-1] for s in seqs]) for j in range(3))
    _check_decodes(
        PagedAttention(pool, meta, HEADS, DIM)(0, q, k, v, window=window, scale=0.4), seqs, window, 0.4
    )


@pytest.mark.skipif(not triton_available(), reason="needs triton (pip install triton)")
@pytest.mark.parametrize("window", [None, 1, 5, 16, 64, 200])
def test_the_triton_decode_kernel_honours_the_window(window: int | None) -> None:
    """The CUDA decode path (here in Triton's interpreter): windows inside one tile, across tile
    boundaries (the kernel's tile is 64 positions) and longer than every context."""
    lens = [1, 20, 65, 130, 150]
    pool, tables, slots, seqs = _decode_case(lens)
    width = max(len(t) for t in tables)
    padded = [t + [pool.scratch_block] * (width - len(t)) for t in tables]
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decodes=len(lens),
        decode_block_ids=None,
        decode_mask=None,
        prefills=(),
        decode_tables=torch.tensor(padded),
        decode_lens=torch.tensor(lens),
    )
    q, k, v = (torch.stack([s[j][-1] for s in seqs]) for j in range(3))
    out = PagedAttention(pool, meta, HEADS, DIM)(0, q, k, v, window=window, scale=0.3)
    _check_decodes(out, seqs, window, 0.3)
