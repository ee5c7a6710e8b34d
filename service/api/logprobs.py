"""Engine logprobs -> OpenAI's two logprobs shapes (chat's `content` list, completions' columns)."""

from __future__ import annotations

from collections.abc import Sequence

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
