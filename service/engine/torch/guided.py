"""Structured output for the torch engine through xgrammar: grammars compiled off the step
thread, and a per-row token bitmask applied to the logits of a mixed batch before sampling.

A request's GuidedDecoding is compiled once when the API checks the request (on a worker thread;
compiled grammars are cached by their spec, so a schema that many requests share compiles once).
The runner keeps one GrammarMatcher per constrained request for as long as it lives (preemption
keeps it: recomputed tokens are not sampled again). Each step, before sampling, the constrained
rows' allowed tokens are written into one bitmask and applied in place (disallowed logits become
-inf); after sampling each matcher accepts its row's token. The end-of-sequence tokens are
allowed exactly when the grammar is complete, so a constrained answer ends with one (unless
max_tokens cuts it short, which OpenAI reports as finish_reason "length").

Token text for xgrammar is each token's raw bytes (Tokenizer.token_bytes); special tokens other
than the end-of-sequence ones are given no text, so a grammar never lets them through.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from service.engine.protocol import GuidedDecoding
from service.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept (by spec)


class GrammarError(ValueError):
    """A schema, regex, grammar or choice list that does not compile; the message says why."""


class GuidedUnavailableError(RuntimeError):
    """xgrammar is not installed: structured output cannot be served."""


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


# response_format json_object: any object (arbitrary properties and values), never an array or scalar.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarCompiler:
    """Compiles GuidedDecoding specs for one tokenizer and vocabulary; thread-safe, cached."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        try:
            import xgrammar
        except ImportError as exc:
            raise GuidedUnavailableError(
                "structured output needs xgrammar, which is not installed "
                "(pip install 'nim-torch[structured]')"
            ) from exc
        self._xgr = xgrammar
        encoded = [
            b"" if tokenizer.is_special(i) and i not in tokenizer.eos_token_ids else tokenizer.token_bytes(i)
            for i in range(tokenizer.vocab_size)
        ]
        info = xgrammar.TokenizerInfo(
            encoded,
            xgrammar.VocabType.RAW,
            vocab_size=vocab_size,
            stop_token_ids=list(tokenizer.eos_token_ids),
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self._cache: OrderedDict[GuidedDecoding, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, guided: GuidedDecoding) -> Any:
        """The compiled grammar for `guided` (cached); GrammarError when it does not compile."""
        with self._lock:
            found = self._cache.get(guided)
            if found is not None:
                self._cache.move_to_end(guided)
                return found
        compiled = self._compile(guided)
        with self._lock:
            self._cache[guided] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, guided: GuidedDecoding) -> Any:
        compiler = self._compiler
        try:
            if guided.kind == "json_schema" and (guided.prefix or guided.suffix):
                grammar = self._xgr.Grammar
                parts = [grammar.from_json_schema(guided.spec, any_whitespace=False)]
                if guided.prefix:
                    parts.insert(0, grammar.from_ebnf(f"root ::= {json.dumps(guided.prefix)}"))
                if guided.suffix:
                    parts.append(grammar.from_ebnf(f"root ::= {json.dumps(guided.suffix)}"))
                return compiler.compile_grammar(grammar.concat(*parts))
            if guided.kind == "json_schema":
                return compiler.compile_json_schema(guided.spec, any_whitespace=False)
            if guided.kind == "json_object":  # OpenAI's JSON mode: an object, not any JSON value
                return compiler.compile_json_schema(JSON_OBJECT_SCHEMA)
            if guided.kind == "regex":
                return compiler.compile_regex(guided.spec)
            if guided.kind == "choice":
                choices = json.loads(guided.spec)
                alternatives = "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
                return compiler.compile_grammar(alternatives)
            return compiler.compile_grammar(guided.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {_NAMES[guided.kind]}: {_first_line(exc)}") from exc

    def matcher(self, guided: GuidedDecoding) -> GuidedRow:
        return GuidedRow(self._xgr.GrammarMatcher(self.compile(guided)))

    def bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
        """Disallowed tokens of rows `indices` of logits [R, V] become -inf, in place."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)


class GuidedRow:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar refuses it (the request must end)."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_terminated())


_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}


def _first_line(exc: BaseException) -> str:
    """The library's message without its log prefix ("[12:00:00] /path/file.cc:83: ")."""
    text = str(exc).strip() or type(exc).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])[:300]


_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
