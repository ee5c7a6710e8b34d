from tensorrt_llm._double import LoraConfig

__all__ = ["LoraConfig"]
