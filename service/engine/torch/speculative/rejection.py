"""Verifying draft tokens against the target model's distributions: rejection sampling.

Given logits at the K + 1 positions of a speculating sequence (its last token, then its K drafts)
and the drafts d_1..d_K, one verification returns the accepted drafts and one token more, so that
the tokens come from the target's distribution exactly as if each had been sampled in a step of its
own (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):

- draft d_j (proposed with probability q_j(d_j)) is accepted with probability
  min(1, p_j(d_j) / q_j(d_j)), where p_j is the target's distribution at that position after the
  request's own sampling parameters (temperature, top_k, top_p, min_p, penalties, bias);
- at the first rejection, the token is drawn from norm(max(0, p_j - q_j)) and verification stops;
- when every draft is accepted, a bonus token is drawn from p_{K+1}.

A draft model sampling a sampled row's drafts hands over its q_j ([K, V], normalised). Prompt
lookup and a draft model's greedy tokens are deterministic given the tokens, so there q_j is a point
mass at d_j (no q is passed): accept with probability p_j(d_j), and on rejection draw from p_j
without d_j, renormalised. A greedy row's p_j is a point mass at its argmax, so the rule reduces to
"accept while the draft is the argmax, then take the argmax": greedy output is the same token for
token as without speculation.

Randomness: as in the sampler, every number is a hash of the request's seed and the position of the
token it decides (service.engine.torch.sampler.uniform), one stream for acceptance tests and one for
the draws after a rejection, so a seeded request draws the same tokens whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.torch.sampler import (
    NOT_A_NUMBER,
    SampledToken,
    SamplingRow,
    apply_constraints,
    filtered_probs,
    sample,
    uniform,
)
from service.util import one_line

ACCEPT_STREAM = 0x5BD1E995  # xor'd into the seed: the acceptance tests' numbers
RESIDUAL_STREAM = 0x27D4EB2F  # xor'd into the seed: the draws after a rejection


@dataclass(frozen=True)
class Verdict:
    """The drafts accepted (a prefix of them, in order) and the token that follows them: the
    target's own at the first rejected position, or a bonus after the last draft. `token.error`
    set: the row could not be sampled (its request fails)."""

    accepted: list[int]
    token: SampledToken


def verify(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None = None,
) -> Verdict:
    """logits: [K + 1, V] float32 (modified in place); rows[j] samples position j (its token_ids end
    with drafts[:j]); drafts: [K]; draft_probs: [K, V] the proposer's q (None: point masses at the
    drafts) -> the Verdict."""
    assert logits.shape[0] == len(rows) == len(drafts) + 1
    if rows[0].params.greedy:
        return _verify_greedy(logits, rows, drafts)
    return _verify_sampled(logits, rows, drafts, draft_probs)


def _verify_greedy(logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[int]) -> Verdict:
    """Accept while the draft is the token a greedy step would take there (the sampler's own)."""
    targets = sample(logits, rows)
    accepted: list[int] = []
    for draft, target in zip(drafts, targets, strict=False):
        if target.error is not None or target.token_id != draft:
            return Verdict(accepted, target)
        accepted.append(draft)
    return Verdict(accepted, targets[len(drafts)])


def _verify_sampled(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
) -> Verdict:
    """Rejection sampling (see the module's docstring)."""
    try:
        apply_constraints(logits, rows, range(len(rows)))
        probs = filtered_probs(logits, [row.params for row in rows])  # [K + 1, V] unnormalised
    except (RuntimeError, ValueError, IndexError) as exc:
        return Verdict([], SampledToken(0, error=f"sampling failed: {one_line(exc)}"))
    totals = torch.cumsum(probs, dim=-1)[:, -1]  # a cumulative sum's last element (batch invariance)
    index = torch.tensor(list(drafts), dtype=torch.long, device=probs.device)
    draft_mass = probs[: len(drafts)].gather(1, index[:, None])[:, 0]
    q, draft_q = None, []
    if draft_probs is not None:
        q = draft_probs[: len(drafts)].to(device=probs.device, dtype=probs.dtype)  # [K, V]
        draft_q = q.gather(1, index[:, None])[:, 0].tolist()
    host_totals, host_mass = totals.tolist(), draft_mass.tolist()
    accepted: list[int] = []
    for j, draft in enumerate(drafts):
        total = host_totals[j]
        if not (total > 0 and total < float("inf")):
            return Verdict(accepted, SampledToken(0, error=NOT_A_NUMBER))
        row = rows[j]
        ratio = host_mass[j] / total  # p_j(d_j): a point mass's q is 1
        if q is not None:
            ratio = ratio / draft_q[j] if draft_q[j] > 0 else 1.0  # q never drew what it gives 0
        if uniform(row.seed ^ ACCEPT_STREAM, row.num_generated) < ratio:
            accepted.append(draft)
            continue
        if q is None:
            residual = probs[j].clone()
            residual[draft] = 0.0
        else:
            residual = torch.clamp(probs[j] / total - q[j], min=0.0)  # max(0, p - q)
            if not float(residual.sum()) > 0:  # p == q up to rounding: a rejection is p's draw
                residual = probs[j]
        return Verdict(
            accepted,
            SampledToken(invert_cdf(residual, uniform(row.seed ^ RESIDUAL_STREAM, row.num_generated))),
        )
    last = rows[-1]
    if not (host_totals[-1] > 0 and host_totals[-1] < float("inf")):
        return Verdict(accepted, SampledToken(0, error=NOT_A_NUMBER))
    return Verdict(accepted, SampledToken(invert_cdf(probs[-1], uniform(last.seed, last.num_generated))))


def invert_cdf(probs: torch.Tensor, u: float) -> int:
    """[V] unnormalised probabilities -> the token where their cumulative mass first exceeds u of
    the total (never a zero-probability token)."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[-1:]
    at = int(torch.searchsorted(cdf, total * u, right=True).item())
    if at >= cdf.shape[0]:
        at = int(torch.searchsorted(cdf, total).item())
    return at
