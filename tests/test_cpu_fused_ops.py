"""The fused CPU ops (service/engine/native/fused_ops.cpp) and their use by the models.

- RMSNorm (with the residual add before it) and MoE routing compute what the aten sequences they
  replace compute: the residual sum exactly, the norms to float32 rounding (16-bit: one rounding),
  the router's choices exactly and its weights to the same;
- a [W, H] weight gives each row its own (the scripted decode's q and k heads side by side), the
  same bits as one call per head;
- a row's values do not depend on the batch, threads splitting rows or not; the AVX-512, AVX2
  and portable copies agree bitwise (each where this CPU has it);
- a NaN row routes to valid experts and harms no other row; ties go to the lower expert; bad
  arguments are refused with the op's name;
- the greedy sampler's fused argmax takes argmax's token and max's value (ties, -inf, NaN rows);
- table RoPE, in place on strided views of q and k, is bitwise the three aten ops it replaces;
- decode attention reads each row's blocks of the paged cache in place (out of order, padded
  tables, windows, grouped heads) and computes what the gathered rows give, each row alike alone or
  batched; scores far apart stay finite;
- models built with them (BuildOptions.cpu_fused_ops) keep the routers unpacked for the op, and
  match transformers as the aten-built ones do (the scripted decode stays bitwise the eager one:
  tests/test_scripted_decode.py);
- NIM_CPU_FUSED_OPS: off keeps aten's ops (and says so), auto takes the fused ops (and says
  why), and a failed start-up check falls back with its reason in the log.

Skipped, with the reason, where the extension cannot be built (no g++ or ninja).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from service.engine.models.attention import CausalAttention
from service.engine.models.base import BuildOptions
from service.engine.models.cpu_linear import PackedLinear
from service.engine.models.loader import build_model, load_hf_dir
from service.engine.models.moe import SparseMoeBlock
from service.engine.models.rope import RotaryEmbedding, TableRope
from service.engine.native import extension, fused_ops
from service.engine.torch import cpu_fused_ops
from service.engine.torch.sampler import greedy
from service.model.config import ModelConfig
from tests.test_model_moe import _hf_model
from tests.test_tensor_parallel_serving import _distinct_tokens

PROBLEM = extension.problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# How far from aten's sequences: float32 sums in another order; 16-bit outputs one rounding.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
ROOT = Path(__file__).resolve().parents[1]


def _inputs(rows: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator) * torch.logspace(-2, 2, rows)[:, None]
    residual = torch.randn(rows, width, generator=generator)
    weight = torch.rand(width, generator=generator) + 0.5
    return x, residual, weight


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return float(((got.float() - want.float()).abs() / scale).max())


def _aten_route(
    x: torch.Tensor, gate: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMoeBlock.route's aten sequence."""
    probs = F.softmax(F.linear(x, gate), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("width", [64, 200, 576])
def test_the_norms_compute_atens_sequence(dtype: torch.dtype, width: int) -> None:
    x, residual, weight = (t.to(dtype) for t in _inputs(9, width))
    want = weight * F.rms_norm(x, (width,), eps=1e-6)
    assert _relative_error(fused_ops.rms_norm(x, weight, 1e-6), want) <= TOLERANCE[dtype]
    normed, summed = fused_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, fused_ops.rms_norm(summed, weight, 1e-6))
    # any leading dimensions, and a non-contiguous view (the scripted decode's q and k heads)
    heads = x.view(9, -1, 8) if width % 8 == 0 else x.view(9, 1, width)
    got = fused_ops.rms_norm(heads.transpose(0, 1), weight[: heads.shape[-1]], 1e-6)
    assert torch.equal(
        got, fused_ops.rms_norm(heads.transpose(0, 1).contiguous(), weight[: heads.shape[-1]], 1e-6)
    )


