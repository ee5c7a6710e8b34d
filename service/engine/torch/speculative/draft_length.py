"""How many drafts a lone request verifies in a step: the count expected to bring the most tokens
per unit of step time, from what a step of 1, 2, ... rows costs here (timed at start-up) and how
often drafts are accepted after a prompt-lookup match of each length (learned while serving).

Why not always the configured count: a step's cost does not grow smoothly with its rows. On a CPU
with an int4 profile, aten's kernel works in blocks of 4 rows, so a lone request's step with 2 rows
costs about 1.07 plain decodes, with 4 rows 1.3 and with 5 to 8 rows 2 (bench/README.md), while
a one-token match's drafts are accepted far less often than a four-token match's. A fixed count
either pays for rows a weak match will not fill or leaves a strong match's run unverified; on a
GPU, where a handful of rows cost what one does, the same rule takes the configured count.

Model: after a match of n tokens each draft is accepted with probability a_n, independently
(geometric), so verifying k drafts yields E(k) = 1 + a_n + ... + a_n^k tokens (the verification's
own token included) from a step costing c(k + 1), where c(1) = 1 is a plain decode. The choice is
the k, from 1 to the drafts available, with the largest E(k) / c(k + 1): the step's expected gain
over a plain decode (below 1 the step is expected to lose; the Speculator's back-off then decides).
a_n = (accepted + 1) / (accepted + rejected + 2), a uniform prior over counts decayed by DECAY at
each verification after a match of that length, so it follows the workload; a verification of k
drafts of which j were accepted counts j accepted and, where j < k, one rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

DECAY = 0.95  # the acceptance estimate reflects about the last 20 verifications at each match length


@dataclass
class DraftLength:
    row_costs: tuple[float, ...]  # a lone request's step with 1, 2, ... rows, relative to one row
    _accepted: dict[int, float] = field(default_factory=dict)  # by match length, decayed
    _rejected: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.row_costs) < 2 or self.row_costs[0] != 1.0:
            raise ValueError(f"row costs start at one row's (1.0) and cover a draft: {self.row_costs}")

    @classmethod
    def from_step_times(cls, seconds: Sequence[float]) -> DraftLength:
        """From a step's time with 1, 2, ... rows: relative to one row's, and never falling as rows
        are added (a timing that does is noise: more rows are never less work)."""
        costs = [1.0]
        for time in seconds[1:]:
            costs.append(max(time / seconds[0], costs[-1]))
        return cls(tuple(costs))

    @property
    def max_drafts(self) -> int:
        return len(self.row_costs) - 1

    def acceptance(self, match: int) -> float:
        accepted, rejected = self._accepted.get(match, 0.0), self._rejected.get(match, 0.0)
        return (accepted + 1.0) / (accepted + rejected + 2.0)

    def choose(self, match: int, available: int) -> tuple[int, float]:
        """(k, gain): how many of the `available` drafts (at least 1) to verify after a match of
        `match` tokens, and E(k) / c(k + 1). The fewest drafts among equal gains."""
        rate = self.acceptance(match)
        best, best_gain = 1, 0.0
        expected = term = 1.0
        for drafts in range(1, min(available, self.max_drafts) + 1):
            term *= rate
            expected += term
            gain = expected / self.row_costs[drafts]
            if gain > best_gain:
                best, best_gain = drafts, gain
        return best, best_gain

    def observe(self, match: int, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts after a match of `match` tokens accepted `accepted`."""
        self._accepted[match] = self._accepted.get(match, 0.0) * DECAY + accepted
        self._rejected[match] = self._rejected.get(match, 0.0) * DECAY + (1.0 if accepted < drafted else 0.0)

    def describe(self) -> str:
        costs = ", ".join(f"{cost:.2f}" for cost in self.row_costs)
        return (
            f"a lone request verifies the number of drafts expected to bring the most tokens per step time, "
            f"from acceptance by match length and a step's cost by rows 1..{len(self.row_costs)} "
            f"({costs}, timed at start)"
        )
