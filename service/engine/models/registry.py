"""The model class that runs each architecture family of service.model.architectures' table,
imported when a model is built (reading the table imports no model code)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from service.engine.models.base import BuildOptions, CausalLM
from service.model.architectures import ARCHITECTURES, UnsupportedModelError, unsupported
from service.model.config import ModelConfig

ModelClass = Callable[[ModelConfig, BuildOptions], CausalLM]


def model_class(family: str) -> ModelClass:
    """The class that runs `family` (a ModelConfig.architecture), imported now."""
    entry = next((e for e in ARCHITECTURES.values() if e.family == family), None)
    if entry is None:
        raise UnsupportedModelError(unsupported(repr(family)))
    return cast(ModelClass, getattr(importlib.import_module(entry.module), entry.class_name))
