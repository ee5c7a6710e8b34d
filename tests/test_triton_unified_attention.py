"""The unified paged attention kernel (prefill chunks and decodes in one launch) against dense
attention written out here, under TRITON_INTERPRET=1 where no GPU is present (tests/conftest.py
switches it on before the kernel module is imported) and natively on one.

Every step is built the way the engine would: a pool whose blocks are handed out in random order
(block tables are not contiguous), rows of the tables padded with the scratch block, the step's
own keys and values already in the pool. Every slot outside the sequences' contexts holds NaN, so
a key read past a context, or from a padding sequence's table, shows up in the output.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.triton_attention import paged_decode_attention
from service.engine.torch.triton_unified_attention import (
    grid_blocks,
    grid_slack,
    launch_shape,
    paged_unified_attention,
)
from service.engine.triton_support import available as triton_available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton (pip install triton)")

# (cached tokens, queries) per sequence: decodes at block edges, prefill chunks after cached context
# (one crossing a block edge, one a whole tile), a one-token prompt, a fresh prompt, and padding
# sequences (0, 0) in the middle and at the end.
MIXED = [(40, 1), (15, 1), (16, 9), (0, 0), (0, 1), (5, 18), (0, 12), (33, 1), (0, 0)]


@dataclass(frozen=True)
class Step:
    pool: KVPool
    q: torch.Tensor  # [T, Hq, D], padding tokens at the end
    tables: torch.Tensor  # [S, W]
    query_start_loc: torch.Tensor  # [S + 1]
    seq_lens: torch.Tensor  # [S]
    query_lens: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    def scales(self) -> torch.Tensor | None:
        return self.pool.scales[0] if self.pool.scales is not None else None

    def attend(self, window: int | None = None, **kwargs: Any) -> torch.Tensor:
        return _attend(self.pool, self.q, self.tables, self.query_start_loc, self.seq_lens, window, **kwargs)


def _attend(
    pool: KVPool,
    q: torch.Tensor,
    tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))  # every row must be written
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    max_query_len = int(query_lens.max()) if query_lens.numel() else 1
    return paged_unified_attention(
        q,
        pool.data[0],
        pool.scales[0] if pool.scales is not None else None,
        pool.spec.cache_dtype,
        tables,
        query_start_loc,
        seq_lens,
        1 / math.sqrt(q.shape[-1]),
        max_query_len=max(1, max_query_len),
        window=window,
        out=out,
        **kwargs,
    )


def _step(
    cache_dtype: str,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    seqs: list[tuple[int, int]],
    pad_tokens: int = 0,
    seed: int = 0,
) -> Step:
    generator = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size, cache_dtype, dtype)  # type: ignore[arg-type]
    counts = [math.ceil((cached + n) / block_size) for cached, n in seqs]
    pool = KVPool(spec, sum(counts) + 3, DEVICE)
    slots = pool.num_blocks * block_size
    k, v = (torch.randn(slots, kv_heads, head_dim, generator=generator).to(DEVICE, dtype) for _ in range(2))
    pool.write(0, torch.arange(slots, device=DEVICE), k, v)

    free = list(range(pool.scratch_block))
    random.Random(seed).shuffle(free)
    width = max(counts) + 1
    used = torch.zeros(slots, dtype=torch.bool)
    tables = []
    for (cached, n), count in zip(seqs, counts, strict=True):
        table = [free.pop() for _ in range(count)]
        for p in range(cached + n):
            used[table[p // block_size] * block_size + p % block_size] = True
        tables.append(table + [pool.scratch_block] * (width - count))
    _poison(pool, ~used)

    query_lens = [n for _, n in seqs]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1] + pad_tokens, heads, head_dim, generator=generator).to(DEVICE, dtype)
    return Step(
        pool=pool,
        q=q,
        tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([cached + n for cached, n in seqs], dtype=torch.int32, device=DEVICE),
        query_lens=query_lens,
    )


def _poison(pool: KVPool, unused: torch.Tensor) -> None:
    """NaN in every slot outside a context: as values, or as scales for a quantized cache."""
    heads = pool.spec.num_kv_heads
    index = unused.nonzero().squeeze(1).to(DEVICE)
    if pool.scales is not None:
        pool.scales[0].view(2, heads, -1)[:, :, index] = float("nan")
    else:
        pool.data[0].view(2, heads, -1, pool.spec.head_dim)[:, :, index] = float("nan")


def _dense(
    step: Step, window: int | None = None, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v per sequence in float32 over the pool as stored (dequantized),
    or with this step's positions taken from `new_kv` where given; causal (and windowed) by
    absolute position; padding rows are zeros."""
    pool, q = step.pool, step.q
    kv_heads, block_size = pool.spec.num_kv_heads, pool.spec.block_size
    out = torch.zeros(q.shape, dtype=torch.float32, device=DEVICE)
    for s, num_query in enumerate(step.query_lens):
        if num_query == 0:
            continue
        length = int(step.seq_lens[s])
        start = int(step.query_start_loc[s])
        blocks = step.tables[s, : math.ceil(length / block_size)].long()
        keys, values = pool.gather(0, pool.head_block_ids(blocks), torch.float32)  # [Hkv, L, D]
        keys, values = keys[:, :length], values[:, :length]
        if new_kv is not None:
            for stored, new in zip((keys, values), new_kv, strict=True):
                stored[:, length - num_query :] = new[start : start + num_query].transpose(0, 1).float()
        queries = q[start : start + num_query].float().view(num_query, kv_heads, -1, q.shape[-1])
        scores = torch.einsum("qhgd,hkd->qhgk", queries, keys) / math.sqrt(q.shape[-1])
        query_pos = torch.arange(length - num_query, length, device=DEVICE)[:, None]
        key_pos = torch.arange(length, device=DEVICE)[None, :]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        attended = torch.einsum("qhgk,hkd->qhgd", scores.softmax(-1), values)
        out[start : start + num_query] = attended.reshape(num_query, *q.shape[1:])
    return out


