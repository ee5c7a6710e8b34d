"""Text <-> token ids for the service: loading, chat templates and streaming detokenization.

Tokenization itself is done by the Rust `tokenizers` library. This module only assembles a
`tokenizers.Tokenizer` from what a model ships with:

- a GGUF file, whose metadata holds llama.cpp's description of the vocabulary (`from_gguf`), or
- a Hugging Face model directory with a `tokenizer.json` (`from_directory`).

Nothing here runs code that comes with a model: `tokenizer.json` is data for the Rust library,
`auto_map`/`trust_remote_code` entries are ignored, and chat templates run in Jinja's immutable
sandbox.

GGUF pre-tokenizers follow llama.cpp's table for `tokenizer.ggml.pre` (which mirrors the
`tokenizer.json` of the original model). Transformers' own GGUF loader knows fewer of them: for
`smollm` (and the other StarCoder-style vocabularies) it falls back to plain GPT-2 splitting and so
loses the "every digit is its own piece" rule. The two differ only where whitespace precedes a
digit: `"x  1"` is `x, ĠĠ, 1` here and in llama.cpp and the original SmolLM2 tokenizer, and
`x, Ġ, Ġ, 1` in transformers' GGUF loader. Likewise Llama 3 vocabularies get `ignore_merges`
(llama.cpp and their tokenizer.json) and Qwen2 ones NFC normalization (their tokenizer.json;
llama.cpp skips it), which transformers' GGUF loader leaves out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

logger = logging.getLogger(__name__)

NO_CHAT_TEMPLATE = "model has no chat template; use /v1/completions or set a chat template"


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, or refused to render these messages."""


# ---------------------------------------------------------------------------------------------
# GGUF vocabularies
# ---------------------------------------------------------------------------------------------

# llama.cpp's `llama_token_type` values in `tokenizer.ggml.token_type`.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How a byte-level vocabulary splits text before BPE (one row of llama.cpp's table)."""

    split: str | None = None  # regex applied before the byte mapping; None: GPT-2's built-in regex
    digits: bool = False  # every digit is its own piece (StarCoder-style vocabularies)
    nfc: bool = False  # the original tokenizer.json NFC-normalizes (Qwen2)
    ignore_merges: bool = False  # a piece that is a whole vocabulary entry is taken as is (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no `add_bos_token`


_LLAMA3 = _PreTokenizer(split=_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_STARCODER = _PreTokenizer(digits=True)
_QWEN2 = _PreTokenizer(split=_QWEN2_SPLIT, nfc=True)

_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"], _LLAMA3
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _PreTokenizer(split=_LLAMA3_SPLIT)),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"], _STARCODER
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], _QWEN2),
    **dict.fromkeys(["gpt-2", "gpt2", "mpt", "olmo", "jais", "default"], _PreTokenizer()),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


def _parse_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if sep:
            pairs.append((left, right))
    return pairs


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a SentencePiece vocabulary, best-scoring result first.

    Same order as transformers' `generate_merges`, so both build identical tokenizers.
    """
    merges: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[AddedToken]:
    """Control/unknown tokens become special tokens, user-defined ones plain added tokens.

    Either way they are matched whole in the input text, as llama.cpp does.
    """
    added = []
    for token, kind in zip(tokens, types, strict=True):
        if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED):
            added.append(AddedToken(token, special=kind != _USER_DEFINED, normalized=False))
    return added


def _byte_level_backend(meta: dict[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text like GPT-2", pre_name)
        pre = _PreTokenizer()
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (_UNKNOWN, _CONTROL, _USER_DEFINED) and not set(token) <= spelled:
            # Written as raw text in the file: respell in the byte alphabet the merges use.
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab[token] = index
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError("byte-level BPE vocabulary without tokenizer.ggml.merges")
    merges = _parse_merges(meta["tokenizer.ggml.merges"])
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.split is None)
    steps: list[Any] = []
    if pre.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.split is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split), behavior="isolated"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level]) if steps else byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """llama.cpp's "llama" vocabularies: SentencePiece BPE with byte fallback, as transformers rebuilds it."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = _parse_merges(meta["tokenizer.ggml.merges"])
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = tokenizers.Tokenizer(
        models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _bos_eos_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing | None:
    if bos is None and eos is None:
        return None
    head = [bos[0]] if bos else []
    tail = [eos[0]] if eos else []
    single = [*head, "$A", *tail]
    pair = [*single, *[f"{t}:1" for t in head], "$B:1", *[f"{t}:1" for t in tail]]
    specials = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(specials))
    )


