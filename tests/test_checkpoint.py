"""One inspection of a checkpoint (service.store.checkpoint): each format, header byte counts equal to
the tensors' own, a model store decided once, a hub checkpoint sized from its headers without its
weights, and config.json read once on the way from planning to a loaded engine."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from huggingface_hub import constants
from safetensors.torch import load_file

from service.config_loading import load_settings
from service.engine.torch.loading import build_engine
from service.model.config import ModelConfig
from service.selection import planning
from service.selection.manifests import Architecture, Manifest
from service.selection.planning import make_plan, manifest_for, model_source
from service.serving import engine_config
from service.store.checkpoint import (
    CONFIG_FILE,
    TensorSizes,
    inspect_hub_config,
    inspect_local,
    safetensors_sizes,
)
from service.store.model_store import (
    EMBEDDED_MODEL_NAME,
    STORE_DESCRIPTOR,
    embedded_model_path,
    read_store_descriptor,
)
from tests.fake_hub import FakeHub
from tests.test_model_numerics import _write_gguf
from tests.test_quantization import _tiny_hf_model, write_modelopt_checkpoint
from tests.test_tensor_parallel_serving import _distinct_tokens

REPO_ID = "org/tiny-llama"


def _state_sizes(directory: Path) -> TensorSizes:
    """What the files hold, tensor by tensor, loaded (the reference the headers must equal)."""
    total = TensorSizes(0, 0)
    for file in sorted(directory.glob("*.safetensors")):
        for tensor in load_file(file).values():
            total += TensorSizes(tensor.nbytes, tensor.numel())
    return total


def _unique_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    _tiny_hf_model(seed=1).save_pretrained(directory)
    return directory


def test_a_safetensors_directory(llama_dir: Path) -> None:
    checkpoint = inspect_local(llama_dir)
    raw = json.loads((llama_dir / CONFIG_FILE).read_text())
    assert checkpoint.model_format == "hf_dir" and checkpoint.path == llama_dir
    assert checkpoint.metadata == raw
    assert checkpoint.config == ModelConfig.from_hf_config(raw)
    assert checkpoint.quantization is None and not checkpoint.is_model_store
    assert checkpoint.weight_files == (llama_dir / "model.safetensors",)
    assert checkpoint.tensors == _state_sizes(llama_dir)
    assert checkpoint.tensors.nbytes < (llama_dir / "model.safetensors").stat().st_size  # header excluded


def test_a_sharded_directory_counts_every_shard(tmp_path: Path) -> None:
    model = _tiny_hf_model(seed=2)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    checkpoint = inspect_local(tmp_path)
    assert checkpoint.weight_files == tuple(shards)
    assert checkpoint.tensors == _state_sizes(tmp_path)
    assert checkpoint.tensors is not None and checkpoint.tensors.elements == _unique_parameters(model)


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_counts_once(tied: bool, tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    tensors = inspect_local(tmp_path).tensors
    assert tensors is not None and tensors.elements == _unique_parameters(model)
    embedding = 128 * 32
    assert _unique_parameters(model) == sum(p.numel() for p in model.state_dict().values()) - (
        embedding if tied else 0
    )


def test_a_mixture_of_experts_counts_every_expert(tmp_path: Path) -> None:
    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(tmp_path)
    checkpoint = inspect_local(tmp_path)
    assert checkpoint.config.num_experts == 8
    assert checkpoint.tensors == _state_sizes(tmp_path)
    assert checkpoint.tensors is not None and checkpoint.tensors.elements == _unique_parameters(model)
    experts = 2 * 8 * 3 * 32 * 16  # layers x experts x (gate, up, down)
    assert checkpoint.tensors.elements > experts


@pytest.mark.parametrize("algo", ["FP8", "NVFP4"])
def test_a_modelopt_checkpoint(algo: str, tmp_path: Path) -> None:
    write_modelopt_checkpoint(_tiny_hf_model(seed=3), tmp_path, algo)
    checkpoint = inspect_local(tmp_path)
    assert checkpoint.quantization is not None
    assert checkpoint.quantization.quant_algo == algo
    assert checkpoint.quantization.precision == algo.lower()
    assert checkpoint.tensors == _state_sizes(tmp_path)


def test_a_gguf_file(tmp_path: Path) -> None:
    hf_model = _tiny_hf_model(seed=4)
    path = tmp_path / "tiny.gguf"
    q8 = gguf.GGMLQuantizationType.Q8_0

    def quantize(name: str) -> gguf.GGMLQuantizationType | None:
        return q8 if name.endswith("ffn_down.weight") else None

    _write_gguf(hf_model, "llama", path, quantize)
    checkpoint = inspect_local(path)
    assert checkpoint.model_format == "gguf" and checkpoint.path == path
    assert checkpoint.quantization is None and checkpoint.weight_files == ()
    assert checkpoint.config == ModelConfig.from_gguf(gguf.GGUFReader(str(path)))
    assert checkpoint.metadata["general.architecture"] == "llama"
    assert checkpoint.metadata["llama.block_count"] == hf_model.config.num_hidden_layers
    assert "tokenizer.ggml.tokens" not in checkpoint.metadata  # arrays stay in the file
    expected = TensorSizes(0, 0)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and hf_model.config.tie_word_embeddings:
            continue
        n = tensor.numel()
        stored = n // 32 * 34 if name.endswith("mlp.down_proj.weight") else n * 4  # Q8_0 blocks, F32
        expected += TensorSizes(stored, n)
    assert checkpoint.tensors == expected


def test_the_gguf_header_reader_reads_what_gguf_reads(tmp_path: Path) -> None:
    """The inspection's reader steps over string arrays (their length kept) and reads number arrays
    at once; every other field, and every number array, reads as gguf's own reader has it."""
    from service.model.gguf_file import _header_reader_class, gguf_strings

    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(3)
    writer.add_token_list(["a", "bb", "ccc", "\u00e9"])
    writer.add_token_types([1, 1, 3, 1])
    writer.add_token_scores([0.5, -1.0, 0.25, 2.0])
    writer.add_array("llama.attention.head_count", [4, 8, 4])
    writer.add_string("general.name", "tiny")
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = _header_reader_class()(str(path)), gguf.GGUFReader(str(path))
    assert ours.fields.keys() == theirs.fields.keys()
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert mine.types == field.types and len(mine.data) == len(field.data), key
        if field.types[:2] != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]:
            assert mine.contents() == field.contents(), key
    assert ours.fields["llama.attention.head_count"].contents() == [4, 8, 4]
    assert gguf_strings(ours, "tokenizer.ggml.tokens") == ["a", "bb", "ccc", "\u00e9"]
    assert [(t.name, t.n_bytes) for t in ours.tensors] == [(t.name, t.n_bytes) for t in theirs.tensors]


