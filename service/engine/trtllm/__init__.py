"""The tensorrt_llm engine: TensorRT-LLM's LLM API behind our Engine interface.

Kept light on purpose: importing this package imports neither tensorrt_llm nor torch, so
selection can read `release` (what the installed release honours) without paying for them.
The registry's `load` imports the adapter (`loading`) only when a profile names tensorrt_llm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from service.engine.config import EngineConfig
    from service.engine.protocol import LoadedEngine


def load(config: EngineConfig, on_fatal: Callable[[BaseException], None] | None = None) -> LoadedEngine:
    from service.engine.trtllm.loading import load as load_adapter

    return load_adapter(config, on_fatal)