def test_a_weight_row_per_head_is_one_call_per_head() -> None:
    """The scripted decode norms Qwen3's adjacent q and k heads in one call with a [Hq + Hkv, D]
    weight; the eager layer norms q and k apart: the same bits."""
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 4, 32, generator=generator), torch.randn(5, 2, 32, generator=generator)
    q_weight, k_weight = torch.rand(32, generator=generator), torch.rand(32, generator=generator)
    for dtype in (torch.float32, torch.bfloat16):
        qk = torch.cat([q, k], dim=1).to(dtype)
        table = torch.cat([q_weight.expand(4, -1), k_weight.expand(2, -1)]).to(dtype)
        together = fused_ops.rms_norm(qk, table, 1e-6)
        assert torch.equal(together[:, :4], fused_ops.rms_norm(q.to(dtype), q_weight.to(dtype), 1e-6))
        assert torch.equal(together[:, 4:], fused_ops.rms_norm(k.to(dtype), k_weight.to(dtype), 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_are_computed_alike_at_any_batch(dtype: torch.dtype) -> None:
    """400 rows of 576: split across threads; one row alone: not. The same bits either way."""
    x, residual, weight = (t.to(dtype) for t in _inputs(400, 576))
    gate = (torch.randn(64, 576, generator=torch.Generator().manual_seed(2)) * 0.05).to(dtype)
    tokens = torch.randn(400, 576, generator=torch.Generator().manual_seed(3)).to(dtype)
    normed, summed = fused_ops.add_rms_norm(x, residual, weight, 1e-6)
    weights, ids = fused_ops.route(tokens, gate, 6, True)
    for rows, first in ((1, 0), (1, 399), (3, 17), (130, 200)):
        part = slice(first, first + rows)
        alone, alone_sum = fused_ops.add_rms_norm(x[part], residual[part], weight, 1e-6)
        assert torch.equal(alone, normed[part]) and torch.equal(alone_sum, summed[part])
        alone_weights, alone_ids = fused_ops.route(tokens[part], gate, 6, True)
        assert torch.equal(alone_weights, weights[part]) and torch.equal(alone_ids, ids[part])


# Inputs come from the parent: torch's own random kernels follow ATEN_CPU_CAPABILITY too.
_ISA_SCRIPT = """
import json, sys, torch
from service.engine.native import extension, fused_ops
assert extension.problem() is None, extension.problem()
x, w, gate = torch.load(sys.argv[1])
out = {"isa": extension.isa()}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    xs, ws, gs = x.to(dtype), w.to(dtype), gate.to(dtype)
    weights, ids = fused_ops.route(xs, gs, 4, True)
    values = [fused_ops.rms_norm(xs, ws, 1e-5), fused_ops.add_rms_norm(xs, xs.flip(0), ws, 1e-5)[0], weights]
    out[str(dtype)] = [v.float().view(torch.int32).tolist() for v in values] + [ids.tolist()]
out["greedy"] = fused_ops.greedy(x.round())[1].tolist()  # ties among the rounded values
cache = x[:24].reshape(2, 2, 6, 4, 50)[..., :32].contiguous()  # [2, Hkv, blocks, block_size, D]
q = x[24:32].reshape(2, 4, 200)[..., :32]
tables, lens = torch.tensor([[5, 0, 3], [2, 4, 1]]), torch.tensor([11, 7])
for dtype in (torch.float32, torch.bfloat16):
    for window in (None, 5):
        got = fused_ops.decode_attention(q.to(dtype), cache.to(dtype), tables, lens, 0.2, window)
        out[f"attention {dtype} {window}"] = got.float().view(torch.int32).tolist()
# A head size AVX-512 takes 16 keys at a time (decode_attention.cpp): lengths across those blocks.
cache = x[:32].reshape(2, 1, 10, 5, 64)
q = x.flatten()[-384:].reshape(3, 2, 64)
tables = torch.tensor([list(range(10)), [3, 1, 4, 0, 5, 9, 2, 6, 8, 7], [7, 8, 9, 0, 1, 2, 3, 4, 5, 6]])
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    got = fused_ops.decode_attention(q.to(dtype), cache.to(dtype), tables, torch.tensor([17, 33, 50]), 0.2)
    out[f"attention 64 {dtype}"] = got.float().view(torch.int32).tolist()
    rotated, cos, sin = (x[:3, :160].reshape(3, 2, 80), x[3:6, :80], x[6:9, :80])
    rotated = rotated.to(dtype)
    torch.ops.nim_cpu.rope_(rotated, cos.reshape(3, 1, 80).to(dtype), sin.reshape(3, 1, 80).to(dtype))
    out[f"rope {dtype}"] = rotated.float().view(torch.int32).tolist()
json.dump(out, sys.stdout)
"""


def _outputs_under(capability: str | None, inputs: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run(
        [sys.executable, "-c", _ISA_SCRIPT, str(inputs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict = json.loads(done.stdout)
    return result


def test_the_instruction_sets_agree_bitwise(tmp_path: Path) -> None:
    """ATEN_CPU_CAPABILITY lowers the instructions the ops run (isa.h): each level this CPU has
    gives the same bits."""
    generator = torch.Generator().manual_seed(7)
    inputs = tmp_path / "inputs.pt"
    torch.save([torch.randn(33, 200, generator=generator), torch.rand(200, generator=generator) + 0.5,
                torch.randn(16, 200, generator=generator) * 0.1], inputs)  # fmt: skip
    runs = [_outputs_under(capability, inputs) for capability in (None, "avx2", "default")]
    isas = {run.pop("isa") for run in runs}
    if len(isas) < 2:
        pytest.skip(f"this CPU runs the ops on one instruction set only ({isas})")
    assert runs[0] == runs[1] == runs[2], isas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("normalize", [True, False], ids=["renormalised", "raw"])
def test_the_router_chooses_atens_experts(dtype: torch.dtype, normalize: bool) -> None:
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randn(40, 96, generator=generator).to(dtype)
    gate = (torch.randn(24, 96, generator=generator) * 0.2).to(dtype)
    weights, ids = fused_ops.route(tokens, gate, 5, normalize)
    want_weights, want_ids = _aten_route(tokens, gate, 5, normalize)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    # bf16 logits tie now and then; the op puts the lower expert first, aten's topk either one
    ids, order = ids.sort(-1)
    want_ids, want_order = want_ids.sort(-1)
    assert torch.equal(ids, want_ids)
    assert _relative_error(weights.gather(-1, order), want_weights.gather(-1, want_order)) <= TOLERANCE[dtype]


def test_a_nan_row_routes_to_valid_experts_and_harms_no_other() -> None:
    """A NaN token (a poisoned activation) must not index past the experts in the MoE op."""
    generator = torch.Generator().manual_seed(5)
    tokens, gate = torch.randn(4, 32, generator=generator), torch.randn(8, 32, generator=generator)
    clean_weights, clean_ids = fused_ops.route(tokens, gate, 3, True)
    tokens[1, 7] = float("nan")
    weights, ids = fused_ops.route(tokens, gate, 3, True)
    assert ((ids >= 0) & (ids < 8)).all() and len(set(ids[1].tolist())) == 3
    assert torch.isnan(weights[1]).all()
    others = [0, 2, 3]
    assert torch.equal(weights[others], clean_weights[others]) and torch.equal(ids[others], clean_ids[others])


def test_tied_experts_go_to_the_lower_one() -> None:
    gate = torch.zeros(6, 16)
    gate[4] = 1.0
    weights, ids = fused_ops.route(torch.ones(1, 16), gate, 3, True)
    assert ids.tolist() == [[4, 0, 1]]
    assert weights.sum().item() == pytest.approx(1.0)


def _attention(
    lens: list[int] | None = None,
    tables: list[list[int]] | None = None,
    heads: int = 4,
    cache_dtype: torch.dtype = torch.float32,
    window: int | None = None,
) -> torch.Tensor:
    """decode_attention over a cache of 3 blocks of 4 positions, 2 kv heads of 8 (one row)."""
    cache = torch.randn(2, 2, 3, 4, 8).to(cache_dtype)
    table = torch.tensor(tables if tables is not None else [[2, 0]])
    length = torch.tensor(lens if lens is not None else [6])
    if window is not None and window < 0:
        out: torch.Tensor = torch.ops.nim_cpu.decode_attention(
            torch.randn(1, heads, 8), cache, table, length, 1.0, window
        )
        return out
    return fused_ops.decode_attention(torch.randn(1, heads, 8), cache, table, length, 1.0, window)


def _gathered_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """The reference: each row's blocks gathered by hand, its keys cut to its length (and window),
    sdpa in float64."""
    rows = []
    kv_heads, dim = cache.shape[1], cache.shape[4]
    for b in range(q.shape[0]):
        length = int(lens[b])
        keys = torch.cat([cache[0, :, int(block)] for block in tables[b]], dim=1)[:, :length].double()
        values = torch.cat([cache[1, :, int(block)] for block in tables[b]], dim=1)[:, :length].double()
        first = 0 if window is None else max(0, length - window)
        queries = q[b].double().view(kv_heads, -1, dim)
        scores = queries @ keys[:, first:].transpose(1, 2) * scale
        rows.append((scores.softmax(-1) @ values[:, first:]).reshape(-1, dim))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("window", [None, 1, 24], ids=["full", "window-1", "window-24"])
def test_decode_attention_reads_each_rows_blocks_in_place(dtype: torch.dtype, window: int | None) -> None:
    """Each row over its own block table (blocks out of order, tables padded past its length),
    grouped query heads, lengths at and across block edges: what the gathered rows give, in float64
    (float32: to its rounding; 16-bit caches: one rounding of the output)."""
    generator = torch.Generator().manual_seed(11)
    block_size, blocks, kv_heads, heads, dim = 16, 20, 3, 9, 64
    cache = torch.randn(2, kv_heads, blocks, block_size, dim, generator=generator).to(dtype)
    lens = torch.tensor([1, 16, 17, 100, 5, 64])
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:7] for _ in lens])
    q = (torch.randn(len(lens), heads, dim, generator=generator) * 2).to(dtype)
    with torch.inference_mode():
        got = fused_ops.decode_attention(q, cache, tables, lens, dim**-0.5, window)
        assert got.dtype == dtype and got.shape == q.shape
        want = _gathered_attention(q, cache, tables, lens, dim**-0.5, window)
        assert (
            _relative_error(got, want)
            <= {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
        )
        for rows in (slice(0, 1), slice(3, 4), slice(1, 4)):  # alone, tables cut: the same bits
            needed = -(-int(lens[rows].max()) // block_size)
            alone = fused_ops.decode_attention(
                q[rows], cache, tables[rows, :needed], lens[rows], dim**-0.5, window
            )
            assert torch.equal(alone, got[rows])
        strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # q as a view of another layout
        assert torch.equal(fused_ops.decode_attention(strided, cache, tables, lens, dim**-0.5, window), got)


def test_decode_attention_writes_the_rows_new_keys_as_the_pool_does_then_attends() -> None:
    """With k, v and slots (the scripted step's one call): the cache afterwards is KVPool.write's,
    and the output is attention over it, bitwise."""
    generator = torch.Generator().manual_seed(12)
    cache = torch.randn(2, 2, 5, 4, 8, generator=generator)
    q, k, v = (torch.randn(3, n, 8, generator=generator) for n in (4, 2, 2))
    tables, lens = torch.tensor([[3, 1], [0, 2], [4, 4]]), torch.tensor([6, 1, 4])
    slots = torch.tensor([1 * 4 + 1, 0 * 4 + 0, 4 * 4 + 3])  # each row's last position
    want_cache = cache.clone()
    want_cache.view(2, 2, -1, 8).index_copy_(2, slots, torch.stack((k, v)).transpose(1, 2))
    want = fused_ops.decode_attention(q, want_cache, tables, lens, 0.3)
    got = torch.ops.nim_cpu.decode_attention(q, cache, tables, lens, 0.3, 0, k, v, slots)
    assert torch.equal(cache, want_cache) and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="slot 80 out of range"):
        torch.ops.nim_cpu.decode_attention(q, cache, tables, lens, 0.3, 0, k, v, torch.tensor([0, 1, 80]))
    with pytest.raises(RuntimeError, match="come together"):
        torch.ops.nim_cpu.decode_attention(q, cache, tables, lens, 0.3, 0, k, None, slots)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_rope_is_bitwise_the_table_ropes_three_ops(dtype: torch.dtype) -> None:
    """In place on q and k as views of the qkv projection's output (rows strided past them), and
    the model's TableRope takes it where the fused ops run (RotaryEmbedding(native=True))."""
    generator = torch.Generator().manual_seed(13)
    config = ModelConfig(
        architecture="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
        bos_token_id=None, eos_token_ids=(0,), torch_dtype=None,
    )  # fmt: skip
    rotary = RotaryEmbedding(config, native=True)
    positions = torch.tensor([0, 5, 63, 17, 2])
    rope = rotary.for_positions(positions, dtype)
    assert isinstance(rope, TableRope) and rope.native
    qkv = (torch.randn(5, 8 * 16 + 5, generator=generator) * 3).to(dtype)
    fused, aten = qkv.clone(), qkv.clone()
    rope(fused[:, : 6 * 16].view(5, 6, 16))
    TableRope(rope.cos, rope.sin)(aten[:, : 6 * 16].view(5, 6, 16))
    assert torch.equal(fused, aten) and not torch.equal(fused, qkv)  # the tail past q and k untouched
    empty = torch.empty(0, 6, 16, dtype=dtype)
    assert fused_ops.rope_(empty, rope.cos[:0], rope.sin[:0]).shape == (0, 6, 16)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        fused_ops.rope_(qkv[:, :96].view(5, 6, 16).double(), rope.cos, rope.sin)
    with pytest.raises(RuntimeError, match="must be even"):
        fused_ops.rope_(torch.ones(5, 1, 15, dtype=dtype), rope.cos[..., :15], rope.sin[..., :15])


def test_decode_attention_of_a_nan_or_infinite_row_spoils_only_that_row() -> None:
    cache = torch.randn(2, 1, 2, 4, 16, generator=torch.Generator().manual_seed(14))
    q = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(15))
    tables, lens = torch.tensor([[0, 1]] * 3), torch.tensor([5, 8, 3])
    clean = fused_ops.decode_attention(q, cache, tables, lens, 0.25)
    q[0, 1, 3] = float("nan")
    q[2, 0, 0] = float("inf")
    spoiled = fused_ops.decode_attention(q, cache, tables, lens, 0.25)
    assert bool(spoiled[0, 1].isnan().all()) and torch.equal(spoiled[0, 0], clean[0, 0])
    assert bool(spoiled[2, 0].isnan().any()) and torch.equal(spoiled[1], clean[1])


def test_decode_attention_of_huge_scores_stays_finite() -> None:
    """Scores far apart (exp underflows to 0 for all but the largest) and a row of equal scores."""
    cache = torch.zeros(2, 1, 2, 4, 16)
    cache[0, 0, 0, 0] = 100.0  # the first key dominates
    cache[1, 0, 0] = torch.arange(4.0)[:, None]  # value rows 0, 1, 2, 3
    q = torch.ones(2, 1, 16)
    q[1] = 0.0  # every score 0: the mean of the values
    out = fused_ops.decode_attention(q, cache, torch.tensor([[0, 1], [0, 1]]), torch.tensor([4, 4]), 1.0)
    assert torch.equal(out[0], torch.zeros(1, 16)) and torch.allclose(out[1], torch.full((1, 16), 1.5))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fused_ops.route(torch.ones(2, 16), torch.ones(4, 16), 5, True), "top_k must be in"),
        (lambda: fused_ops.route(torch.ones(2, 16), torch.ones(4, 8), 2, True), "the gate must be"),
        (lambda: fused_ops.route(torch.ones(2, 16), torch.ones(4, 16).double(), 2, True), "the gate must be"),
        (lambda: fused_ops.rms_norm(torch.ones(2, 16), torch.ones(8), 1e-6), "the weight must be"),
        (lambda: fused_ops.rms_norm(torch.ones(2, 16), torch.ones(16).bfloat16(), 1e-6), "x's dtype"),
        (
            lambda: fused_ops.rms_norm(torch.ones(2, 16, dtype=torch.int32), torch.ones(16).int(), 1e-6),
            "float32",
        ),
        (
            lambda: fused_ops.add_rms_norm(torch.ones(2, 16), torch.ones(3, 16), torch.ones(16), 1e-6),
            "residual",
        ),
        (lambda: fused_ops.rms_norm(torch.ones(6, 16), torch.ones(4, 16), 1e-6), r"a \[W, H\] weight needs"),
        (
            lambda: fused_ops.rms_norm(torch.ones(2, 3, 16), torch.ones(2, 16), 1e-6),
            r"a \[W, H\] weight needs",
        ),
        (lambda: fused_ops.greedy(torch.ones(2, 16).bfloat16()), "float32"),
        (lambda: _attention(lens=[9]), "length 9 is not within its table's 8 positions"),
        (lambda: _attention(lens=[0]), "length 0 is not within"),
        (lambda: _attention(tables=[[0, 7]]), "block id 7 out of range"),
        (lambda: _attention(heads=3), "3 query heads over 2 kv heads"),
        (lambda: _attention(cache_dtype=torch.bfloat16), "q and the cache must share a dtype"),
        (lambda: _attention(window=-1), "window must be >= 0"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152, 49155])
def test_greedy_takes_argmaxs_token(vocab: int) -> None:
    """The first largest logit, as argmax: ties, -inf, a tail past whole SIMD blocks; a NaN row
    gets NaN and a valid id, and harms no other row."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=generator).round()  # many ties
    logits[1] = float("-inf")
    logits[2, -1] = 1e9  # the largest in the tail
    logits[3] = float("-inf")
    logits[3, vocab // 2] = -5.0
    logits[4, vocab // 3] = float("nan")
    values, ids = fused_ops.greedy(logits)
    clean = [row for row in range(9) if row != 4]
    assert torch.equal(ids[clean], logits[clean].argmax(-1))
    assert torch.equal(values[clean], logits[clean].amax(-1))
    assert torch.isnan(values[4]) and 0 <= int(ids[4]) < vocab
    sampled = greedy(logits, fused=True)
    assert torch.equal(sampled[1][clean], greedy(logits)[1][clean])


def test_empty_batches_and_strided_logits() -> None:
    """No rows: empty results of the right shapes; logits that are a view (every other row)."""
    for dtype in (torch.float32, torch.bfloat16):
        empty = torch.empty(0, 64, dtype=dtype)
        assert fused_ops.rms_norm(empty, torch.ones(64, dtype=dtype), 1e-6).shape == (0, 64)
        normed, summed = fused_ops.add_rms_norm(empty, empty, torch.ones(64, dtype=dtype), 1e-6)
        assert normed.shape == summed.shape == (0, 64)
        weights, ids = fused_ops.route(empty, torch.ones(8, 64, dtype=dtype), 2, True)
        assert weights.shape == ids.shape == (0, 2)
    values, ids = fused_ops.greedy(torch.empty(0, 100))
    assert values.shape == ids.shape == (0,)
    logits = torch.randn(10, 300, generator=torch.Generator().manual_seed(9))
    assert torch.equal(fused_ops.greedy(logits[::2])[1], logits[::2].argmax(-1))


def test_infinite_logits_route_to_valid_experts() -> None:
    tokens = torch.ones(2, 16)
    gate = torch.zeros(6, 16)
    gate[2], gate[5] = float("inf"), float("-inf")
    _, ids = fused_ops.route(tokens, gate, 3, True)
    assert ((ids >= 0) & (ids < 6)).all() and all(len(set(row)) == 3 for row in ids.tolist())


def test_the_start_up_check_passes() -> None:
    assert fused_ops.check() is None


def test_the_setting_and_the_start_up_check_decide(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cpu = torch.device("cpu")
    chosen = cpu_fused_ops.choose(cpu, enabled=True)
    assert chosen.used and extension.isa() in chosen.reason and chosen.setting == "NIM_CPU_FUSED_OPS=off"
    chosen = cpu_fused_ops.choose(cpu, enabled=False)
    assert not chosen.used and "off (NIM_CPU_FUSED_OPS=off)" in chosen.reason
    assert not cpu_fused_ops.choose(torch.device("meta"), enabled=True).used
    monkeypatch.setattr(fused_ops, "check", lambda: "the fused ops compute a row differently at batch 3")
    with caplog.at_level(logging.WARNING):
        chosen = cpu_fused_ops.choose(cpu, enabled=True)
    assert not chosen.used and "batch 3; aten's op sequences instead" in chosen.reason
    assert "norms, routing and decode attention run aten's ops" in caplog.text

    def raises() -> str | None:
        raise RuntimeError("no kernel for this schema")

    monkeypatch.setattr(fused_ops, "check", raises)
    chosen = cpu_fused_ops.choose(cpu, enabled=True)  # a fallback, not a failed start
    assert (
        not chosen.used and "start-up check failed (RuntimeError: no kernel for this schema)" in chosen.reason
    )


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fused") / "tiny-qwen3_moe"
    _hf_model("qwen3_moe").save_pretrained(directory)
    _distinct_tokens(directory)
    return directory


def test_a_model_built_with_them_matches_transformers(qwen3_moe: Path) -> None:
    """Qwen3-MoE (q/k norms, routed and dense layers) with the fused ops: its routers stay plain
    for the op, every other linear is packed, and its logits are transformers' (to 1e-4) as the
    aten-built model's are."""
    config, weights = load_hf_dir(qwen3_moe, "fp32")
    model = build_model(
        config, weights, torch.float32, "cpu", BuildOptions(prepack_cpu=True, cpu_fused_ops=True)
    )
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(block.native and type(block.gate) is torch.nn.Linear for block in blocks)
    # /v1/metadata says what runs fused: 3 layers' two norms, 3 x 2 q/k norms, the final one; 2 routers
    reason = cpu_fused_ops.path(model, cpu_fused_ops.choose(torch.device("cpu"), enabled=True)).reason
    assert reason.startswith(
        "13 RMSNorms (with their residual adds), 2 MoE routers, the rotary embedding, the greedy argmax as "
    )  # and how decode rows attend, once the engine has chosen (tests/test_scripted_decode.py)
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    reference = transformers.AutoModelForCausalLM.from_pretrained(qwen3_moe, dtype=torch.float32).eval()
    with torch.inference_mode():
        for prompt in ([5, 17, 200, 3, 99, 42, 7], list(range(30, 60))):
            ids = torch.tensor(prompt)
            ours = model.compute_logits(model(ids, torch.arange(len(prompt)), CausalAttention()))
            torch.testing.assert_close(ours, reference(ids[None]).logits[0].float(), atol=1e-4, rtol=1e-4)
