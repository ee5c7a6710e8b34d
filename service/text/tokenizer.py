"""Text <-> token ids for the service: loading, chat templates and streaming detokenization.

Tokenization itself is done by the Rust `tokenizers` library. This module only assembles a
`tokenizers.Tokenizer` from what a model ships with:

- a GGUF file, whose metadata holds llama.cpp's description of the vocabulary (`from_gguf`; the
  vocabulary itself is rebuilt by `service.text.gguf_vocab`), or
- a Hugging Face model directory with a `tokenizer.json` (`from_directory`).

Chat templates are rendered by `service.text.chat_template`, as transformers renders them.

Nothing here runs code that comes with a model: `tokenizer.json` is data for the Rust library,
`auto_map`/`trust_remote_code` entries are ignored, and chat templates run in Jinja's immutable
sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import tokenizers

from service.model.config import ModelFormat
from service.model.gguf_file import gguf_reader, gguf_strings
from service.text.chat_template import NO_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError, TemplateCache
from service.text.gguf_vocab import (
    added_tokens,
    bos_eos_processor,
    build_backend,
    byte_alphabet,
    default_add_bos,
)
from service.util import one_line

__all__ = ["NO_CHAT_TEMPLATE", "ChatTemplateError", "IncrementalDetokenizer", "InvalidTextError", "Tokenizer"]


class InvalidTextError(ValueError):
    """Text that cannot be tokenized (e.g. lone surrogates from a JSON \\ud800 escape)."""


# ---------------------------------------------------------------------------------------------
# Reading model files
# ---------------------------------------------------------------------------------------------


def _read_gguf_tokenizer_metadata(path: Path) -> dict[str, Any]:
    try:
        reader = gguf_reader(path)
        strings = [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
        return {
            key: gguf_strings(reader, key) if field.types[:2] == strings else field.contents()
            for key, field in reader.fields.items()
            if key.startswith("tokenizer.")
        }
    except Exception as exc:  # bad magic, truncated file, bad UTF-8...: whatever the reader trips on
        raise ValueError(f"{path}: not a readable GGUF file ({one_line(exc)})") from exc


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken-like dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not valid JSON ({one_line(exc)})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _directory_templates(path: Path, config: dict[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    legacy = _read_json(path / "chat_template.json").get("chat_template")
    value = legacy if legacy is not None else config.get("chat_template")
    if isinstance(value, str) and value:
        return {"default": value}
    if isinstance(value, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        return {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, Mapping)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
        }
    return {}


_TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Tokenizer:
    """A model's tokenizer: encode/decode, its special ids, and its chat template(s).

    `templates` maps a name to Jinja source; "default" is the chat template and "tool_use", when a
    model has one, is used instead when tools are passed (transformers' rule). `template_tokens`
    are the special-token strings templates see (`bos_token`, `eos_token`, ...). A template a
    request brings is compiled once per distinct source and kept in a small cache
    (service.text.chat_template.TemplateCache).
    """

    backend: tokenizers.Tokenizer = field(repr=False)
    vocab_size: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    templates: dict[str, str] = field(default_factory=dict, repr=False)
    template_tokens: dict[str, str] = field(default_factory=dict)
    max_token_chars: int = field(init=False, default=1)  # no token stands for more characters of text

    def __post_init__(self) -> None:
        added = self.backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self.max_token_chars = _max_token_chars(self.backend)
        self._chat_templates = {name: ChatTemplate(source) for name, source in self.templates.items()}
        self._request_templates = TemplateCache()
        byte_level = "ByteLevel" in repr(self.backend.decoder)
        self._byte_decoder = {ch: b for b, ch in byte_alphabet().items()} if byte_level else None

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def from_model_files(
        cls, path: Path, model_format: ModelFormat, hf_config: Mapping[str, Any] | None = None
    ) -> Tokenizer:
        """The tokenizer in a model's files: a GGUF file's own vocabulary, else the directory's (every
        engine reads it here, and so does the API process beside an engine process)."""
        if model_format == "gguf":
            return cls.from_gguf(path)
        return cls.from_directory(path, hf_config)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (byte-level BPE or SentencePiece vocabularies)."""
        path = Path(path)
        meta = _read_gguf_tokenizer_metadata(path)
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise ValueError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)")
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        for key in ("token_type", "scores"):
            values = meta.get(f"tokenizer.ggml.{key}")
            if values is not None and len(values) != len(tokens):
                raise ValueError(
                    f"{path}: tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens"
                )
        if model not in ("gpt2", "llama"):
            raise ValueError(f"{path}: unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")
        try:
            backend = build_backend(model, meta, tokens, types)
            default_bos = default_add_bos(model, meta)
        except Exception as exc:  # e.g. a merge naming a token that is not in the vocabulary
            raise ValueError(f"{path}: cannot build the tokenizer ({one_line(exc)})") from exc
        backend.add_tokens(added_tokens(tokens, types))

        def token_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return value if isinstance(value, int) and 0 <= value < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = bos_eos_processor(
            (tokens[bos], bos) if add_bos and bos is not None else None,
            (tokens[eos], eos) if add_eos and eos is not None else None,
        )
        # Generation ends at EOS, and at end-of-turn / end-of-message when the file names them.
        stops = [i for i in (eos, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
        # The special-token strings templates see: the four transformers' GGUF loader sets.
        named = {
            "bos_token": bos,
            "eos_token": eos,
            "unk_token": token_id("unknown_token_id"),
            "pad_token": token_id("padding_token_id"),
        }
        # llama.cpp writes a model's named templates (e.g. "tool_use") as tokenizer.chat_template.<name>.
        templates = {
            key.removeprefix("tokenizer.chat_template."): value
            for key, value in meta.items()
            if key.startswith("tokenizer.chat_template.") and isinstance(value, str) and value
        }
        default = meta.get("tokenizer.chat_template")
        if isinstance(default, str) and default:
            templates["default"] = default
        return cls(
            backend=backend,
            vocab_size=len(tokens),
            bos_token_id=bos,
            eos_token_ids=tuple(dict.fromkeys(stops)),
            pad_token_id=named["pad_token"],
            templates=templates,
            template_tokens={name: tokens[i] for name, i in named.items() if i is not None},
        )

    @classmethod
    def from_directory(cls, path: str | Path, hf_config: Mapping[str, Any] | None = None) -> Tokenizer:
        """Load a Hugging Face model directory's fast tokenizer (`tokenizer.json`) and chat template.

        `hf_config`: the directory's config.json as already parsed (a checkpoint's inspection,
        service.store.checkpoint), whose eos_token_id counts when there is no generation_config.json;
        read from the directory when not given.

        `tokenizer.json` decides whether BOS/EOS are added (as transformers does when it exists);
        `clean_up_tokenization_spaces` is ignored, so decoding is an exact inverse of the vocabulary.
        Template precedence: `chat_template.jinja` (plus `additional_chat_templates/*.jinja`),
        then `chat_template.json`, then `tokenizer_config.json`'s `chat_template`.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ValueError(f"{tokenizer_file}: cannot be loaded ({one_line(exc)})") from exc
        config = _read_json(path / "tokenizer_config.json")

        template_tokens = {}
        for name in _TEMPLATE_TOKEN_NAMES:
            content = _token_content(config.get(name))
            if content is not None:
                template_tokens[name] = content

        def token_id(name: str) -> int | None:
            content = template_tokens.get(name)
            return backend.token_to_id(content) if content is not None else None

        generation = _read_json(path / "generation_config.json")
        if not generation:  # transformers derives the generation config from config.json then
            generation = dict(hf_config) if hf_config is not None else _read_json(path / "config.json")
        eos = token_id("eos_token")
        stops = [*([eos] if eos is not None else []), *_id_list(generation.get("eos_token_id"))]
        vocab = backend.get_vocab(with_added_tokens=True)
        return cls(
            backend=backend,
            vocab_size=max(vocab.values(), default=-1) + 1,
            bos_token_id=token_id("bos_token"),
            eos_token_ids=tuple(dict.fromkeys(stops)),
            pad_token_id=token_id("pad_token"),
            templates=_directory_templates(path, config),
            template_tokens=template_tokens,
        )

    # -- text <-> ids ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text are matched as such.

        With add_special_tokens, BOS/EOS are added as the model's tokenizer says to (SmolLM2: none).
        Rendered chat templates already contain them: encode those with add_special_tokens=False.
        Safe to call from several threads at once.
        """
        try:
            # encode_batch releases the GIL while it works (encode holds it: megabytes of text on a
            # worker thread would stall the event loop for seconds); same ids, same cost.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:  # the Rust side rejects strings UTF-8 cannot hold (lone surrogates)
            raise InvalidTextError(
                "text is not valid Unicode (it contains a lone UTF-16 surrogate)"
            ) from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; invalid UTF-8 (a model may emit any byte sequence) becomes U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (what OpenAI's logprobs `bytes` field reports)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            return piece.encode()
        if self._byte_decoder is not None and all(ch in self._byte_decoder for ch in piece):
            return bytes(self._byte_decoder[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def is_special(self, token_id: int) -> bool:
        """Whether the id is a special (control) token, i.e. one that skip_special_tokens drops."""
        return token_id in self._special_ids

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one generated sequence."""
        return IncrementalDetokenizer(self, skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self.templates.get("default")

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        """Replace the default chat template (e.g. from service configuration); None removes it."""
        if source:
            self.templates["default"] = source
            self._chat_templates["default"] = ChatTemplate(source)
        else:
            self.templates.pop("default", None)
            self._chat_templates.pop("default", None)

    def replace_templates(self, templates: Mapping[str, str]) -> None:
        """Serve these chat templates (name -> Jinja source) instead of the model's own."""
        self.templates = dict(templates)
        self._chat_templates = {name: ChatTemplate(source) for name, source in self.templates.items()}

    def chat_template_for(self, tools: bool = False, source: str | None = None) -> ChatTemplate | None:
        """The template a conversation is rendered with: `source` when given (a request's own
        template: compiled once and cached; ChatTemplateError, one line, when it is over
        MAX_TEMPLATE_BYTES or does not compile), else "tool_use", when tools are passed and the
        model has one, else "default" (None: the model has no chat template)."""
        if source is not None:
            return self._request_templates.get(source)
        name = "tool_use" if tools and "tool_use" in self._chat_templates else "default"
        return self._chat_templates.get(name)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render a conversation to prompt text exactly as transformers' `apply_chat_template` would.

        `chat_template`: a request's own template source, used instead of the model's (see
        `chat_template_for`). `extra` becomes template variables (`tools`, `documents`,
        `enable_thinking`, ...) and may override the special-token strings. Raises
        ChatTemplateError, with a one-line reason, when there is no template, it does not compile
        or is too large, the messages are malformed, the template refuses them (`raise_exception`),
        fails while rendering -- sandbox violations included -- or passes the render limits
        (service.text.chat_template's RENDER_CPU_SECONDS and MAX_RENDERED_CHARS).
        """
        template = self.chat_template_for(tools=extra.get("tools") is not None, source=chat_template)
        if template is None:
            raise ChatTemplateError(NO_CHAT_TEMPLATE)
        return template.render(messages, add_generation_prompt, self.template_tokens, **extra)


def _max_token_chars(backend: tokenizers.Tokenizer) -> int:
    """An upper bound on the characters of text one token stands for, so that a text of n characters
    is at least n / bound tokens (what lets a prompt be refused as too long before it is tokenized).

    A vocabulary entry is written one character per byte (byte-level BPE) or per character
    (SentencePiece, added tokens), and a character is at least one byte, so the longest entry bounds
    the text a token covers. A normalizer runs before the vocabulary is matched and may shorten the
    text: Unicode composition joins up to 4 code points into one (Greek U+1FAF), hence the factor.
    """
    longest = max((len(piece) for piece in backend.get_vocab(with_added_tokens=True)), default=1)
    return max(1, longest) * (4 if backend.normalizer is not None else 1)


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------

_REPLACEMENT = "\ufffd"
# Tokens held back waiting for a character to complete before a partial emit is attempted. A
# UTF-8 character is at most 4 bytes, so in valid text far fewer are ever pending.
_MAX_PENDING = 16


@dataclass(eq=False)
class IncrementalDetokenizer:
    """Turns one sequence's token ids into text as they arrive (vLLM/TGI's prefix/read offsets).

    `ids[prefix:read]` were already emitted and are decoded again only as context (so that leading
    spaces and merges at the boundary come out as in a full decode); `ids[read:]` are pending. New
    text is emitted once the window decodes to more than its context and does not end in U+FFFD,
    i.e. no character is cut in half. Emitted ids before `prefix` are dropped, so the work per token
    is bounded by the window, not the sequence. Concatenating every returned piece and `flush()`
    gives `tokenizer.decode(all_ids, skip_special_tokens)`.
    """

    tokenizer: Tokenizer = field(repr=False)
    skip_special_tokens: bool = True
    _ids: list[int] = field(default_factory=list, init=False)
    _prefix: int = field(default=0, init=False)
    _read: int = field(default=0, init=False)
    _pieces: list[str] = field(default_factory=list, init=False, repr=False)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new ids; returns only the new, complete text (possibly "")."""
        skip = self.skip_special_tokens
        # Skipped special tokens contribute nothing to a decode, so they need not enter the window.
        self._ids.extend(i for i in token_ids if not (skip and self.tokenizer.is_special(i)))
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, len(self._ids))
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            return self._emit(new_text[len(prefix_text) :], len(self._ids))
        if len(self._ids) - self._read > _MAX_PENDING:
            return self._emit_settled(prefix_text, new_text)
        return ""

    def flush(self) -> str:
        """End of sequence: whatever is still pending, including U+FFFD for incomplete bytes."""
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, len(self._ids))
        return self._emit(new_text[len(prefix_text) :], len(self._ids))

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], self.skip_special_tokens) if end > start else ""

    def _emit(self, piece: str, read: int) -> str:
        """Record `piece` as emitted up to token `read`; the old pending tokens become the context."""
        self._prefix, self._read = self._read, read
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        if piece:
            self._pieces.append(piece)
        return piece

    def _emit_settled(self, prefix_text: str, new_text: str) -> str:
        """Too many pending tokens: emit the part no later token can change, to keep the window bounded.

        Only reached when tokens keep ending in an incomplete or invalid character (a model emitting
        invalid UTF-8) or decode to nothing. Later bytes can only change the last few characters (an
        incomplete character is at most 3 bytes, each at most 3 U+FFFD), so a cut at a token whose
        decode is a prefix of the window's decode, short of those, is final.
        """
        if not new_text.endswith(_REPLACEMENT):
            return self._emit(new_text[len(prefix_text) :], len(self._ids))
        for cut in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(self._prefix, cut)
            if len(prefix_text) <= len(head) <= len(new_text) - 3 and new_text.startswith(head):
                return self._emit(head[len(prefix_text) :], cut)
        return ""