def _assert_close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    assert not got.isnan().any()
    assert (got.float() - want).abs().max() <= tolerance * max(1.0, float(want.abs().max()))


@needs_triton
@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "tolerance", "heads", "kv_heads", "head_dim", "block_size", "window"),
    [
        ("auto", torch.float32, 1e-5, 2, 2, 64, 16, None),  # group 1
        ("auto", torch.bfloat16, 2e-2, 4, 1, 128, 32, None),  # group 4
        ("int8", torch.bfloat16, 2e-2, 8, 2, 64, 16, 7),  # windowed within a block
        ("int8", torch.float32, 1e-5, 8, 1, 128, 32, 20),  # group 8, windowed
        ("fp8", torch.bfloat16, 2e-2, 4, 1, 64, 32, None),
        ("fp8", torch.float32, 1e-5, 2, 2, 128, 16, 33),  # group 1, a window across tiles
        ("auto", torch.float32, 1e-5, 6, 2, 80, 16, None),  # group 3, head size not a power of two
    ],
)
def test_mixed_step_matches_dense_attention(
    cache_dtype: str,
    dtype: torch.dtype,
    tolerance: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None,
) -> None:
    step = _step(cache_dtype, dtype, heads, kv_heads, head_dim, block_size, MIXED, pad_tokens=3)
    got = step.attend(window)
    assert got.dtype == dtype and got.shape == step.q.shape
    _assert_close(got, _dense(step, window), tolerance)
    assert torch.equal(got[-3:], torch.zeros_like(got[-3:]))  # token padding: zeros


@needs_triton
@pytest.mark.parametrize("window", [1, 2, 17, 1000])
def test_window_edges(window: int) -> None:
    """A window of one (a query sees itself), windows inside and across blocks, and one wider
    than any context (the same as none)."""
    step = _step("auto", torch.float32, 4, 2, 64, 16, [(30, 1), (9, 24), (0, 12)], seed=window)
    _assert_close(step.attend(window), _dense(step, window), 1e-5)


