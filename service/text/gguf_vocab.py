"""GGUF vocabularies as `tokenizers` backends, following llama.cpp's reading of the metadata.

A GGUF file describes its tokenizer in `tokenizer.ggml.*` metadata: the model kind (`gpt2`:
byte-level BPE, `llama`: SentencePiece BPE with byte fallback), the tokens and their types, merges
or scores, and the name of a pre-tokenizer. `build_backend` turns that into a `tokenizers.Tokenizer`
that splits text exactly as llama.cpp (and the model's original `tokenizer.json`) does.

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

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["added_tokens", "bos_eos_processor", "build_backend", "byte_alphabet", "default_add_bos"]

logger = logging.getLogger(__name__)

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


def byte_alphabet() -> dict[int, str]:
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


def added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[AddedToken]:
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
    alphabet = byte_alphabet()
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


def bos_eos_processor(
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


def build_backend(
    model: str, meta: dict[str, Any], tokens: list[str], types: list[int]
) -> tokenizers.Tokenizer:
    """The BPE model, normalizer, pre-tokenizer and decoder for a `gpt2` or `llama` GGUF vocabulary.

    Added tokens and the BOS/EOS post-processor are left to the caller (`added_tokens`,
    `bos_eos_processor`). Raises (any exception type) when the metadata is inconsistent.
    """
    if model == "gpt2":
        return _byte_level_backend(meta, tokens, types)
    if model == "llama":
        return _sentencepiece_backend(meta, tokens)
    raise ValueError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")


def default_add_bos(model: str, meta: dict[str, Any]) -> bool:
    """Whether llama.cpp adds BOS when the file has no `tokenizer.ggml.add_bos_token`."""
    if model == "gpt2":
        return _PRE_TOKENIZERS.get(meta.get("tokenizer.ggml.pre", ""), _PreTokenizer()).add_bos
    return True