def _read_gguf_tokenizer_metadata(path: Path) -> dict[str, Any]:
    import gguf  # only GGUF models need it

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # bad magic, truncated file, ...: whatever the reader trips on
        raise ValueError(f"{path}: not a readable GGUF file ({_one_line(exc)})") from exc
    return {key: f.contents() for key, f in reader.fields.items() if key.startswith("tokenizer.")}


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` HTML-escapes; templates are written against transformers' version, which does not.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
            )


_ENV: ImmutableSandboxedEnvironment | None = None


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (less its `{% generation %}` tag)."""
    global _ENV
    if _ENV is None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["dict"] = _TemplateDict()
        env.globals["namespace"] = _TemplateNamespace
        _ENV = env
    return _ENV


def _reads_content(node: nodes.Node, aliases: set[str]) -> bool:
    for sub in [node, *node.find_all((nodes.Getitem, nodes.Getattr, nodes.Name))]:
        if isinstance(sub, nodes.Getitem) and isinstance(sub.arg, nodes.Const) and sub.arg.value == "content":
            return True
        if isinstance(sub, nodes.Getattr) and sub.attr == "content":
            return True
        if isinstance(sub, nodes.Name) and sub.name in aliases:
            return True
    return False


def _iterates_content(ast: nodes.Template) -> bool:
    """Whether the template loops over a message's content, i.e. expects a list of content parts.

    Same idea as vLLM's content-format detection: `{% for part in message['content'] %}` (or over
    a variable set from it) means the template wants OpenAI-style parts; otherwise it wants a string.
    """
    aliases: set[str] = set()
    for assign in ast.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _reads_content(assign.node, set()):
            aliases.add(assign.target.name)
    return any(_reads_content(loop.iter, aliases) for loop in ast.find_all(nodes.For))


@dataclass(frozen=True)
class _CompiledTemplate:
    template: jinja2.Template | None
    error: str | None  # why it does not compile
    wants_parts: bool  # pass list content through instead of joining its text


def _compile(source: str) -> _CompiledTemplate:
    env = _jinja_env()
    try:
        ast = env.parse(source)
        return _CompiledTemplate(env.from_string(ast), None, _iterates_content(ast))
    except TemplateSyntaxError as exc:
        return _CompiledTemplate(None, f"chat template is invalid: {exc.message} (line {exc.lineno})", False)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _plain(value: Any) -> Any:
    """A copy made only of JSON-like builtins, so a template never sees methods of caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _content_text(parts: Sequence[Any], index: int) -> list[str]:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ChatTemplateError(
                f"messages[{index}].content[{j}]: only text content parts are supported, got {kind!r}"
            )
        texts.append(part["text"])
    return texts


def _prepare_messages(messages: Any, wants_parts: bool) -> list[dict[str, Any]]:
    """The conversation as transformers hands it to a template, with content parts resolved.

    Like transformers: keys whose value is None are dropped, everything is copied to plain builtins,
    and reasoning is also offered as `reasoning_content` and `thinking`. A content given as a list
    of parts may only hold text parts; it stays a list for templates that loop over parts (what
    transformers always passes) and becomes the parts' texts concatenated with no separator for
    templates that expect a string (transformers would fail on those).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role', 'content'} objects")
    prepared = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            texts = _content_text(content, i)
            if not wants_parts:
                message["content"] = "".join(texts)
        message = _plain(message)
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


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
        raise ValueError(f"{path}: not valid JSON ({_one_line(exc)})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


_TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(eq=False)
class Tokenizer:
    """A model's tokenizer: encode/decode, its special ids, and its chat template(s).

    `templates` maps a name to Jinja source; "default" is the chat template and "tool_use", when a
    model has one, is used instead when tools are passed (transformers' rule). `template_tokens`
    are the special-token strings templates see (`bos_token`, `eos_token`, ...).
    """

    backend: tokenizers.Tokenizer = field(repr=False)
    vocab_size: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    templates: dict[str, str] = field(default_factory=dict, repr=False)
    template_tokens: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        added = self.backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self._compiled = {name: _compile(source) for name, source in self.templates.items()}

    # -- loading ---------------------------------------------------------------------------

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
            if model == "gpt2":
                backend = _byte_level_backend(meta, tokens, types)
                default_bos = _PRE_TOKENIZERS.get(meta.get("tokenizer.ggml.pre", ""), _PreTokenizer()).add_bos
            else:
                backend = _sentencepiece_backend(meta, tokens)
                default_bos = True
        except Exception as exc:  # e.g. a merge naming a token that is not in the vocabulary
            raise ValueError(f"{path}: cannot build the tokenizer ({_one_line(exc)})") from exc
        backend.add_tokens(_added_tokens(tokens, types))

        def token_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return value if isinstance(value, int) and 0 <= value < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _bos_eos_processor(
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
    def from_directory(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face model directory's fast tokenizer (`tokenizer.json`) and chat template.

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
            raise ValueError(f"{tokenizer_file}: cannot be loaded ({_one_line(exc)})") from exc
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
            generation = _read_json(path / "config.json")
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
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; invalid UTF-8 (a model may emit any byte sequence) becomes U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

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
            self._compiled["default"] = _compile(source)
        else:
            self.templates.pop("default", None)
            self._compiled.pop("default", None)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render a conversation to prompt text exactly as transformers' `apply_chat_template` would.

        `extra` becomes template variables (`tools`, `documents`, `enable_thinking`, ...) and may
        override the special-token strings. Raises ChatTemplateError, with a one-line reason, when
        there is no template, it does not compile, the messages are malformed, or the template
        refuses them (`raise_exception`) or fails while rendering -- including sandbox violations.
        """
        name = "tool_use" if extra.get("tools") is not None and "tool_use" in self._compiled else "default"
        compiled = self._compiled.get(name)
        if compiled is None:
            raise ChatTemplateError(NO_CHAT_TEMPLATE)
        if compiled.template is None:
            raise ChatTemplateError(compiled.error)
        conversation = _prepare_messages(messages, compiled.wants_parts)
        variables: dict[str, Any] = {
            "tools": None,
            "documents": None,
            **self.template_tokens,
            **_plain(extra),
        }
        try:
            return compiled.template.render(
                messages=conversation, add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError:
            raise
        except SecurityError as exc:
            raise ChatTemplateError(f"chat template attempted an unsafe operation: {_one_line(exc)}") from exc
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {_one_line(exc)}") from exc
        except Exception as exc:  # a template can trip any Python error (TypeError on str + list, ...)
            raise ChatTemplateError(
                f"chat template failed to render: {type(exc).__name__}: {_one_line(exc)}"
            ) from exc


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
