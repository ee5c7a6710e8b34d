from tensorrt_llm._double import SERIES

if SERIES != "1.2":  # the TensorRT-engine backend is gone from the 1.3 series on
    raise ImportError("No module named 'tensorrt_llm._tensorrt_engine'")

from tensorrt_llm._double import TrtLLM as LLM

__all__ = ["LLM"]
