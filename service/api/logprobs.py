"""Engine logprobs -> OpenAI's two logprobs shapes (chat's `content` list, completions' columns),
and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from service.api.schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from service.engine.protocol import TokenLogprob
from service.text.tokenizer import Tokenizer


def _token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    content = []
    for entry in entries:
        text, raw = _token_text(tokenizer, entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            alt_text, alt_raw = _token_text(tokenizer, token_id)
            top.append(TopLogprob(token=alt_text, logprob=logprob, bytes=alt_raw))
        content.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    offset: int = 0,
) -> CompletionLogprobs:
    """Columns for `token_ids`; an entry of None (the first prompt token) has no logprob."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        text, _ = _token_text(tokenizer, token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry.logprob)
        top = {_token_text(tokenizer, t)[0]: lp for t, lp in entry.top}
        out.top_logprobs.append(top)
    return out


def prompt_logprobs(
    tokenizer: Tokenizer, prompt: Sequence[int], entries: Sequence[TokenLogprob | None] | None, num: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first (nothing predicts it), else a
    dict keyed by token id (as JSON keys are, a string) of {logprob, rank, decoded_token}: the prompt's
    own token, then the `num` most likely (rank 1 first), each once."""
    found = list(entries) if entries is not None else [None] * len(prompt)
    out: list[dict[str, Any] | None] = []
    for token_id, entry in zip(prompt, found, strict=True):
        if entry is None:
            out.append(None)
            continue
        position = {str(token_id): _prompt_entry(tokenizer, token_id, entry.logprob, entry.rank)}
        for rank, (alternative, logprob) in enumerate(entry.top[:num], start=1):
            position.setdefault(str(alternative), _prompt_entry(tokenizer, alternative, logprob, rank))
        out.append(position)
    return out


def _prompt_entry(tokenizer: Tokenizer, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": _token_text(tokenizer, token_id)[0]}


def with_top(entries: Sequence[TokenLogprob | None], num: int) -> list[TokenLogprob | None]:
    """`entries` with at most `num` alternatives each (prompt logprobs computed for a larger ask)."""
    return [e if e is None or len(e.top) <= num else replace(e, top=e.top[:num]) for e in entries]
