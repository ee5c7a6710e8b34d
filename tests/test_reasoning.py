"""Reasoning models: thinking split from the answer (`reasoning_content`), whole and streamed; the
answer alone is what tool calls and structured output apply to.

The parsers are tested on text, whole and fed in every chunking. The server is tested on a real
model that thinks: a tiny Llama checkpoint built here whose greedy answer is fixed. Every
attention and MLP output projection is zero, so the residual stream is the current token's
embedding (one-hot: the hidden size is the vocabulary's); lm_head maps token t to its successor
(logit 8 after the final norm) and, for a few tokens, to a second choice (logit 4) that a grammar
falls back on when it masks the first. A word-level tokenizer holds `<think>`, `</think>`,
`<tool_call>`, `</tool_call>` as added tokens and `<|im_end|>` as the end of sequence; decoding
fuses the tokens' text. So the generation prompt `<|assistant|>` is answered
`<think>Let me think</think>Hello there<|im_end|>`, and `<|tool_turn|>` with a hermes tool call.
Its chat template is Qwen3-like (it writes `<think>` and reads `enable_thinking`), so the parser is
recognised as qwen3 with no setting.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.text.reasoning import ReasoningParser, ReasoningTurn, prompt_state
from tests.conftest import ServerProcess
from tests.test_quantization import serving
from tests.test_trtllm import checkpoint, double  # noqa: F401  (fixtures: TensorRT-LLM's double)

NAME = "tiny-thinker"
FP32 = {"NIM_MODEL_PROFILE": "torch-generic-fp32-tp1-pp1-throughput"}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SPECIAL = ["<|im_end|>", "<|im_start|>", "<|assistant|>", "<|tool_turn|>", "[UNK]"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
WORDS = ["{", "}", "Let", " me", " think", "Hello", " there", CALL, "\n", " ", '"', ":", ",", "_", "P"]
WORDS += [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["user", "system", "assistant", "tool"]
VOCAB = SPECIAL + ADDED + WORDS
HIDDEN = 64  # one-hot embeddings: the vocabulary padded to it
VOCAB += [f"w{i}" for i in range(HIDDEN - len(VOCAB))]
# token -> the token greedy decoding takes after it (every other token is followed by <|im_end|>)
SUCCESSOR = {
    "<|assistant|>": "<think>",
    "<think>": "Let",
    "Let": " me",
    " me": " think",
    " think": "</think>",
    "</think>": "Hello",
    "Hello": " there",
    "<|tool_turn|>": "<tool_call>",
    "<tool_call>": CALL,
    CALL: "</tool_call>",
    "{": "}",
    "\n": CALL,
}
SECOND = {"</think>": "{", "<tool_call>": "\n", "<|tool_turn|>": "{"}  # what a grammar falls back on
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
    "{%- if tools %}<|im_start|>system {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "<tool_call></tool_call><|im_end|>"
    "{% endif %}"
    "{%- if add_generation_prompt %}"
    "{%- if enable_thinking is defined and enable_thinking is false %}<|assistant|><think></think>"
    '{%- elif reasoning_effort is defined and reasoning_effort == "none" %}<|assistant|><think></think>'
    "{%- elif call_now is defined and call_now %}<|tool_turn|>"
    "{%- else %}<|assistant|>{% endif %}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
HI = [{"role": "user", "content": "hi"}]


def write_thinker(directory: Path) -> Path:
    """The tiny thinking model (see the module docstring) as a Hugging Face directory."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    ids = {token: i for i, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=ids, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "chat_template": TEMPLATE,
        "eos_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))

    hf = transformers.LlamaConfig(
        vocab_size=HIDDEN,
        hidden_size=HIDDEN,
        intermediate_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
    )
    model = transformers.LlamaForCausalLM(hf)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(HIDDEN))
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(HIDDEN, HIDDEN)
        for token, i in ids.items():
            head[ids[SUCCESSOR.get(token, "<|im_end|>")], i] = 1.0
            if token in SECOND:
                head[ids[SECOND[token]], i] = 0.5
        model.lm_head.weight.copy_(head)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


# --- The parsers, on text -------------------------------------------------------------------------