@needs_triton
@pytest.mark.parametrize("block_q", [1, 32])
def test_any_query_block_gives_the_same_attention(block_q: int) -> None:
    """One query per program (the decode shape, here over prefill chunks) and blocks larger than
    any chunk (chunks starting mid-block) agree with the dense reference."""
    seqs = [(15, 1), (16, 9), (0, 0), (5, 12)]
    step = _step("auto", torch.float32, 8, 2, 64, 16, seqs, pad_tokens=5, seed=block_q)
    got = step.attend(None, block_q=block_q, tile=16)
    _assert_close(got, _dense(step), 1e-5)
    assert torch.equal(got[-5:], torch.zeros_like(got[-5:]))


@needs_triton
@pytest.mark.parametrize(("cache_dtype", "window"), [("int8", None), ("fp8", 9)])
def test_this_steps_keys_and_values_as_computed(cache_dtype: str, window: int | None) -> None:
    """With new_kv, this step's positions are attended as computed, not as the quantized cache
    stores them; q, k and v here are views of one fused projection output (strided rows)."""
    seqs = [(15, 1), (16, 9), (0, 0), (5, 12), (0, 7)]
    step = _step(cache_dtype, torch.float32, 8, 2, 64, 16, seqs, pad_tokens=2, seed=5)
    tokens, heads, head_dim = step.q.shape
    qkv = torch.randn(tokens, heads + 4, head_dim, device=DEVICE)
    qkv[:, :heads] = step.q
    q, k, v = qkv.split([heads, 2, 2], dim=1)
    got = _attend(step.pool, q, step.tables, step.query_start_loc, step.seq_lens, window, new_kv=(k, v))
    _assert_close(got, _dense(step, window, (k, v)), 1e-5)
    assert (got - _dense(step, window)).abs().max() > 1e-2  # the stored copies would differ


@needs_triton
@pytest.mark.parametrize(("cache_dtype", "window"), [("auto", None), ("int8", 20), ("fp8", None)])
def test_decode_only_step_agrees_with_the_decode_kernel(cache_dtype: str, window: int | None) -> None:
    """A decode-only step, its metadata in int64 as the model runner builds it today."""
    step = _step(cache_dtype, torch.float32, 8, 2, 64, 16, [(c, 1) for c in (0, 14, 15, 31, 70)], seed=3)
    step = replace(
        step,
        tables=step.tables.long(),
        query_start_loc=step.query_start_loc.long(),
        seq_lens=step.seq_lens.long(),
    )
    got = step.attend(window)
    want = paged_decode_attention(
        step.q,
        step.pool.data[0],
        step.scales(),
        cache_dtype,
        step.tables,
        step.seq_lens,
        1 / math.sqrt(step.q.shape[-1]),
        window=window,
    )
    _assert_close(got, want.float(), 1e-5)


