"""Pick the next token for each row of a batch, each row with its own sampling parameters, as
batched tensor operations: no loop over rows on the device, one copy of the chosen ids to the host.

Order of operations, per row: logprobs are taken from the model's raw distribution; then
min_tokens (end tokens masked until enough were generated), logit_bias, repetition /
frequency / presence penalties; greedy rows take the argmax of that; sampled rows apply
temperature, top_k, top_p and min_p and draw by inverting their cumulative distribution at one
uniform number per row.

Randomness: a row's uniform number is a hash (splitmix64) of its request's seed and the number of
tokens it has generated, computed on the host and sent with the step. A seeded request therefore
draws the same token at the same position whatever else shares its batch, after a preemption and
recomputation, and on any device; a request without a seed gets a random 64-bit seed when it
arrives. (The engine used to keep one torch.Generator per request and sample row by row.)

Batch invariance (a seeded or greedy row's token does not depend on its batch): every operation
here works along each row on its own, and the CPU kernels used (softmax, log_softmax, cumsum,
searchsorted, max) compute a row the same way whatever the number of rows (tests/test_engine.py and
tests/test_output_and_sampling.py hold this). Sums over a row's vocabulary are never taken with
`sum`, whose CPU reduction may split a row across threads differently for different batch sizes;
the cumulative sum's last element is the total. On CUDA the same operations are per-row kernels,
but this has not been checked on a GPU.

On CUDA: nothing waits for the device before the one copy of the chosen ids, except where the CPU
path checks a count (ranking ties, a nucleus wider than its candidates), which CUDA avoids by
sorting whole rows. The step's parameter vectors (temperatures, top_k, seeds' uniforms, ...) are
built from Python lists each step and copied to the device from pageable memory; keeping them in
persistent pinned buffers, updated as requests come and go, is still to do.

Equal values rank in ascending token id, argmax's convention, wherever tokens are ranked (the
greedy choice, top_k's k, top_p's order, the top logprobs): bfloat16 logits tie exactly (their step
is 0.125 between 16 and 32), and top_k=1 must then still be the greedy answer, and the greedy
answer the first of its top logprobs.

Failure domain: a row's own parameters can fail its sampling (a logit_bias naming a token outside
the logits), and its logits can be NaN (an overflow in that request's computation). Such a row
gets a SampledToken with `error` set and its request ends; the other rows are sampled exactly as
they would have been without it. Parameters are checked on the host before anything is batched.
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.native import fused_ops
from service.engine.protocol import SamplingParams, TokenLogprob
from service.util import one_line


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int  # the request's (its own, or drawn when it arrived): with the position, its randomness
    token_ids: Sequence[int]  # prompt + generated so far
    num_prompt_tokens: int
    end_token_ids: frozenset[int]  # masked while fewer than min_tokens were generated

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def masks_end(self) -> bool:
        p = self.params
        return bool(p.min_tokens and self.num_generated < p.min_tokens and self.end_token_ids)

    @property
    def penalised(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits is the answer: nothing adjusts them, no logprobs wanted."""
        p = self.params
        return (
            p.greedy and p.logprobs is None and not p.logit_bias and not self.penalised and not self.masks_end
        )


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None
    error: str | None = None  # the row could not be sampled (token_id means nothing then)


def request_seed(params: SamplingParams) -> int:
    """The 64-bit seed of a request's draws: its own (any integer, taken modulo 2**64), else random."""
    return params.seed % 2**64 if params.seed is not None else secrets.randbits(64)


_MASK64 = 2**64 - 1


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) determined by (seed, position): splitmix64 of the pair, 53 bits kept."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


NOT_A_NUMBER = "the model's output for this request is not a number (NaN); it was ended"