def test_header_sizes_equal_the_tensors_nbytes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        "a": torch.zeros(3, 5, dtype=torch.bfloat16),
        "b": torch.zeros(7, dtype=torch.float32),
        "c": torch.zeros(2, 2, 2, dtype=torch.int8),
        "scalar": torch.tensor(1.0),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    assert safetensors_sizes(tmp_path / "x.safetensors") == TensorSizes(
        sum(t.nbytes for t in tensors.values()), sum(t.numel() for t in tensors.values())
    )


def test_a_checkpoint_travels_pickled(llama_dir: Path) -> None:
    """Tensor-parallel workers receive it inside EngineConfig, pickled."""
    checkpoint = inspect_local(llama_dir)
    assert pickle.loads(pickle.dumps(checkpoint)) == checkpoint


def _gguf_store(tmp_path: Path) -> Path:
    """A model store made from the embedded profile (`create-model-store`'s layout), its GGUF linked."""
    plan = make_plan(load_settings(cache_path=tmp_path / "cache"))
    store = tmp_path / "store"
    store.mkdir()
    gguf_file = embedded_model_path()
    os.link(gguf_file, store / gguf_file.name)
    descriptor = {
        "model": plan.manifest.model,
        "profile_id": plan.profile.id,
        "profile_name": plan.profile.name,
        "files": [gguf_file.name],
    }
    (store / STORE_DESCRIPTOR).write_text(json.dumps(descriptor))
    return store


