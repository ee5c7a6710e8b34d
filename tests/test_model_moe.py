"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers' own.

Tiny random float32 checkpoints written by transformers (per-expert tensor names, as
save_pretrained writes them) are loaded through the engine's loader; logits of a few prompts match
transformers' to 1e-4 and ten greedy tokens are equal. The real server serves the Qwen3-MoE one and
answers with transformers' greedy tokens. Tensor parallelism: tests/test_moe_tp.py; LoRA:
tests/test_moe_lora.py; quantized experts (and the settings still refused): tests/test_moe_quant.py.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import tokenizers
import torch
import transformers

from service.engine.models.attention import CausalAttention
from service.engine.models.loader import build_model, load_hf_dir
from service.engine.models.moe import Experts, MoeForCausalLM
from service.model.config import ModelConfig
from tests.test_quantization import serving
from tests.test_tensor_parallel import randomize
from tests.test_tensor_parallel_serving import _distinct_tokens

PROMPTS = ([5, 17, 200, 3, 99, 42, 7], [1], list(range(30, 60)))
STEPS = 10
FP32 = "torch-generic-fp32-tp1-pp1-throughput"
_COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "num_experts_per_tok": 2,
}


def _hf_model(family: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if family == "qwen3_moe":
        # Layer 1 dense (mlp_only_layers): a dense MLP between routed ones.
        config = transformers.Qwen3MoeConfig(
            **_COMMON,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        # intermediate 64: int4 groups (32, 64 or 128 inputs) divide each expert's down_proj
        config = transformers.MixtralConfig(**_COMMON, intermediate_size=64, num_local_experts=4)
        model = transformers.MixtralForCausalLM(config)
    randomize(model)
    return model.eval()


def _write(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(family) / f"tiny-{family}"
    _hf_model(family).save_pretrained(directory)
    _distinct_tokens(directory)
    return directory


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One family through the server is enough: serving and its refusals do not depend on it."""
    return _write("qwen3_moe", tmp_path_factory)


def _hf_greedy(directory: Path, prompt: list[int], steps: int = STEPS) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps
        )
    return [int(t) for t in out[0, len(prompt) :]]


def test_logits_and_greedy_tokens_match_transformers(checkpoint: Path) -> None:
    config, weights = load_hf_dir(checkpoint, "fp32")
    model = build_model(config, weights, torch.float32, "cpu")
    assert isinstance(model, MoeForCausalLM)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor(prompt)
            ours = model.compute_logits(model(ids, torch.arange(len(prompt)), CausalAttention()))
            theirs = reference(ids[None]).logits[0].float()
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
            sequence = list(prompt)
            for _ in range(STEPS):
                ids = torch.tensor(sequence)
                logits = model.compute_logits(model(ids, torch.arange(len(sequence)), CausalAttention()))
                sequence.append(int(logits[-1].argmax()))
            assert sequence[len(prompt) :] == _hf_greedy(checkpoint, prompt)


def test_stacked_expert_tensors_load_as_per_expert_ones(checkpoint: Path) -> None:
    """transformers 5 holds experts stacked (mlp.experts.gate_up_proj [E, 2I, H]); those names load too."""
    config, weights = load_hf_dir(checkpoint, "fp32")
    per_expert = build_model(config, weights, torch.float32, "cpu")
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in reference.state_dict())
    stacked = build_model(config, reference.state_dict().items(), torch.float32, "cpu")
    for name, tensor in per_expert.state_dict().items():
        assert torch.equal(tensor, stacked.state_dict()[name]), name


def test_gathered_experts_equal_grouped_ones() -> None:
    """The graph-capturable path (each row times its gathered expert) computes the grouped one."""
    config = ModelConfig.from_hf_config({**_hf_model("qwen3_moe").config.to_dict()})
    experts = Experts(config)
    torch.manual_seed(3)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
        x = torch.randn(12, config.hidden_size)
        ids = torch.tensor([0, 3, 3, 7, 1, 0, 5, 5, 5, 2, 7, 0])
        torch.testing.assert_close(experts.gathered(x, ids), experts.grouped(x, ids), atol=1e-5, rtol=1e-5)


def test_routed_layers_name_only_their_attention_linears(checkpoint: Path) -> None:
    config, weights = load_hf_dir(checkpoint, "fp32")
    model = build_model(config, weights, torch.float32, "cpu")
    roles = [(linear.layer, linear.role) for linear in model.linear_layers()]
    dense = [i for i in range(config.num_layers) if i not in config.sparse_layers]
    assert dense == ([1] if config.architecture == "qwen3_moe" else [])
    expected = [
        (i, role)
        for i in range(config.num_layers)
        for role in (("qkv", "o") if i in config.sparse_layers else ("qkv", "o", "gate_up", "down"))
    ]
    assert roles == expected
    stack = model.llama_stack()  # the scripted CPU decode's: a router and experts where routed
    assert [mlp is not None for mlp in stack.routed] == [
        i in config.sparse_layers for i in range(config.num_layers)
    ]


def test_the_server_answers_with_transformers_greedy_tokens(qwen3_moe: Path, tmp_path: Path) -> None:
    checkpoint = qwen3_moe
    prompt = "Once upon a time"
    tokenizer = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    prompt_ids = tokenizer.encode(prompt).ids
    env = {"NIM_MODEL_PROFILE": FP32, "NIM_MODEL_NAME": str(checkpoint)}
    with serving(tmp_path / "server.log", env) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=STEPS,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        log = server.log()
    tokens = out.choices[0].logprobs.tokens if out.choices[0].logprobs is not None else None
    assert tokens is not None
    assert [vocab[t] for t in tokens] == _hf_greedy(checkpoint, prompt_ids)
    assert "qwen3_moe" in log
    assert "CPU decode steps run as one TorchScript call" in log  # the routed layers too


def test_a_hub_checkpoint_is_sized_with_its_experts() -> None:
    """Generic profiles for a hub id size weights from the config: every expert counts."""
    from service.selection.planning import _estimate_weights_bytes

    config = ModelConfig.from_hf_config(_hf_model("qwen3_moe").config.to_dict())
    hidden, attention = 64, 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64
    dense_mlp, routed = 3 * hidden * 96, 8 * (3 * hidden * 32 + hidden)
    expected = 256 * hidden * 2 + 3 * attention + dense_mlp + 2 * routed
    assert _estimate_weights_bytes(config) == 2 * expected