NAN_ROW = -1  # the host id of a row whose largest logit is NaN (no token means anything there)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], fused: bool = False) -> list[SampledToken]:
    """logits: [B, V] float32 (modified in place) -> one token per row (or the row's error).
    `fused`: `greedy` through the fused CPU op (the same ids and values; NIM_CPU_FUSED_OPS)."""
    if all(row.plain_greedy for row in rows):  # the common case: one argmax, one copy to the host
        ids = _to_host(*greedy(logits, fused))
        return [SampledToken(t) if t != NAN_ROW else SampledToken(0, error=NOT_A_NUMBER) for t in ids]
    vocab = logits.shape[1]
    errors = {i: why for i, row in enumerate(rows) if (why := _refusal(row.params, vocab)) is not None}
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None and i not in errors]
    raw_logprobs = torch.log_softmax(logits[wanted], dim=-1) if wanted else None  # before any adjustment
    _constrain(logits, rows, [i for i in range(len(rows)) if i not in errors], errors)
    values, chosen = greedy(logits, fused)  # [B]; final for greedy rows
    drawn = [i for i in range(len(rows)) if not rows[i].params.greedy and i not in errors]
    if drawn:
        index = torch.tensor(drawn, device=logits.device)
        drawn_ids = _draw(logits.index_select(0, index), rows, drawn, errors)  # -1: no valid distribution
        chosen[index] = torch.where(drawn_ids >= 0, drawn_ids, chosen[index])  # else the argmax stands
    host_ids = _to_host(values, chosen)
    logprobs = {}
    still = [j for j, i in enumerate(wanted) if i not in errors]  # rows of raw_logprobs still wanted
    if raw_logprobs is not None and still:
        logprobs = _logprobs(raw_logprobs[still], chosen, [wanted[j] for j in still], rows)
    tokens = []
    for i, token_id in enumerate(host_ids):
        if token_id == NAN_ROW:
            tokens.append(SampledToken(0, error=errors.get(i, NOT_A_NUMBER)))
        elif i in errors:
            tokens.append(SampledToken(token_id, error=errors[i]))
        else:
            tokens.append(SampledToken(token_id, logprobs.get(i)))
    return tokens


# What a row's own sampling can raise. A batched operation that raises is redone row by row, so the
# row at fault fails alone and every other row gets what the batch would have given it (each row is
# computed alone in the batch: see the module's word on batch invariance).
_ROW_FAULTS = (RuntimeError, ValueError, IndexError)


def _constrain(
    logits: torch.Tensor, rows: Sequence[SamplingRow], which: list[int], errors: dict[int, str]
) -> None:
    """apply_constraints over the rows `which`; a row whose adjustment fails is restored and failed."""
    touched = [i for i in which if rows[i].masks_end or rows[i].params.logit_bias or rows[i].penalised]
    if not touched:
        return
    saved = logits[touched].clone()
    try:
        apply_constraints(logits, rows, touched)
        return
    except _ROW_FAULTS:
        logits[touched] = saved
    for j, i in enumerate(touched):
        try:
            apply_constraints(logits, rows, [i])
        except _ROW_FAULTS as exc:
            logits[i] = saved[j]
            errors[i] = f"sampling failed: {one_line(exc)}"


def _draw(
    logits: torch.Tensor, rows: Sequence[SamplingRow], drawn: list[int], errors: dict[int, str]
) -> torch.Tensor:
    """draw() for the rows `drawn` (logits: theirs, [D, V]); a row whose draw fails is failed (-1)."""
    try:
        return draw(logits, [rows[i] for i in drawn])
    except _ROW_FAULTS:
        pass
    ids = []
    for j, i in enumerate(drawn):
        try:
            ids.append(draw(logits[j : j + 1], [rows[i]]))
        except _ROW_FAULTS as exc:
            errors[i] = f"sampling failed: {one_line(exc)}"
            ids.append(torch.full((1,), -1, dtype=torch.long, device=logits.device))
    return torch.cat(ids)


