"""LoRA on mixture-of-experts models (Qwen3-MoE, Mixtral): attention only.

An adapter may target what the model's linear layers hold (`CausalLM.linear_layers`): q/k/v/o in
every layer, gate/up/down only in a dense layer (Qwen3-MoE's mlp_only_layers). One that targets an
expert or the router is refused with that reason. Through the real server an attention adapter
answers with transformers' greedy tokens on the merged weights W + scale * B @ A (float32), the
refused ones are logged once and not listed, and the base model answers as transformers does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import openai
import pytest
import tokenizers
import torch
from safetensors.torch import load_file, save_file

from service.engine.lora import AdapterError, read_adapter
from service.model.config import ModelConfig
from tests import test_lora
from tests.test_model_moe import FP32, _hf_greedy, _hf_model, _write
from tests.test_quantization import serving

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
STEPS = 10
# Adapters the server's source holds that target an expert or the router: name -> (module, why)
REFUSED = {
    "on-experts": (
        "model.layers.0.mlp.experts.3.up_proj",
        "an expert of a mixture-of-experts layer; LoRA adapts only the attention projections",
    ),
    "on-router": (
        "model.layers.2.mlp.gate",
        "the router of a mixture-of-experts layer; LoRA adapts only the attention projections",
    ),
}


def _config(family: str) -> ModelConfig:
    return ModelConfig.from_hf_config(_hf_model(family).config.to_dict())


def _write_on(directory: Path, path: str, in_features: int, out_features: int = 8) -> Path:
    """An adapter whose only module is the one at `path` (a module path of the base model)."""
    test_lora.write_adapter(directory, seed=4, modules=("q_proj",), config=_config("qwen3_moe"))
    save_file(
        {
            f"base_model.model.{path}.lora_A.weight": torch.zeros(4, in_features),
            f"base_model.model.{path}.lora_B.weight": torch.zeros(out_features, 4),
        },
        str(directory / "adapter_model.safetensors"),
    )
    return directory


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_attention_adapters_are_read_and_expert_and_router_ones_refused(family: str, tmp_path: Path) -> None:
    config = _config(family)
    directory = test_lora.write_adapter(tmp_path / "attn", seed=1, modules=ATTENTION, config=config)
    adapter = read_adapter(directory, "attn", config, 16)
    assert sorted(adapter.modules) == sorted((i, m) for i in range(config.num_layers) for m in ATTENTION)
    block, expert = ("mlp", "up_proj") if family == "qwen3_moe" else ("block_sparse_moe", "w3")
    refusals = {
        f"model.layers.0.{block}.experts.1.{expert}": "an expert of a mixture-of-experts layer",
        f"model.layers.2.{block}.gate": "the router of a mixture-of-experts layer",
        # A routed layer has no dense MLP to adapt.
        "model.layers.0.mlp.gate_proj": "targets model.layers.0.mlp.gate_proj, which this model does not",
    }
    for path, why in refusals.items():
        bad = _write_on(tmp_path / path, path, config.hidden_size)
        with pytest.raises(AdapterError, match=f"^adapter {path}: .*{why}"):
            read_adapter(bad, path, config, 16)
    if family == "qwen3_moe":  # layer 1 is dense (mlp_only_layers): its MLP adapts as a Llama one
        path = "model.layers.1.mlp.gate_proj"
        ok = _write_on(tmp_path / "dense-ok", path, config.hidden_size, config.intermediate_size)
        assert list(read_adapter(ok, "ok", config, 16).modules) == [(1, "gate_proj")]
        wrong = _write_on(tmp_path / "dense-wrong", path, config.hidden_size)  # 8 rows, not 96
        with pytest.raises(AdapterError, match=r"do not fit a rank-4 adapter of a \[96, 64\] projection"):
            read_adapter(wrong, "wrong", config, 16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write("qwen3_moe", tmp_path_factory)


def _merged(checkpoint: Path, adapter_dir: Path, directory: Path) -> Path:
    """`checkpoint` with the adapter's deltas added to its weights (float64, then float32)."""
    config = ModelConfig.from_hf_config(_hf_model("qwen3_moe").config.to_dict())
    adapter = read_adapter(adapter_dir, adapter_dir.name, config, 64)
    shutil.copytree(checkpoint, directory)
    tensors = load_file(checkpoint / "model.safetensors")
    for (layer, module), weights in adapter.modules.items():
        key = f"model.layers.{layer}.self_attn.{module}.weight"
        tensors[key] = (tensors[key].double() + weights.delta().double()).float()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def test_the_server_serves_attention_adapters_and_refuses_expert_ones(
    checkpoint: Path, tmp_path: Path
) -> None:
    config = _config("qwen3_moe")
    source = tmp_path / "adapters"
    attn = test_lora.write_adapter(source / "attn", 7, 8, 16.0, ATTENTION, config, std=0.15)
    for name, (path, _) in REFUSED.items():
        _write_on(source / name, path, config.hidden_size)
    merged = _merged(checkpoint, attn, tmp_path / "merged")
    prompt = "Once upon a time"
    vocab = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json")).get_vocab()
    prompt_ids = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(prompt).ids
    env = {
        "NIM_MODEL_PROFILE": FP32,
        "NIM_MODEL_NAME": str(checkpoint),
        "NIM_PEFT_SOURCE": str(source),
        "NIM_MAX_LORA_RANK": "16",
    }
    with serving(tmp_path / "server.log", env) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        served = [m.id for m in client.models.list().data]
        answers = {}
        for model in served:
            out = client.completions.create(
                model=model, prompt=prompt, max_tokens=STEPS, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert out.choices[0].logprobs is not None and out.choices[0].logprobs.tokens is not None
            answers[model] = [vocab[t] for t in out.choices[0].logprobs.tokens]
        for name in REFUSED:
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model=name, prompt=prompt, max_tokens=2)
        log = server.log()
    assert len(served) == 2 and "attn" in served  # the base model and its one servable adapter
    base = next(model for model in served if model != "attn")
    assert answers["attn"] == _hf_greedy(merged, prompt_ids)
    assert answers[base] == _hf_greedy(checkpoint, prompt_ids)
    assert answers["attn"] != answers[base]
    for name, (path, why) in REFUSED.items():
        assert log.count(f"LoRA adapter not served: adapter {name}: ") == 1, log
        assert f"adapter {name}: targets {path}, {why}" in log, log
