"""Fused CPU ops for a decode step's small steps (fused_ops.cpp): RMSNorm, with the residual add
before it, MoE routing, the greedy sampler's argmax and table RoPE, each one op where aten runs a
sequence; and
decode rows' attention over the paged KV cache, each row's blocks read in place (decode_attention.cpp,
where PagedAttention gathered them into a padded copy for sdpa).

At one stream a decode step is a few hundred small ops between the weight-streaming matmuls, and
after each matmul the small ops' dispatch and kernel code have left the caches: the residual
add and RMSNorm of one row took 142 us there against 19 us hot, the router of a 32-expert layer
212 us against 55 us; the fused ops 61 and 58 us there, 4 and 5 us hot (bench/README.md "Fused
CPU norms, routing and argmax").

What each computes is the aten sequence it replaces (named at each), in float32 with the same
roundings to the activation dtype; only the order of the float32 sums differs, so results agree
to the last bits of float32 (bf16: to one rounding). Eager modules and the scripted decode call
the same ops, so a scripted step stays bitwise the eager one; rows are computed alike at any
batch size (the ops' invariants, fused_ops.cpp). `check()` holds both at start-up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from service.engine.native import extension

extension.define(
    {
        "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
        "add_rms_norm": "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) "
        "-> (Tensor, Tensor)",
        "route": "route(Tensor x, Tensor gate, int top_k, bool normalize) -> (Tensor, Tensor)",
        "greedy": "greedy(Tensor logits) -> (Tensor, Tensor)",
        "rope_": "rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)",
        "decode_attention": "decode_attention(Tensor q, Tensor(a!) cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, Tensor? k=None, Tensor? v=None, "
        "Tensor? slots=None) -> Tensor",
    }
)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * F.rms_norm(x, (H,), eps=eps) (llama_layers.RMSNorm.forward); a [W, H] weight takes
    x [..., W, H] and gives each row its own weight row, as the broadcast product does."""
    out: Tensor = torch.ops.nim_cpu.rms_norm(x, weight, eps)
    return out


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual) (llama_layers.RMSNorm.add_forward)."""
    normed, summed = torch.ops.nim_cpu.add_rms_norm(x, residual, weight, eps)
    return normed, summed


def route(x: Tensor, gate: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """SparseMoeBlock's routing (models/moe.py): (weights [T, top_k] in x's dtype, expert ids
    [T, top_k] int64) from the router's weight [experts, hidden]."""
    weights, ids = torch.ops.nim_cpu.route(x, gate, top_k, normalize)
    return weights, ids


def greedy(logits: Tensor) -> tuple[Tensor, Tensor]:
    """sampler.greedy: [B, V] float32 -> ([B] largest values, [B] the first id holding each, as
    argmax); a row holding a NaN gets NaN (and id 0)."""
    values, ids = torch.ops.nim_cpu.greedy(logits)
    return values, ids


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """TableRope in place (models/rope.py: x * cos + roll(x, D / 2) * sin, each op's rounding to
    x's dtype; bitwise `_aten_rope`): x [T, H, D] with its last dimension contiguous, cos and sin
    [T, 1, D] as RotaryEmbedding.lookup_full makes them."""
    out: Tensor = torch.ops.nim_cpu.rope_(x, cos, sin)
    return out