def _refusal(params: SamplingParams, vocab: int) -> str | None:
    """Why this row's parameters cannot adjust [V] logits (the API checks them against the tokenizer's
    vocabulary; the model's may differ), else None."""
    for token_id, bias in params.logit_bias.items():
        if not 0 <= token_id < vocab:
            return f"sampling failed: logit_bias token id {token_id} is outside the model's [0, {vocab})"
        if not math.isfinite(bias):
            return f"sampling failed: logit_bias {bias} for token {token_id} is not a finite number"
    return None


def _to_host(values: torch.Tensor, chosen: torch.Tensor) -> list[int]:
    """The chosen ids, NAN_ROW where a row's largest logit is NaN (the max propagates NaN), in one
    copy to the host."""
    return torch.where(torch.isnan(values), NAN_ROW, chosen).tolist()


def greedy(logits: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] -> ([B] largest values, [B] their ids): each row's first largest logit, as argmax
    defines it. A row holding a NaN has a NaN largest value (its id is any valid id).

    `fused` (the engine's NIM_CPU_FUSED_OPS choice), on the CPU: one native op (fused_ops.greedy:
    one SIMD pass keeping each lane's max and where it first saw it), the same values and ids: a
    row of 49152 in 10 us hot and 80 us after a weight stream, where the blocks below take 55 and
    270-340 us (2-core Xeon).

    On the CPU, a max with indices over the whole row is a scalar loop (0.8 ms for 32 rows of
    49152 on two cores); the vectorised max without indices is 8x faster. So each row is cut into
    blocks: the first block whose max is the row's max holds the first largest logit, and a max
    with indices runs over that block alone (0.17 ms). Elsewhere, or when no block width divides
    the vocabulary, max's indices (the same first maxima as argmax, and faster).
    """
    if fused and logits.device.type == "cpu" and logits.dtype == torch.float32:
        return fused_ops.greedy(logits)
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


def ranked(values: torch.Tensor, k: int) -> torch.Tensor:
    """[B, V] -> [B, k]: each row's ids of its k largest values, largest first, equal values in
    ascending id order (so the first is the argmax, and the set is exact at the k-th).

    On CUDA a stable sort of the whole rows. On the CPU (where sorting 49k values per row costs
    ~2 ms) torch.topk, whose order and choice among ties is arbitrary: its k ids are put in order
    by two stable sorts, and a row whose k-th value ties with a value outside the k (so which ties
    belong is arbitrary) is ranked alone.
    """
    vocab = values.shape[-1]
    k = min(k, vocab)
    if values.device.type != "cpu" or k == vocab:
        return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
    top = torch.topk(values, k, dim=-1).indices  # [B, k]
    ids = torch.sort(top, dim=-1).values  # ascending ids ...
    order = torch.sort(values.gather(1, ids), dim=-1, descending=True, stable=True).indices
    ids = ids.gather(1, order)  # ... then by value, ties staying in ascending id
    kth = values.gather(1, ids[:, -1:])  # [B, 1]
    crowded = ((values >= kth).sum(dim=-1) > k).nonzero().squeeze(1).tolist()  # an integer count: exact
    for row in crowded:
        ids[row] = top_ids(values[row], k)
    return ids


def top_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """[V] -> the ids of the k largest values, largest first, equal values in ascending id order
    (so the first is the argmax). torch.topk alone orders ties arbitrarily, at the k-th too."""
    kth = torch.topk(values, k).values[-1]
    candidates = (values >= kth).nonzero().squeeze(1)  # ascending ids; every tie of the k-th
    order = torch.sort(values[candidates], descending=True, stable=True).indices[:k]
    return candidates[order]


def _logprobs(
    raw: torch.Tensor, chosen: torch.Tensor, wanted: list[int], rows: Sequence[SamplingRow]
) -> dict[int, TokenLogprob]:
    """The chosen tokens' logprobs (raw: [W, V] log_softmax of the rows in `wanted`), their ranks and
    the top alternatives each row asked for."""
    ids = chosen.index_select(0, torch.tensor(wanted, device=raw.device))  # [W]
    found = token_logprobs(raw, ids, [rows[i].params.logprobs or 0 for i in wanted])
    return dict(zip(wanted, found, strict=True))


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, top_ns: Sequence[int]
) -> list[TokenLogprob]:
    """logprobs: [N, V] (log_softmax rows), token_ids: [N] on their device -> for each row its
    token's logprob, rank (1 + how many are more likely, counted exactly) and its top_ns[i]
    alternatives, taken for all rows at once with one copy to the host."""
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_n = max(top_ns, default=0)
    top = ranked(logprobs, top_n) if top_n else token_ids.new_zeros((len(top_ns), 0))
    top_lp = logprobs.gather(1, top)
    host = (token_ids.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top.tolist(), top_lp.tolist())
    return [
        TokenLogprob(token_id=t, logprob=lp, rank=rank, top=tuple(zip(ids[:n], lps[:n], strict=True)))
        for (t, lp, rank, ids, lps), n in zip(zip(*host, strict=True), top_ns, strict=True)
    ]


def apply_constraints(logits: torch.Tensor, rows: Sequence[SamplingRow], which: Sequence[int]) -> None:
    """Adjust logits [B, V] in place, for the rows `which`, by min_tokens, logit_bias and penalties,
    each a few scatter operations over all the rows that ask for it (ids checked by `_refusal`)."""
    device = logits.device
    ends = [(i, t) for i in which if rows[i].masks_end for t in rows[i].end_token_ids if t < logits.shape[1]]
    if ends:
        at = torch.tensor(ends, dtype=torch.long, device=device)
        logits[at[:, 0], at[:, 1]] = float("-inf")
    biases = [(i, t, b) for i in which for t, b in rows[i].params.logit_bias.items()]
    if biases:
        at = torch.tensor([(i, t) for i, t, _ in biases], dtype=torch.long, device=device)
        amounts = torch.tensor([b for _, _, b in biases], dtype=logits.dtype, device=device)
        logits.index_put_((at[:, 0], at[:, 1]), amounts, accumulate=True)
    penalised = [i for i in which if rows[i].penalised]
    if penalised:
        _apply_penalties(logits, [rows[i] for i in penalised], penalised)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow], which: list[int]) -> None:
    """Conventions as in vLLM / OpenAI: the repetition penalty divides (multiplies, when negative)
    the logits of every token seen in the prompt or the output; frequency and presence subtract
    in proportion to, and for, each token's occurrences in the output."""
    vocab = logits.shape[1]
    device = logits.device
    index = torch.tensor(which, device=device)
    picked = logits.index_select(0, index)  # [P, V]
    repetition = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = _occurrences(rows, vocab, device, whole=True) > 0
        penalised = torch.where(picked > 0, picked / repetition, picked * repetition)
        picked = torch.where(seen, penalised, picked)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
    if any(r.params.frequency_penalty or r.params.presence_penalty for r in rows):
        counts = _occurrences(rows, vocab, device, whole=False).to(picked.dtype)
        picked = picked - frequency * counts - presence * (counts > 0).to(picked.dtype)
    logits.index_copy_(0, index, picked)


def _occurrences(
    rows: Sequence[SamplingRow], vocab: int, device: torch.device, *, whole: bool
) -> torch.Tensor:
    """[P, V] counts of each token in each row's output (whole: prompt and output), built by one
    scatter from the rows' ids padded with an extra column (ids outside the vocabulary land there)."""
    histories = [r.token_ids if whole else r.token_ids[r.num_prompt_tokens :] for r in rows]
    width = max(1, max(len(h) for h in histories))
    padded = torch.full((len(rows), width), vocab, dtype=torch.long)
    for j, history in enumerate(histories):
        if history:
            padded[j, : len(history)] = torch.as_tensor(history, dtype=torch.long)
    padded = padded.clamp_(0, vocab).to(device)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


# top_p first looks for the nucleus among this many most likely tokens (almost always enough) on
# the CPU, then among eight times as many, until they hold top_p of the mass or the whole vocabulary.
NUCLEUS_CANDIDATES = 256


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [B, V] -> each row's unnormalised probabilities after its temperature, top_k, min_p
    and top_p (zero for the tokens they remove); a row's most likely token always stays.

    As in vLLM: top_k first, then min_p (relative to the most likely token), then top_p over the
    top_k set's distribution (its mass before min_p is the whole)."""
    vocab = logits.shape[1]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    probs = torch.softmax(logits / temperature, dim=-1)  # [B, V]
    unmasked = probs
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        probs = probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, 0.0)
    cut = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if not cut:
        return probs
    index = torch.tensor(cut, device=device)
    pick = functools.partial(torch.index_select, dim=0, index=index)
    kept = _truncated(pick(logits), pick(probs), pick(unmasked), [params[j] for j in cut])
    return probs.index_copy(0, index, kept)