@needs_triton
def test_a_row_does_not_depend_on_what_shares_its_step() -> None:
    """With the launch shape pinned, a query's output is bitwise the same whether its prompt is
    prefilled in one chunk or two, alone or beside other sequences, with or without padding."""
    cached, prompt, split = 7, 40, 13  # the second chunk's queries start mid-block
    step = _step(
        "auto", torch.float32, 8, 2, 64, 16, [(cached, prompt), (3, 1), (0, 0), (20, 13)], pad_tokens=4
    )
    shape = {"block_q": 8, "tile": 32}
    beside = step.attend(None, **shape)

    def one_int(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    length = one_int([cached + prompt])
    whole = _attend(step.pool, step.q[:prompt], step.tables[:1], one_int([0, prompt]), length, **shape)
    assert torch.equal(beside[:prompt], whole)
    # The last chunk only, beside a decode (sequence 1), two padding tokens after them.
    queries = torch.cat([step.q[split : prompt + 1], step.q[-2:]])
    chunked = _attend(
        step.pool,
        queries,
        step.tables[:2],
        one_int([0, prompt - split, prompt - split + 1]),
        one_int([cached + prompt, 4]),
        **shape,
    )
    assert torch.equal(chunked[: prompt - split], whole[split:])
    assert torch.equal(chunked[prompt - split], beside[prompt])


@pytest.mark.gpu
@needs_triton
def test_a_captured_launch_replays_any_step_of_its_size() -> None:
    """The grid depends on (tokens, sequences) only: one launch captured in a CUDA graph over
    static metadata buffers replays a step with other query and context lengths as an eager
    launch computes it."""
    first = _step("auto", torch.bfloat16, 8, 2, 128, 16, MIXED, pad_tokens=3, seed=1)
    # The same tables (each context within the one written for `first`), the 43 queries split anew.
    seqs = [(10, 1), (0, 3), (16, 4), (0, 0), (0, 1), (2, 20), (0, 12), (30, 2), (0, 0)]
    starts = [sum(n for _, n in seqs[:i]) for i in range(len(seqs) + 1)]
    second = replace(
        first,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=DEVICE),
        query_lens=[n for _, n in seqs],
    )
    shape = {"block_q": 16, "tile": 32}
    starts_buffer, lens_buffer = first.query_start_loc.clone(), first.seq_lens.clone()
    out = torch.empty_like(first.q)

    def launch() -> None:
        paged_unified_attention(
            first.q, first.pool.data[0], None, "auto", first.tables, starts_buffer, lens_buffer,
            1 / math.sqrt(first.q.shape[-1]), max_query_len=16, out=out, **shape,
        )  # fmt: skip

    launch()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for step in (second, first):
        starts_buffer.copy_(step.query_start_loc)
        lens_buffer.copy_(step.seq_lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step.attend(None, **shape))
        _assert_close(out, _dense(step), 2e-2)


