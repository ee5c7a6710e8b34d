"""Scale-out on NVIDIA Dynamo 1.6: replicas of this engine as Dynamo workers, this server's API in
front of Dynamo's KV-aware router. Dynamo is optional (`pip install 'nim-torch[dynamo]'` plus
`pip install --no-deps ai-dynamo==1.6.1`); nothing outside this package imports it.

    requests.py    Dynamo's request / chunk dicts <-> GenerationRequest / RequestOutput (FIELDS:
                   what happens to each request field)
    kv_publish.py  the engine's prefix-cache events -> Dynamo's KV event publisher, in cache order
    cards.py       what a worker registers: the model directory, and a WorkerCard for the router
    worker.py      `nim-torch dynamo-worker`: the profile's engine as a Dynamo LLMEngine
    routed.py      `nim-torch dynamo-router`: the API over RoutedEngine, an Engine that routes
    local.py       one machine: N workers and the router as child processes (recipe, tests, bench)

docs/dynamo.md describes the deployment and the disaggregated prefill/decode design.
"""

from __future__ import annotations

import importlib.metadata

from pydantic import AliasChoices

from service.config import Settings

DYNAMO_VERSION = "1.6.1"  # the unified backend is beta: the API is pinned to this release
INSTALL = f"pip install 'nim-torch[dynamo]' && pip install --no-deps ai-dynamo=={DYNAMO_VERSION}"


def missing() -> str | None:
    """Why the Dynamo roles cannot run here (one line), or None when they can."""
    for package in ("ai-dynamo-runtime", "ai-dynamo"):
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return f"{package} is not installed ({INSTALL})"
        if version != DYNAMO_VERSION:
            return f"{package} {version} is installed; this release needs {DYNAMO_VERSION} ({INSTALL})"
    try:
        import dynamo.common.backend
        import dynamo.llm  # noqa: F401
    except Exception as exc:  # an import error of the extension, a missing dependency
        return f"Dynamo {DYNAMO_VERSION} does not import: {type(exc).__name__}: {exc}"
    return None


# Which Dynamo role reads each setting: "engine" (dynamo-worker), "api" (dynamo-router), or both. A
# setting given to the role that does not read it is named in one warning line at start.
_BOTH = (
    "model_name", "model_path", "passthrough_args", "served_model_name", "log_level", "jsonl_logging",
    "cache_path", "hf_token", "hf_hub_offline",
    "dynamo_namespace", "dynamo_discovery", "dynamo_file_kv", "max_guided_spec_bytes",
    "guided_compile_timeout_seconds", "guided_compile_workers", "guided_cache_bytes",
)  # fmt: skip
_ENGINE = (
    "max_model_len", "dtype", "device", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype",
    "kv_cache_percent", "kv_cache_max_tokens", "kv_block_size", "enable_kv_cache_reuse", "model_profile",
    "profile_type", "tensor_parallel_size", "system_info", "cuda_visible_devices", "enforce_eager",
    "unified_attention", "fp8_scaled_mm", "compact_logits", "dense_prompt_rows", "cpu_int4_kernel",
    "cpu_fused_ops", "engine_process", "fused_kernels",
    "collective_timeout_seconds", "num_threads", "guided_decoding_backend", "peft_source",
    "peft_refresh_interval", "max_lora_rank", "max_gpu_loras", "max_cpu_loras", "lora_modules",
    "quantization", "speculative_config", "draft_model_path",
)  # fmt: skip
_API = (
    "host", "port", "api_key", "api_keys_file", "cors_allow_origins", "cors_allow_methods",
    "cors_allow_headers", "max_pending_requests", "max_request_bytes", "max_prompt_tokens",
    "max_completion_tokens", "request_timeout_seconds", "always_include_usage", "ssl_mode", "ssl_key_path",
    "ssl_certs_path", "ssl_ca_certs_path", "shutdown_grace_seconds", "tool_call_parser", "chat_template",
    "trust_request_chat_template", "reasoning_parser", "enable_auto_tool_choice", "dynamo_router_mode",
    "dynamo_router_track_active_blocks", "enable_otel", "otel_exporter_otlp_endpoint",
    "otel_exporter_otlp_traces_endpoint", "otel_traces_exporter", "otel_service_name", "cors_expose_headers",
    "cors_max_age", "allow_runtime_lora_updating", "seed", "responses_store_max_count",
    "responses_store_max_bytes",
)  # fmt: skip
SETTING_ROLES: dict[str, str] = {
    **dict.fromkeys(_BOTH, "both"),
    **dict.fromkeys(_ENGINE, "engine"),
    **dict.fromkeys(_API, "api"),
}


def unused_settings(settings: Settings, role: str) -> list[str]:
    """The variables set (away from their defaults) that `role` ("engine" or "api") does not read."""
    unused = []
    for name, field in type(settings).model_fields.items():
        if SETTING_ROLES.get(name, "both") in ("both", role):
            continue
        if getattr(settings, name) != field.default:
            alias = field.validation_alias
            unused.append(str(alias.choices[0]) if isinstance(alias, AliasChoices) else name)
    return unused
