"""Reasoning models: a generated answer split into its thinking (`<think>...</think>`) and the answer.

Two formats, by vLLM's parser names (NIM_REASONING_PARSER):

- `deepseek_r1` (DeepSeek-R1 and its distills; also Qwen3.5-style templates): the chat template
  opens `<think>` in the prompt, so the output is thinking until `</think>` and the answer after it.
  A leading `<think>` the model writes anyway is dropped. Without `</think>` (cut by max_tokens)
  everything is thinking.
- `qwen3` (Qwen3, QwQ): the model opens the block itself. An output that begins with `<think>`
  (after whitespace) is thinking until `</think>`, the answer after it; one cut before `</think>`
  is thinking throughout (as vLLM's current Qwen3 parser reads it: the thinking was truncated).
  An output that does not begin with `<think>` is all answer: thinking is off
  (`chat_template_kwargs: {"enable_thinking": false}`) or the model chose not to think.

The prompt decides first: a rendered prompt whose text ends (whitespace aside) with `<think>` opens the
thinking, so the output starts in it, whatever the format; one ending with `</think>` (Qwen3's
template with `enable_thinking: false` renders `<think>\\n\\n</think>\\n\\n`) has closed it, so the
output is all answer and nothing is split.

Without NIM_REASONING_PARSER the format is recognised from the model's chat template (`recognise`):
a template whose generation prompt (rendered for one user message) ends by opening `<think>` is
`deepseek_r1`; else one that writes `<think>` and reads `enable_thinking` is `qwen3`; else none (the
answer is left whole, as before). Either way `</think>` must be a token the text keeps: one that
decoding drops (a special token) could never be found, and is refused.

Splitting works on text: the whole answer (`ReasoningTurn.split`), or the detokenised deltas as they
stream (`ReasoningSplitter`), which holds back only what may still become a marker (a partial
`<think>` at the start, a partial `</think>` in the thinking), so both give the same two texts. The
thinking's token count (usage.completion_tokens_details.reasoning_tokens) is counted on token ids,
the markers excluded.

Structured output and tool calls apply to the answer: `ReasoningTurn.start_after` are the token ids
of `</think>`, after which an engine's grammar begins to constrain (no turn when the prompt closed the
thinking: the grammar applies from the first token). A constrained answer whose prompt left it open
whether the model thinks is read as qwen3 reads one, whatever the parser: the thinking, if any,
opens with `<think>` as the answer's first token (`ReasoningTurn.opening`; only where `<think>` is
one token); an answer that does not begin so is the answer, constrained from its first token. So a
model that never thinks still gets its constraint (a deepseek_r1 turn would wait for a `</think>`
that never comes).

`enable_thinking: false` works wherever a parser is active (`closed`): the prompt ends with the
thinking closed, by the chat template where it reads `enable_thinking`, else (or where it renders
no closed block) by the server, which ends the prompt with the empty block Qwen3's template writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from service.text.chat_template import ChatTemplateError
from service.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ParserName = Literal["deepseek_r1", "qwen3"]
PARSERS: tuple[ParserName, ...] = ("deepseek_r1", "qwen3")
THINK_START = "<think>"
THINK_END = "</think>"
_PROBE = [{"role": "user", "content": "Hello"}]  # a conversation to render the generation prompt with


class ReasoningConfigError(ValueError):
    """NIM_REASONING_PARSER names a format this model's tokenizer cannot carry (one line)."""


@dataclass(frozen=True)
class ReasoningParser:
    """The served model's reasoning format, with its markers' token ids."""

    name: ParserName
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    decode: Callable[[Sequence[int]], str]  # token ids -> text, as the answer is decoded

    def for_prompt(self, prompt_text: str, constrained: bool = False) -> ReasoningTurn | None:
        """How the answer to a prompt is split; None when the prompt closed the thinking already
        (the whole answer is content, and a grammar applies from the first token). `constrained`:
        the answer has a grammar, so where the prompt did not open the thinking, only an answer
        that begins with `<think>` thinks (see the module docstring)."""
        state = prompt_state(prompt_text)
        if state == "closed":
            return None
        opens = state == "open" or (self.name == "deepseek_r1" and not constrained)
        return ReasoningTurn(self, opens_thinking=opens)


def closed(prompt_text: str) -> str:
    """The prompt with its thinking closed, as Qwen3's template closes it for `enable_thinking:
    false`: unchanged where it ends closed already, an open block closed, else an empty block added
    after the generation prompt."""
    state = prompt_state(prompt_text)
    if state == "closed":
        return prompt_text
    if state == "open":
        return prompt_text[: len(prompt_text.rstrip())] + "\n\n" + THINK_END + "\n\n"
    return prompt_text + THINK_START + "\n\n" + THINK_END + "\n\n"


def prompt_state(prompt_text: str) -> Literal["open", "closed", "none"]:
    """Whether a rendered prompt ends inside a thinking block ("open"), just after one ("closed"),
    or neither: only its end counts (earlier turns may hold whole blocks)."""
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_START):
        return "open"
    if tail.endswith(THINK_END):
        return "closed"
    return "none"


