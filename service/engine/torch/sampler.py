"""Pick the next token for each row of a batch, each row with its own sampling parameters.

Order of operations, per row: logprobs are taken from the model's raw distribution; then
min_tokens (end tokens masked until enough were generated), logit_bias, repetition /
frequency / presence penalties; greedy rows take the argmax of that; sampled rows apply
temperature, top_k, top_p and min_p and draw from their own `torch.Generator`, so a seeded
request reproduces whatever else shares its batch.

Equal values rank in ascending token id, argmax's convention, wherever tokens are ranked (the
greedy choice, top_k's k, the top logprobs): bfloat16 logits tie exactly (their step is 0.125
between 16 and 32), and top_k=1 must then still be the greedy answer, and the greedy answer the
first of its top logprobs.

Failure domain: a row's own parameters can fail its sampling (a logit_bias or penalty the
logits reject, a distribution left empty), and its logits can be NaN (an overflow in that
request's computation). Such a row gets a SampledToken with `error` set and its request ends;
the other rows are sampled exactly as they would have been without it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.protocol import SamplingParams, TokenLogprob
from service.util import one_line


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

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits is the answer: nothing adjusts them, no logprobs wanted."""
        p = self.params
        return (
            p.greedy
            and p.logprobs is None
            and not p.logit_bias
            and p.repetition_penalty == 1.0
            and not p.presence_penalty
            and not p.frequency_penalty
            and not (p.min_tokens and self.num_generated < p.min_tokens)
        )


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None
    error: str | None = None  # the row could not be sampled (token_id means nothing then)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed % 2**64)  # any integer seed; torch takes [0, 2**64)
    else:
        generator.seed()  # fresh non-deterministic seed
    return generator


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """logits: [B, V] float32 (modified in place) -> one token per row (or the row's error)."""
    if all(row.plain_greedy for row in rows):  # the common case: one argmax, one copy to the host
        ids = _to_host(*greedy(logits))
        return [SampledToken(t) if t != NAN_ROW else SampledToken(0, error=NOT_A_NUMBER) for t in ids]
    raw_logprobs = _raw_logprobs(logits, rows)
    errors: dict[int, str] = {}
    for i, row in enumerate(rows):
        try:
            _apply_constraints(logits[i], row)
        except (RuntimeError, ValueError, IndexError) as exc:
            errors[i] = f"sampling failed: {one_line(exc)}"
    values, chosen = greedy(logits)  # [B]; final for greedy rows
    for i, row in enumerate(rows):
        if row.params.greedy or i in errors:
            continue
        try:
            probs = filtered_probs(logits[i], row.params)
            if bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0:
                chosen[i] = torch.multinomial(probs, 1, generator=row.generator)[0]
            # else: extreme parameters left no valid distribution; the argmax stands
        except (RuntimeError, ValueError, IndexError) as exc:
            errors[i] = f"sampling failed: {one_line(exc)}"
    tokens = []
    for i, token_id in enumerate(_to_host(values, chosen)):
        if token_id == NAN_ROW:
            tokens.append(SampledToken(0, error=errors.get(i, NOT_A_NUMBER)))
        elif i in errors:
            tokens.append(SampledToken(token_id, error=errors[i]))
        else:
            try:
                logprob = _logprob_of(raw_logprobs, i, token_id, rows[i].params.logprobs)
                tokens.append(SampledToken(token_id, logprob))
            except (RuntimeError, ValueError, IndexError) as exc:
                tokens.append(SampledToken(token_id, error=f"logprobs failed: {one_line(exc)}"))
    return tokens


NOT_A_NUMBER = "the model's output for this request is not a number (NaN); it was ended"


NAN_ROW = -1  # the host id of a row whose largest logit is NaN (no token means anything there)


def _to_host(values: torch.Tensor, chosen: torch.Tensor) -> list[int]:
    """The chosen ids, NAN_ROW where a row's largest logit is NaN (the max propagates NaN), in one
    copy to the host."""
    return torch.where(torch.isnan(values), NAN_ROW, chosen).tolist()


