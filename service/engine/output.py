"""Turn a request's generated token ids into text deltas and decide when it has finished.

Runs inside the engine's step loop, so a request stops generating (and frees its cache) the
moment a stop condition is met, not when a client notices.
"""

from __future__ import annotations

from service.engine.protocol import FinishReason, SamplingParams
from service.text.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringMatcher:
    """Finds the earliest stop string in streamed text, holding back text that may begin one.

    Invariant: the text already emitted contains no stop string, and at most `hold` characters
    (the longest stop string less one) are held back, so an occurrence that ends in new text
    always starts inside `pending + new`.
    """

    def __init__(self, stop: tuple[str, ...], include_in_output: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include_in_output = include_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def feed(self, text: str, check: bool = True) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found).

        With `check` False (before min_tokens) text passes through the hold-back buffer unmatched.
        """
        buffer = self.pending + text
        hits = [(i, len(s)) for i, s in ((buffer.find(s), s) for s in self.stop) if i >= 0] if check else []
        if hits:
            self.pending = ""
            start, length = min(hits)
            return buffer[: start + length if self.include_in_output else start], True
        keep = min(self.hold, len(buffer))
        self.pending = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


class OutputProcessor:
    """Per-request: token ids in, (text delta, finish reason or None) out."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        num_prompt_tokens: int,
        max_model_len: int,
    ) -> None:
        self.params = params
        self.detokenizer: IncrementalDetokenizer = tokenizer.detokenizer(params.skip_special_tokens)
        self.stop_strings = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(tokenizer.eos_token_ids)
        self.stop_token_ids = frozenset(stop_ids)
        self.max_generated = min(params.max_tokens, max_model_len - num_prompt_tokens)
        self.num_generated = 0

    def process(self, token_id: int) -> tuple[str, FinishReason | None]:
        self.num_generated += 1
        if token_id in self.stop_token_ids:
            # The stop token counts as generated but is never part of the text.
            return self._finish("stop")
        check = self.num_generated >= self.params.min_tokens
        text, stopped = self.stop_strings.feed(self.detokenizer.add([token_id]), check)
        if stopped:
            return text, "stop"
        if self.num_generated >= self.max_generated:
            tail, reason = self._finish("length")
            return text + tail, reason
        return text, None

    def finish(self, reason: FinishReason) -> tuple[str, FinishReason]:
        """The engine ended the request for `reason` (a stop or length this side did not see):
        the text held back, and the reason (a stop string in that text makes it "stop")."""
        return self._finish(reason)

    def _finish(self, reason: FinishReason) -> tuple[str, FinishReason]:
        text, stopped = self.stop_strings.feed(self.detokenizer.flush())
        if stopped:
            return text, "stop"
        return text + self.stop_strings.flush(), reason
