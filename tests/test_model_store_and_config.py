"""Model resolution (never unpickling), the embedded model, and configuration errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from service.config_loading import ConfigError, load_settings
from service.model.config import ModelConfig
from service.selection.planning import make_plan, model_source
from service.store.checkpoint import ModelSource
from service.store.model_download import DownloadError
from service.store.model_store import (
    EMBEDDED_MODEL_NAME,
    ModelNotFoundError,
    PickledCheckpointError,
    embedded_model_path,
    install_embedded,
)


def resolve_model(model_name: str | None, served_model_name: str | None, cache_path: Path) -> ModelSource:
    """What `serve` loads for NIM_MODEL_NAME: the one resolution path (planning)."""
    settings = load_settings(
        model_name=model_name, served_model_name=served_model_name, cache_path=cache_path
    )
    return model_source(make_plan(settings), settings)


def test_embedded_model_is_found_without_network(tmp_path: Path) -> None:
    source = resolve_model(None, None, tmp_path)
    assert source.kind == "gguf"
    assert source.served_name == EMBEDDED_MODEL_NAME
    assert source.path == embedded_model_path()
    assert source.path.stat().st_size > 90_000_000
    # inspected once on the way: its config and tensor sizes from the GGUF headers, no store
    checkpoint = source.checkpoint
    assert checkpoint.config.architecture == "llama" and not checkpoint.is_model_store
    assert checkpoint.config == ModelConfig.from_gguf(gguf.GGUFReader(str(source.path)))
    assert checkpoint.tensors is not None
    assert 90_000_000 < checkpoint.tensors.nbytes < source.path.stat().st_size
    assert 134_000_000 < checkpoint.tensors.elements < 135_000_000  # SmolLM2-135M: a tied head counts once


def test_install_embedded_places_the_file(tmp_path: Path) -> None:
    placed = install_embedded(tmp_path)
    assert placed == tmp_path / EMBEDDED_MODEL_NAME / placed.name
    assert placed.stat().st_size == embedded_model_path().stat().st_size
    assert install_embedded(tmp_path) == placed  # idempotent
    assert embedded_model_path(tmp_path) == placed


def test_served_name_override(tmp_path: Path) -> None:
    assert resolve_model(None, "my-model", tmp_path).served_name == "my-model"


@pytest.mark.parametrize("name", ["model.bin", "model.pt", "model.pth", "model.ckpt"])
def test_pickled_files_are_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(b"\x80\x04")
    with pytest.raises(PickledCheckpointError, match="never loaded"):
        resolve_model(str(path), None, tmp_path)


def test_directory_with_only_pickles_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(PickledCheckpointError, match=r"pytorch_model\.bin"):
        resolve_model(str(tmp_path), None, tmp_path)


def test_directory_without_config_or_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_model(str(tmp_path), None, tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_model(str(tmp_path), None, tmp_path)


def test_nonexistent_path_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not an existing"):
        resolve_model(str(tmp_path / "missing.gguf"), None, tmp_path)


def test_uncached_hub_model_offline_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match=r"not (fully cached|in the cache)"):
        resolve_model("some-org/some-model", None, tmp_path)


def test_settings_from_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIM_SERVER_PORT", "9001")
    monkeypatch.setenv("NIM_LOG_LEVEL", "debug")
    monkeypatch.setenv("NIM_JSONL_LOGGING", "1")
    settings = load_settings()
    assert (settings.port, settings.log_level, settings.jsonl_logging) == (9001, "DEBUG", True)
    assert load_settings(port=9001, log_level="DEBUG").port == 9001  # flags agreeing with the environment
    with pytest.raises(ConfigError) as info:  # one that disagrees would silently drop a setting
        load_settings(port=8123)
    assert str(info.value) == "--port and NIM_SERVER_PORT='9001' disagree: give one of them"
    monkeypatch.delenv("NIM_SERVER_PORT")
    assert load_settings(port=8123).port == 8123


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("NIM_SERVER_PORT", "eighty"),
        ("NIM_SERVER_PORT", "70000"),
        ("NIM_LOG_LEVEL", "LOUD"),
        ("NIM_DTYPE", "int3"),
    ],
)
def test_invalid_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert var in message and "\n" not in message
