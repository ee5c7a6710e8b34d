"""Test double of TensorRT-LLM (see tests/fakes/README.md). Never shipped."""

from tensorrt_llm._double import LLM, SamplingParams
from tensorrt_llm._double import VERSION as __version__

__all__ = ["LLM", "SamplingParams", "__version__"]
