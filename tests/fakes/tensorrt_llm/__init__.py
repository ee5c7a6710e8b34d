"""Test double of TensorRT-LLM (see tests/fakes/README.md). Never shipped."""

from tensorrt_llm._double import LLM, SamplingParams

__version__ = "1.2.1"
__all__ = ["LLM", "SamplingParams", "__version__"]
