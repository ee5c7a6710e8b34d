"""LoRA groundwork: PEFT adapters read and checked (service.engine.lora), and the batched LoRA term
of a mixed batch (service.engine.models.lora_ops) against merged weights W + scale * B @ A.

Adapters are written here in PEFT's saved layout (adapter_config.json, adapter_model.safetensors with
`base_model.model.model.layers.N.<block>.<proj>.lora_A/B.weight` keys) for a tiny Llama config.
Tolerance: float32 throughout; the batched path and the merged weight differ only in summation
order (1e-5 relative to the output's scale).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.engine.lora import (
    AdapterError,
    LoraAdapter,
    block_of,
    projection_shape,
    read_adapter,
    scan_source,
)
from service.engine.models.lora_ops import MIN_ROWS, NO_ADAPTER, LoraBatch, LoraStack
from service.model.config import ModelConfig

CONFIG = ModelConfig.from_hf_config(
    {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
)


def write_adapter(
    directory: Path,
    seed: int,
    rank: int = 4,
    alpha: float = 8.0,
    modules: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
    config: ModelConfig = CONFIG,
    std: float = 0.1,
    **settings: object,
) -> Path:
    """A random adapter for `config` in PEFT's saved layout (`settings` go into its config)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in modules:
            out_features, in_features = projection_shape(config, module)
            prefix = f"base_model.model.model.layers.{layer}.{block_of(module)}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    saved = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules)}
    saved.update(settings)
    (directory / "adapter_config.json").write_text(json.dumps(saved))  # NaN / Infinity as Python writes them
    return directory


def poison(directory: Path, value: float = float("nan")) -> Path:
    """Put `value` into one element of an adapter's first lora_A (layer 0, its first module)."""
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    key = min(k for k in tensors if k.endswith("lora_A.weight") and ".layers.0." in k)
    tensors[key][0, 0] = value
    save_file(tensors, str(path))
    return directory


def lie_about_offsets(directory: Path, extra: int = 64) -> Path:
    """Rewrite an adapter's weights file so that its header claims `extra` bytes more for one
    tensor than the file holds (the file's size unchanged)."""
    path = directory / "adapter_model.safetensors"
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    header[last]["data_offsets"][1] += extra
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    return directory


def truncate(directory: Path, keep: float = 0.5) -> Path:
    """Cut an adapter's weights file to a fraction of its size, as a half-finished copy leaves it."""
    path = directory / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return directory


def test_an_adapter_is_read_with_its_scales(tmp_path: Path) -> None:
    adapter = read_adapter(write_adapter(tmp_path / "a", seed=1), "a", CONFIG, max_rank=16)
    assert adapter.rank == 4 and len(adapter.modules) == 2 * 4
    weights = adapter.modules[(1, "down_proj")]
    assert weights.a.shape == (4, 128) and weights.b.shape == (64, 4) and weights.scale == 8.0 / 4
    rslora = read_adapter(write_adapter(tmp_path / "r", seed=1, use_rslora=True), "r", CONFIG, 16)
    assert rslora.modules[(0, "q_proj")].scale == pytest.approx(8.0 / math.sqrt(4))


def test_rank_and_alpha_patterns_apply_per_module(tmp_path: Path) -> None:
    directory = write_adapter(tmp_path / "p", seed=2, modules=("q_proj",), alpha_pattern={"q_proj": 2.0})
    adapter = read_adapter(directory, "p", CONFIG, 16)
    assert adapter.modules[(0, "q_proj")].scale == 2.0 / 4
    # A rank_pattern the stored shapes contradict is refused rather than scaled wrongly.
    bad = write_adapter(
        tmp_path / "q", seed=2, modules=("q_proj",), rank_pattern={"layers.1.self_attn.q_proj": 8}
    )
    with pytest.raises(AdapterError, match=r"layer 1 q_proj: lora_A \(4, 64\).*rank-8"):
        read_adapter(bad, "q", CONFIG, 16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "trained biases"),
        ({"modules_to_save": ["lm_head"]}, "fully trained modules"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "IA3"}, "only LORA adapters"),
        ({"r": 0}, "positive r"),
    ],
)
def test_what_the_engine_does_not_compute_is_refused(tmp_path: Path, change: dict, message: str) -> None:
    directory = write_adapter(tmp_path / "x", seed=3, **change)
    with pytest.raises(AdapterError, match=message):
        read_adapter(directory, "x", CONFIG, 16)


