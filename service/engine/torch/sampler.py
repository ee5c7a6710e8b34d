"""Pick the next token for each row of a batch, each row with its own sampling parameters.

Seeded rows draw from their own `torch.Generator`, so a seeded request reproduces whatever else
shares its batch. Greedy rows (temperature 0) take the argmax and consume no randomness.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.protocol import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()  # fresh non-deterministic seed
    return generator


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
    """logits: [B, V] float32 -> one token id per row."""
    greedy_ids = torch.argmax(logits, dim=-1)  # [B]
    if all(p.greedy for p in params):
        return greedy_ids.tolist()
    chosen = greedy_ids.clone()
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        probs = torch.softmax(logits[row] / p.temperature, dim=-1)  # [V]
        if p.top_p < 1.0:
            probs = _top_p_filter(probs, p.top_p)
        chosen[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return chosen.tolist()


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()
