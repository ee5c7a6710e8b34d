"""The fused CPU ops (service/engine/native/fused_ops.cpp) against the aten sequences they replace.

    PYTHONPATH=. .venv/bin/python bench/cpu_fused_ops.py --out bench/results/.../fused_ops.json

For each op, at decode shapes (one row unless said; bf16 like the served models' activations),
the median time of the aten sequence and of the fused op, twice: hot (called back to back), and
after a weight stream (each call follows a 32 MB read on one thread, as a decode step's small ops
follow the matmuls that stream the weights past the caches). The second is the one a decode step
sees: the small aten ops' dispatch and kernel code leave the caches with the weights.

- RMSNorm with the residual add: `x + residual`, then `weight * F.rms_norm(...)`, width 576;
- the router of a 32-expert layer (hidden 512): F.linear, softmax, top-4, renormalised;
- the greedy sampler's argmax over 49152 logits (sampler.greedy with and without `fused`), at 1,
  8 and 32 rows;
- decode attention, the embedded model's heads (9 query heads over 3 kv heads of 64, blocks of
  16), rows of 200 and 600 keys: the engine's previous path (one row's blocks as a run read in
  place, 8 rows' gathered by one index_select; sdpa with the additive mask: PagedAttention._decode
  on gathered blocks) against the native op over the block tables (DecodeAttention.NATIVE); and
  a lone request's verification step, 8 rows of one sequence over 230 to 237 keys (the rows of
  7 drafts), the same gathered path against the native op;
- the table RoPE over q and k (12 heads of 64), the three aten ops against the fused op, at 1 and
  8 rows.

Prints one JSON document (with the command) and writes --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from service.engine.native import extension, fused_ops
from service.engine.torch.sampler import greedy
from service.engine.torch.scripted_ops import rotate_


def median_us(fn: Callable[[], object], before: Callable[[], object], reps: int) -> float:
    """The median time of fn() alone, each call after before() (not timed)."""
    for _ in range(5):
        before()
        fn()
    times = []
    for _ in range(reps):
        before()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 1)


def _attention_pair(
    rows: int, keys: int, generator: torch.Generator
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(the gathered path, the native op) for `rows` decode rows of `keys` keys each, bf16."""
    heads, kv_heads, dim, block = 9, 3, 64, 16
    width = -(-keys // block)
    cache = torch.randn(2, kv_heads, rows * width + 1, block, dim, generator=generator).bfloat16()
    q = torch.randn(rows, heads, dim, generator=generator).bfloat16()
    tables = torch.arange(rows * width).view(rows, width)
    lens = torch.full((rows,), keys)
    mask = torch.zeros(rows, 1, 1, width * block, dtype=torch.bfloat16)
    mask[..., keys:] = float("-inf")
    planes = torch.arange(2 * kv_heads)[:, None] * cache.shape[2]
    rows_of_pool = (planes + tables.flatten()[None, :]).flatten()  # KVPool.head_block_ids

    def gathered() -> object:
        if rows == 1:  # a run of blocks read in place (KVPool.run_pair)
            both = cache[:, :, :width].reshape(2, kv_heads, width * block, dim)
            k, v = both.unsqueeze(1).unbind(0)
        else:  # KVPool.gather_pair
            both = cache.view(-1, block, dim).index_select(0, rows_of_pool).view(2, kv_heads, rows, -1, dim)
            k, v = both.transpose(1, 2).unbind(0)
        queries = q.view(rows, kv_heads, heads // kv_heads, dim)
        return F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=dim**-0.5)

    return gathered, lambda: fused_ops.decode_attention(q, cache, tables, lens, dim**-0.5)


def _verification_pair(
    rows: int, keys: int, generator: torch.Generator
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(the gathered path, the native op) for a lone request's verification step: `rows` rows of
    one sequence, the first over `keys` keys and each next one over one more, bf16."""
    heads, kv_heads, dim, block = 9, 3, 64, 16
    width = -(-(keys + rows) // block)
    cache = torch.randn(2, kv_heads, width, block, dim, generator=generator).bfloat16()
    q = torch.randn(rows, heads, dim, generator=generator).bfloat16()
    tables = torch.arange(width).repeat(rows, 1)
    lens = torch.arange(keys, keys + rows)
    mask = torch.zeros(rows, 1, 1, width * block, dtype=torch.bfloat16)
    for r in range(rows):
        mask[r, ..., keys + r :] = float("-inf")

    def gathered() -> object:  # one run of blocks read in place, each row masked to its length
        k, v = cache.reshape(2, 1, kv_heads, width * block, dim).unbind(0)
        queries = q.view(rows, kv_heads, heads // kv_heads, dim)
        return F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=dim**-0.5)

    return gathered, lambda: fused_ops.decode_attention(q, cache, tables, lens, dim**-0.5)


def _rope_pair(rows: int, generator: torch.Generator) -> tuple[Callable[[], object], Callable[[], object]]:
    """(TableRope's three aten ops, the fused op) over q and k of `rows` rows, in place, bf16."""
    qk = torch.randn(rows, 12, 64, generator=generator).bfloat16()
    cos, sin = (torch.randn(rows, 1, 64, generator=generator).bfloat16() for _ in range(2))
    return lambda: rotate_(qk, cos, sin), lambda: torch.ops.nim_cpu.rope_(qk, cos, sin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    problem = extension.problem()
    if problem is not None:
        sys.exit(problem)
    stream = torch.randn(8 * 1024 * 1024)  # 32 MB

    def after_a_stream() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        stream.add_(1.0)
        torch.set_num_threads(threads)

    def nothing() -> None:
        return None

    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(1, 576, generator=generator).bfloat16() for _ in range(2))
    weight = (torch.rand(576, generator=generator) + 0.5).bfloat16()
    tokens = torch.randn(1, 512, generator=generator).bfloat16()
    gate = (torch.randn(32, 512, generator=generator) * 0.05).bfloat16()

    def aten_norm() -> object:
        summed = x + residual
        return weight * F.rms_norm(summed, (576,), eps=1e-6), summed

    def aten_route() -> object:
        probs = F.softmax(F.linear(tokens, gate), dim=-1, dtype=torch.float32)
        chosen, ids = torch.topk(probs, 4, dim=-1)
        return (chosen / chosen.sum(dim=-1, keepdim=True)).to(tokens.dtype), ids

    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "add_rms_norm 576": (aten_norm, lambda: fused_ops.add_rms_norm(x, residual, weight, 1e-6)),
        "route 32x512 top-4": (aten_route, lambda: fused_ops.route(tokens, gate, 4, True)),
    }
    for rows in (1, 8, 32):
        logits = torch.randn(rows, 49152, generator=generator)
        cases[f"greedy {rows}x49152"] = (
            lambda logits=logits: greedy(logits),
            lambda logits=logits: greedy(logits, fused=True),
        )
    for rows, keys in ((1, 200), (1, 600), (8, 200)):
        cases[f"decode attention {rows}x{keys} keys"] = _attention_pair(rows, keys, generator)
    cases["decode attention, 8 verification rows of 230-237 keys"] = _verification_pair(8, 230, generator)
    for rows in (1, 8):
        cases[f"rope {rows}x12x64"] = _rope_pair(rows, generator)
    results = {}
    for name, (aten, fused) in cases.items():
        results[name] = {
            f"{which} {when}": median_us(fn, before, args.reps)
            for when, before in (("hot", nothing), ("after a stream", after_a_stream))
            for which, fn in (("aten", aten), ("fused", fused))
        }
    document = {
        "command": " ".join(sys.argv),
        "isa": extension.isa(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "us": results,
    }
    text = json.dumps(document, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
