from tensorrt_llm._double import (
    LLM,
    BuildConfig,
    GuidedDecodingParams,
    KvCacheConfig,
    LoRARequest,
    RequestError,
    SamplingParams,
)

__all__ = [
    "LLM",
    "BuildConfig",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "LoRARequest",
    "RequestError",
    "SamplingParams",
]
