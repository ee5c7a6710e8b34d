from tensorrt_llm._double import TrtLLM as LLM

__all__ = ["LLM"]