def test_bad_weights_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="rank 4 is above NIM_MAX_LORA_RANK=2"):
        read_adapter(write_adapter(tmp_path / "big", seed=4), "big", CONFIG, max_rank=2)
    pickled = tmp_path / "pickled"
    write_adapter(pickled, seed=4)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"only pickled weights \(adapter_model.bin\).*never opened"):
        read_adapter(pickled, "pickled", CONFIG, 16)
    q_proj = [f"base_model.model.model.layers.{{}}.self_attn.q_proj.lora_{p}.weight" for p in "AB"]
    wrong = {q_proj[0].format(0): torch.zeros(4, 32), q_proj[1].format(0): torch.zeros(64, 4)}
    _refused_with(tmp_path / "wrong", wrong, r"do not fit a rank-4 adapter of a \[64, 64\] projection")
    lm_head = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}
    _refused_with(tmp_path / "head", lm_head, "not a LoRA weight of a decoder projection")
    deep = {q_proj[0].format(5): torch.zeros(4, 64), q_proj[1].format(5): torch.zeros(64, 4)}
    _refused_with(tmp_path / "deep", deep, "targets layer 5; the model has 2")
    misplaced = {"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": torch.zeros(4, 64)}
    _refused_with(tmp_path / "misplaced", misplaced, "puts q_proj under mlp")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lora_alpha": float("nan")}, "positive lora_alpha .a finite number., has nan"),
        ({"lora_alpha": float("inf")}, "positive lora_alpha .a finite number., has inf"),
        ({"lora_alpha": -2.0}, "positive lora_alpha"),
        ({"r": 4.0}, r"positive r \(an integer\), has 4.0"),
        ({"r": True}, "positive r"),
        ({"alpha_pattern": {"q_proj": float("nan")}}, r"alpha_pattern\['q_proj'\] must be a finite positive"),
        (
            {"alpha_pattern": {"q_proj": float("-inf")}},
            r"alpha_pattern\['q_proj'\] must be a finite positive",
        ),
        ({"alpha_pattern": {"q_proj": "8"}}, r"alpha_pattern\['q_proj'\] must be a finite positive"),
        ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\] must be a positive integer, not 0"),
        ({"rank_pattern": {"q_proj": 4.5}}, r"rank_pattern\['q_proj'\] must be a positive integer"),
        ({"rank_pattern": {"q_proj(": 4}}, r"rank_pattern key 'q_proj\(' is not a valid regular expression"),
        ({"alpha_pattern": {"(?i)q_proj": 4}}, r"alpha_pattern key '\(\?i\)q_proj' is not a valid regular"),
        ({"rank_pattern": {"q{99999999999}": 4}}, "is not a valid regular expression"),
        ({"rank_pattern": ["q_proj"]}, "rank_pattern must be an object"),
    ],
)
def test_scales_and_patterns_are_checked_in_full(tmp_path: Path, change: dict, message: str) -> None:
    """NaN and Infinity (which Python's JSON reader accepts), non-integer ranks and patterns that
    do not compile are refused with the adapter's name, never served or raised as another error."""
    directory = write_adapter(tmp_path / "bad", seed=3, **change)
    with pytest.raises(AdapterError, match=rf"^adapter bad: .*{message}"):
        read_adapter(directory, "bad", CONFIG, 16)


@pytest.mark.parametrize(
    ("value", "alpha", "message"),
    [
        (float("nan"), 8.0, "lora_A holds NaN, infinite or too large values"),
        (float("inf"), 8.0, "lora_A holds NaN, infinite or too large values"),
        (-float("inf"), 8.0, "lora_A holds NaN, infinite or too large values"),
        (None, 1e300, r"lora_B holds NaN, .* \(.*scale included\)"),  # a finite alpha, too large
    ],
)
def test_non_finite_weights_are_refused(
    tmp_path: Path, value: float | None, alpha: float, message: str
) -> None:
    directory = write_adapter(tmp_path / "nan", seed=3, alpha=alpha)
    if value is not None:
        poison(directory, value)
    with pytest.raises(AdapterError, match=f"^adapter nan: layer 0 .*{message}"):
        read_adapter(directory, "nan", CONFIG, 16)


