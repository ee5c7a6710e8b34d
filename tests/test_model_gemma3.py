"""Gemma 3 (text) against transformers' own, through the model, the engine's paged cache and HTTP.

A tiny random float32 Gemma3ForCausalLM written by transformers (sliding window 8 on three of
four layers, a full-attention layer between them with linear RoPE scaling, its own local RoPE
base, query_pre_attn_scalar unlike head_dim) is loaded through the engine's loader. Prompts are
longer than the window, so windowed layers see less than full attention would.

Tolerances: float32 logits within 1e-4 (absolute and relative) of transformers'; log-probabilities
from the engine within 1e-4; greedy tokens equal; bfloat16 logits as far from float32 as
transformers' bfloat16 ones (within 25%); int8 weights within 5% of the logits' scale.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tokenizers
import torch

from service.config_loading import load_settings
from service.engine.models.attention import CausalAttention
from service.engine.models.base import CausalLM
from service.engine.models.gemma3 import Gemma3ForCausalLM
from service.engine.models.loader import build_model, load_hf_dir
from service.engine.protocol import GenerationRequest, RequestOutput, SamplingParams
from service.engine.torch.engine import TorchEngine
from service.engine.torch.loading import build_engine
from service.model.config import ModelConfig, UnsupportedModelError
from service.serving import config_for
from tests.conftest import TEST_THREADS
from tests.test_quantization import serving
from tests.test_tensor_parallel import randomize
from tests.test_tensor_parallel_serving import _distinct_tokens

# Test-only: the reference implementation (transformers 5 writes Gemma 3's per-layer-type rope_parameters).
transformers = pytest.importorskip(
    "transformers",
    minversion="5.0",
    reason="Gemma 3 is checked against transformers >= 5's Gemma3ForCausalLM",
)

FP32 = "torch-generic-fp32-tp1-pp1-throughput"
WINDOW = 8
STEPS = 8
PROMPTS = (list(range(40, 110)), [5, 17, 200, 3, 99, 42, 7, 1, 250, 31, 64, 12], [9])

# google/gemma-3-1b-it's chat template (tokenizer_config.json), verbatim.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def _hf_config(**overrides: object) -> transformers.Gemma3TextConfig:
    settings: dict[str, object] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
        },
    }
    return transformers.Gemma3TextConfig(**{**settings, **overrides})


def _hf_model() -> transformers.Gemma3ForCausalLM:
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(_hf_config())
    randomize(model)  # Gemma's norm weights are offsets from 1: "around 1" makes them about 2x
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint, a byte-level tokenizer (each token one character) and Gemma's template."""
    directory = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3"
    _hf_model().save_pretrained(directory)
    _distinct_tokens(directory)
    config = {"chat_template": GEMMA3_TEMPLATE, "bos_token": "<bos>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _hf_logits(reference: transformers.PreTrainedModel, sequence: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([sequence])).logits[0].float()


def _hf_greedy(reference: transformers.PreTrainedModel, prompt: list[int], steps: int = STEPS) -> list[int]:
    """Greedy tokens, recomputing the whole sequence each step (no cache on transformers' side)."""
    sequence = list(prompt)
    for _ in range(steps):
        sequence.append(int(_hf_logits(reference, sequence)[-1].argmax()))
    return sequence[len(prompt) :]


def _ours(checkpoint: Path, config: ModelConfig | None = None) -> Gemma3ForCausalLM:
    """The checkpoint through the engine's loader (as its config says, or as `config` does)."""
    read, weights = load_hf_dir(checkpoint, "fp32")
    model = build_model(config or read, weights, torch.float32, "cpu")
    assert isinstance(model, Gemma3ForCausalLM)
    return model


def _logits(model: CausalLM, sequence: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        ids = torch.tensor(sequence)
        return model.compute_logits(model(ids, torch.arange(len(sequence)), CausalAttention()))


# -- the model -----------------------------------------------------------------------------


def test_the_config_reads_windows_ropes_and_scale(checkpoint: Path) -> None:
    config, _ = load_hf_dir(checkpoint, "fp32")
    assert config.architecture == "gemma3"
    assert config.layer_windows == (WINDOW, WINDOW, None, WINDOW)
    assert config.rope_theta == 50_000.0 and config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.rope_local_theta == 1_000.0
    assert config.attention_scale == pytest.approx(24**-0.5)
    assert config.tie_word_embeddings and config.qk_norm and config.hidden_act == "gelu_pytorch_tanh"
    assert config.sliding_window is None  # the recorded-only window, which would cap the context
    # Configs key caches (lora.adaptable): one with rope scaling hashes too (the dict is left out).
    assert hash(config) == hash(dataclasses.replace(config, rope_scaling=dict(config.rope_scaling or {})))


def test_a_transformers_4_config_reads_the_same() -> None:
    """google/gemma-3-1b-it's config.json layout (transformers 4.50): rope_theta,
    rope_local_base_freq and rope_scaling, sliding_window_pattern instead of layer_types, and no
    tie_word_embeddings (save_pretrained left out the default)."""
    config = ModelConfig.from_hf_config(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "bos_token_id": 2,
            "eos_token_id": [1, 106],
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "max_position_embeddings": 32768,
            "model_type": "gemma3_text",
            "num_attention_heads": 4,
            "num_hidden_layers": 26,
            "num_key_value_heads": 1,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "rope_theta": 1000000,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "torch_dtype": "bfloat16",
            "vocab_size": 262144,
        }
    )
    assert config.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    assert config.rope_theta == 1e6 and config.rope_local_theta == 1e4
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.attention_scale == 1 / 16 and config.tie_word_embeddings
    assert config.eos_token_ids == (1, 106) and config.num_kv_heads == 1


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        ({"attn_logit_softcapping": 50.0}, "gemma3 with attn_logit_softcapping=50.0 is not supported"),
        ({"final_logit_softcapping": 30.0}, "gemma3 with final_logit_softcapping=30.0 is not supported"),
        ({"use_bidirectional_attention": True}, "gemma3 with use_bidirectional_attention is not supported"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported for gemma3"),
        (
            {"rope_parameters": None, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope scaling type 'yarn' is not supported",
        ),
        (
            {"rope_parameters": None, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
            "gemma3 rope scaling type 'dynamic' is not supported; supported: linear",
        ),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "gemma3 layer_types"),
    ],
)
def test_what_it_does_not_compute_is_refused_in_one_line(overrides: dict[str, object], refusal: str) -> None:
    raw = {**_hf_config().to_dict(), **overrides}
    with pytest.raises(UnsupportedModelError, match=refusal) as refused:
        ModelConfig.from_hf_config(raw)
    assert "\n" not in str(refused.value)


def test_logits_and_greedy_tokens_match_transformers(
    checkpoint: Path, reference: transformers.PreTrainedModel
) -> None:
    model = _ours(checkpoint)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            _logits(model, prompt), _hf_logits(reference, prompt), atol=1e-4, rtol=1e-4
        )
        sequence = list(prompt)
        for _ in range(STEPS):
            sequence.append(int(_logits(model, sequence)[-1].argmax()))
        assert sequence[len(prompt) :] == _hf_greedy(reference, prompt)


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(
    checkpoint: Path, reference: transformers.PreTrainedModel
) -> None:
    """In bfloat16 (embedding scale rounded to bfloat16 as transformers rounds it) our logits are
    as far from the float32 ones as transformers' bfloat16 logits are (measured: 0.80 vs 0.77,
    0.44 vs 0.45, equal; logits up to about 11): within 25% of that error, plus 0.02."""
    config, weights = load_hf_dir(checkpoint, "bf16")
    model = build_model(config, weights, torch.bfloat16, "cpu")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    for prompt in PROMPTS:
        want = _hf_logits(reference, prompt)
        ours_error = float((_logits(model, prompt) - want).abs().max())
        their_error = float((_hf_logits(theirs, prompt) - want).abs().max())
        assert ours_error <= 1.25 * their_error + 0.02, (ours_error, their_error)


