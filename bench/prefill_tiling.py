"""Prefill time with attention in aligned query tiles (what the engine does) against one fused
call per chunk (what it did before the tiles, kept here only to compare), in one process,
alternating, on the embedded model.

The tiles make a token's attention output independent of how many prompt tokens its chunk
computes (service/engine/torch/paged_attention.py says why); this measures what that costs.

    .venv/bin/python bench/prefill_tiling.py --prompt-tokens 1500 --chunk 512 --rounds 4 \
        --out bench/results/cpu-2026-11-25/prefill_tiling.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_load

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from service.config_loading import load_settings  # noqa: E402
from service.engine.protocol import GenerationRequest, SamplingParams  # noqa: E402
from service.engine.torch import model_runner, paged_attention  # noqa: E402
from service.engine.torch.engine import TorchEngine  # noqa: E402
from service.engine.torch.loading import build_engine  # noqa: E402
from service.serving import config_for  # noqa: E402

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "cats")
TILED_MASK = paged_attention.prefill_mask
TILED_OFFSET = paged_attention.PrefillChunk.tile_offset


def untiled_mask(first: int, num_query: int, padded_len: int, device: torch.device, dtype: torch.dtype):
    """One tile holding the whole chunk: the fused kernel cuts it as it likes (the old path)."""
    keys = torch.arange(padded_len, device=device)
    queries = torch.arange(first, first + num_query, device=device)
    return paged_attention.additive_mask(keys[None, :] <= queries[:, None], dtype)[None]


def use(tiled: bool) -> None:
    model_runner.prefill_mask = TILED_MASK if tiled else untiled_mask  # type: ignore[assignment]
    paged_attention.PrefillChunk.tile_offset = TILED_OFFSET if tiled else property(lambda self: 0)  # type: ignore[assignment,method-assign]


async def prefill(engine: TorchEngine, prompt: list[int], rid: str) -> None:
    request = GenerationRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    async for _ in engine.generate(request):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    settings = load_settings(
        num_threads=2, max_model_len=4096, kv_cache_max_tokens=16384, max_num_batched_tokens=args.chunk
    )
    engine = build_engine(config_for(settings))
    asyncio.run(engine.start())
    text = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_tokens * 2))
    prompt = engine.tokenizer.encode(text)[: args.prompt_tokens]
    seconds: dict[str, list[float]] = {"untiled": [], "tiled": []}
    for round_ in range(args.rounds):
        for name in seconds:
            use(name == "tiled")
            engine.core.pool.reset_cache()
            started = time.perf_counter()
            asyncio.run(prefill(engine, prompt, f"{name}-{round_}"))
            seconds[name].append(time.perf_counter() - started)
    use(True)
    asyncio.run(engine.stop())
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    report = {
        "prompt_tokens": len(prompt),
        "chunk": args.chunk,
        "seconds": {name: [round(v, 3) for v in values] for name, values in seconds.items()},
        "median_seconds": {name: round(v, 3) for name, v in medians.items()},
        "tiled_over_untiled": round(medians["tiled"] / medians["untiled"], 3),
    }
    http_load.write_report(report, args.out)


if __name__ == "__main__":
    main()
