from tensorrt_llm._double import LoRARequest, RequestError

__all__ = ["LoRARequest", "RequestError"]
