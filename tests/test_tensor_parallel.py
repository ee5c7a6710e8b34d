"""Tensor-parallel sharding of the Llama family (service.engine.models.tensor_parallel).

The layout and the slicing of every weight format are checked directly; then two real processes
joined by gloo each build their shard of a tiny checkpoint and must compute the unsharded model's
logits and greedy tokens. Tolerances: float32 shards sum partial products in another order (1e-5
of the logits' scale); bfloat16 ones also round each rank's partial sum to bfloat16 before the
all-reduce, as Megatron does (3e-2 of the scale; measured 1.4e-2).
"""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from service.engine.models.attention import CausalAttention
from service.engine.models.base import BuildOptions, TensorParallel
from service.engine.models.loader import build_model, load_hf_dir
from service.engine.models.quant import FP8Weight, Int4Weight, Int8Weight
from service.engine.models.tensor_parallel import (
    ProcessGroupCollectives,
    TPLayout,
    shard_weights,
    slice_columns,
    slice_rows,
)
from service.model.config import ModelConfig, UnsupportedModelError
from service.model.quantization import QuantizationError

PROMPT = [5, 17, 99, 3, 249, 42, 7, 180, 66, 12, 201, 33]
GREEDY_TOKENS = 6


# The tiny Llama both kinds of test use, as transformers' config arguments.
TINY = dict(
    vocab_size=250,  # does not divide by 4: the last rank's vocabulary rows are padding
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def hf_config(**overrides) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**{**TINY, **overrides})


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_config(hf_config(**overrides).to_dict())


def test_layout_splits_heads_kv_heads_mlp_and_vocabulary() -> None:
    config = tiny_config()
    layouts = [TPLayout(config, rank, 2) for rank in range(2)]
    local = layouts[1].local_config()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 64, 125)
    assert [lay.kv_head_start for lay in layouts] == [0, 1]
    assert layouts[1].split_of("model.layers.0.self_attn.q_proj.weight") == ("rows", 32, 64)
    assert layouts[1].split_of("model.layers.0.self_attn.o_proj.weight") == ("columns", 32, 64)
    assert layouts[1].split_of("model.layers.1.mlp.down_proj.weight") == ("columns", 64, 128)
    assert layouts[1].split_of("model.layers.1.mlp.up_proj.weight") == ("rows", 64, 128)
    assert layouts[0].split_of("model.norm.weight") is None
    # Four ranks over two kv heads: ranks 0-1 share kv head 0, ranks 2-3 kv head 1.
    four = [TPLayout(config, rank, 4) for rank in range(4)]
    assert [lay.kv_head_start for lay in four] == [0, 0, 1, 1]
    assert four[3].split_of("lm_head.weight") == ("rows", 189, 252)  # padded past 250
    padded = four[3].shard("lm_head.weight", torch.ones(250, 64))
    assert isinstance(padded, torch.Tensor) and padded.shape == (63, 64) and padded[61:].abs().sum() == 0


def test_layout_refuses_sizes_that_do_not_divide() -> None:
    with pytest.raises(UnsupportedModelError, match="does not divide this model's 4 attention heads"):
        TPLayout(tiny_config(), 0, 3)
    with pytest.raises(UnsupportedModelError, match="kv heads"):
        TPLayout(tiny_config(hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 0, 2)


def test_row_parallel_biases_are_added_once() -> None:
    layouts = [TPLayout(tiny_config(), rank, 2) for rank in range(2)]
    bias = torch.arange(64.0)
    shards = [lay.shard("model.layers.0.self_attn.o_proj.bias", bias) for lay in layouts]
    assert torch.equal(sum(shards), bias)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_quantized_slices_are_slices_of_the_dequantized_weight(fmt: str) -> None:
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(0))
    quantized = {
        "int4": lambda: Int4Weight.quantize(weight, 32),
        "int8": lambda: Int8Weight.quantize(weight),
        "fp8": lambda: FP8Weight.quantize(weight),
    }[fmt]()
    whole = quantized.dequantize()
    rows = slice_rows(quantized, 32, 64, "w")
    columns = slice_columns(quantized, 64, 128, "w")
    assert torch.equal(rows.dequantize(), whole[32:64])  # type: ignore[union-attr]
    assert torch.equal(columns.dequantize(), whole[:, 64:128])  # type: ignore[union-attr]
    rows.validate("w")  # type: ignore[union-attr]
    columns.validate("w")  # type: ignore[union-attr]
    if fmt == "int4":
        with pytest.raises(QuantizationError, match="split its quantization groups of 32"):
            slice_columns(quantized, 16, 80, "w")


