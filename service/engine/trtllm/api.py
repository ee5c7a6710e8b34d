"""The TensorRT-LLM LLM API, imported only when a profile needs it, and what this install can do.

Capabilities are found by what imports, never by version strings: the PyTorch backend
(`tensorrt_llm.LLM`, the supported path from 1.2 on) is required; building TensorRT engines needs
`tensorrt_llm._tensorrt_engine` (the 1.2 series; removed in 1.3). `LoraConfig` moved between
releases (`tensorrt_llm._torch.peft.lora.config` in newer trees, `tensorrt_llm.lora_manager`
before), so it is looked up in both places. `CppExecutorError` (tensorrt_llm.executor) is what
its C++ executor raises when it fails as a whole; trtllm-serve treats it, alone, as fatal.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


class TrtllmUnavailableError(RuntimeError):
    """tensorrt_llm is missing or lacks what the adapter needs; the message says which."""


@dataclass(frozen=True)
class TrtllmApi:
    version: str
    LLM: Any  # tensorrt_llm.LLM (PyTorch backend)
    SamplingParams: Any
    KvCacheConfig: Any
    LoRARequest: Any
    RequestError: type[BaseException]  # one request failed inside the executor
    CppExecutorError: type[BaseException]  # the executor itself failed: the engine is dead
    LoraConfig: Any | None  # None: this install serves no LoRA
    EngineLLM: Any | None  # tensorrt_llm._tensorrt_engine.LLM: engines can be built and saved
    BuildConfig: Any | None
    GuidedDecodingParams: Any | None  # None: no structured output through this install

    @property
    def can_build_engines(self) -> bool:
        return self.EngineLLM is not None and self.BuildConfig is not None


class _NeverRaised(Exception):
    """Stands in for an exception class this install does not define."""


def _optional(module: str, name: str) -> Any | None:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def import_api() -> TrtllmApi:
    try:
        trtllm = importlib.import_module("tensorrt_llm")
        llmapi = importlib.import_module("tensorrt_llm.llmapi")
        api = TrtllmApi(
            version=str(getattr(trtllm, "__version__", "unknown")),
            LLM=trtllm.LLM,
            SamplingParams=trtllm.SamplingParams,
            KvCacheConfig=llmapi.KvCacheConfig,
            LoRARequest=llmapi.LoRARequest,
            RequestError=llmapi.RequestError,
            CppExecutorError=_optional("tensorrt_llm.executor", "CppExecutorError") or _NeverRaised,
            LoraConfig=_optional("tensorrt_llm._torch.peft.lora.config", "LoraConfig")
            or _optional("tensorrt_llm.lora_manager", "LoraConfig"),
            EngineLLM=_optional("tensorrt_llm._tensorrt_engine", "LLM"),
            BuildConfig=_optional("tensorrt_llm.llmapi", "BuildConfig"),
            GuidedDecodingParams=_optional("tensorrt_llm.llmapi", "GuidedDecodingParams"),
        )
    except (ImportError, AttributeError) as exc:
        raise TrtllmUnavailableError(
            f"tensorrt_llm does not provide the LLM API this adapter needs: {exc}"
        ) from exc
    return api
