"""Tensor parallelism of mixture-of-experts models (Qwen3-MoE, Mixtral).

Each expert is split over its intermediate dimension (gate/up rows, down columns), the router is
replicated, and one all-reduce of the weighted routed sum completes a routed layer. Checked as
tests/test_tensor_parallel.py checks dense models: the layout directly; two real processes joined
by gloo computing the unsharded model's logits (float32: 1e-5 of their scale, the dense tests'
tolerance) and greedy tokens; each rank's slices read straight from the files equal to the whole
tensors sliced; and the real server at NIM_TENSOR_PARALLEL_SIZE=2 answering with transformers'
greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import tokenizers
import torch

from service.engine.models.loader import build_model, hf_dir_shards, load_hf_dir
from service.engine.models.tensor_parallel import TPLayout, shard_weights
from service.model.config import ModelConfig, UnsupportedModelError
from tests.test_model_moe import _hf_greedy, _hf_model, _write
from tests.test_quantization import serving
from tests.test_tensor_parallel import GREEDY_TOKENS, PROMPT, _run, _tensor_parallel

TP2 = "torch-generic-fp32-tp2-pp1-throughput"


def _config(family: str, **overrides: object) -> ModelConfig:
    return ModelConfig.from_hf_config({**_hf_model(family).config.to_dict(), **overrides})


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(request.param, tmp_path_factory)


def test_layout_splits_every_expert_over_its_intermediate_dimension() -> None:
    qwen, mixtral = _config("qwen3_moe"), _config("mixtral")  # expert intermediate 32 and 64
    rank1 = TPLayout(qwen, 1, 2)
    assert rank1.local_config().moe_intermediate_size == 16
    assert rank1.local_config().intermediate_size == 48  # the dense layer's MLP, as for Llama
    assert rank1.split_of("model.layers.0.mlp.experts.5.gate_proj.weight") == ("rows", 16, 32)
    assert rank1.split_of("model.layers.0.mlp.experts.5.up_proj.weight") == ("rows", 16, 32)
    assert rank1.split_of("model.layers.0.mlp.experts.5.down_proj.weight") == ("columns", 16, 32)
    assert rank1.split_of("model.layers.1.mlp.gate_proj.weight") == ("rows", 48, 96)  # dense layer
    assert rank1.split_of("model.layers.0.mlp.gate.weight") is None  # the router: replicated
    mixtral1 = TPLayout(mixtral, 1, 2)
    assert mixtral1.split_of("model.layers.2.block_sparse_moe.experts.3.w1.weight") == ("rows", 32, 64)
    assert mixtral1.split_of("model.layers.2.block_sparse_moe.experts.3.w3.weight") == ("rows", 32, 64)
    assert mixtral1.split_of("model.layers.2.block_sparse_moe.experts.3.w2.weight") == ("columns", 32, 64)
    assert mixtral1.split_of("model.layers.2.block_sparse_moe.gate.weight") is None
    with pytest.raises(
        UnsupportedModelError, match="does not divide this model's expert intermediate size 30"
    ):
        TPLayout(_config("qwen3_moe", moe_intermediate_size=30), 0, 4)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_two_gloo_ranks_compute_the_unsharded_moe_model(
    family: str, tmp_path_factory, tmp_path: Path
) -> None:
    directory = _write(family, tmp_path_factory)
    config, weights = load_hf_dir(directory, "fp32")
    reference = build_model(config, weights, torch.float32, "cpu")
    want_logits, want_tokens = _run(reference, GREEDY_TOKENS)
    got_logits, got_tokens = _tensor_parallel(directory, 2, "fp32", "float32", tmp_path / "tp")
    assert got_logits.shape == want_logits.shape == (len(PROMPT), config.vocab_size)
    scale = float(np.abs(want_logits).max())
    error = float(np.abs(got_logits - want_logits).max())
    print(f"{family} tp2 fp32: max |logit diff| = {error:.3g} of {scale:.3g}")
    assert error <= 1e-5 * scale, (error, scale)
    assert got_tokens == want_tokens


def test_ranks_read_their_expert_slices_straight_from_the_files(checkpoint: Path) -> None:
    config, _ = load_hf_dir(checkpoint, "bf16")
    for rank in range(2):
        layout = TPLayout(config, rank, 2)
        direct = hf_dir_shards(checkpoint, "bf16", layout)
        assert direct is not None
        got = dict(direct)
        _, weights = load_hf_dir(checkpoint, "bf16")
        want = dict(shard_weights(weights, layout))
        assert got.keys() == want.keys()
        assert any(".experts.3." in name for name in got)
        for name, tensor in want.items():
            assert isinstance(tensor, torch.Tensor)
            assert torch.equal(got[name], tensor), name  # type: ignore[arg-type]


def test_stacked_experts_are_sliced_per_expert(checkpoint: Path, tmp_path: Path) -> None:
    """A file holding transformers 5's stacked experts shards as the per-expert one does."""
    import transformers
    from safetensors.torch import save_file

    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    stacked = {name: t.contiguous() for name, t in reference.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in stacked)
    stacked_dir = tmp_path / "stacked"
    stacked_dir.mkdir()
    (stacked_dir / "config.json").write_text((checkpoint / "config.json").read_text())
    save_file(stacked, str(stacked_dir / "model.safetensors"))
    config, _ = load_hf_dir(checkpoint, "fp32")
    layout = TPLayout(config, 1, 2)
    from_stacked = hf_dir_shards(stacked_dir, "fp32", layout)
    assert from_stacked is not None
    got = build_model(layout.local_config(), from_stacked, torch.float32, "cpu").state_dict()
    _, weights = load_hf_dir(checkpoint, "fp32")
    want = build_model(layout.local_config(), shard_weights(weights, layout), torch.float32, "cpu")
    assert got.keys() == want.state_dict().keys()
    for name, tensor in want.state_dict().items():
        assert torch.equal(got[name], tensor), name


def test_the_server_at_tensor_parallel_two_answers_with_transformers_tokens(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    directory = _write("qwen3_moe", tmp_path_factory)
    prompt = "Once upon a time"
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    env = {"NIM_MODEL_PROFILE": TP2, "NIM_TENSOR_PARALLEL_SIZE": "2", "NIM_MODEL_NAME": str(directory)}
    with serving(tmp_path / "server.log", env) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        log = server.log()
    tokens = out.choices[0].logprobs.tokens if out.choices[0].logprobs is not None else None
    assert tokens is not None
    assert [vocab[t] for t in tokens] == _hf_greedy(directory, tokenizer.encode(prompt).ids)
    assert "qwen3_moe" in log and "rank 0 of 2" in log