def test_the_grid_covers_every_query_block() -> None:
    """Sequence s's blocks (aligned to multiples of block_q in absolute positions) are numbered
    from query_start_loc[s] // block_q + slack * s and never reach the next sequence's, and
    grid_blocks holds them all, for any split of T tokens and any cached lengths."""
    rng = random.Random(0)
    for _ in range(500):
        block_q = rng.choice([1, 2, 4, 8, 16, 64])
        lens = [rng.choice([0, 1, 1, 2, 7, 16, 33, 64, 100]) for _ in range(rng.randint(1, 12))]
        cached = [rng.randint(0, 200) for _ in lens]
        starts = [sum(lens[:i]) for i in range(len(lens) + 1)]
        total = starts[-1] + rng.randint(0, 20)  # token padding
        firsts = [start // block_q + grid_slack(block_q) * s for s, start in enumerate(starts)]
        for s, (n, c) in enumerate(zip(lens, cached, strict=True)):
            touched = (c + n - 1) // block_q - c // block_q + 1 if n else 0
            assert firsts[s] + touched <= (
                firsts[s + 1] if s + 1 < len(lens) else grid_blocks(total, len(lens), block_q)
            )


def test_launch_shapes_fill_a_dot() -> None:
    def shape(max_query_len: int, group: int, **pinned: Any) -> tuple[int, int, int, int]:
        dtype = pinned.pop("dtype", torch.bfloat16)
        cache_dtype = pinned.pop("cache_dtype", "auto")
        chosen = launch_shape(max_query_len, group, 128, dtype, cache_dtype, **pinned)
        return chosen.block_q, chosen.block_m, chosen.tile, chosen.num_warps

    assert shape(1, 4) == (1, 16, 64, 8)  # decodes: one query per block
    assert shape(1, 4, cache_dtype="int8") == (1, 16, 32, 8)  # dequantizing takes registers
    assert shape(1, 32) == (1, 32, 32, 8)  # a wide group: shorter tiles
    assert shape(500, 1) == (64, 64, 32, 8)
    assert shape(500, 4) == (16, 64, 32, 8)
    assert shape(500, 3) == (16, 64, 32, 8)  # group padded to 4
    assert shape(3, 8) == (4, 32, 32, 8)
    assert shape(500, 4, dtype=torch.float32) == (8, 32, 16, 8)
    assert shape(500, 8, block_q=2, tile=16) == (2, 16, 16, 4)
    with pytest.raises(ValueError, match="power of two"):
        shape(10, 4, block_q=3)
    with pytest.raises(ValueError, match="at least 16"):
        shape(10, 4, tile=8)


# Compiles the kernel for sm_90 in a fresh interpreter (this process runs Triton's interpreter).
_COMPILE_FOR_HOPPER = """
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from service.engine.torch import triton_unified_attention as unified

kernel = unified._unified_attention_kernel
pointers = {"q_ptr": "*bf16", "out_ptr": "*bf16", "new_k_ptr": "*bf16", "new_v_ptr": "*bf16",
            "tables_ptr": "*i32", "qsl_ptr": "*i32", "lens_ptr": "*i32"}
for max_query_len, cache_dtype, windowed in ((1, "auto", False), (500, "fp8", True)):
    shape = unified.launch_shape(max_query_len, 4, 128, torch.bfloat16, cache_dtype)
    constexprs = unified.kernel_constexprs(
        shape, group=4, head_dim=128, block_size=16, cache_dtype=cache_dtype, dtype=torch.bfloat16,
        windowed=windowed, own_kv=windowed, interpreted=False,
    )
    if windowed:  # a launch's integer arguments equal to 1 become compile-time constants
        constexprs.update(num_seqs=1, num_tokens=1, window=1, stride_qsl=1, stride_lens=1)
    cache = "*u8" if cache_dtype == "fp8" else "*bf16"
    kinds = {**pointers, "cache_ptr": cache, "scale_ptr": "*fp16" if cache_dtype == "fp8" else cache,
             "sm_scale": "fp32"}
    signature = {n: "constexpr" if n in constexprs else kinds.get(n, "i32") for n in kernel.arg_names}
    source = ASTSource(kernel, signature, {(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    options = {"num_warps": shape.num_warps}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"], "no cubin"
    print(max_query_len, cache_dtype, shape, "compiled")
"""


@needs_triton
def test_the_kernel_compiles_for_hopper(pytestconfig: pytest.Config, tmp_path: Path) -> None:
    """The interpreter accepts Python the compiler rejects: both launch shapes (decode-only, and
    mixed with an fp8 cache, a window, this step's own keys and the integer arguments a launch
    with one sequence specializes to constants) compile to sm_90 machine code with the ptxas
    Triton ships, no GPU needed."""
    assert compile_for_hopper(_COMPILE_FOR_HOPPER, pytestconfig, tmp_path).count("compiled") == 2


def compile_for_hopper(code: str, pytestconfig: pytest.Config, tmp_path: Path) -> str:
    """Run `code` (which compiles kernels for sm_90 with Triton's compiler, not its interpreter) in
    a process of its own; its output. Skips where this Triton build ships no ptxas."""
    import triton

    if not list(Path(triton.__file__).parent.glob("backends/nvidia/bin/ptxas*")):
        pytest.skip("this Triton build ships no ptxas to compile for a GPU")
    # Triton's cache is keyed by the kernel's source: pytest's cache keeps compiles between runs.
    cache = getattr(pytestconfig, "cache", None)
    cache_dir = cache.mkdir("triton-sm90") if cache is not None else tmp_path
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache_dir)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_triton
def test_bad_arguments_are_refused() -> None:
    step = _step("int8", torch.float32, 4, 2, 64, 16, [(3, 2)])
    with pytest.raises(ValueError, match="window 0"):
        step.attend(0)
    with pytest.raises(ValueError, match="needs its scales"):
        paged_unified_attention(
            step.q, step.pool.data[0], None, "int8", step.tables, step.query_start_loc, step.seq_lens, 0.1,
            max_query_len=2,
        )  # fmt: skip
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_unified_attention(
            step.q, step.pool.data[0], step.scales(), "int8", step.tables, step.seq_lens, step.seq_lens, 0.1,
            max_query_len=2,
        )  # fmt: skip


@needs_triton
def test_an_empty_step_launches_nothing() -> None:
    step = _step("auto", torch.float32, 4, 2, 64, 16, [(3, 2)])
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    got = _attend(
        step.pool, step.q[:0], step.tables[:0], torch.zeros(1, dtype=torch.int32, device=DEVICE), empty
    )
    assert got.shape == (0, 4, 64)
