from tensorrt_llm._double import (
    LLM,
    BuildConfig,
    KvCacheConfig,
    LoRARequest,
    RequestError,
    SamplingParams,
)

__all__ = ["LLM", "BuildConfig", "KvCacheConfig", "LoRARequest", "RequestError", "SamplingParams"]
