"""Pick the next token for each row of a batch, each row with its own sampling parameters.

Order of operations, per row: logprobs are taken from the model's raw distribution; then
min_tokens (end tokens masked until enough were generated), logit_bias, repetition /
frequency / presence penalties; greedy rows take the argmax of that; sampled rows apply
temperature, top_k, top_p and min_p and draw from their own `torch.Generator`, so a seeded
request reproduces whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.protocol import SamplingParams, TokenLogprob


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator
    token_ids: Sequence[int]  # prompt + generated so far
    num_prompt_tokens: int
    end_token_ids: frozenset[int]  # masked while fewer than min_tokens were generated

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()  # fresh non-deterministic seed
    return generator


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """logits: [B, V] float32 (modified in place) -> one token per row."""
    raw_logprobs = _raw_logprobs(logits, rows)
    _apply_constraints(logits, rows)
    chosen = torch.argmax(logits, dim=-1)  # [B]; final for greedy rows
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits.index_select(0, index), [rows[i].params for i in random_rows])
        for j, i in enumerate(random_rows):
            chosen[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
    ids = chosen.tolist()
    return [
        SampledToken(token_id, _logprob_of(raw_logprobs, i, token_id, rows[i].params.logprobs))
        for i, token_id in enumerate(ids)
    ]


def _raw_logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> dict[int, torch.Tensor]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return {}
    index = torch.tensor(wanted, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)
    return {i: logprobs[j] for j, i in enumerate(wanted)}


def _logprob_of(
    raw: dict[int, torch.Tensor], row: int, token_id: int, top_n: int | None
) -> TokenLogprob | None:
    if row not in raw or top_n is None:
        return None
    return token_logprob(raw[row], token_id, top_n)


def token_logprob(logprobs: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """logprobs: [V] -> the token's logprob, its rank, and the top_n alternatives."""
    chosen = float(logprobs[token_id])
    rank = int((logprobs > chosen).sum()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        values, ids = torch.topk(logprobs, top_n)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id=token_id, logprob=chosen, rank=rank, top=top)


def _apply_constraints(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if p.min_tokens and row.num_generated < p.min_tokens and row.end_token_ids:
            logits[i, list(row.end_token_ids)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=logits.device))
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            _apply_penalties(logits[i], row)


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    # logits: [V]; conventions as in vLLM / OpenAI.
    p = row.params
    vocab = logits.shape[0]
    device = logits.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=device)
        seen = seen[seen < vocab]
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        generated = torch.tensor(row.token_ids[row.num_prompt_tokens :], dtype=torch.long, device=device)
        if generated.numel():
            counts = torch.bincount(generated, minlength=vocab)[:vocab].to(logits.dtype)
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [R, V] of sampled rows -> probabilities after temperature, top_k, top_p, min_p."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    top_k = [p.top_k for p in params]
    if any(0 < k < logits.shape[1] for k in top_k):
        k_max = max(k for k in top_k if k > 0)
        kth = torch.topk(logits, min(k_max, logits.shape[1]), dim=-1).values  # [R, k_max]
        limit = torch.tensor([(k if k > 0 else k_max) - 1 for k in top_k], device=device)
        threshold = kth.gather(1, limit[:, None])  # [R, 1]
        no_limit = torch.tensor([k <= 0 for k in top_k], device=device)[:, None]
        logits = logits.masked_fill((logits < threshold) & ~no_limit, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_p < 1.0).any()):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        cutoff = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        probs = probs.masked_fill(probs < cutoff, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