def test_a_model_store_is_decided_once_in_planning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _gguf_store(tmp_path)
    checkpoint = inspect_local(store, read_store_descriptor(store))
    assert checkpoint.is_model_store and checkpoint.model_format == "gguf"
    assert checkpoint.path == store / embedded_model_path().name

    settings = load_settings(model_name=str(store), cache_path=tmp_path / "cache")
    plan = make_plan(settings)
    assert plan.checkpoint is not None and plan.checkpoint.is_model_store
    fetched: list[object] = []
    monkeypatch.setattr(planning, "fetch_profile", lambda *args, **kw: fetched.append(args))
    source = model_source(plan, settings)
    assert source.checkpoint is plan.checkpoint and fetched == []  # nothing fetched, nothing re-read
    assert source.kind == "gguf" and source.served_name == EMBEDDED_MODEL_NAME


def test_an_hf_model_store_keeps_its_descriptor(llama_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "hf-store"
    store.mkdir()
    for file in llama_dir.iterdir():
        (store / file.name).write_bytes(file.read_bytes())
    (store / STORE_DESCRIPTOR).write_text(json.dumps({"model": "tiny", "profile_id": "x"}))
    checkpoint = inspect_local(store, read_store_descriptor(store))
    assert checkpoint.model_format == "hf_dir" and checkpoint.store == {"model": "tiny", "profile_id": "x"}


class _ConfigReads:
    """Counts every opening of a config.json: through pathlib (read_text and read_bytes open through
    Path.open) or the open() builtin (json.load(open(...)))."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        path_open, builtin_open = Path.open, open

        def opened_path(path: Path, *args: Any, **kwargs: Any) -> Any:
            self._note(path)
            return path_open(path, *args, **kwargs)

        def opened(file: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, str | Path):
                self._note(Path(file))
            return builtin_open(file, *args, **kwargs)

        monkeypatch.setattr(Path, "open", opened_path)
        monkeypatch.setattr("builtins.open", opened)

    def _note(self, path: Path) -> None:
        if path.name == CONFIG_FILE:
            self.paths.append(str(path))


@pytest.mark.parametrize("precision", ["fp32", "int8_wo"])
def test_config_json_is_read_once_from_plan_to_a_built_engine(
    precision: str, llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning inspects; the source, the EngineConfig, the loader, the weight cache's check and the
    tokenizer read the inspection (int8_wo: quantized at load, through the weight cache)."""
    directory = tmp_path / "model"
    directory.mkdir()
    for file in llama_dir.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    _distinct_tokens(directory)
    reads = _ConfigReads(monkeypatch)
    settings = load_settings(
        model_name=str(directory),
        cache_path=tmp_path / "cache",
        model_profile=f"torch-generic-{precision}-tp1-pp1-throughput",
        num_threads=1,
        max_model_len=256,
        kv_cache_max_tokens=1024,
    )
    plan = make_plan(settings)
    config = engine_config(settings, plan, model_source(plan, settings))
    assert config.checkpoint is plan.checkpoint
    assert (config.model_path, config.model_format) == (directory, "hf_dir")
    engine = build_engine(config)
    assert engine.info.architecture == plan.checkpoint.config.architecture
    assert reads.paths == [str(directory / CONFIG_FILE)]


# --- a hub checkpoint: headers over HTTP ranges, weights not downloaded ------------------------------


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """The fake hub as huggingface_hub's endpoint; no token, no offline switch from the environment."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with FakeHub() as fake:
        monkeypatch.setattr(constants, "ENDPOINT", fake.endpoint)  # HF_ENDPOINT, as read at import
        template = fake.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        yield fake


def _hub_settings(tmp_path: Path, **overrides: object):  # type: ignore[no-untyped-def]
    return load_settings(model_name=REPO_ID, cache_path=tmp_path / "cache", **overrides)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_hub_checkpoint_is_sized_from_its_headers_without_its_weights(
    sharded: bool, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _tiny_hf_model(seed=6)
    local = tmp_path / "repo"
    model.save_pretrained(local, **({"max_shard_size": "200KB"} if sharded else {}))
    hub.add_commit_from_dir(REPO_ID, local)
    weights = sum(f.stat().st_size for f in local.glob("*.safetensors"))

    settings = _hub_settings(tmp_path)
    sized = _record_sizes(monkeypatch)
    plan = make_plan(settings)
    checkpoint = plan.checkpoint
    assert checkpoint is not None and checkpoint.tensors == _state_sizes(local)
    assert checkpoint.weight_files == ()
    reads = [r for r in hub.transfers() if r.file and r.file.endswith(".safetensors")]
    assert reads and all(r.range is not None and r.sent <= 100_001 for r in reads), reads
    assert sum(r.sent for r in reads) < weights  # headers only: one 100 kB range per file at most
    assert sized == [(checkpoint.tensors.elements * 2, "bf16")]

    source = model_source(plan, settings)  # downloads the weights into the same snapshot
    assert source.path == checkpoint.path
    assert source.checkpoint.config is checkpoint.config  # config.json not parsed again
    assert source.checkpoint.weight_files and source.checkpoint.tensors == checkpoint.tensors


def test_unreadable_headers_fall_back_to_the_shape_estimate(
    hub: FakeHub, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repo whose weights are not model.safetensors (nor indexed) is sized from the config's shapes."""
    model = _tiny_hf_model(seed=7)
    local = tmp_path / "repo"
    model.save_pretrained(local)
    (local / "model.safetensors").rename(local / "weights.safetensors")
    hub.add_commit_from_dir(REPO_ID, local)
    sized = _record_sizes(monkeypatch)
    with caplog.at_level("INFO", logger="service.store.checkpoint"):
        plan = make_plan(_hub_settings(tmp_path))
    assert plan.checkpoint is not None and plan.checkpoint.tensors is None
    assert "safetensors headers not read" in caplog.text
    assert sized == [(planning._estimate_weights_bytes(plan.checkpoint.config), "bf16")]


def test_offline_a_hub_checkpoint_is_not_asked_for_headers(hub: FakeHub, tmp_path: Path) -> None:
    local = tmp_path / "repo"
    _tiny_hf_model(seed=8).save_pretrained(local)
    hub.add_commit_from_dir(REPO_ID, local)
    make_plan(_hub_settings(tmp_path))  # fills the cache with the config files
    hub.reset_stats()
    config_dir = next((tmp_path / "cache" / "hub").rglob(CONFIG_FILE)).parent
    checkpoint = inspect_hub_config(config_dir, REPO_ID, token=None, offline=True)
    assert checkpoint.tensors is None and hub.requests == []


def test_local_checkpoints_are_sized_from_their_headers(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unquantized (and GGUF) at bf16 for every element; ModelOpt at its stored bytes."""
    sized = _record_sizes(monkeypatch)
    manifest_for(load_settings(model_name=str(llama_dir)))
    tensors = inspect_local(llama_dir).tensors
    assert tensors is not None and sized == [(tensors.elements * 2, "bf16")]
    write_modelopt_checkpoint(_tiny_hf_model(seed=9), tmp_path / "fp8", "FP8")
    sized.clear()
    manifest_for(load_settings(model_name=str(tmp_path / "fp8")))
    assert sized == [(_state_sizes(tmp_path / "fp8").nbytes, "fp8")]
    _write_gguf(_tiny_hf_model(seed=10), "llama", tmp_path / "t.gguf")
    sized.clear()
    manifest_for(load_settings(model_name=str(tmp_path / "t.gguf")))
    assert sized == [(_unique_parameters(_tiny_hf_model(seed=10)) * 2, "bf16")]


def _record_sizes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(weights_bytes, bytes_precision) of every generic manifest planning makes."""
    sized: list[tuple[int, str]] = []
    original = planning.generic_manifest

    def recorded(
        model: str, repo: str, arch: Architecture, weights_bytes: int, *args: Any, **kwargs: Any
    ) -> Manifest:
        precision = args[1] if len(args) > 1 else kwargs.get("bytes_precision", "bf16")
        sized.append((weights_bytes, precision))
        return original(model, repo, arch, weights_bytes, *args, **kwargs)

    monkeypatch.setattr(planning, "generic_manifest", recorded)
    return sized