def _aten_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rotated = x.roll(x.shape[-1] // 2, -1).mul_(sin)
    return x.mul_(cos).add_(rotated)


def decode_attention(
    q: Tensor,
    cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """q [B, Hq, D] against one layer's paged cache [2, Hkv, blocks, block_size, D] (the same dtype),
    each row over its own context_lens[b] keys through block_tables[b] (read in place), or their
    last `window`: [B, Hq, D] (decode_attention.cpp). What PagedAttention's gathered sdpa computes
    for a decode row (`_aten_attention`). The scripted step passes the rows' new keys and values
    [B, Hkv, D] and their slots too (k, v, slots), written first as KVPool.write writes them."""
    out: Tensor = torch.ops.nim_cpu.decode_attention(q, cache, block_tables, context_lens, scale, window or 0)
    return out


def _aten_attention(
    q: Tensor, cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float, window: int | None
) -> Tensor:
    """The reference: each row's blocks gathered and its keys masked, then sdpa (PagedAttention._decode)."""
    rows = []
    _, kv_heads, _, block_size, dim = cache.shape
    for b in range(q.shape[0]):
        length = int(context_lens[b])
        blocks = block_tables[b, : -(-length // block_size)]
        keys, values = (cache[i, :, blocks].reshape(kv_heads, -1, dim)[:, :length] for i in (0, 1))
        if window is not None:
            keys, values = keys[:, -window:], values[:, -window:]
        queries = q[b].view(kv_heads, -1, dim)
        rows.append(F.scaled_dot_product_attention(queries, keys, values, scale=scale).reshape(-1, dim))
    return torch.stack(rows)


def _aten_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def _aten_route(x: Tensor, gate: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    probs = F.softmax(F.linear(x, gate), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), ids


# The start-up check's shapes: rows, width (not a multiple of 16), experts, top-k.
_ROWS, _WIDTH, _EXPERTS, _TOP_K = 24, 200, 12, 3
_PROBED = ((1, 0), (1, 5), (3, 2), (7, 17), (16, 8))  # (rows, first row) slices against the whole batch
# How far the fused ops may be from aten's: float32 sums in another order (relative to a row's
# largest value), and for 16-bit outputs one rounding of the value.
_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def check() -> str | None:
    """None where the loaded ops compute what the aten sequences they replace compute (to the
    tolerance above, the routers' choices exactly) and every row alike at any batch size and
    place; else what they got wrong."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_ROWS, _WIDTH, generator=generator) * torch.logspace(-3, 3, _ROWS)[:, None]
    residual = torch.randn(_ROWS, _WIDTH, generator=generator)
    weight = torch.rand(_WIDTH, generator=generator) + 0.5
    # The router's inputs unscaled: saturated softmaxes tie at 0, and ties may go either way.
    tokens = torch.randn(_ROWS, _WIDTH, generator=generator)
    gate = torch.randn(_EXPERTS, _WIDTH, generator=generator) * 0.1
    with torch.inference_mode():
        for dtype, tolerance in _TOLERANCE.items():
            xs, rs, w, ts, g = (t.to(dtype) for t in (x, residual, weight, tokens, gate))
            normed, summed = add_rms_norm(xs, rs, w, 1e-6)
            if not torch.equal(summed, xs + rs):
                return f"the fused add_rms_norm's residual sum differs from aten's ({dtype})"
            if not torch.equal(normed, rms_norm(summed, w, 1e-6)):
                return f"the fused add_rms_norm differs from its rms_norm ({dtype})"
            for name, got, want in (
                ("rms_norm", rms_norm(xs, w, 1e-6), _aten_norm(xs, w, 1e-6)),
                ("router's weights", route(ts, g, _TOP_K, True)[0], _aten_route(ts, g, _TOP_K)[0]),
            ):
                scale = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
                error = float(((got.float() - want.float()).abs() / scale).max())
                if not error <= tolerance:
                    return f"the fused {name} is {error:.2g} off aten's ({dtype})"
            weights, ids = route(ts, g, _TOP_K, True)
            # as sets: aten's top-k orders ties (bf16 logits tie now and then) either way
            if not torch.equal(ids.sort(-1).values, _aten_route(ts, g, _TOP_K)[1].sort(-1).values):
                return f"the fused router chooses other experts than aten's ({dtype})"
            for rows, first in _PROBED:
                part = slice(first, first + rows)
                if not (
                    torch.equal(rms_norm(xs[part], w, 1e-6), rms_norm(xs, w, 1e-6)[part])
                    and torch.equal(route(ts[part], g, _TOP_K, True)[0], weights[part])
                ):
                    return f"the fused ops compute a row differently at batch {rows} ({dtype})"
    return _greedy_problem(generator) or _attention_problem(generator) or _rope_problem(generator)


def _rope_problem(generator: torch.Generator) -> str | None:
    """None where `rope_` gives the aten sequence's bits, in place on a strided view of q and k."""
    qkv = torch.randn(5, 3 * 64 + 17, generator=generator) * 3
    angles = torch.rand(5, 1, 32, generator=generator) * 6
    for dtype in _TOLERANCE:
        cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
        sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
        fused, aten = (qkv.to(dtype).clone()[:, : 3 * 64].view(5, 3, 64) for _ in range(2))
        rope_(fused, cos, sin)
        if not torch.equal(fused, _aten_rope(aten, cos, sin)):
            return f"the fused RoPE differs from aten's ({dtype})"
    return None


# The attention check: query heads, kv heads, head size, block size, blocks; rows' lengths.
_HEADS, _KV_HEADS, _DIM, _BLOCK, _BLOCKS = 6, 2, 64, 16, 12
_LENGTHS = (1, 15, 16, 17, 40, 97, 3, 64)


def _attention_problem(generator: torch.Generator) -> str | None:
    """None where `decode_attention` computes what gathered sdpa computes for each row (to the
    tolerance above), with and without a window, and each row alike whatever rows share the call."""
    cache = torch.randn(2, _KV_HEADS, _BLOCKS, _BLOCK, _DIM, generator=generator)
    q = torch.randn(len(_LENGTHS), _HEADS, _DIM, generator=generator) * 2
    width = -(-max(_LENGTHS) // _BLOCK)
    tables = torch.stack([torch.randperm(_BLOCKS, generator=generator)[:width] for _ in _LENGTHS])
    lens = torch.tensor(_LENGTHS)
    scale = _DIM**-0.5
    with torch.inference_mode():
        for dtype, tolerance in _TOLERANCE.items():
            qs, c = q.to(dtype), cache.to(dtype)
            for window in (None, 20):
                got = decode_attention(qs, c, tables, lens, scale, window)
                want = _aten_attention(qs.float(), c.float(), tables, lens, scale, window)
                largest = want.abs().amax(-1, keepdim=True).clamp_min(1e-30)
                error = float(((got.float() - want).abs() / largest).max())
                if not error <= tolerance:
                    return f"the fused decode attention is {error:.2g} off sdpa ({dtype}, window {window})"
                for rows, first in ((1, 0), (1, 5), (3, 2)):  # alone, their tables cut to their lengths
                    part = slice(first, first + rows)
                    needed = -(-int(lens[part].max()) // _BLOCK)
                    alone = decode_attention(qs[part], c, tables[part, :needed], lens[part], scale, window)
                    if not torch.equal(alone, got[part]):
                        return f"the fused decode attention computes a row differently at batch {rows}"
    return None


def _greedy_problem(generator: torch.Generator) -> str | None:
    """None where `greedy` takes argmax's ids and max's values: ties (the first), -inf, a NaN row."""
    logits = torch.randn(_ROWS, 3 * _WIDTH + 5, generator=generator)
    logits[1, 7] = logits[1, 400] = logits[1].max() + 1  # a tie: the first
    logits[2] = float("-inf")
    logits[3, 9] = float("nan")
    values, ids = greedy(logits)
    clean = [row for row in range(_ROWS) if row != 3]
    if not (
        torch.equal(ids[clean], logits[clean].argmax(-1))
        and torch.equal(values[clean], logits[clean].amax(-1))
    ):
        return "the fused greedy takes other tokens than argmax"
    if not (torch.isnan(values[3]) and 0 <= int(ids[3]) < logits.shape[1]):
        return "the fused greedy does not mark a NaN row"
    return None