def test_damaged_weights_files_are_adapter_errors(tmp_path: Path) -> None:
    """A half-copied file, a header lying about its offsets or its own length, and files too
    short or not safetensors at all: each an AdapterError naming the adapter, never another one."""
    cases = {
        "half": (lambda d: truncate(d, 0.5), "is .* bytes but its header describes .*: truncated"),
        "header-only": (lambda d: truncate(d, 0.05), "is truncated or not a safetensors file"),
        "liar": (lie_about_offsets, "is .* bytes but its header describes"),
        "tiny": (lambda d: truncate(d, 0.0001), "is truncated or not a safetensors file"),
    }
    for name, (damage, message) in cases.items():
        directory = damage(write_adapter(tmp_path / name, seed=3))
        with pytest.raises(AdapterError, match=f"^adapter {name}: adapter_model.safetensors {message}"):
            read_adapter(directory, name, CONFIG, 16)
    weights = write_adapter(tmp_path / "huge-header", seed=3) / "adapter_model.safetensors"
    weights.write_bytes(struct.pack("<Q", 1 << 62) + weights.read_bytes()[8:])
    with pytest.raises(AdapterError, match="truncated or not a safetensors file"):
        read_adapter(weights.parent, "huge-header", CONFIG, 16)
    # The header adds up but one tensor overlaps another: the library's own checks, as AdapterError.
    overlap = write_adapter(tmp_path / "overlap", seed=3) / "adapter_model.safetensors"
    data = overlap.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    second = min(
        (k for k in header if k not in ("__metadata__", first)), key=lambda k: header[k]["data_offsets"][0]
    )
    header[second]["data_offsets"] = header[first]["data_offsets"]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    overlap.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    with pytest.raises(AdapterError, match=r"adapter overlap: adapter_model\.safetensors "):
        read_adapter(overlap.parent, "overlap", CONFIG, 16)
    # Far larger than any adapter of this model could be: refused before it is read whole.
    big = write_adapter(tmp_path / "big", seed=3) / "adapter_model.safetensors"
    with big.open("r+b") as file:
        file.truncate(64 << 20)
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors is larger than any valid one"):
        read_adapter(big.parent, "big", CONFIG, 16)


def test_files_linked_out_of_the_source_are_refused(tmp_path: Path) -> None:
    source = tmp_path / "loras"
    outside = write_adapter(tmp_path / "elsewhere", seed=7)
    for name in ("config-link", "weights-link", "inside-link"):
        write_adapter(source / name, seed=7)
    for name, file in (("config-link", "adapter_config.json"), ("weights-link", "adapter_model.safetensors")):
        (source / name / file).unlink()
        os.symlink(outside / file, source / name / file)
        with pytest.raises(AdapterError, match="outside"):  # without a source: the adapter's own directory
            read_adapter(source / name, name, CONFIG, 16)
        with pytest.raises(AdapterError, match=f"^adapter {name}: {file} resolves to .*, outside "):
            read_adapter(source / name, name, CONFIG, 16, source=source)
    # A link to another file inside the source is followed.
    weights = source / "inside-link" / "adapter_model.safetensors"
    weights.unlink()
    os.symlink(source / "config-link" / "adapter_model.safetensors", weights)
    assert read_adapter(source / "inside-link", "inside-link", CONFIG, 16, source=source).rank == 4


def _refused_with(directory: Path, tensors: dict[str, torch.Tensor], message: str) -> None:
    """An adapter whose weights file holds `tensors` is refused with `message`."""
    write_adapter(directory, seed=4, modules=("q_proj",))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=message):
        read_adapter(directory, directory.name, CONFIG, 16)


def test_the_source_lists_adapters_by_name_and_refuses_escapes(tmp_path: Path) -> None:
    source = tmp_path / "loras"
    write_adapter(source / "sql-expert", seed=5)
    write_adapter(source / "support.v2", seed=6)
    (source / "notes").mkdir()  # no adapter_config.json: not an adapter, not reported
    outside = write_adapter(tmp_path / "elsewhere", seed=7)
    os.symlink(outside, source / "escape")
    write_adapter(source / "-bad name", seed=8)
    found, skipped = scan_source(source)
    assert sorted(found) == ["sql-expert", "support.v2"]
    assert any(line.startswith("escape: resolves to") and "outside" in line for line in skipped)
    assert any("not a valid adapter name" in line for line in skipped)


def _adapters(tmp_path: Path, count: int) -> list[LoraAdapter]:
    return [
        read_adapter(write_adapter(tmp_path / f"a{i}", seed=10 + i, rank=2 + 2 * i), f"a{i}", CONFIG, 16)
        for i in range(count)
    ]


