"""Which requests speculate this step, with what drafts, and what acceptance they had.

Back-off: a verification in which no draft was accepted cost a step wider than a plain decode
(k + 1 rows through every layer instead of one) and gave one token, as a plain decode would
have. So after each such verification the request skips proposing for a while: one step after the
first, then twice as many after each further one in a row (up to
MAX_BACKOFF_STEPS), and any accepted draft resets it. A workload with nothing to accept therefore
spends about one step in MAX_BACKOFF_STEPS verifying, while one that repeats its input speculates
on every step. (A proposal the lookup cannot make costs no step at all: the request decodes.)

Draft counts: a request decoding alone (the case speculation is for: one stream faster than its
weights can be read) verifies the number of prompt-lookup drafts that `lengths` (draft_length.py,
timed by the core at start-up) expects to bring the most tokens per unit of step time; where that
gain is at least 1 it speculates through a back-off, since the step is expected to win. Beside
other requests it verifies every draft the lookup found, up to num_speculative_tokens.

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
from service.engine.torch.speculative.draft_length import DraftLength
from service.engine.torch.speculative.ngram import lookup

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
    # Prompt lookup's draft counts for a lone request (None: the configured count); the core sets it.
    lengths: DraftLength | None = None
    # Start-up only (the core's timing of steps by rows): every decoding request verifies this many
    # drafts, its last token repeated, whatever the lookup would find.
    calibrating: int | None = None
    _backoff: dict[str, _Backoff] = field(default_factory=dict)
    _matches: dict[str, int] = field(default_factory=dict)  # this step's lookup match length, by request
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
        self._matches = {}
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return
        if self.calibrating is not None:
            for request in running:
                count = min(self.calibrating, self._budget(request))
                request.draft_token_ids = [request.token_ids[-1]] * max(count, 0)
            return
        lone = self.lengths is not None and len(running) == 1
        wanted: list[tuple[Request, int]] = []
        for request in running:
            request.draft_token_ids = []
            budget = self._budget(request)
            if budget < 1:
                continue
            state = self._backoff.setdefault(request.request_id, _Backoff())
            backing_off = state.skip > 0
            if backing_off:
                state.skip -= 1
            if lone:
                self._propose_alone(request, budget, backing_off)
            elif not backing_off:
                wanted.append((request, budget))
        if not wanted:
            return
        if self.draft is None:
            for request, budget in wanted:
                tokens, match = self._lookup(request, budget)
                request.draft_token_ids = tokens
                if tokens:
                    self._matches[request.request_id] = match
            return
        for (request, _), proposal in zip(wanted, self.draft.propose(wanted), strict=True):
            request.draft_token_ids = proposal.token_ids
            if proposal.probs is not None:
                self.draft_probs[request.request_id] = proposal.probs

    def _propose_alone(self, request: Request, budget: int, backing_off: bool) -> None:
        """A lone request's prompt-lookup drafts, as many as `lengths` chooses; while it backs off,
        only where the step is expected to win."""
        assert self.lengths is not None
        tokens, match = self._lookup(request, budget)
        if not tokens:
            return
        count, gain = self.lengths.choose(match, len(tokens))
        if backing_off and gain < 1.0:
            return
        request.draft_token_ids = tokens[:count]
        self._matches[request.request_id] = match

    def _lookup(self, request: Request, budget: int) -> tuple[list[int], int]:
        config = self.config
        return lookup(request.token_ids, budget, config.prompt_lookup_min, config.prompt_lookup_max)

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
        match = self._matches.pop(request_id, None)
        if match is not None and self.lengths is not None:
            self.lengths.observe(match, num_drafts, num_accepted)
        state = self._backoff.setdefault(request_id, _Backoff())
        if num_accepted:
            state.skip, state.penalty = 0, 1
        else:
            state.skip = state.penalty
            state.penalty = min(2 * state.penalty, MAX_BACKOFF_STEPS)

    def ended(self, request_id: str) -> None:
        self._backoff.pop(request_id, None)
        self._matches.pop(request_id, None)
        self.draft_probs.pop(request_id, None)
        if self.draft is not None:
            self.draft.ended(request_id)