def randomize(model: torch.nn.Module) -> None:
    """Every parameter random and seeded: norms around 1, the rest small."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)


def _checkpoint(directory: Path, **overrides) -> Path:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config(**overrides))
    randomize(model)
    model.save_pretrained(directory)
    return directory


def _run(model, steps: int) -> tuple[np.ndarray, list[int]]:
    """Logits of PROMPT, then `steps` greedy tokens (recomputing the whole sequence each step)."""
    sequence = list(PROMPT)
    with torch.inference_mode():
        first = None
        for _ in range(steps):
            ids = torch.tensor(sequence)
            logits = model.compute_logits(model(ids, torch.arange(len(ids)), CausalAttention()))
            if first is None:
                first = logits.float().numpy()
            sequence.append(int(logits[-1].argmax()))
    assert first is not None
    return first, sequence[len(PROMPT) :]


def _rank_main(rank: int, size: int, directory: str, precision: str, dtype: str, out: str) -> None:
    """One rank: its shard of the checkpoint, joined to the others by gloo."""
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{out}.rendezvous", rank=rank, world_size=size
        )
        config, weights = load_hf_dir(Path(directory), precision)
        layout = TPLayout(config, rank, size)
        shards = shard_weights(weights, layout)
        options = BuildOptions(tensor_parallel=TensorParallel(ProcessGroupCollectives(), layout))
        model = build_model(layout.local_config(), shards, getattr(torch, dtype), "cpu", options)
        logits, tokens = _run(model, GREEDY_TOKENS)
        if rank == 0:
            np.save(f"{out}.logits.npy", logits)
            np.save(f"{out}.tokens.npy", np.array(tokens))
        torch.distributed.barrier()  # no rank tears gloo down while another still talks to it
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(f"{out}.rank{rank}.error").write_text(traceback.format_exc())
        raise


def _tensor_parallel(directory: Path, size: int, precision: str, dtype: str, out: Path):
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=_rank_main, args=(rank, size, str(directory), precision, dtype, str(out)))
        for rank in range(size)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    errors = [p.read_text() for p in out.parent.glob(f"{out.name}.rank*.error")]
    assert not errors, errors[0]
    assert all(p.exitcode == 0 for p in ranks), [p.exitcode for p in ranks]
    return np.load(f"{out}.logits.npy"), np.load(f"{out}.tokens.npy").tolist()


@pytest.mark.parametrize(
    ("case", "size", "precision", "dtype", "tolerance"),
    [
        ("float32", 2, "fp32", "float32", 1e-5),
        # One kv head for two ranks: replicated; tied embeddings: the vocab-parallel table is the head.
        ("replicated-kv-tied", 2, "fp32", "float32", 1e-5),
        # int8 weights quantized at load (per row, before sharding), bf16 activations.
        ("int8-bf16", 2, "int8_wo", "bfloat16", 3e-2),
    ],
)
def test_two_gloo_ranks_compute_the_unsharded_model(
    tmp_path: Path, case: str, size: int, precision: str, dtype: str, tolerance: float
) -> None:
    replicated = case == "replicated-kv-tied"
    overrides = {"num_key_value_heads": 1, "tie_word_embeddings": True} if replicated else {}
    directory = _checkpoint(tmp_path / "model", **overrides)
    config, weights = load_hf_dir(directory, precision)
    reference = build_model(config, weights, getattr(torch, dtype), "cpu")
    want_logits, want_tokens = _run(reference, GREEDY_TOKENS)
    got_logits, got_tokens = _tensor_parallel(directory, size, precision, dtype, tmp_path / "tp")
    assert got_logits.shape == want_logits.shape == (len(PROMPT), config.vocab_size)
    scale = float(np.abs(want_logits).max())
    error = float(np.abs(got_logits - want_logits).max())
    assert error <= tolerance * scale, (error, scale)
    assert got_tokens == want_tokens


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_read_their_shards_straight_from_the_files(tmp_path: Path, size: int) -> None:
    """Float weights: each rank's slices read from the safetensors files equal the whole tensors
    read and then sliced (vocabulary padding included); quantized-at-load weights are not read
    that way (they are quantized whole, then sliced)."""
    from service.engine.models.loader import hf_dir_shards

    directory = _checkpoint(tmp_path / "model")  # vocab 250: the last of 4 ranks is padded
    config, _ = load_hf_dir(directory, "bf16")
    for rank in range(size):
        layout = TPLayout(config, rank, size)
        direct = hf_dir_shards(directory, "bf16", layout)
        assert direct is not None
        got = dict(direct)
        _, weights = load_hf_dir(directory, "bf16")
        want = dict(shard_weights(weights, layout))
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert isinstance(tensor, torch.Tensor)
            assert torch.equal(got[name], tensor), name  # type: ignore[arg-type]
    assert hf_dir_shards(directory, "int8_wo", TPLayout(config, 0, 2)) is None