def test_a_mixed_batch_equals_each_rows_merged_weight(tmp_path: Path) -> None:
    """Four adapters of ranks 2-8 and rows without one, shuffled in one batch, through a fused
    q/k/v projection: every row's output equals x @ (W + scale * B @ A).T with its own adapter's
    merged weight for each part (W alone for none)."""
    adapters = _adapters(tmp_path, 4)
    parts = [(m, projection_shape(CONFIG, m)[0]) for m in ("q_proj", "k_proj", "v_proj")]
    in_features = CONFIG.hidden_size
    stack = LoraStack(in_features, parts, num_slots=4, max_rank=8, dtype=torch.float32)
    for slot, adapter in enumerate(adapters):
        stack.fill(slot, {m: _piece(adapter, 1, m) for m, _ in parts if (1, m) in adapter.modules})
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(stack.out_features, in_features, generator=generator) * 0.2
    slots = [2, NO_ADAPTER, 0, 3, 3, 1, NO_ADAPTER, 0, 2, 1, 3]
    x = torch.randn(len(slots), in_features, generator=generator)
    out = stack.apply(x @ base.T, x, LoraBatch.from_slots(slots))
    for row, slot in enumerate(slots):
        merged = base.clone()
        if slot != NO_ADAPTER:
            first = 0
            for module, size in parts:  # k_proj is not adapted: its rows stay W
                weights = adapters[slot].modules.get((1, module))
                if weights is not None:
                    merged[first : first + size] += weights.delta()
                first += size
        want = x[row] @ merged.T
        assert torch.allclose(out[row], want, rtol=0, atol=1e-5 * float(want.abs().max())), (row, slot)