def _truncated(
    logits: torch.Tensor, probs: torch.Tensor, unmasked: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """[C, V] -> probs with only each row's top_k most likely tokens (ranked by logit, before the
    temperature can round near values together) and, of those, the smallest set whose mass reaches
    top_p of the top_k set's (`unmasked`: the probabilities before min_p)."""
    vocab = logits.shape[1]
    device = logits.device
    limits = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    nucleus = any(p.top_p < 1.0 and limit == vocab for p, limit in zip(params, limits, strict=True))
    widths = [limit for limit in limits if limit < vocab] + ([NUCLEUS_CANDIDATES] if nucleus else [])
    # On CUDA the ranking sorts whole rows anyway, and a second try would need the host's word.
    width = min(vocab, max(widths)) if device.type == "cpu" else vocab
    k = torch.tensor(limits, device=device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    while True:
        ids = ranked(logits, width)  # [C, W]
        candidates = probs.gather(1, ids)
        within_k = torch.arange(ids.shape[1], device=device)[None, :] < k
        # The top_k set's whole mass (a cumulative sum's element, not a `sum`: see the module's
        # word on batch invariance); 1 for a row without top_k.
        set_mass = torch.cumsum(unmasked.gather(1, ids) * within_k, dim=-1)[:, -1:]
        set_mass = torch.where(k < vocab, set_mass, 1.0)
        mass_before = torch.cumsum(candidates, dim=-1) - candidates
        keep = within_k & ((mass_before < top_p * set_mass) | (top_p >= 1.0))
        keep[:, 0] = True  # the most likely token always stays, however small top_p is
        # A row whose nucleus may reach past the candidates (its last one is still kept, and
        # top_k does not end it there) is ranked again over eight times as many (a full sort of
        # [256, 49152] costs more than 256 sorts of a row, and a nucleus is rarely that wide).
        if width == vocab or not bool((keep[:, -1] & (k[:, 0] > width)).any()):
            break
        width = min(vocab, width * 8)
    return torch.zeros_like(probs).scatter_(1, ids, candidates * keep)


def draw(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[B, V] adjusted logits of sampled rows -> [B] drawn ids: each row's cumulative distribution
    inverted at its uniform number. -1 where a row's parameters left no valid distribution (its
    filtered mass is zero or not finite)."""
    probs = filtered_probs(logits, [row.params for row in rows])
    cdf = torch.cumsum(probs, dim=-1)  # [B, V]; the last column is each row's total
    total = cdf[:, -1:].contiguous()
    u = torch.tensor([uniform(row.seed, row.num_generated) for row in rows], dtype=cdf.dtype)
    # The first token whose cumulative mass exceeds u * total: never a zero-probability one. Where
    # rounding puts u * total at the total itself, the token where the mass reaches the total.
    ids = torch.searchsorted(cdf, u.to(cdf.device)[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total)
    ids = torch.where(ids < cdf.shape[1], ids, last)[:, 0]
    valid = torch.isfinite(total[:, 0]) & (total[:, 0] > 0)
    return torch.where(valid, ids, -1)
