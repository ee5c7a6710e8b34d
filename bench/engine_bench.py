"""In-process benchmarks of the PyTorch engine against a bare PyTorch decode loop, same model, same run.

    .venv/bin/python bench/engine_bench.py --batch 32 --input-len 128 --output-len 128

- bare: the model's forward over a dense, preallocated [B, max_len] KV cache, SDPA with
  enable_gqa, greedy argmax; no scheduler, no paging, no detokenization: the ceiling the
  serving engine is measured against;
- engine: the real TorchEngine (paged cache, scheduler, sampler, detokenizer, stop checks) fed
  `batch` requests at once, with ignore_eos so each produces exactly output-len tokens.

Prints decode tok/s for both (medians of --repeat runs) and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from service.config_loading import load_settings
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.loading import build_engine
from service.serving import config_for


class DenseAttention:
    """A preallocated dense cache: k/v [L, B, Hkv, max_len, D]; every row at the same position."""

    def __init__(
        self, layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int, dtype, device
    ) -> None:
        self.k = torch.zeros(layers, batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.batch = batch
        self.pos = 0
        self.num_new = 0

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        if window is not None:
            raise NotImplementedError("no sliding window in this test-only attention")
        # q: [B*S, Hq, D] (flat), k/v: [B*S, Hkv, D]
        s = q.shape[0] // self.batch
        q = q.view(self.batch, s, *q.shape[1:]).transpose(1, 2)  # [B, Hq, S, D]
        k = k.view(self.batch, s, *k.shape[1:]).transpose(1, 2)
        v = v.view(self.batch, s, *v.shape[1:]).transpose(1, 2)
        end = self.pos + s
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        out = F.scaled_dot_product_attention(
            q,
            self.k[layer, :, :, :end],
            self.v[layer, :, :, :end],
            is_causal=s > 1,
            enable_gqa=True,
            scale=scale,
        )
        return out.transpose(1, 2).reshape(self.batch * s, *out.shape[1:2], out.shape[-1])


def bare_decode(engine, batch: int, input_len: int, output_len: int) -> float:
    model, config = engine.core.model, engine.core.model_config
    device = engine.core.config.device
    cache = DenseAttention(
        config.num_layers,
        batch,
        config.num_kv_heads,
        config.head_dim,
        input_len + output_len,
        engine.core.config.dtype,
        device,
    )
    rng = random.Random(0)
    tokens = [[rng.randrange(100, 40000) for _ in range(input_len)] for _ in range(batch)]
    prompt = torch.tensor(tokens, device=device)
    with torch.inference_mode():
        positions = torch.arange(input_len, device=device).repeat(batch)
        hidden = model(prompt.reshape(-1), positions, cache)
        cache.pos = input_len
        last = model.compute_logits(hidden.view(batch, input_len, -1)[:, -1]).argmax(-1)
        started = time.perf_counter()
        for _ in range(output_len - 1):
            positions = torch.full((batch,), cache.pos, device=device)
            hidden = model(last, positions, cache)
            cache.pos += 1
            last = model.compute_logits(hidden).argmax(-1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
    return batch * (output_len - 1) / elapsed


def engine_decode(engine, batch: int, input_len: int, output_len: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(input_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    async def run() -> dict[str, float]:
        first_token_at: list[float] = []
        started = time.perf_counter()

        async def one(i: int) -> int:
            request = GenerationRequest(f"bench-{seed}-{i}", prompts[i], params, time.monotonic())
            count = 0
            async for out in engine.generate(request):
                if count == 0 and out.token_ids:
                    first_token_at.append(time.perf_counter())
                count += len(out.token_ids)
            return count

        counts = await asyncio.gather(*(one(i) for i in range(batch)))
        ended = time.perf_counter()
        decode_start = max(first_token_at)
        return {
            "output_tok_per_s": sum(counts) / (ended - started),
            "decode_tok_per_s": (sum(counts) - batch) / (ended - decode_start),
        }

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    settings = load_settings(
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        max_num_seqs=max(args.batch, 1),
        max_num_batched_tokens=max(1024, args.batch),
        kv_cache_max_tokens=65536,
    )
    engine = build_engine(config_for(settings))

    async def start() -> None:
        await engine.start()

    asyncio.run(start())
    bare, served, total = [], [], []
    for r in range(args.repeat):
        bare.append(bare_decode(engine, args.batch, args.input_len, args.output_len))
        result = engine_decode(engine, args.batch, args.input_len, args.output_len, seed=r)
        served.append(result["decode_tok_per_s"])
        total.append(result["output_tok_per_s"])
    summary = {
        "bare_decode_tok_per_s": statistics.median(bare),
        "engine_decode_tok_per_s": statistics.median(served),
        "engine_output_tok_per_s_incl_prefill": statistics.median(total),
        "engine_over_bare": statistics.median(s / b for s, b in zip(served, bare, strict=True)),
    }
    print(json.dumps({"config": vars(args), "median": summary, "bare": bare, "engine": served}, indent=2))


if __name__ == "__main__":
    main()