def top_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """[V] -> the ids of the k largest values, largest first, equal values in ascending id order
    (so the first is the argmax). torch.topk alone orders ties arbitrarily, at the k-th too."""
    kth = torch.topk(values, k).values[-1]
    candidates = (values >= kth).nonzero().squeeze(1)  # ascending ids; every tie of the k-th
    order = torch.sort(values[candidates], descending=True, stable=True).indices[:k]
    return candidates[order]


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] -> ([B] largest values, [B] their ids): each row's first largest logit, as argmax
    defines it. A row holding a NaN has a NaN largest value (its id is any valid id).

    On the CPU, a max with indices over the whole row is a scalar loop (0.8 ms for 32 rows of
    49152 on two cores); the vectorised max without indices is 8x faster. So each row is cut into
    blocks: the first block whose max is the row's max holds the first largest logit, and a max
    with indices runs over that block alone (0.17 ms). Elsewhere, or when no block width divides
    the vocabulary, max's indices (the same first maxima as argmax, and faster).
    """
    width = _block_width(logits.shape[-1]) if logits.device.type == "cpu" else 0
    if not width or not logits.is_contiguous():
        found = logits.max(dim=-1)
        return found.values, found.indices
    rows, vocab_size = logits.shape
    blocks = logits.view(rows, vocab_size // width, width)  # [B, N, W]
    block_max = blocks.amax(dim=-1)  # [B, N]
    row_max = block_max.amax(dim=-1, keepdim=True)  # [B, 1]
    # The first block holding the row's max. A NaN row matches no block: block 0, any valid id.
    first = (block_max == row_max).to(torch.uint8).argmax(dim=-1)  # [B]
    chosen = blocks[torch.arange(rows, device=logits.device), first]  # [B, W]
    return row_max.squeeze(1), first * width + chosen.max(dim=-1).indices


@functools.cache
def _block_width(vocab_size: int) -> int:
    """The widest block of at most 1024 logits that cuts a row evenly into two or more, if one of
    at least 64 does; else 0 (the whole-row max)."""
    for width in range(min(1024, vocab_size // 2), 63, -1):
        if vocab_size % width == 0:
            return width
    return 0


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
        ids = top_ids(logprobs, top_n)
        top = tuple(zip(ids.tolist(), logprobs[ids].tolist(), strict=True))
    return TokenLogprob(token_id=token_id, logprob=chosen, rank=rank, top=top)


def _apply_constraints(logits: torch.Tensor, row: SamplingRow) -> None:
    """logits: [V] of one row, adjusted in place by that row's parameters."""
    p = row.params
    if p.min_tokens and row.num_generated < p.min_tokens and row.end_token_ids:
        logits[list(row.end_token_ids)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=logits.device)
        logits.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=logits.device))
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        _apply_penalties(logits, row)


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


# top_p first looks for the nucleus among this many most likely tokens (almost always enough),
# sorting the whole vocabulary only when they hold less than top_p of the mass.
NUCLEUS_CANDIDATES = 256


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] of one row -> probabilities after temperature, top_k, top_p and min_p.

    Rows are processed one at a time on purpose: a [B, V] reduction may be split across threads
    differently for different B, and a seeded request must draw from bitwise the same
    distribution whatever else shares its batch.
    """
    vocab = logits.shape[0]
    if 0 < params.top_k < vocab:
        # Exactly k tokens, chosen before the temperature can round near values together.
        keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        keep[top_ids(logits, params.top_k)] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    logits = logits / params.temperature
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < probs.max() * params.min_p, 0.0)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs / probs.sum()


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    values, ids = torch.topk(probs, min(NUCLEUS_CANDIDATES, probs.shape[0]))
    if float(values.sum()) < top_p:
        values, ids = torch.sort(probs, descending=True, stable=True)
    mass_before = torch.cumsum(values, dim=0) - values
    keep = mass_before < top_p
    keep[0] = True  # the most likely token always stays, however small top_p is
    return torch.zeros_like(probs).index_put_((ids[keep],), values[keep])
