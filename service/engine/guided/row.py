"""One constrained request's place in its grammar, step by step: the token bitmask it fills and the
tokens it accepts, with a reasoning model's free thinking before its constrained answer."""

from __future__ import annotations

from collections import deque
from typing import Any, Literal

import torch

RowState = Literal["deciding", "opening", "thinking", "constrained"]


class GuidedRow:
    """One request's position in its grammar.

    Without `start_after` the grammar constrains from the first token. With it (a reasoning model's
    `</think>` ids, GuidedDecoding.start_after) the answer may think first, freely:

    - "deciding" (only with `opens_with`, the `<think>` ids, when the prompt left it open whether
      the model thinks): the first token is one the grammar allows or the first of `opens_with`.
      The latter, where the grammar would not take it, opens the thinking; any other token is the
      grammar's, which constrains from it on (a model that does not think gets its constraint).
    - "opening": the rest of `opens_with` is forced, one token a step.
    - "thinking": every token is allowed and the matcher neither masks nor advances, until
      `start_after` has been generated, in a row.
    - "constrained": the grammar's mask, and its matcher advances.
    """

    def __init__(
        self, matcher: Any, start_after: tuple[int, ...] = (), opens_with: tuple[int, ...] = ()
    ) -> None:
        self.matcher = matcher
        self.start_after = start_after
        self.opens_with = opens_with
        self.state: RowState = "constrained" if not start_after else "deciding" if opens_with else "thinking"
        self._opened = 0  # tokens of opens_with generated ("opening")
        self._grammar_takes_opening = False  # "deciding": whether the grammar allows opens_with[0]
        self._recent: deque[int] = deque(maxlen=max(len(start_after), 1))  # the last tokens, thinking

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        if self.state == "thinking":
            bitmask[index].fill_(-1)  # every bit set: every token allowed
        elif self.state == "opening":
            only(bitmask, index, self.opens_with[self._opened])
        else:
            self.matcher.fill_next_token_bitmask(bitmask, index)
            if self.state == "deciding":
                first = self.opens_with[0]
                self._grammar_takes_opening = allows(bitmask, index, first)
                allow(bitmask, index, first)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar refuses it (the request must end)."""
        if self.state == "deciding":
            if token_id != self.opens_with[0] or self._grammar_takes_opening:
                self.state = "constrained"
                return bool(self.matcher.accept_token(token_id))
            self.state, self._opened = "opening", 0
        if self.state == "opening":
            if token_id != self.opens_with[self._opened]:
                return False
            self._opened += 1
            if self._opened == len(self.opens_with):
                self.state = "thinking"
            return True
        if self.state == "thinking":
            self._recent.append(token_id)
            if tuple(self._recent) == self.start_after:
                self.state = "constrained"
            return True
        return bool(self.matcher.accept_token(token_id))

    @property
    def finished(self) -> bool:
        return self.state == "constrained" and bool(self.matcher.is_terminated())


def allows(bitmask: torch.Tensor, index: int, token_id: int) -> bool:
    """Whether row `index` of a token bitmask (int32 words, bit t % 32 of word t // 32) allows it."""
    return bool((int(bitmask[index, token_id >> 5]) >> (token_id & 31)) & 1)


def allow(bitmask: torch.Tensor, index: int, token_id: int) -> None:
    word = int(bitmask[index, token_id >> 5]) | (1 << (token_id & 31))
    bitmask[index, token_id >> 5] = word - (1 << 32) if word >= 1 << 31 else word  # as int32


def only(bitmask: torch.Tensor, index: int, token_id: int) -> None:
    bitmask[index].zero_()
    allow(bitmask, index, token_id)