def test_the_window_and_the_local_rope_change_the_answer(
    checkpoint: Path, reference: transformers.PreTrainedModel
) -> None:
    """Without its window (or with the global RoPE on every layer) the model is measurably another:
    the agreement above is not one full attention would reach too."""
    config, _ = load_hf_dir(checkpoint, "fp32")
    prompt = PROMPTS[0]
    want = _hf_logits(reference, prompt)
    # Windows longer than the prompt: the sliding layers attend fully (and keep their local RoPE).
    unwindowed = dataclasses.replace(config, layer_windows=tuple(w and 10_000 for w in config.layer_windows))
    for changed in (unwindowed, dataclasses.replace(config, rope_local_theta=config.rope_theta)):
        assert (_logits(_ours(checkpoint, changed), prompt) - want).abs().max() > 1e-2
    # Within the window, windowed and full attention agree: the first WINDOW positions match.
    full = _logits(_ours(checkpoint, unwindowed), prompt)
    torch.testing.assert_close(full[:WINDOW], want[:WINDOW], atol=1e-4, rtol=1e-4)


def test_linear_layers_by_role_and_its_own_stack(checkpoint: Path) -> None:
    model = _ours(checkpoint)
    roles = [(linear.layer, linear.role) for linear in model.linear_layers()]
    assert roles == [(i, r) for i in range(4) for r in ("qkv", "o", "gate_up", "down")]
    qkv = model.linear_layers()[0]
    assert [p.weight_name for p in qkv.parts] == [
        f"model.layers.0.self_attn.{p}_proj.weight" for p in ("q", "k", "v")
    ]
    replacement = torch.nn.Linear(qkv.in_features, sum(p.rows for p in qkv.parts))
    model.set_linear(0, "qkv", replacement)
    assert model.linear_layers()[0].module is replacement
    assert model.llama_stack() is None  # not Llama-shaped: the scripted CPU decode runs Gemma's stack
    stack = model.gemma_stack()
    assert stack.windows == [WINDOW, WINDOW, None, WINDOW] and len(stack.norms) == 16


