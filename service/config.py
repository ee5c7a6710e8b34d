"""The one place configuration is declared: `Settings`, every NIM_* variable (and the few others
read) as a field with its default, bounds and description, and the checks across fields.

`Settings` is built once at start-up from NIM_* environment variables, with command-line flags
layered on top (service.config_loading.load_settings), and passed down explicitly. Nothing else in
the code base reads the environment. What the fields mean downstream (LoRA, guided and scheduler
limits, ...) is service.config_views, Settings' base; parsers of compound values are
service.config_values; the fields of a self-contained feature are a base class of their own
(service.config_responses, service.config_speculative).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.config_cpu import CpuFields
from service.config_responses import ResponsesStoreFields
from service.config_speculative import SpeculativeFields
from service.config_values import LogLevel, chat_template_source, lora_modules
from service.config_views import SettingsViews
from service.engine.config import (
    DEFAULT_GUIDED_CACHE_BYTES,
    DEFAULT_GUIDED_COMPILE_TIMEOUT_S,
    DEFAULT_GUIDED_COMPILE_WORKERS,
    DEFAULT_MAX_GUIDED_SPEC_BYTES,
    DeviceKind,
    DType,
    KVCacheDType,
)
from service.engine.precision import QUANTIZED_PRECISIONS
from service.store.model_uri import ModelRef, ModelRefError, resolve_model_ref


def _env_name(field: str) -> str:
    """The environment variable of a Settings field."""
    alias = Settings.model_fields[field].validation_alias
    assert isinstance(alias, AliasChoices)
    return str(alias.choices[0])


def _env(name: str) -> AliasChoices:
    return AliasChoices(name)


class Settings(SettingsViews, SpeculativeFields, ResponsesStoreFields, CpuFields, BaseSettings):
    """Service settings. Field docs are the configuration table in docs/configuration.md."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True, frozen=True)

    model_name: str | None = Field(
        None,
        validation_alias=_env("NIM_MODEL_NAME"),
        description="Model to serve: hub id (or hf://org/name[@revision]), local model directory or "
        ".gguf file; unset = embedded. NIM 1.x's name for NIM_MODEL_PATH: given both, they must agree.",
    )
    model_path: str | None = Field(
        None,
        validation_alias=_env("NIM_MODEL_PATH"),
        description="NIM 2.x's name for the model to serve: hf://org/name[@revision], a local "
        "directory or file (or file:///path), or a plain hub id; ngc:// and other remote sources "
        "are refused with why.",
    )
    _model: ModelRef | None = PrivateAttr(None)
    served_model_name: str | None = Field(
        None,
        validation_alias=_env("NIM_SERVED_MODEL_NAME"),
        description="Name the API reports and accepts in `model`; default derived from the model.",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        validation_alias=_env("NIM_MAX_MODEL_LEN"),
        description="Context length (prompt + completion); default the model's own.",
    )
    host: str = Field("0.0.0.0", validation_alias=_env("NIM_SERVER_HOST"), description="Address to bind.")
    port: int = Field(
        8000, ge=1, le=65535, validation_alias=_env("NIM_SERVER_PORT"), description="HTTP port."
    )
    log_level: LogLevel = Field("DEFAULT", validation_alias=_env("NIM_LOG_LEVEL"), description="Log level.")
    jsonl_logging: bool = Field(
        False, validation_alias=_env("NIM_JSONL_LOGGING"), description="Emit logs as JSON lines."
    )
    cache_path: Path = Field(
        Path("~/.cache/nim").expanduser(),
        validation_alias=_env("NIM_CACHE_PATH"),
        description="Model and engine cache directory.",
    )
    dtype: DType = Field(
        "auto",
        validation_alias=_env("NIM_DTYPE"),
        description="Weight/activation dtype; auto = bfloat16 where the hardware runs it fast, else float32. "
        "With NIM_MODEL_PROFILE naming an int8_wo or int4_wo profile: the dtype its activations compute in.",
    )
    quantization: str | None = Field(
        None,
        validation_alias=_env("NIM_QUANTIZATION"),
        description="Only consider profiles of this quantized precision (fp8, nvfp4, int8_wo, int4_wo; "
        "vLLM's --quantization); NIM_DTYPE then stays auto.",
    )
    device: DeviceKind = Field(
        "auto", validation_alias=_env("NIM_DEVICE"), description="auto = CUDA when available, else CPU."
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        le=4096,
        validation_alias=_env("NIM_MAX_NUM_SEQS"),
        description="Most requests generating at once; more wait in the queue. "
        "Default 256 on CUDA, 64 on CPU.",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=16,
        validation_alias=_env("NIM_MAX_NUM_BATCHED_TOKENS"),
        description="Token budget of one engine step: decode tokens plus chunks of long prompts. "
        "Default 8192 on CUDA GPUs of 70 GiB or more, 2048 on smaller ones, 1024 on CPU.",
    )
    kv_cache_dtype: KVCacheDType = Field(
        "auto",
        validation_alias=_env("NIM_KV_CACHE_DTYPE"),
        description="KV cache element type; int8 and fp8 (e4m3) store about half the bytes of bf16.",
    )
    kv_cache_percent: float | None = Field(
        None,
        gt=0,
        le=100,
        validation_alias=AliasChoices("NIM_KV_CACHE_PERCENT", "NIM_KVCACHE_PERCENT"),
        description="Share of free memory (after weights) for the KV cache, as a fraction (0.9) or "
        "percent (90); default 0.9 on CUDA, 0.1 on CPU. On CUDA the largest step's activations and "
        "the decode graphs, measured at start, come out of the share first. NIM 1.x's "
        "NIM_KVCACHE_PERCENT is read too.",
    )
    kv_cache_max_tokens: int | None = Field(
        None,
        ge=16,
        validation_alias=_env("NIM_KV_CACHE_MAX_TOKENS"),
        description="Cap the KV cache at this many tokens (wins over the percentage when smaller).",
    )
    kv_block_size: int = Field(
        16,
        ge=16,
        le=1024,
        multiple_of=16,
        validation_alias=_env("NIM_KV_BLOCK_SIZE"),
        description="Tokens per KV cache block (the unit of allocation and prefix reuse); a multiple of 16.",
    )
    enable_kv_cache_reuse: bool = Field(
        True,
        validation_alias=_env("NIM_ENABLE_KV_CACHE_REUSE"),
        description="Prefix caching: reuse the keys/values of identical prompt prefixes; 0 turns it off.",
    )
    model_profile: str | None = Field(
        None,
        validation_alias=_env("NIM_MODEL_PROFILE"),
        description="Profile to run: a 64-hex id, a readable name, or `default`; unset = automatic.",
    )
    profile_type: Literal["throughput", "latency"] = Field(
        "throughput",
        validation_alias=_env("NIM_PROFILE_TYPE"),
        description="Which profiles automatic selection prefers: throughput (smallest tp) or latency.",
    )
    tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        validation_alias=_env("NIM_TENSOR_PARALLEL_SIZE"),
        description="Only consider profiles with this tensor-parallel size; torch profiles are sharded to "
        "it at load (on the CPU tensor parallelism runs only when this asks for it).",
    )
    system_info: Path | None = Field(
        None,
        validation_alias=_env("NIM_SYSTEM_INFO"),
        description="A system description (JSON from the `detect` command) used instead of detecting one.",
    )
    cuda_visible_devices: str | None = Field(
        None,
        validation_alias=_env("CUDA_VISIBLE_DEVICES"),
        description="GPUs this process may use (CUDA's own variable, applied to NVML's inventory).",
    )
    hf_token: SecretStr | None = Field(
        None, validation_alias=_env("HF_TOKEN"), description="Token for gated or private hub models."
    )
    hf_hub_offline: bool = Field(
        False,
        validation_alias=AliasChoices("HF_HUB_OFFLINE", "NIM_DISABLE_MODEL_DOWNLOAD"),
        description="Never contact the hub: serve and download only from the cache. NIM 2.x's "
        "NIM_DISABLE_MODEL_DOWNLOAD is read too.",
    )
    api_key: SecretStr | None = Field(
        None,
        validation_alias=_env("NIM_API_KEY"),
        description="Require `Authorization: Bearer <key>` on the API (comma-separate several keys).",
    )
    api_keys_file: Path | None = Field(
        None,
        validation_alias=_env("NIM_API_KEYS_FILE"),
        description="File of accepted API keys, one per line; re-read when it changes.",
    )
    cors_allow_origins: str | None = Field(
        None,
        validation_alias=_env("NIM_CORS_ALLOW_ORIGINS"),
        description="Comma-separated origins allowed by CORS (`*` for any); unset = no CORS headers.",
    )
    cors_allow_methods: str = Field(
        "GET,POST,OPTIONS", validation_alias=_env("NIM_CORS_ALLOW_METHODS"), description="CORS methods."
    )
    cors_allow_headers: str = Field(
        "Authorization,Content-Type,X-Request-Id",
        validation_alias=_env("NIM_CORS_ALLOW_HEADERS"),
        description="CORS request headers.",
    )
    cors_expose_headers: str = Field(
        "X-Request-Id",
        validation_alias=_env("NIM_CORS_EXPOSE_HEADERS"),
        description="Response headers a browser script may read (comma-separated).",
    )
    cors_max_age: int = Field(
        600,
        ge=0,
        validation_alias=_env("NIM_CORS_MAX_AGE"),
        description="Seconds a browser may cache a preflight answer.",
    )
    max_pending_requests: int | None = Field(
        None,
        ge=1,
        validation_alias=_env("NIM_MAX_PENDING_REQUESTS"),
        description="Generation requests accepted at once (running + queued); beyond it 429 with "
        "Retry-After. Default 4 x NIM_MAX_NUM_SEQS.",
    )
    max_request_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        validation_alias=_env("NIM_MAX_REQUEST_BYTES"),
        description="Largest request body accepted; larger ones get 413.",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, validation_alias=_env("NIM_MAX_PROMPT_TOKENS"), description="Cap on prompt tokens (400)."
    )
    max_completion_tokens: int | None = Field(
        None,
        ge=1,
        validation_alias=_env("NIM_MAX_COMPLETION_TOKENS"),
        description="Cap on max_tokens / max_completion_tokens a request may ask for (400).",
    )
    request_timeout_seconds: float | None = Field(
        None,
        gt=0,
        validation_alias=_env("NIM_REQUEST_TIMEOUT_SECONDS"),
        description="Abort a generation that runs longer (504, or an error frame when streaming).",
    )
    always_include_usage: bool = Field(
        False,
        validation_alias=_env("NIM_ALWAYS_INCLUDE_USAGE"),
        description="End every stream with the usage chunk, as if stream_options.include_usage were set "
        "(gateways meter tokens from it).",
    )
    ssl_mode: Literal["DISABLED", "TLS", "MTLS"] = Field(
        "DISABLED",
        validation_alias=_env("NIM_SSL_MODE"),
        description="DISABLED (plain HTTP), TLS (HTTPS), or MTLS (HTTPS that requires client certificates).",
    )
    ssl_key_path: Path | None = Field(
        None, validation_alias=_env("NIM_SSL_KEY_PATH"), description="Server private key (PEM)."
    )
    ssl_certs_path: Path | None = Field(
        None, validation_alias=_env("NIM_SSL_CERTS_PATH"), description="Server certificate chain (PEM)."
    )
    ssl_ca_certs_path: Path | None = Field(
        None,
        validation_alias=_env("NIM_SSL_CA_CERTS_PATH"),
        description="CA bundle that client certificates must chain to (MTLS).",
    )
    shutdown_grace_seconds: float = Field(
        30.0,
        ge=0,
        validation_alias=_env("NIM_SHUTDOWN_GRACE_SECONDS"),
        description="On SIGTERM, how long in-flight requests may run on before the server stops.",
    )
    enforce_eager: bool = Field(
        False,
        validation_alias=AliasChoices("NIM_ENFORCE_EAGER", "NIM_DISABLE_CUDA_GRAPH"),
        description="1: run every step eagerly: no CUDA graphs, no scripted CPU decode step (debugging). "
        "Unset, a decode graph that fails to capture or whose replay differs from the eager step at "
        "start is dropped with a log line (its batch sizes run eagerly). NIM 2.x's "
        "NIM_DISABLE_CUDA_GRAPH is read too.",
    )
    unified_attention: Literal["auto", "off"] = Field(
        "auto",
        validation_alias=_env("NIM_UNIFIED_ATTENTION"),
        description="auto: on CUDA, steps with prompt chunks attend through one Triton kernel per layer once "
        "a start-up check of every launch shape agrees with the gathered attention (else they gather, "
        "with a log line); off: they always gather the cache blocks.",
    )
    fp8_scaled_mm: Literal["auto", "scaled-mm", "off"] = Field(
        "auto",
        validation_alias=_env("NIM_FP8_SCALED_MM"),
        description="fp8 profiles on GPUs of compute capability 8.9+: auto runs torch._scaled_mm, and steps "
        "of at most 16 rows through a Triton fp8 rows kernel, each once a start-up check against the "
        "dequantized matmul passes (else the next path, with a log line); scaled-mm: _scaled_mm at every "
        "size; off: emulated (weights dequantized for each matmul).",
    )
    engine_process: Literal["auto", "on", "off"] = Field(
        "auto",
        validation_alias=_env("NIM_ENGINE_PROCESS"),
        description="Run the engine core in a process of its own, so the API's event loop and the step "
        "loop never share an interpreter lock: on, off, or auto (on for CUDA with one rank, falling back "
        "to in process with a log line when the engine process cannot start; off on CPUs, where both "
        "would share the cores a step needs). The torch engine only: on with tensorrt_llm is refused.",
    )
    fused_kernels: bool = Field(
        False,
        validation_alias=_env("NIM_FUSED_KERNELS"),
        description="1: on CUDA, run norms, SiLU-mul and RoPE as fused Triton kernels once a start-up check "
        "against PyTorch's ops passes (else PyTorch's, with a log line); experimental.",
    )
    collective_timeout_seconds: float | None = Field(
        None,
        gt=0,
        validation_alias=_env("NIM_COLLECTIVE_TIMEOUT_SECONDS"),
        description="Tensor parallelism: a collective not complete by then (a hung rank) fails the engine; "
        "default 60. Refused when the profile runs one rank.",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        validation_alias=_env("NIM_NUM_THREADS"),
        description="CPU threads for the PyTorch engine; default all available cores.",
    )

    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = Field(
        None,
        validation_alias=_env("NIM_TOOL_CALL_PARSER"),
        description="The model's tool-call format; unset = recognised from its chat template.",
    )
    chat_template: str | None = Field(
        None,
        validation_alias=_env("NIM_CHAT_TEMPLATE"),
        description="The chat template conversations are rendered with instead of the model's (its "
        "tool_use template too): an existing file is read, otherwise a value holding `{{` or `{%` is "
        "the template itself; rendered in the same sandbox as the model's own.",
    )
    _chat_template_source: str | None = PrivateAttr(None)
    _service_links: tuple[str, ...] = PrivateAttr(())  # Kubernetes service links ignored (nim_variables)
    trust_request_chat_template: bool = Field(
        False,
        validation_alias=_env("NIM_TRUST_REQUEST_CHAT_TEMPLATE"),
        description="1: a request may bring its own `chat_template` (sandboxed, and bounded in size, CPU "
        "time and the memory it builds); unset, such a request is refused with 400 (vLLM's "
        "--trust-request-chat-template).",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None,
        validation_alias=_env("NIM_REASONING_PARSER"),
        description="Split a reasoning model's thinking from its answer into `reasoning_content`; unset = "
        "recognised from the chat template where it shows the format, else off.",
    )
    enable_auto_tool_choice: bool = Field(
        True,
        validation_alias=_env("NIM_ENABLE_AUTO_TOOL_CHOICE"),
        description="0: tool_choice auto is refused (400); required and named calls still work.",
    )
    guided_decoding_backend: Literal["xgrammar", "llguidance", "outlines", "lm-format-enforcer"] | None = (
        Field(
            None,
            validation_alias=_env("NIM_GUIDED_DECODING_BACKEND"),
            description="Structured-output backend; unset = xgrammar where installed. The torch engine runs "
            "xgrammar only (others are refused at start); tensorrt_llm takes xgrammar or llguidance.",
        )
    )
    max_guided_spec_bytes: int = Field(
        DEFAULT_MAX_GUIDED_SPEC_BYTES,
        ge=256,
        le=64 * 1024 * 1024,
        validation_alias=_env("NIM_MAX_GUIDED_SPEC_BYTES"),
        description="Largest structured-output constraint (JSON schema, regex, grammar, choice list, in "
        "UTF-8 bytes) a request may give; larger ones get 400 before anything is compiled.",
    )
    guided_compile_timeout_seconds: float = Field(
        DEFAULT_GUIDED_COMPILE_TIMEOUT_S,
        gt=0,
        le=3600,
        validation_alias=_env("NIM_GUIDED_COMPILE_TIMEOUT_SECONDS"),
        description="Longest a constraint may take to compile; the compile is stopped and the request "
        "gets 400.",
    )
    guided_compile_workers: int = Field(
        DEFAULT_GUIDED_COMPILE_WORKERS,
        ge=1,
        le=64,
        validation_alias=_env("NIM_GUIDED_COMPILE_WORKERS"),
        description="Constraints compiled at once, each in a worker process (started on first use); "
        "further compiles wait.",
    )
    guided_cache_bytes: int = Field(
        DEFAULT_GUIDED_CACHE_BYTES,
        ge=0,
        validation_alias=_env("NIM_GUIDED_CACHE_BYTES"),
        description="Memory for compiled constraints kept for reuse (least recently used out); "
        "0 keeps only those of requests in flight.",
    )
    peft_source: Path | None = Field(
        None,
        validation_alias=_env("NIM_PEFT_SOURCE"),
        description="LoRA adapter directory: one subdirectory per adapter (PEFT format), requested by "
        "its name as `model`. The NIM_*LORA* settings below are refused without it.",
    )
    peft_refresh_interval: float | None = Field(
        None,
        gt=0,
        validation_alias=_env("NIM_PEFT_REFRESH_INTERVAL"),
        description="Seconds between rescans of NIM_PEFT_SOURCE (new adapters appear, removed ones go "
        "once their requests end); unset = scanned once at start.",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        le=256,
        validation_alias=_env("NIM_MAX_LORA_RANK"),
        description="Largest adapter rank served (adapters above it are refused); default 32. Device "
        "memory for adapters grows with it.",
    )
    max_gpu_loras: int | None = Field(
        None,
        ge=1,
        validation_alias=_env("NIM_MAX_GPU_LORAS"),
        description="Adapters resident on the device at once (requests of others wait); default 8.",
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        validation_alias=_env("NIM_MAX_CPU_LORAS"),
        description="Adapters kept read in host memory (least recently used out); default 16, at least "
        "NIM_MAX_GPU_LORAS.",
    )
    lora_modules: str | None = Field(
        None,
        validation_alias=_env("NIM_LORA_MODULES"),
        description="Adapters to serve besides NIM_PEFT_SOURCE's, as name=path (comma-separated; "
        "vLLM's --lora-modules); each is read and checked at start, and a bad one stops it.",
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        validation_alias=AliasChoices("NIM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
        description="1: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) load and unload "
        "adapters at run time, from inside NIM_PEFT_SOURCE only; vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING is read too.",
    )
    seed: int | None = Field(
        None,
        ge=0,
        validation_alias=_env("NIM_SEED"),
        description="Seed of the random draws of requests that send no seed (vLLM's --seed): the same "
        "requests in the same order sample the same after a restart; unset: each draws at random.",
    )
    passthrough_args: str | None = Field(
        None,
        validation_alias=_env("NIM_PASSTHROUGH_ARGS"),
        description="serve flags, vLLM's names included (--max-model-len 8192 --enable-prefix-caching); "
        "a vLLM flag this server cannot honour is refused by name, and a flag that disagrees with "
        "its variable or the command line stops the start.",
    )
    dynamo_namespace: str = Field(
        "nim",
        pattern=r"^[A-Za-z0-9_-]+$",
        validation_alias=_env("NIM_DYNAMO_NAMESPACE"),
        description="Dynamo roles (dynamo-worker, dynamo-router): the Dynamo namespace the workers register "
        "in and the router routes over (endpoint <namespace>.backend.generate); one per deployment.",
    )
    dynamo_discovery: Literal["file", "etcd", "kubernetes"] = Field(
        "file",
        validation_alias=_env("NIM_DYNAMO_DISCOVERY"),
        description="Dynamo roles: how workers and the router find each other: file (a directory every "
        "process shares, DYN_FILE_KV; one machine or a shared volume), etcd (ETCD_ENDPOINTS) or kubernetes "
        "(the pods' API objects). Requests go over TCP and KV events over ZMQ either way (no NATS).",
    )
    dynamo_file_kv: Path | None = Field(
        None,
        validation_alias=_env("DYN_FILE_KV"),
        description="Dynamo's own variable: the file-discovery directory (read by Dynamo; shown in the "
        "start-up line). Unset: Dynamo's default under the system temp directory.",
    )
    dynamo_router_mode: Literal["kv", "round-robin"] = Field(
        "kv",
        validation_alias=_env("NIM_DYNAMO_ROUTER_MODE"),
        description="dynamo-router: kv sends each request to the worker whose prefix cache holds most of "
        "its prompt (Dynamo's KV router, fed by the workers' KV events); round-robin takes turns.",
    )
    dynamo_router_track_active_blocks: bool = Field(
        False,
        validation_alias=_env("NIM_DYNAMO_ROUTER_TRACK_ACTIVE_BLOCKS"),
        description="dynamo-router, kv mode: also weigh each worker by the KV blocks of the requests in "
        "flight on it (Dynamo's default, on). Off here: under concurrency it sent conversations away "
        "from the worker holding their prefix (bench/README.md).",
    )
    enable_otel: bool | None = Field(
        None,
        validation_alias=_env("NIM_ENABLE_OTEL"),
        description="Export a span per API request over OpenTelemetry; unset = on when "
        "OTEL_EXPORTER_OTLP_ENDPOINT is set, 1 = required (start fails without the SDK), 0 = off.",
    )
    otel_exporter_otlp_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_ENDPOINT", "NIM_OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="OTLP/HTTP collector base URL (traces go to <url>/v1/traces), e.g. http://otel:4318.",
    )
    otel_exporter_otlp_traces_endpoint: str | None = Field(
        None,
        validation_alias=_env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        description="Full OTLP/HTTP traces URL; wins over OTEL_EXPORTER_OTLP_ENDPOINT.",
    )
    otel_traces_exporter: Literal["otlp", "console", "none"] = Field(
        "otlp",
        validation_alias=AliasChoices("OTEL_TRACES_EXPORTER", "NIM_OTEL_TRACES_EXPORTER"),
        description="Where spans go: otlp (the collector), console (the log), none (off).",
    )
    otel_service_name: str = Field(
        "nim-torch",
        validation_alias=AliasChoices("OTEL_SERVICE_NAME", "NIM_OTEL_SERVICE_NAME"),
        description="service.name on spans.",
    )

    @model_validator(mode="after")
    def _ssl_files(self) -> Settings:
        self._check_ssl_files(_env_name)
        return self

    @model_validator(mode="after")
    def _model_ref(self) -> Settings:
        try:
            self._model = resolve_model_ref(self.model_name, self.model_path)
        except ModelRefError as exc:
            raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _one_precision(self) -> Settings:
        if self.quantization is not None and self.dtype != "auto":
            raise ValueError(
                f"NIM_QUANTIZATION={self.quantization} and NIM_DTYPE={self.dtype}: a quantized profile's "
                "precision decides its dtype; set one of them"
            )
        return self

    @model_validator(mode="after")
    def _lora_settings(self) -> Settings:
        self._check_lora_settings(_env_name)
        return self

    @model_validator(mode="after")
    def _read_chat_template(self) -> Settings:
        if self.chat_template is not None:
            self._chat_template_source = chat_template_source(self.chat_template)
        return self

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, value: str | None) -> str | None:
        lora_modules(value)  # ValueError for a malformed list
        return value

    @field_validator("quantization")
    @classmethod
    def _quantized(cls, value: str | None) -> str | None:
        if value is not None and value not in QUANTIZED_PRECISIONS:
            raise ValueError(f"one of {', '.join(sorted(QUANTIZED_PRECISIONS))}")
        return value

    @field_validator("otel_traces_exporter", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("log_level", "ssl_mode", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator(
        "model_name",
        "served_model_name",
        "model_profile",
        "otel_exporter_otlp_endpoint",
        "otel_exporter_otlp_traces_endpoint",
        mode="before",
    )
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value