@dataclass(frozen=True)
class ReasoningTurn:
    """One answer's split: `opens_thinking` says whether an answer that does not begin with
    `<think>` is thinking (deepseek_r1, or a prompt that opened the block) or answer (qwen3)."""

    parser: ReasoningParser
    opens_thinking: bool

    @property
    def start_after(self) -> tuple[int, ...]:
        """The token ids after which structured output begins (the end of the thinking); empty
        where it begins with the answer's first token (the answer cannot open a thinking block)."""
        return self.parser.end_ids if self.opens_thinking or self.opening else ()

    @property
    def opening(self) -> tuple[int, ...]:
        """The token id that opens the thinking as the answer's first token, where the answer may
        think or not; empty where it begins in the thinking, and where `<think>` is several tokens
        (a tokenizer made for thinking has it as one; a first token such as `<` would not say that
        the model thinks, and committing to the thinking on it would drop the constraint)."""
        if self.opens_thinking or len(self.parser.start_ids) != 1:
            return ()
        return self.parser.start_ids

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for a part that is empty."""
        splitter = self.splitter()
        reasoning, content = splitter.feed(text)
        more_reasoning, more_content = splitter.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.opens_thinking)

    def count_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of the generated `token_ids` are thinking (between the markers, exclusive)."""
        ids = list(token_ids)
        start = _find(ids, self.parser.start_ids)
        end = _find(ids, self.parser.end_ids)
        opened = start >= 0 and (end < 0 or start < end) and not self.parser.decode(ids[:start]).strip()
        if opened:
            first = start + len(self.parser.start_ids)
            end = _find(ids, self.parser.end_ids, first)
        elif self.opens_thinking:
            first = 0
        else:
            return 0
        return (end if end >= 0 else len(ids)) - first


def _find(ids: list[int], marker: tuple[int, ...], start: int = 0) -> int:
    """Where `marker` first occurs in `ids` at or after `start`; -1 when it does not."""
    if not marker:
        return -1
    size = len(marker)
    for i in range(start, len(ids) - size + 1):
        if ids[i] == marker[0] and tuple(ids[i : i + size]) == marker:
            return i
    return -1


class ReasoningSplitter:
    """A streamed answer split into (reasoning, content) deltas as its text arrives.

    States: "start" (nothing but whitespace or a partial `<think>` seen yet: held), "thinking"
    (a tail that may begin `</think>` is held), "answer" (everything passes)."""

    def __init__(self, opens_thinking: bool) -> None:
        self.opens_thinking = opens_thinking
        self.state: Literal["start", "thinking", "answer"] = "start"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can go out now, given the next piece of the answer."""
        buffer = self.held + text
        self.held = ""
        reasoning = content = ""
        if self.state == "start":
            stripped = buffer.lstrip()
            if stripped.startswith(THINK_START):
                self.state, buffer = "thinking", stripped[len(THINK_START) :]
            elif THINK_START.startswith(stripped):  # empty, whitespace, or a partial marker: wait
                self.held = buffer
                return "", ""
            else:
                self.state = "thinking" if self.opens_thinking else "answer"
        if self.state == "thinking":
            at = buffer.find(THINK_END)
            if at < 0:
                keep = _marker_overlap(buffer, THINK_END)
                self.held = buffer[len(buffer) - keep :]
                return buffer[: len(buffer) - keep], ""
            reasoning, buffer = buffer[:at], buffer[at + len(THINK_END) :]
            self.state = "answer"
        content = buffer
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held at the end of the answer."""
        held, self.held = self.held, ""
        if self.state == "thinking" or (self.state == "start" and self.opens_thinking):
            return held, ""
        return "", held


def _marker_overlap(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (shorter than all of it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


# --- Which parser ---------------------------------------------------------------------------------


def resolve(configured: ParserName | None, tokenizer: Tokenizer) -> tuple[ReasoningParser | None, str]:
    """The served model's parser and why (one line, for the log): NIM_REASONING_PARSER as set, else
    the format its chat template shows (`recognise`), else None. ReasoningConfigError when the
    setting names a format whose `</think>` decoding would drop."""
    name, why = (configured, "NIM_REASONING_PARSER") if configured else recognise(tokenizer)
    if name is None:
        return None, why
    start_ids = tuple(tokenizer.encode(THINK_START, add_special_tokens=False))
    end_ids = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
    dropped = [marker for marker, ids in ((THINK_START, start_ids), (THINK_END, end_ids))
               if any(tokenizer.is_special(i) for i in ids)]  # fmt: skip
    if dropped:
        message = (
            f"reasoning parser {name} ({why}): {dropped[0]} is a special token of this tokenizer, which "
            "decoding drops, so the thinking could never be told from the answer"
        )
        if configured:
            raise ReasoningConfigError(f"NIM_REASONING_PARSER={configured}: {message}")
        return None, f"not used: {message}"
    parser = ReasoningParser(name, start_ids, end_ids, lambda ids: tokenizer.decode(ids, False))
    return parser, why


def recognise(tokenizer: Tokenizer) -> tuple[ParserName | None, str]:
    """The reasoning format the model's chat template shows, and how it was told (see the module
    docstring); (None, why not) when it shows none."""
    template = tokenizer.chat_template_for()
    if template is None or THINK_START not in template.source:
        return None, f"the chat template does not write {THINK_START}"
    try:
        prompt = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True)
    except ChatTemplateError as exc:
        return None, f"the chat template does not render a conversation ({exc})"
    if prompt_state(prompt) == "open":
        return "deepseek_r1", f"recognised: the chat template opens {THINK_START} in the generation prompt"
    if template.reads("enable_thinking"):
        return "qwen3", f"recognised: the chat template writes {THINK_START} and reads enable_thinking"
    return None, f"the chat template writes {THINK_START} but neither opens it nor reads enable_thinking"