def test_int8_weights_quantized_at_load_keep_greedy_tokens(
    checkpoint: Path, reference: transformers.PreTrainedModel
) -> None:
    """Quantization at load finds Gemma's projections by their (Llama-like) names."""
    config, weights = load_hf_dir(checkpoint, "int8_wo")
    model = build_model(config, weights, torch.float32, "cpu")
    quantized = [type(linear.module).__name__ for linear in model.linear_layers()]
    assert all(name != "Linear" for name in quantized), quantized
    prompt = PROMPTS[1]
    torch.testing.assert_close(
        _logits(model, prompt), _hf_logits(reference, prompt), atol=0.05 * 10, rtol=0.05
    )  # int8 per-row weights: a few percent of the logits' scale (about 10)


def test_two_gloo_ranks_compute_the_unsharded_model(checkpoint: Path, tmp_path: Path) -> None:
    """Tensor parallelism as for Llama (heads, kv heads, MLP and vocabulary split; Gemma's norms
    replicated): two processes joined by gloo compute one rank's logits within 1e-5 of their scale."""
    from tests.test_tensor_parallel import GREEDY_TOKENS, _run, _tensor_parallel

    want_logits, want_tokens = _run(_ours(checkpoint), GREEDY_TOKENS)
    got_logits, got_tokens = _tensor_parallel(checkpoint, 2, "fp32", "float32", tmp_path / "tp")
    scale = float(abs(want_logits).max())
    assert float(abs(got_logits - want_logits).max()) <= 1e-5 * scale
    assert got_tokens == want_tokens


def test_a_gemma3_gguf_is_refused_in_one_line(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError) as refused:
        ModelConfig.from_gguf(gguf.GGUFReader(str(path)))
    assert str(refused.value) == "GGUF architecture 'gemma3' is not supported; supported: llama, qwen2, qwen3"


# -- the engine's paged cache ---------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[TorchEngine]:
    """Chunks of at most 16 tokens (prompts prefill in several), blocks of 16, prefix caching on."""
    settings = load_settings(
        model_name=str(checkpoint),
        model_profile=FP32,
        num_threads=TEST_THREADS,
        max_model_len=512,
        kv_cache_max_tokens=4096,
        max_num_batched_tokens=16,
    )
    engine = build_engine(config_for(settings))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


def _run(engine: TorchEngine, requests: list[GenerationRequest]) -> list[list[RequestOutput]]:
    async def one(request: GenerationRequest) -> list[RequestOutput]:
        return [out async for out in engine.generate(request)]

    async def run() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(run())


def _greedy_request(rid: str, prompt: list[int], prompt_logprobs: bool = False) -> GenerationRequest:
    params = SamplingParams(
        max_tokens=STEPS,
        temperature=0.0,
        ignore_eos=True,
        logprobs=0,
        prompt_logprobs=0 if prompt_logprobs else None,
    )
    return GenerationRequest(rid, prompt, params)


def _check_against_transformers(
    reference: transformers.PreTrainedModel, prompt: list[int], outputs: list[RequestOutput]
) -> None:
    """Greedy tokens equal; each generated (and, where asked, prompt) token's logprob within 1e-4."""
    tokens = [t for out in outputs for t in out.token_ids]
    assert tokens == _hf_greedy(reference, prompt)
    logprobs = torch.log_softmax(_hf_logits(reference, prompt + tokens[:-1]), dim=-1)
    generated = [entry for out in outputs for entry in out.logprobs or []]
    assert len(generated) == STEPS
    for i, entry in enumerate(generated):
        assert entry.logprob == pytest.approx(float(logprobs[len(prompt) - 1 + i, entry.token_id]), abs=1e-4)
    prompt_entries = outputs[0].prompt_logprobs
    if prompt_entries is not None:
        assert prompt_entries[0] is None and len(prompt_entries) == len(prompt)
        for position, entry in enumerate(prompt_entries[1:], start=1):
            assert entry is not None and entry.token_id == prompt[position]
            want = float(logprobs[position - 1, prompt[position]])
            assert entry.logprob == pytest.approx(want, abs=1e-4), position


