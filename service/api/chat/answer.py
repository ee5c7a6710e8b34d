"""How a chat answer's text becomes what a client reads: its thinking split off (a reasoning
model), then tool calls read from what is left (the answer, never the thinking), whole or as it
streams. Chat completions, Responses and Messages all read answers this way."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.api.chat.protocol import ResponseMessage
from service.api.schemas import CompletionTokensDetails, FinishReason, Usage
from service.api.tools import ToolCall, ToolSpec, ToolStream
from service.text.reasoning import ReasoningSplitter, ReasoningTurn


@dataclass(frozen=True)
class Answer:
    """How an answer is read: `turn` splits the thinking off (None: no reasoning parser, or the
    prompt closed the thinking), `tools` reads calls from the rest (None: no tool in play)."""

    tools: ToolSpec | None
    turn: ReasoningTurn | None
    reasoning: bool  # the model has a reasoning parser: usage counts reasoning_tokens

    def message(self, text: str, finish: FinishReason | None) -> tuple[ResponseMessage, FinishReason | None]:
        """The message of a finished answer, and its finish reason: "tool_calls" when it made
        calls, "length" still where max_tokens cut it (a call it left unfinished is dropped)."""
        reasoning, content = self.turn.split(text) if self.turn is not None else (None, text)
        if self.tools is not None and content:
            cut = finish == "length"
            parsed, calls = self.tools.parse(content, cut=cut)
            if calls or cut:
                calls_out = [c.to_openai() for c in calls] or None
                message = ResponseMessage(content=parsed, reasoning_content=reasoning, tool_calls=calls_out)
                return message, finish if cut or not calls else "tool_calls"
        return ResponseMessage(content=content, reasoning_content=reasoning), finish

    def count_reasoning(self, totals: Usage, token_ids: list[list[int]]) -> None:
        """usage.completion_tokens_details.reasoning_tokens, for a model with a reasoning parser."""
        if self.reasoning:
            counted = sum(self.turn.count_tokens(ids) for ids in token_ids) if self.turn is not None else 0
            totals.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=counted)


@dataclass
class ChoiceStream:
    """One streamed choice: its thinking split off as it arrives, tool calls held back."""

    answer: Answer
    splitter: ReasoningSplitter | None
    tools: ToolStream | None
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0

    @classmethod
    def of(cls, answer: Answer) -> ChoiceStream:
        splitter = answer.turn.splitter() if answer.turn is not None else None
        return cls(answer, splitter, ToolStream(answer.tools) if answer.tools is not None else None)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to send now for the next piece of text."""
        reasoning, content = self.splitter.feed(text) if self.splitter is not None else ("", text)
        return reasoning, content if self.tools is None else self.tools.feed(content)

    def finish(self, cut: bool) -> tuple[str, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) still to send at the end; `cut`: by max_tokens (a call
        left unfinished is dropped)."""
        reasoning, content = self.splitter.finish() if self.splitter is not None else ("", "")
        if self.tools is None:
            return reasoning, content or None, []
        shown = self.tools.feed(content)
        rest, calls = self.tools.finish(cut=cut)
        return reasoning, (shown + (rest or "")) or None, calls
