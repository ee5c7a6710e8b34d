"""Prompt-lookup proposals (vLLM's "ngram" method): no second model.

For a request whose tokens end with an n-gram that occurred earlier in its own tokens (prompt or
output), the tokens that followed that earlier occurrence are proposed to follow again: rewriting,
extracting from or editing a given text repeats long runs of it. The longest suffix from
`prompt_lookup_max` down to `prompt_lookup_min` tokens that has an earlier occurrence wins, and of
its occurrences the most recent one.

The search runs over the tokens as one bytes object (4 bytes a token) with `bytes.rfind`, in C: a
few microseconds for thousands of tokens, so a step that finds nothing costs next to nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("i").itemsize


def propose_ngram(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` tokens to follow `token_ids`, by prompt lookup; [] when no suffix of
    min_n..max_n tokens occurred before."""
    return lookup(token_ids, num_tokens, min_n, max_n)[0]


def lookup(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """propose_ngram's tokens and the length of the suffix that matched (0: none): a longer match
    predicts the text more reliably (speculative.draft_length keeps acceptance by it)."""
    length = len(token_ids)
    if num_tokens < 1 or length <= min_n:
        return [], 0
    haystack = array("i", token_ids).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        needle = haystack[(length - n) * _WIDTH :]
        end = (length - 1) * _WIDTH  # an occurrence must end before the suffix's last token
        while True:
            at = haystack.rfind(needle, 0, end)
            if at < 0:
                break
            if at % _WIDTH == 0:  # aligned on a token
                start = at // _WIDTH + n
                return list(token_ids[start : start + num_tokens]), n
            end = at + len(needle) - 1
    return [], 0
