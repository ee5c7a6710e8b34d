"""Built TensorRT engines, cached in the model store: build once per profile, reuse after.

Only for profiles that ask for a built engine (`trtllm_buildable`) on a tensorrt_llm that can
build (the 1.2 series' `_tensorrt_engine.LLM`); everything else loads the checkpoint on the
PyTorch backend, which needs no build.

The profile's slot (`EngineConfig.engine_cache_dir`, under NIM_CACHE_PATH/trtllm-engines/<profile
id>) holds `engine/` (what `LLM.save` wrote) and `manifest.json`: the tensorrt_llm version, the
build settings and the checkpoint it was built from. A slot is reused only when its manifest
matches exactly and the engine loads; a version or settings mismatch, a missing or corrupt engine
is rebuilt. Builds go to a temporary directory renamed into place, under an exclusive lock on the
slot, so concurrent starts (replicas sharing a volume) wait for one build and then reuse it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.engine.config import EngineConfig
from service.engine.trtllm.api import TrtllmApi
from service.util import one_line

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
ENGINE = "engine"


def load_or_build(api: TrtllmApi, config: EngineConfig, kwargs: dict[str, Any]) -> Any:
    """The LLM for `config`: the PyTorch backend over the checkpoint, or a cached / new engine.

    `kwargs` are the backend's own run-time arguments (`loading.llm_kwargs` or, for a built
    engine, `loading.engine_kwargs`); they are passed as they are."""
    if not config.build_engine:
        return api.LLM(str(config.model_path), **kwargs)
    assert config.engine_cache_dir is not None and api.EngineLLM is not None
    slot = config.engine_cache_dir
    build = build_settings(config)
    wanted = {
        "tensorrt_llm": api.version,
        "checkpoint": str(config.model_path),
        "build": build,
        "tokens_per_block": config.kv_cache.block_size,  # the paged KV layout is built in
    }
    runtime = kwargs
    with _locked(slot):
        found = _read_manifest(slot)
        if found == wanted and (slot / ENGINE).is_dir():
            try:
                llm = api.EngineLLM(str(slot / ENGINE), **runtime)
            except Exception as exc:  # a corrupt or partial engine: build it again
                log.warning(
                    "cached TensorRT engine in %s does not load (%s): rebuilding", slot, one_line(exc)
                )
            else:
                log.info("TensorRT engine reused from %s (tensorrt_llm %s)", slot, api.version)
                return llm
        elif found is not None:
            log.info(
                "cached TensorRT engine in %s was built for %s: rebuilding", slot, _difference(found, wanted)
            )
        started = time.monotonic()
        builder, build_config = api.EngineLLM, api.BuildConfig
        assert builder is not None and build_config is not None
        llm = builder(str(config.model_path), build_config=build_config(**build), **runtime)
        slot.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=slot))
        try:
            llm.save(str(staging / ENGINE))
            (staging / MANIFEST).write_text(json.dumps(wanted, indent=2, sort_keys=True))
            shutil.rmtree(slot / ENGINE, ignore_errors=True)
            (slot / MANIFEST).unlink(missing_ok=True)
            (staging / ENGINE).rename(slot / ENGINE)
            (staging / MANIFEST).rename(slot / MANIFEST)  # last: the slot is complete
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("TensorRT engine built in %.0f s and saved to %s", time.monotonic() - started, slot)
        return llm


def build_settings(config: EngineConfig) -> dict[str, Any]:
    """What a built engine is fixed to (BuildConfig's fields)."""
    settings: dict[str, Any] = {
        "max_batch_size": config.scheduler.max_num_seqs,
        "max_num_tokens": config.scheduler.max_num_batched_tokens,
    }
    if config.max_model_len is not None:
        settings["max_seq_len"] = config.max_model_len
    return settings


def _read_manifest(slot: Path) -> dict[str, Any] | None:
    try:
        found = json.loads((slot / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _difference(found: dict[str, Any], wanted: dict[str, Any]) -> str:
    keys = sorted(k for k in wanted if found.get(k) != wanted[k])
    return ", ".join(f"{k} {found.get(k)!r} (now {wanted[k]!r})" for k in keys) or "other settings"


@contextlib.contextmanager
def _locked(slot: Path) -> Iterator[None]:
    slot.parent.mkdir(parents=True, exist_ok=True)
    with (slot.parent / f"{slot.name}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another process building this slot: wait for it
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
