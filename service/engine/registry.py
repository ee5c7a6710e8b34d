"""Engines by the profile's `llm_engine` tag: which can run in this build, and loading one.

The API and the entry point import this module and service.engine.protocol, never an engine
package: each engine's module is imported only when it is loaded, so a build without an
engine's dependencies (tensorrt_llm outside the gpu image) still starts and says why.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.engine.config import EngineConfig, UnsupportedConfigError
from service.engine.core import EngineCore
from service.engine.precision import TORCH_PRECISIONS, TRTLLM_PRECISIONS
from service.engine.protocol import LoadedEngine

# Called from the engine's own thread when its step loop dies.
FatalCallback = Callable[[BaseException], None]


@dataclass(frozen=True)
class EngineSupport:
    """What an engine can run, so selection never picks a profile the engine would refuse."""

    precisions: frozenset[str]
    max_tensor_parallel: int = 1
    max_pipeline_parallel: int = 1
    lora: bool = False

    def refusal(self, precision: str, tp: int, pp: int, lora: bool) -> str | None:
        """Why a profile with these tags cannot run on this engine, or None if it can."""
        if precision not in self.precisions:
            return f"runs {', '.join(sorted(self.precisions))} weights, not {precision}"
        if tp > self.max_tensor_parallel:
            return f"runs tensor parallelism up to {self.max_tensor_parallel}, not tp={tp}"
        if pp > self.max_pipeline_parallel:
            return f"does not run pipeline parallelism (pp={pp})"
        if lora and not self.lora:
            return "does not serve LoRA adapters yet"
        return None


@dataclass(frozen=True)
class EngineEntry:
    name: str
    module: str  # imported on load; provides `load(config, on_fatal) -> LoadedEngine`
    support: EngineSupport
    needs: str | None = None  # the package that must be importable for it to run
    # Its module also provides `load_core(config) -> EngineCore` (a synchronous core that a process
    # of its own can drive: NIM_ENGINE_PROCESS); False: it runs only as loaded.
    has_core: bool = False


ENGINES: dict[str, EngineEntry] = {
    "torch": EngineEntry(
        "torch",
        "service.engine.torch.loading",
        EngineSupport(precisions=TORCH_PRECISIONS, max_tensor_parallel=8, lora=True),
        needs="torch",
        has_core=True,
    ),
    "tensorrt_llm": EngineEntry(
        "tensorrt_llm",
        "service.engine.trtllm",
        EngineSupport(precisions=TRTLLM_PRECISIONS, max_tensor_parallel=8, lora=True),
        needs="tensorrt_llm",
    ),
}


@dataclass(frozen=True)
class Availability:
    engine: str
    available: bool
    reason: str = ""  # one line, when not available


def availability(name: str) -> Availability:
    entry = ENGINES.get(name)
    if entry is None:
        return Availability(name, False, f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}")
    if entry.needs is not None and importlib.util.find_spec(entry.needs) is None:
        return Availability(name, False, f"{entry.needs} is not installed in this image")
    return Availability(name, True)


def available_engines() -> dict[str, Availability]:
    return {name: availability(name) for name in ENGINES}


class EngineUnavailableError(RuntimeError):
    """The selected profile's engine cannot run in this build."""


def load_engine(config: EngineConfig, on_fatal: FatalCallback | None = None) -> LoadedEngine:
    """Load the engine `config.engine` names (blocking: weights are read here).

    Raises EngineUnavailableError, or UnsupportedConfigError for a setting the engine cannot
    honour; both carry a one-line message for the start-up log.
    """
    loaded: LoadedEngine = _module(config).load(config, on_fatal)
    return loaded


def load_core(config: EngineConfig) -> EngineCore:
    """The engine's synchronous core, for a process that drives it itself (the engine process);
    refused in one line for an engine that has none."""
    if not ENGINES.get(config.engine, ENGINES["torch"]).has_core:
        raise UnsupportedConfigError(f"the {config.engine} engine has no core a process of its own can drive")
    core: EngineCore = _module(config).load_core(config)
    return core


def _module(config: EngineConfig) -> Any:
    """The module of `config.engine`, once the engine is known to run here and take `config`."""
    state = availability(config.engine)
    if not state.available:
        raise EngineUnavailableError(f"engine {config.engine} cannot run here: {state.reason}")
    refusal = ENGINES[config.engine].support.refusal(
        config.precision,
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
        config.lora is not None,
    )
    if refusal is not None:
        raise UnsupportedConfigError(f"profile {config.profile_name}: the {config.engine} engine {refusal}")
    return importlib.import_module(ENGINES[config.engine].module)
