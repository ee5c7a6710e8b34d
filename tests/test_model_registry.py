"""The model registry and the model protocol the engine depends on.

Every supported architecture maps to a class that implements `CausalLM` and is imported only when
looked up; an architecture the registry lacks is refused in one line naming the supported ones;
the engine's modules reach models through the protocol and the registry only.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from service.engine.models import registry
from service.engine.models.base import CausalLM
from service.engine.models.loader import build_model
from service.model import architectures
from service.model.config import (
    FAMILIES,
    SUPPORTED_GGUF_ARCHITECTURES,
    SUPPORTED_HF_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
)

ROOT = Path(__file__).resolve().parents[1]
# The engine's modules that hold a model: none may name a model class or a model's attribute paths.
ENGINE_MODULES = (
    "service/engine/models/loader.py",
    "service/engine/torch/loading.py",
    "service/engine/torch/engine.py",
    "service/engine/torch/model_runner.py",
    "service/engine/torch/cuda_graphs.py",
    "service/engine/torch/lora_slots.py",
    "service/engine/torch/scripted_decode.py",
    "service/engine/torch/rank_loading.py",
    "service/engine/torch/decode_path.py",
)
_TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}


def test_every_supported_architecture_maps_to_a_model_class() -> None:
    assert set(architectures.ARCHITECTURES) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "Gemma3ForCausalLM",
    }
    assert set(FAMILIES) == set(SUPPORTED_HF_ARCHITECTURES.values())  # one config reading per family
    assert list(SUPPORTED_HF_ARCHITECTURES) == list(architectures.ARCHITECTURES)  # ModelConfig reads it
    assert SUPPORTED_GGUF_ARCHITECTURES == ("llama", "qwen2", "qwen3")
    for name, entry in architectures.ARCHITECTURES.items():
        cls = registry.model_class(entry.family)
        assert isinstance(cls, type) and cls.__name__ == entry.class_name, name
        config = ModelConfig.from_hf_config({**_TINY, "architectures": [name]})
        assert config.architecture == entry.family


def test_reading_the_registry_imports_no_model_code() -> None:
    probe = (
        "import sys\n"
        "from service.model import architectures\n"
        "from service.model.config import ModelConfig\n"
        "assert 'service.engine.models.llama' not in sys.modules\n"
        "assert 'torch' not in sys.modules\n"
        "from service.engine.models import registry\n"
        "registry.model_class('qwen3')\n"
        "assert 'service.engine.models.llama' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)


def test_building_the_embedded_model_imports_no_sympy() -> None:
    """Building a model on 'meta' and loading its weights stays off torch's meta-tensor Python
    kernels, whose first use imports sympy (0.65 s of every server start when the RoPE tables
    went through Module.to_empty)."""
    probe = (
        "import sys, torch\n"
        "from service.engine.models.loader import build_model, load_gguf\n"
        "from service.store.model_store import embedded_model_path\n"
        "config, weights = load_gguf(embedded_model_path(), 'fp32')\n"
        "model = build_model(config, weights, torch.float32, 'cpu')\n"
        "assert not model.rotary.cos_cached.is_meta and 'sympy' not in sys.modules, 'sympy imported'\n"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True, timeout=300)


def test_a_config_without_architectures_is_read_by_its_model_type() -> None:
    assert ModelConfig.from_hf_config({**_TINY, "model_type": "gemma3_text"}).architecture == "gemma3"
    assert ModelConfig.from_hf_config({**_TINY, "model_type": "qwen2"}).architecture == "qwen2"


def test_an_unknown_architecture_is_refused_in_one_line() -> None:
    with pytest.raises(UnsupportedModelError) as refused:
        ModelConfig.from_hf_config({**_TINY, "architectures": ["PhiForCausalLM"]})
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        "architecture PhiForCausalLM is not supported; supported: LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, "
        "Gemma3ForCausalLM"
    )
    with pytest.raises(UnsupportedModelError, match="'phi' is not supported; supported: LlamaForCausalLM"):
        registry.model_class("phi")


def test_a_known_but_unserved_architecture_is_refused_with_its_reason() -> None:
    with pytest.raises(UnsupportedModelError) as refused:
        ModelConfig.from_hf_config({**_TINY, "architectures": ["Gemma3ForConditionalGeneration"]})
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("Gemma3ForConditionalGeneration (Gemma 3 with vision, gemma-3-4b and up)")
    assert "language_model.*" in message


def test_built_models_enumerate_their_linear_layers(tmp_path: Path) -> None:
    hf_config = transformers.Qwen3Config(**_TINY, head_dim=8, tie_word_embeddings=True)
    config = ModelConfig.from_hf_config(json.loads(hf_config.to_json_string()))
    weights = transformers.Qwen3ForCausalLM(hf_config).state_dict().items()
    model: CausalLM = build_model(config, weights, torch.float32, "cpu")
    linears = model.linear_layers()
    assert [(lin.layer, lin.role) for lin in linears] == [
        (layer, role) for layer in range(2) for role in ("qkv", "o", "gate_up", "down")
    ]
    for linear in linears:
        weight = getattr(linear.module, "weight")  # noqa: B009 - an nn.Module attribute
        assert tuple(weight.shape) == (sum(p.rows for p in linear.parts), linear.in_features)
    qkv = linears[0]
    assert [p.name for p in qkv.parts] == ["q_proj", "k_proj", "v_proj"]
    assert qkv.parts[1].weight_name == "model.layers.0.self_attn.k_proj.weight"
    replacement = torch.nn.Linear(qkv.in_features, sum(p.rows for p in qkv.parts))
    model.set_linear(0, "qkv", replacement)
    assert model.linear_layers()[0].module is replacement
    assert model.activation_dtype == torch.float32 and model.device.type == "cpu"
    assert not model.tensor_parallel and model.llama_stack() is not None


def test_engine_modules_import_no_model_class() -> None:
    """The engine names models through base.CausalLM and builds them through the registry."""
    for path in ENGINE_MODULES:
        tree = ast.parse((ROOT / path).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "service.engine.models.llama", path
                assert all(alias.name != "LlamaForCausalLM" for alias in node.names), path
            elif isinstance(node, ast.Import):
                assert all(alias.name != "service.engine.models.llama" for alias in node.names), path
            elif isinstance(node, ast.Name):
                assert node.id != "LlamaForCausalLM", path
            elif isinstance(node, ast.Attribute) and node.attr in ("embed_tokens", "decoder_layers"):
                raise AssertionError(f"{path}:{node.lineno} reaches into a model's attributes ({node.attr})")