def test_the_engine_prefills_in_chunks_and_matches_transformers(
    engine: TorchEngine, reference: transformers.PreTrainedModel
) -> None:
    """Prompts of 70 and 12 tokens prefill in chunks of 16 (crossing windows, 32-position tiles
    and blocks), decode side by side, and match transformers token for token, prompt included."""
    requests = [_greedy_request(f"chunked-{i}", p, True) for i, p in enumerate(PROMPTS)]
    for prompt, outputs in zip(PROMPTS, _run(engine, requests), strict=True):
        assert outputs[-1].error is None
        _check_against_transformers(reference, prompt, outputs)


def test_a_cached_prefix_gives_the_same_answers(
    engine: TorchEngine, reference: transformers.PreTrainedModel
) -> None:
    """The second prompt's first 64 positions come from the prefix cache (every block stays cached,
    windowed layers' included), and its answer is still transformers'."""
    shared = list(range(120, 190))  # a prefix no other test's prompt starts with
    first = _run(engine, [_greedy_request("prefix-1", [*shared, 3, 4, 5])])[0]
    second_prompt = [*shared, 9, 8, 7, 6]
    second = _run(engine, [_greedy_request("prefix-2", second_prompt)])[0]
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens >= 64
    _check_against_transformers(reference, [*shared, 3, 4, 5], first)
    _check_against_transformers(reference, second_prompt, second)


# -- over HTTP -------------------------------------------------------------------------------


def test_the_server_chats_with_gemmas_template(checkpoint: Path, tmp_path: Path) -> None:
    """A chat completion renders Gemma's template as transformers does (the system message folded
    into the first user turn) and answers with transformers' greedy tokens; roles that do not
    alternate are the template's 400."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nName a colour.<end_of_turn>\n")
    tokenizer = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = _hf_greedy(reference, tokenizer.encode(text, add_special_tokens=False).ids)

    env = {"NIM_MODEL_PROFILE": FP32, "NIM_MODEL_NAME": str(checkpoint)}
    with serving(tmp_path / "server.log", env) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=STEPS,
            temperature=0,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
        bad = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": model, "messages": [messages[1], messages[1]], "max_tokens": 2},
            timeout=60,
        )
        log = server.log()
    assert out.usage is not None and out.usage.prompt_tokens == len(text.encode())
    content = out.choices[0].logprobs.content if out.choices[0].logprobs is not None else None
    assert content is not None
    assert [vocab[entry.token] for entry in content] == expected
    assert bad.status_code == 400, bad.text
    assert "Conversation roles must alternate user/assistant/user/assistant/..." in bad.text
    assert "CPU decode steps run as one TorchScript call" in log


def test_a_lora_adapter_answers_as_its_merged_weights(checkpoint: Path, tmp_path: Path) -> None:
    """LoRA wraps Gemma's linear layers by (layer, role) as it wraps Llama's: an adapter on all
    seven projections answers with transformers' greedy tokens over the merged weights W + s * B @ A."""
    from tests.test_lora_serving import _merged, write_adapter

    config, _ = load_hf_dir(checkpoint, "fp32")
    source = tmp_path / "adapters"
    deltas = write_adapter(source / "gemma-adapter", config, seed=7, rank=8)
    merged = _merged(checkpoint, deltas, tmp_path / "merged")
    reference = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    prompt = "Once upon a time"
    tokenizer = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    vocab, prompt_ids = tokenizer.get_vocab(), tokenizer.encode(prompt).ids
    expected = _hf_greedy(reference, prompt_ids)
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert expected != _hf_greedy(base, prompt_ids)  # the adapter changes the answer
    env = {"NIM_MODEL_PROFILE": FP32, "NIM_MODEL_NAME": str(checkpoint), "NIM_PEFT_SOURCE": str(source)}
    with serving(tmp_path / "server.log", env) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(
            model="gemma-adapter",
            prompt=prompt,
            max_tokens=STEPS,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
    tokens = out.choices[0].logprobs.tokens if out.choices[0].logprobs is not None else None
    assert tokens is not None and [vocab[t] for t in tokens] == expected