def _turn(name: str, opens: bool | None = None) -> ReasoningTurn:
    parser = ReasoningParser(name, (5,), (6,), lambda ids: "".join(" " if i == 0 else "x" for i in ids))  # type: ignore[arg-type]
    return ReasoningTurn(parser, name == "deepseek_r1" if opens is None else opens)


# (parser, answer text, reasoning, content): vLLM's semantics, and the cases between them
CASES = [
    ("qwen3", "<think>Let me think</think>Hello there", "Let me think", "Hello there"),
    ("qwen3", "\n<think>\nhmm\n</think>\n\nanswer", "\nhmm\n", "\n\nanswer"),
    ("qwen3", "Hello there", None, "Hello there"),  # thinking off: all answer
    ("qwen3", "<think>cut by max_tokens", "cut by max_tokens", None),  # truncated thinking
    ("qwen3", "<think>a</think>", "a", None),
    ("qwen3", "x<think>a</think>b", None, "x<think>a</think>b"),  # not at the start: not thinking
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "", None, None),
    ("qwen3", "<think>a</thin", "a</thin", None),
    ("deepseek_r1", "Let me think</think>Hello there", "Let me think", "Hello there"),
    ("deepseek_r1", "<think>\nLet me think\n</think>\n\nHi", "\nLet me think\n", "\n\nHi"),
    ("deepseek_r1", "all thinking, cut", "all thinking, cut", None),
    ("deepseek_r1", "</think>only answer", None, "only answer"),
    ("deepseek_r1", "a</think>b</think>c<think>d", "a", "b</think>c<think>d"),
    ("deepseek_r1", "  ", "  ", None),
    ("deepseek_r1", "<th", "<th", None),
    ("deepseek_r1", "a</th", "a</th", None),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_a_whole_answer_splits_as_vllm_reads_it(name: str, text: str, reasoning: str | None,
                                               content: str | None) -> None:  # fmt: skip
    assert _turn(name).split(text) == (reasoning, content)


def _streamed(turn: ReasoningTurn, pieces: list[str]) -> tuple[str, str]:
    splitter = turn.splitter()
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_a_streamed_answer_splits_alike_in_every_chunking(name: str, text: str, reasoning: str | None,
                                                         content: str | None) -> None:  # fmt: skip
    turn = _turn(name)
    want = (reasoning or "", content or "")
    assert _streamed(turn, list(text)) == want  # one character at a time
    for i in range(len(text) + 1):  # split at every position
        assert _streamed(turn, [text[:i], text[i:]]) == want
        for j in range(i, len(text) + 1):  # and at every pair of positions (markers cut anywhere)
            assert _streamed(turn, [text[:i], text[i:j], text[j:]]) == want


def test_the_splitter_holds_back_only_what_may_be_a_marker() -> None:
    splitter = _turn("qwen3").splitter()
    assert splitter.feed("<thi") == ("", "")  # may become <think>
    assert splitter.feed("nk>Let me") == ("Let me", "")
    assert splitter.feed(" think</th") == (" think", "")  # "</th" may become </think>
    assert splitter.feed("ink>Hel") == ("", "Hel")
    assert splitter.feed("lo") == ("", "lo")
    assert splitter.finish() == ("", "")
    deepseek = _turn("deepseek_r1").splitter()
    assert deepseek.feed("Hmm <") == ("Hmm ", "")
    assert deepseek.feed("b>") == ("<b>", "")


def test_the_prompt_decides_first() -> None:
    assert prompt_state("<|im_start|>assistant\n<think>\n") == "open"  # DeepSeek-R1, Qwen3.5
    assert prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"  # enable_thinking off
    assert prompt_state("<think>a</think>earlier turn<|im_start|>assistant\n") == "none"
    parser = _turn("qwen3").parser
    assert parser.for_prompt("x<think>\n") == ReasoningTurn(parser, True)  # qwen3 opened in the prompt
    assert parser.for_prompt("x<think></think>") is None  # closed: the answer is all content
    assert parser.for_prompt("x") == ReasoningTurn(parser, False)


