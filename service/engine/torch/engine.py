"""The PyTorch engine as the API sees it: its core (service.engine.torch.core) driven on a thread
of this process by service.engine.async_engine.AsyncEngine."""

from __future__ import annotations

from service.engine.async_engine import AsyncEngine
from service.engine.torch.core import TorchEngineCore


class TorchEngine(AsyncEngine):
    """AsyncEngine over a TorchEngineCore (typed, for what reaches into the core: tests, benches)."""

    core: TorchEngineCore