def _piece(adapter: LoraAdapter, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    weights = adapter.modules[(layer, module)]
    return weights.a, weights.b, weights.scale


def test_sequences_become_rows_of_their_slots() -> None:
    batch = LoraBatch.from_sequences([1, NO_ADAPTER, 0, 1], [1, 3, 2, 2])
    # rows: seq0 -> 0, seq1 -> 1-3 (base), seq2 -> 4-5, seq3 -> 6-7; present slots [0, 1]
    assert batch.present.tolist() == [0, 1] and batch.segments == ((0, 2), (1, 3))
    assert batch.rows is not None and batch.rows.tolist() == [0, 4, 5, 6, 7]  # base rows left out
    assert batch.own is not None
    first, second = [True, False], [False, True]
    assert batch.own[:5, :, 0].tolist() == [second, first, first, second, second]
    assert batch.own.shape[0] == MIN_ROWS and not batch.own[5:].any()  # padding rows use no slot
    every = LoraBatch.from_sequences([1, NO_ADAPTER], [1, 3], num_slots=4)  # the engine's shapes
    assert every.present.tolist() == [0, 1, 2, 3] and every.segments == ((1, 1),)
    assert every.own is not None and every.own[0, :, 0].tolist() == [False, True, False, False]
    whole = LoraBatch.from_sequences([2, 2], [3, 1])  # every row uses the one slot
    assert whole.rows is None and whole.own is None
    some = LoraBatch.from_sequences([NO_ADAPTER, 2], [2, 2])  # one slot, base rows beside it
    assert some.rows is not None and some.rows.tolist() == [2, 3] and some.own is None
    assert LoraBatch.from_sequences([NO_ADAPTER], [4]).present.numel() == 0


def test_a_poisoned_slot_cannot_reach_other_rows(tmp_path: Path) -> None:
    """A slot holding NaN and infinite weights (filled directly, past the reader's checks) beside a
    good adapter and base rows in one batch, in float32 and bfloat16: base rows stay the base
    layer's bit for bit, as in a batch without adapters. With the poison in lora_A only (the
    stacks' lora_B finite, as the reader guarantees) the good adapter's rows are untouched too."""
    good = _adapters(tmp_path, 1)[0]
    parts = [(m, projection_shape(CONFIG, m)[0]) for m in ("q_proj", "k_proj", "v_proj")]
    in_features, q_size = CONFIG.hidden_size, projection_shape(CONFIG, "q_proj")[0]
    poisoned_a = torch.randn(4, in_features)
    poisoned_a[0, 0], poisoned_a[1, 3] = float("nan"), float("inf")
    poisoned_b = torch.randn(q_size, 4)
    poisoned_b[2, 1] = float("nan")
    slots = [NO_ADAPTER, 2, 0, NO_ADAPTER, 2, 0]
    for dtype in (torch.float32, torch.bfloat16):
        stack = LoraStack(in_features, parts, num_slots=3, max_rank=8, dtype=dtype)
        stack.fill(0, {m: _piece(good, 0, m) for m, _ in parts if (0, m) in good.modules})
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(6, in_features, generator=generator).to(dtype)
        base_out = torch.randn(6, stack.out_features, generator=generator).to(dtype)
        for b in (poisoned_b, torch.randn(q_size, 4)):
            stack.fill(2, {"q_proj": (poisoned_a, b, 2.0), "k_proj": (poisoned_a, torch.randn(32, 4), 1.0)})
            mixed = stack.apply(base_out.clone(), x, LoraBatch.from_slots(slots))
            for row in (0, 3):
                assert torch.equal(mixed[row], base_out[row]), (dtype, row)
            assert torch.isnan(mixed[1]).any() and torch.isnan(mixed[4]).any()  # its own rows, as it asks
        without = stack.apply(base_out.clone(), x, LoraBatch.from_slots([NO_ADAPTER, NO_ADAPTER, 0] * 2))
        for row in (2, 5):
            assert torch.isfinite(mixed[row]).all() and not torch.equal(mixed[row], base_out[row])
            assert torch.allclose(mixed[row].float(), without[row].float(), rtol=1e-2, atol=1e-2), (
                dtype,
                row,
            )


def test_rows_without_adapters_are_untouched_and_refilled_slots_forget(tmp_path: Path) -> None:
    smaller, larger = _adapters(tmp_path, 2)  # ranks 2 and 4
    out_features, in_features = projection_shape(CONFIG, "o_proj")
    stack = LoraStack(in_features, [("o_proj", out_features)], 3, 8, torch.bfloat16)
    stack.fill(1, {"o_proj": _piece(larger, 0, "o_proj")})
    x = torch.randn(5, in_features).to(torch.bfloat16)
    base_out = torch.randn(5, out_features).to(torch.bfloat16)
    assert torch.equal(stack.apply(base_out.clone(), x, LoraBatch.from_slots([NO_ADAPTER] * 5)), base_out)
    empty = stack.apply(base_out.clone(), x, LoraBatch.from_slots([0, 2, NO_ADAPTER, 0, 2]))
    assert torch.equal(empty, base_out)  # slots 0 and 2 hold nothing: zero weights
    slots = [1, NO_ADAPTER, 1, NO_ADAPTER, NO_ADAPTER]
    one = stack.apply(base_out.clone(), x, LoraBatch.from_slots(slots))
    assert torch.equal(one[1], base_out[1]) and not torch.equal(one[0], base_out[0])
    weights = larger.modules[(0, "o_proj")]
    want = base_out[0].float() + weights.scale * (x[0].float() @ weights.a.T) @ weights.b.T
    assert torch.allclose(one[0].float(), want, atol=5e-2)  # bfloat16 weights and activations
    # Refilled with a smaller rank: what the larger one left in the rank padding is gone.
    stack.fill(1, {"o_proj": _piece(smaller, 0, "o_proj")})
    again = stack.apply(base_out.clone(), x, LoraBatch.from_slots(slots))
    weights = smaller.modules[(0, "o_proj")]
    want = base_out[0].float() + weights.scale * (x[0].float() @ weights.a.T) @ weights.b.T
    assert torch.allclose(again[0].float(), want, atol=5e-2)
    stack.fill(1, {})  # nothing: the base layer alone
    assert torch.equal(stack.apply(base_out.clone(), x, LoraBatch.from_slots(slots)), base_out)
    with pytest.raises(ValueError, match="rank 12 is above"):
        stack.fill(0, {"o_proj": (torch.zeros(12, in_features), torch.zeros(out_features, 12), 1.0)})


def test_an_adapted_row_is_computed_alike_whatever_shares_its_step() -> None:
    """A row's LoRA term is bitwise the same alone, beside a few rows of other adapters and base
    rows, and among many (the engine's shapes: every slot present, rows padded to MIN_ROWS); with
    only the slots in use and no padding, the CPU's float32 matmul rounds small row counts apart."""
    parts = [(m, projection_shape(CONFIG, m)[0]) for m in ("q_proj", "k_proj", "v_proj")]
    in_features = CONFIG.hidden_size
    stack = LoraStack(in_features, parts, num_slots=4, max_rank=8, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    for slot in range(4):
        stack.fill(
            slot,
            {
                name: (
                    torch.randn(8, in_features, generator=generator),
                    torch.randn(out, 8, generator=generator),
                    0.5,
                )
                for name, out in parts
            },
        )
    x = torch.randn(40, in_features, generator=generator)
    base_out = torch.randn(40, stack.out_features, generator=generator)

    def term(slots: list[int]) -> torch.Tensor:
        batch = LoraBatch.from_sequences(slots, [1] * len(slots), num_slots=4)
        return stack.apply(base_out[: len(slots)].clone(), x[: len(slots)], batch)

    alone = term([1])[0]
    for slots in ([1, NO_ADAPTER, 2], [1, 0, 3, NO_ADAPTER, 2, 2], [1, *[0, 2, 3, NO_ADAPTER] * 9, 0, 3, 2]):
        assert torch.equal(term(slots)[0], alone), len(slots)