def test_reasoning_tokens_are_counted_between_the_markers() -> None:
    qwen3, deepseek = _turn("qwen3"), _turn("deepseek_r1")
    assert qwen3.count_tokens([5, 11, 12, 13, 6, 14, 15, 0]) == 3
    assert qwen3.count_tokens([0, 5, 11, 6, 14]) == 1  # whitespace before <think>
    assert qwen3.count_tokens([14, 15, 0]) == 0  # no thinking
    assert qwen3.count_tokens([14, 5, 11, 6]) == 0  # <think> after text: not thinking
    assert qwen3.count_tokens([5, 11, 12]) == 2  # cut before </think>
    assert deepseek.count_tokens([11, 12, 6, 14]) == 2
    assert deepseek.count_tokens([5, 11, 12, 6, 14]) == 2
    assert deepseek.count_tokens([11, 12, 13]) == 3


# --- Which parser -----------------------------------------------------------------------------------


DEEPSEEK_TEMPLATE = (
    "{% for m in messages %}<｜{{ m.role }}｜>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


def _tokenizer_with(directory: Path, template: str):
    from service.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_directory(directory)
    tokenizer.chat_template = template
    return tokenizer


def test_the_parser_is_recognised_from_the_template_or_set(thinker: Path) -> None:
    from service.text.reasoning import ReasoningConfigError, resolve

    tokenizer = _tokenizer_with(thinker, TEMPLATE)
    parser, why = resolve(None, tokenizer)
    assert parser is not None and parser.name == "qwen3" and "enable_thinking" in why
    assert parser.start_ids == (5,) and parser.end_ids == (6,)
    parser, why = resolve(None, _tokenizer_with(thinker, DEEPSEEK_TEMPLATE))
    assert parser is not None and parser.name == "deepseek_r1" and "generation prompt" in why
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert resolve(None, _tokenizer_with(thinker, plain))[0] is None
    mentions = "{% for m in messages %}{{ m.content | replace('<think>', '') }}{% endfor %}"
    assert resolve(None, _tokenizer_with(thinker, mentions))[0] is None  # writes <think>, reads nothing
    parser, why = resolve("deepseek_r1", _tokenizer_with(thinker, plain))  # the setting wins
    assert parser is not None and parser.name == "deepseek_r1" and why == "NIM_REASONING_PARSER"
    special = _tokenizer_with(thinker, TEMPLATE)
    special._special_ids = frozenset({6})  # a tokenizer whose </think> decoding drops
    with pytest.raises(
        ReasoningConfigError, match=r"NIM_REASONING_PARSER=qwen3: .*</think> is a special token"
    ):
        resolve("qwen3", special)
    assert resolve(None, special)[0] is None


# --- Over HTTP, on a model that thinks ------------------------------------------------------------


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_thinker(tmp_path_factory.mktemp("thinker") / NAME)


@pytest.fixture(scope="module")
def thinker_server(thinker: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("thinker-server") / "server.log"
    with serving(log, {**FP32, "NIM_MODEL_NAME": str(thinker)}) as server:
        yield server


@pytest.fixture(scope="module")
def client(thinker_server: ServerProcess) -> openai.OpenAI:
    return _client(thinker_server)


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, **fields: Any) -> Any:
    extra = fields.pop("extra_body", {})
    return client.chat.completions.create(model=NAME, messages=HI, temperature=0, extra_body=extra, **fields)  # type: ignore[arg-type]


def _stream(client: openai.OpenAI, **fields: Any) -> list[Any]:
    return list(_chat(client, stream=True, **fields))


def _joined(chunks: list[Any]) -> tuple[str, str]:
    """The streamed reasoning and content, each concatenated."""
    reasoning = content = ""
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    return reasoning, content


def test_the_parser_is_recognised_and_logged(thinker_server: ServerProcess, client: openai.OpenAI) -> None:
    _chat(client, max_tokens=2)  # the parser is decided by the first request at the latest
    assert (
        "reasoning parser qwen3 (recognised: the chat template writes <think> and reads enable_thinking)"
        in (thinker_server.log())
    )


def test_thinking_is_reasoning_content_and_counted(client: openai.OpenAI) -> None:
    out = _chat(client)
    message = out.choices[0].message
    assert message.reasoning_content == "Let me think"
    assert message.content == "Hello there"
    assert out.choices[0].finish_reason == "stop"
    # <think> Let me think </think> Hello there <|im_end|>: 8 tokens, 3 of them thinking
    assert out.usage.completion_tokens == 8
    assert out.usage.completion_tokens_details.reasoning_tokens == 3


def test_streamed_thinking_concatenates_to_the_same(client: openai.OpenAI) -> None:
    chunks = _stream(client, stream_options={"include_usage": True})
    assert _joined(chunks) == ("Let me think", "Hello there")
    for chunk in chunks:
        for c in chunk.choices:  # the markers never reach the client
            assert "<think>" not in (c.delta.content or "") + (
                getattr(c.delta, "reasoning_content", None) or ""
            )
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_enable_thinking_false_reaches_the_template(client: openai.OpenAI) -> None:
    out = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = out.choices[0].message
    assert message.content == "Hello there" and message.reasoning_content is None
    assert out.usage.completion_tokens == 3 and out.usage.completion_tokens_details.reasoning_tokens == 0
    chunks = _stream(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert _joined(chunks) == ("", "Hello there")


def test_reasoning_effort_reaches_a_template_that_reads_it(client: openai.OpenAI) -> None:
    out = _chat(client, reasoning_effort="none")
    assert out.choices[0].message.content == "Hello there"
    assert out.choices[0].message.reasoning_content is None
    out = _chat(client, reasoning_effort="high")  # read, and this template thinks then
    assert out.choices[0].message.reasoning_content == "Let me think"


def test_template_kwargs_the_template_does_not_read_are_refused(client: openai.OpenAI) -> None:
    for kwargs, param in (
        ({"enable_thinkin": False}, "chat_template_kwargs.enable_thinkin"),
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
        ({"tools": []}, "chat_template_kwargs.tools"),
        ({"eos_token": "x"}, "chat_template_kwargs.eos_token"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            _chat(client, extra_body={"chat_template_kwargs": kwargs})
        assert caught.value.body["param"] == param, kwargs  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="given twice"):
        _chat(
            client, reasoning_effort="low", extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}}
        )


def test_json_mode_applies_to_the_answer_only(client: openai.OpenAI) -> None:
    """The grammar waits for </think>: the thinking is the model's own (a grammar from the first
    token would have allowed no <think>), and the answer is the JSON object the grammar forces
    where the model would have said "Hello there"."""
    out = _chat(client, response_format={"type": "json_object"})
    message = out.choices[0].message
    assert message.reasoning_content == "Let me think"
    assert json.loads(message.content) == {}
    assert out.choices[0].finish_reason == "stop"
    chunks = _stream(client, response_format={"type": "json_object"})
    reasoning, content = _joined(chunks)
    assert reasoning == "Let me think" and json.loads(content) == {}
    # thinking off: the prompt closed the thinking, so the grammar applies from the first token
    off = _chat(client, response_format={"type": "json_object"},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert json.loads(off.choices[0].message.content) == {}
    assert off.choices[0].message.reasoning_content is None


def test_a_tool_call_is_parsed_from_the_answer(client: openai.OpenAI) -> None:
    out = _chat(client, tools=[WEATHER], extra_body={"chat_template_kwargs": {"call_now": True}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content is None  # no thinking: a qwen3 answer without <think>
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_required_tool_call_follows_the_thinking(client: openai.OpenAI) -> None:
    """tool_choice required: the call's grammar starts after </think>, so the model thinks, then
    calls (it would have said "Hello there"); the call is read from the answer alone."""
    out = _chat(client, tools=[WEATHER], tool_choice="required")
    choice = out.choices[0]
    assert choice.message.reasoning_content == "Let me think"
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = _stream(client, tools=[WEATHER], tool_choice="required")
    reasoning, content = _joined(chunks)
    assert reasoning == "Let me think" and content == ""
    calls = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_continuous_usage_stats_put_usage_in_every_chunk(client: openai.OpenAI) -> None:
    chunks = _stream(client, stream_options={"include_usage": True, "continuous_usage_stats": True})
    *answer, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert all(chunk.usage is not None for chunk in answer)
    counts = [chunk.usage.completion_tokens for chunk in answer]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 8
    assert all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in answer)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in answer)
    plain = _stream(client, stream_options={"include_usage": True})
    assert all(chunk.usage is None for chunk in plain[:-1])  # only with continuous_usage_stats


def test_prompt_logprobs_on_chat_match_completions_echo(client: openai.OpenAI) -> None:
    out = _chat(client, max_tokens=1, extra_body={"prompt_logprobs": 2})
    entries = out.model_extra["prompt_logprobs"]
    prompt = [1, 50, 4, 0, 2]  # <|im_start|> user hi(unknown) <|im_end|> <|assistant|>
    assert len(entries) == out.usage.prompt_tokens == len(prompt) and entries[0] is None
    echo = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=2, temperature=0
    )
    echoed = echo.choices[0].logprobs.token_logprobs[: len(prompt)]
    for token_id, entry, want in zip(prompt[1:], entries[1:], echoed[1:], strict=True):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(want, abs=1e-5)
        assert own["decoded_token"] == VOCAB[token_id]
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert ranked[0]["rank"] == 1 and ranked[0]["logprob"] == max(e["logprob"] for e in entry.values())
        assert 2 <= len(entry) <= 3  # its own token and the two most likely, each once
    completion = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, n=2, temperature=0,
                                           extra_body={"prompt_logprobs": 0})  # fmt: skip
    for choice in completion.choices:
        per_choice = choice.model_extra["prompt_logprobs"]
        assert per_choice[0] is None and [list(e) for e in per_choice[1:]] == [[str(t)] for t in prompt[1:]]
        assert [
            e[str(t)]["logprob"] for e, t in zip(per_choice[1:], prompt[1:], strict=True)
        ] == pytest.approx(echoed[1:], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as caught:
        _stream(client, extra_body={"prompt_logprobs": 1})
    assert caught.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_deepseek_r1_set_by_name(thinker: Path, tmp_path: Path) -> None:
    """NIM_REASONING_PARSER=deepseek_r1 over a template it was not recognised from: the answer is
    thinking until </think> (a leading <think> dropped), and without one it is all thinking."""
    env = {
        **FP32,
        "NIM_MODEL_NAME": str(thinker),
        "NIM_REASONING_PARSER": "deepseek_r1",
        "NIM_TRUST_REQUEST_CHAT_TEMPLATE": "1",
    }
    with serving(tmp_path / "server.log", env) as server:
        client = _client(server)
        message = _chat(client).choices[0].message
        assert (message.reasoning_content, message.content) == ("Let me think", "Hello there")
        tool_turn = _chat(client, extra_body={"chat_template_kwargs": {"call_now": True}}).choices[0].message
        assert tool_turn.reasoning_content == f"<tool_call>{CALL}</tool_call>" and tool_turn.content is None
        # constrained, the same turn does not open <think>: the grammar takes its first token (issue 43)
        call_now = {"chat_template_kwargs": {"call_now": True}}
        json_turn = _chat(client, response_format={"type": "json_object"}, extra_body=call_now)
        message = json_turn.choices[0].message
        assert message.reasoning_content is None and json.loads(message.content) == {}
        response = httpx.get(f"{server.base_url}/v1/health/ready", timeout=10)
        assert response.status_code == 200
        assert "reasoning parser deepseek_r1 (NIM_REASONING_PARSER)" in server.log()
        # a request's own template, trusted here: it closes the thinking in the prompt
        closed = TEMPLATE.replace(
            "{%- else %}<|assistant|>{% endif %}", "{%- else %}<|assistant|><think></think>{% endif %}"
        )
        assert closed != TEMPLATE
        answer = _chat(client, extra_body={"chat_template": closed}).choices[0].message
        assert (answer.reasoning_content, answer.content) == (None, "Hello there")
        with pytest.raises(openai.BadRequestError) as caught:
            _chat(client, extra_body={"chat_template": "{% for m in messages %}"})
        assert caught.value.body["param"] == "chat_template"  # type: ignore[index]


def test_a_request_template_is_refused_unless_trusted(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="NIM_TRUST_REQUEST_CHAT_TEMPLATE=1") as caught:
        _chat(client, extra_body={"chat_template": TEMPLATE})
    assert caught.value.body["param"] == "chat_template"  # type: ignore[index]


def test_a_tool_call_cut_by_max_tokens_is_dropped(client: openai.OpenAI) -> None:
    """<tool_call> and the call's JSON, then max_tokens: no </tool_call>, so no call, and no half
    call in content either; finish_reason says length."""
    fields: dict[str, Any] = {
        "tools": [WEATHER],
        "max_tokens": 2,
        "extra_body": {"chat_template_kwargs": {"call_now": True}},
    }
    out = _chat(client, **fields)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 2
    assert choice.message.content is None and not choice.message.tool_calls
    chunks = _stream(client, **fields)
    assert _joined(chunks) == ("", "")
    assert not [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_tensorrt_llm_refuses_a_constraint_after_thinking(
    double: Path,  # noqa: F811  (the fixture imported above)
    checkpoint: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """TensorRT-LLM's grammar constrains from the first token: a constraint that should begin after
    the thinking is a 400 there, saying why; the same constraint from the first token is served."""
    import asyncio

    from service.engine.protocol import GuidedDecoding, RequestRefusedError
    from tests.test_trtllm import _engine, _request

    engine = _engine(checkpoint, tmp_path)
    after_thinking = GuidedDecoding("json_object", start_after=(7,))
    with pytest.raises(RequestRefusedError, match="reasoning model is not served by the tensorrt_llm engine"):
        asyncio.run(engine.check(_request([65], guided=after_thinking)))
    asyncio.run(engine.check(_request([65], guided=GuidedDecoding("json_object"))))


# --- A constraint where the prompt leaves it open whether the model thinks --------------------------


class _Sequence:
    """A matcher (xgrammar's interface) for one fixed token sequence."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.at = tokens, 0

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> None:
        bitmask[index].zero_()
        if self.at < len(self.tokens):
            from service.engine.guided.row import allow as _allow

            _allow(bitmask, index, self.tokens[self.at])

    def accept_token(self, token_id: int) -> bool:
        ok = self.at < len(self.tokens) and token_id == self.tokens[self.at]
        self.at += ok
        return ok

    def is_terminated(self) -> bool:
        return self.at == len(self.tokens)


def _allowed(row: Any) -> set[int]:
    import torch

    bitmask = torch.full((1, 2), -1, dtype=torch.int32)
    row.fill(bitmask, 0)
    return {t for t in range(64) if (int(bitmask[0, t >> 5]) >> (t & 31)) & 1}


def test_the_first_token_decides_whether_a_constrained_answer_thinks() -> None:
    """opens_with (<think> as tokens 40, 41) and start_after (</think>: 42): the first token is the
    grammar's or the opening's; the opening is then forced, the thinking free until </think>, and
    the grammar constrains after it. Any other first token is the grammar's from the start."""
    from service.engine.guided.row import GuidedRow

    row = GuidedRow(_Sequence([7, 8]), start_after=(42,), opens_with=(40, 41))
    assert _allowed(row) == {7, 40}
    assert row.accept(7) and row.state == "constrained"  # no thinking: constrained from the first token
    assert _allowed(row) == {8} and row.accept(8) and row.finished

    thinks = GuidedRow(_Sequence([7, 8]), start_after=(42,), opens_with=(40, 41))
    assert _allowed(thinks) == {7, 40} and thinks.accept(40) and thinks.state == "opening"
    assert _allowed(thinks) == {41} and thinks.accept(41) and thinks.state == "thinking"
    assert len(_allowed(thinks)) == 64 and thinks.accept(3) and thinks.accept(42)  # free, then </think>
    assert thinks.state == "constrained" and _allowed(thinks) == {7} and not thinks.finished

    takes = GuidedRow(_Sequence([40, 8]), start_after=(42,), opens_with=(40, 41))  # the grammar's too
    assert _allowed(takes) == {40} and takes.accept(40) and takes.state == "constrained"

    begun = GuidedRow(_Sequence([7]), start_after=(42,))  # the prompt opened the thinking
    assert begun.state == "thinking" and begun.accept(3) and begun.accept(42) and _allowed(begun) == {7}
    assert GuidedRow(_Sequence([7])).state == "constrained"


def test_a_constrained_turn_thinks_only_if_it_opens_with_think() -> None:
    from service.text.reasoning import closed

    for name in ("qwen3", "deepseek_r1"):
        parser = _turn(name).parser
        turn = parser.for_prompt("x", constrained=True)
        assert turn == ReasoningTurn(parser, False) and turn.opening == (5,) and turn.start_after == (6,)
        assert parser.for_prompt("x<think>\n", constrained=True).opening == ()  # begins in the thinking
        assert parser.for_prompt("x<think></think>", constrained=True) is None
    deepseek = _turn("deepseek_r1").parser
    assert deepseek.for_prompt("x") == ReasoningTurn(deepseek, True)  # unconstrained: as before
    several = ReasoningParser("qwen3", (44, 17400, 46), (9617, 17400, 46), lambda ids: "")  # `<`, think, `>`
    turn = several.for_prompt("x", constrained=True)
    assert turn is not None and (turn.start_after, turn.opening) == ((), ())  # constrained at once
    assert several.for_prompt("x<think>\n", constrained=True).start_after == (9617, 17400, 46)
    assert closed("<|assistant|>") == "<|assistant|><think>\n\n</think>\n\n"
    assert closed("<|assistant|><think>\n") == "<|assistant|><think>\n\n</think>\n\n"
    assert closed("a<think></think>\n") == "a<think></think>\n"
    assert prompt_state(closed("anything")) == "closed"


@pytest.fixture(scope="module")
def never_thinks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The embedded model, which never writes <think>, with NIM_REASONING_PARSER=qwen3."""
    log = tmp_path_factory.mktemp("never-thinks") / "server.log"
    with serving(log, {"NIM_REASONING_PARSER": "qwen3"}) as server:
        yield server


EMBEDDED_TOOL = {
    "type": "function",
    "function": {
        "name": "get_capital",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "constraint",
    [
        {"tools": [EMBEDDED_TOOL], "tool_choice": "required"},
        {"tools": [EMBEDDED_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_capital"}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
        {"extra_body": {"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}},
    ],
    ids=["required-tool", "named-tool", "json-schema", "regex"],
)
@pytest.mark.parametrize("thinking", [None, False], ids=["default", "enable-thinking-false"])
def test_a_model_that_never_thinks_gets_its_constraint(
    never_thinks: ServerProcess, constraint: dict[str, Any], thinking: bool | None
) -> None:
    """Issue 43: the grammar waited for a </think> this model never writes, and each of these
    answered 200 with unconstrained prose. Its first token is not <think>, so the constraint
    applies from it; `enable_thinking: false` works on a template that does not read it."""
    import jsonschema

    client = _client(never_thinks)
    fields = json.loads(json.dumps(constraint))
    if thinking is not None:
        fields.setdefault("extra_body", {})["chat_template_kwargs"] = {"enable_thinking": thinking}
    out = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Who are you, and where is the capital of France?"}],
        temperature=0,
        max_tokens=48,
        **fields,
    )
    choice = out.choices[0]
    assert choice.message.reasoning_content is None
    if "tools" in constraint:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_capital"
        jsonschema.validate(json.loads(call.function.arguments), EMBEDDED_TOOL["function"]["parameters"])
    elif "response_format" in constraint:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    else:
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", choice.message.content), choice.message.content


def test_enable_thinking_is_a_boolean_wherever_a_parser_is_active(never_thinks: ServerProcess) -> None:
    """The template does not read enable_thinking: false closes the thinking in the prompt (the
    empty block Qwen3's template writes), true asks for what the model does anyway, and anything
    else is a 400 naming it."""
    client = _client(never_thinks)

    def prompt_tokens(kwargs: dict[str, Any] | None) -> int:
        extra = {"chat_template_kwargs": kwargs} if kwargs is not None else {}
        out = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=HI, max_tokens=1, extra_body=extra
        )
        return out.usage.prompt_tokens

    plain = prompt_tokens(None)
    assert prompt_tokens({"enable_thinking": True}) == plain
    assert prompt_tokens({"enable_thinking": False}) > plain
    with pytest.raises(openai.BadRequestError) as caught:
        prompt_tokens({"enable_thinking": "no"})
    assert caught.value.body["param"] == "chat_template_kwargs.enable_thinking"  # type: ignore[index]


def test_an_answer_that_does_not_open_with_think_is_constrained_from_its_first_token(
    client: openai.OpenAI,
) -> None:
    """The thinker's tool turn answers <tool_call> at once, never <think>: json mode used to wait
    for </think> and returned the call as prose; now the grammar takes the first token."""
    out = _chat(client, response_format={"type": "json_object"},
                extra_body={"chat_template_kwargs": {"call_now": True}})  # fmt: skip
    message = out.choices[0].message
    assert message.reasoning_content is None and json.loads(message.content) == {}
    assert out.choices[0].finish_reason == "stop"
