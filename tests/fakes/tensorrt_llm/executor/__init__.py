from tensorrt_llm._double import CppExecutorError, LoRARequest, RequestError

__all__ = ["CppExecutorError", "LoRARequest", "RequestError"]
