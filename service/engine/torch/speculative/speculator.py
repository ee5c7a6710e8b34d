"""Which requests speculate this step, with what drafts, and what acceptance they had.

Back-off: a verification in which no draft was accepted cost a step wider than a plain decode
(k + 1 rows through every layer instead of one) and gave one token, as a plain decode would
have. So after each such verification the request skips proposing for a while: one step after the
first, then twice as many after each further one in a row (up to
MAX_BACKOFF_STEPS), and any accepted draft resets it. A workload with nothing to accept therefore
spends about one step in MAX_BACKOFF_STEPS verifying, while one that repeats its input speculates
on every step. (A proposal the lookup cannot make costs no step at all: the request decodes.)

Counters are vLLM's: drafts (verifications), draft tokens, accepted tokens, and accepted tokens by
position in the proposal (bench/README.md and the metrics table name them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from service.engine.speculative_config import SpeculativeConfig
from service.engine.torch.request import Request
from service.engine.torch.speculative.draft import DraftModel
from service.engine.torch.speculative.ngram import propose_ngram

MAX_BACKOFF_STEPS = 64


@dataclass
class _Backoff:
    skip: int = 0  # steps left without proposing
    penalty: int = 1  # steps to skip after the next verification that accepts nothing


@dataclass(frozen=True)
class SpecCounts:
    """Cumulative counts since start (vLLM's spec_decode series)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()


@dataclass
class Speculator:
    config: SpeculativeConfig
    max_model_len: int
    draft: DraftModel | None = None  # None: prompt lookup (the "ngram" method)
    # This step's proposals' distributions, by request (sampled rows of a draft model; absent:
    # point masses at the drafts). Verification reads them (ModelRunner.execute).
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    _backoff: dict[str, _Backoff] = field(default_factory=dict)
    _drafts: int = 0
    _draft_tokens: int = 0
    _accepted: int = 0
    _per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._per_position = [0] * self.config.num_speculative_tokens

    @property
    def counts(self) -> SpecCounts:
        return SpecCounts(self._drafts, self._draft_tokens, self._accepted, tuple(self._per_position))

    def reset_counts(self) -> None:
        """Forget the counts (after the warm-up)."""
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_position = [0] * self.config.num_speculative_tokens

    def propose(self, running: Sequence[Request]) -> None:
        """Set the draft tokens of the decoding requests that speculate this step."""
        self.draft_probs = {}
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return
        wanted: list[tuple[Request, int]] = []
        for request in running:
            request.draft_token_ids = []
            budget = self._budget(request)
            if budget < 1:
                continue
            state = self._backoff.setdefault(request.request_id, _Backoff())
            if state.skip:
                state.skip -= 1
                continue
            wanted.append((request, budget))
        if not wanted:
            return
        if self.draft is None:
            config = self.config
            for request, budget in wanted:
                request.draft_token_ids = propose_ngram(
                    request.token_ids, budget, config.prompt_lookup_min, config.prompt_lookup_max
                )
            return
        for (request, _), proposal in zip(wanted, self.draft.propose(wanted), strict=True):
            request.draft_token_ids = proposal.token_ids
            if proposal.probs is not None:
                self.draft_probs[request.request_id] = proposal.probs

    def _budget(self, request: Request) -> int:
        """How many drafts `request` may verify now: 0 unless it is decoding, unconstrained and
        without logprobs; at most what its max_tokens and the context leave after one more token."""
        sampling = request.sampling
        if request.num_uncomputed != 1 or sampling.guided is not None or sampling.logprobs is not None:
            return 0
        left = min(sampling.max_tokens - request.num_generated, self.max_model_len - request.num_tokens)
        return min(self.config.num_speculative_tokens, left - 1)

    def verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts accepted the first `num_accepted`."""
        self._drafts += 1
        self._draft_tokens += num_drafts
        self._accepted += num_accepted
        for position in range(num_accepted):
            self._per_position[position] += 1
        state = self._backoff.setdefault(request_id, _Backoff())
        if num_accepted:
            state.skip, state.penalty = 0, 1
        else:
            state.skip = state.penalty
            state.penalty = min(2 * state.penalty, MAX_BACKOFF_STEPS)

    def ended(self, request_id: str) -> None:
        self._backoff.pop(request_id, None)
        self.draft_probs.pop(request_id, None)
        if self.draft is not None:
            self.draft.ended(request_id)
