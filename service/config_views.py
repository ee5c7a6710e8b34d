"""What the settings mean downstream, derived from Settings' fields when asked: the LoRA, guided
decoding and scheduler limits the engine is given, the pending-request bound, the API keys, the
KV-cache share, the Python log level and the OTLP traces endpoint; what the validators found (the
model reference, the chat template's source); and the two longer checks across fields.

`SettingsViews` is a base of `service.config.Settings` (so callers read `settings.lora`); it declares
no fields itself (a pydantic base's annotations would become fields, ahead of Settings' own), and
types `self` as `_Fields`: the fields and views these read, which mypy checks Settings provides.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from pydantic import SecretStr

from service.config_values import LogLevel, lora_modules, split_list
from service.engine.config import DeviceKind, GuidedLimits, LoraConfig, SchedulerLimits, step_defaults
from service.store.model_uri import ModelRef


class _Fields(Protocol):
    """The Settings fields (and views) the views below read."""

    @property
    def _chat_template_source(self) -> str | None: ...
    @property
    def _service_links(self) -> tuple[str, ...]: ...
    @property
    def _model(self) -> ModelRef | None: ...

    @property
    def peft_source(self) -> Path | None: ...
    @property
    def lora_modules(self) -> str | None: ...
    @property
    def max_lora_rank(self) -> int | None: ...
    @property
    def max_gpu_loras(self) -> int | None: ...
    @property
    def max_cpu_loras(self) -> int | None: ...
    @property
    def peft_refresh_interval(self) -> float | None: ...
    @property
    def max_guided_spec_bytes(self) -> int: ...
    @property
    def guided_compile_timeout_seconds(self) -> float: ...
    @property
    def guided_compile_workers(self) -> int: ...
    @property
    def guided_cache_bytes(self) -> int: ...
    @property
    def otel_exporter_otlp_endpoint(self) -> str | None: ...
    @property
    def otel_exporter_otlp_traces_endpoint(self) -> str | None: ...
    @property
    def max_num_seqs(self) -> int | None: ...
    @property
    def max_num_batched_tokens(self) -> int | None: ...
    @property
    def max_pending_requests(self) -> int | None: ...
    @property
    def device(self) -> DeviceKind: ...
    @property
    def api_key(self) -> SecretStr | None: ...
    @property
    def kv_cache_percent(self) -> float | None: ...
    @property
    def log_level(self) -> LogLevel: ...
    @property
    def ssl_mode(self) -> str: ...
    @property
    def allow_runtime_lora_updating(self) -> bool: ...
    @property
    def lora(self) -> LoraConfig | None: ...
    @property
    def scheduler_limits(self) -> SchedulerLimits: ...
    def device_type(self) -> str: ...


class SettingsViews:
    """Derived views of `service.config.Settings` (its base: see the module docstring)."""

    def _check_ssl_files(self: _Fields, env_name: Callable[[str], str]) -> None:
        """NIM_SSL_MODE's files exist (Settings' validator; `env_name`: a field's variable)."""
        needed = {
            "TLS": ("ssl_key_path", "ssl_certs_path"),
            "MTLS": ("ssl_key_path", "ssl_certs_path", "ssl_ca_certs_path"),
        }
        for name in needed.get(self.ssl_mode, ()):
            path = getattr(self, name)
            if path is None or not Path(path).is_file():
                env = env_name(name)
                raise ValueError(
                    f"NIM_SSL_MODE={self.ssl_mode} needs {env} to name a readable file, got {path}"
                )

    def _check_lora_settings(self: _Fields, env_name: Callable[[str], str]) -> None:
        """The LoRA settings agree with each other (Settings' validator; `env_name`: a field's variable)."""
        if self.allow_runtime_lora_updating and self.peft_source is None:
            raise ValueError(
                "NIM_ALLOW_RUNTIME_LORA_UPDATING=1 needs NIM_PEFT_SOURCE: adapters are loaded at run "
                "time from inside it only"
            )
        limits = ("peft_refresh_interval", "max_lora_rank", "max_gpu_loras", "max_cpu_loras")
        if self.peft_source is None and not self.lora_modules:
            stray = [env_name(name) for name in limits if getattr(self, name) is not None]
            if stray:
                raise ValueError(
                    f"{', '.join(stray)} set without NIM_PEFT_SOURCE or NIM_LORA_MODULES: no adapters "
                    "are served"
                )
            return
        if self.peft_refresh_interval is not None and self.peft_source is None:
            raise ValueError(
                "NIM_PEFT_REFRESH_INTERVAL set without NIM_PEFT_SOURCE: there is nothing to rescan"
            )
        if self.peft_source is not None and not self.peft_source.is_dir():
            raise ValueError(f"NIM_PEFT_SOURCE={self.peft_source} is not a directory")
        lora = self.lora
        assert lora is not None
        if lora.max_cpu_loras < lora.max_gpu_loras:
            raise ValueError(
                f"NIM_MAX_CPU_LORAS={lora.max_cpu_loras} is below NIM_MAX_GPU_LORAS={lora.max_gpu_loras}: "
                "every adapter on the device is also kept in host memory"
            )

    @property
    def chat_template_source(self: _Fields) -> str | None:
        """NIM_CHAT_TEMPLATE's Jinja source (a file's text, read once at start), or None."""
        return self._chat_template_source

    @property
    def service_links(self: _Fields) -> tuple[str, ...]:
        """The NIM_* Kubernetes service-link variables ignored at start (logged once)."""
        return self._service_links

    @property
    def model(self: _Fields) -> ModelRef | None:
        """The model to serve, as NIM_MODEL_NAME and NIM_MODEL_PATH name it together (None: the
        embedded model)."""
        return self._model

    @property
    def lora(self: _Fields) -> LoraConfig | None:
        """The LoRA settings with their defaults filled in; None without NIM_PEFT_SOURCE or
        NIM_LORA_MODULES."""
        modules = lora_modules(self.lora_modules)
        if self.peft_source is None and not modules:
            return None
        return LoraConfig.with_defaults(
            self.peft_source,
            self.max_lora_rank,
            self.max_gpu_loras,
            self.max_cpu_loras,
            self.peft_refresh_interval,
            modules,
        )

    @property
    def guided_limits(self: _Fields) -> GuidedLimits:
        return GuidedLimits(
            self.max_guided_spec_bytes,
            self.guided_compile_timeout_seconds,
            self.guided_compile_workers,
            self.guided_cache_bytes,
        )

    @property
    def otlp_traces_endpoint(self: _Fields) -> str:
        if self.otel_exporter_otlp_traces_endpoint:
            return self.otel_exporter_otlp_traces_endpoint
        base = self.otel_exporter_otlp_endpoint or "http://localhost:4318"
        return base.rstrip("/") + "/v1/traces"

    @property
    def scheduler_limits(self: _Fields) -> SchedulerLimits:
        """NIM_MAX_NUM_SEQS and NIM_MAX_NUM_BATCHED_TOKENS as set (the engine resolves unset ones)."""
        return SchedulerLimits(self.max_num_seqs, self.max_num_batched_tokens)

    @property
    def pending_limit(self: _Fields) -> int:
        """NIM_MAX_PENDING_REQUESTS, else 4 x the sequences a step runs on the device the engine
        will run on (NIM_DEVICE; auto: CUDA when PyTorch sees a GPU)."""
        if self.max_pending_requests:
            return self.max_pending_requests
        return 4 * self.scheduler_limits.for_device(step_defaults(self.device_type())).max_num_seqs

    def device_type(self: _Fields) -> str:
        """Where NIM_DEVICE puts the engine, "cuda" or "cpu" (the rule of its choose_device)."""
        if self.device != "auto":
            return self.device
        import torch  # here, not at import: reading settings needs no torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def api_keys(self: _Fields) -> list[str]:
        if self.api_key is None:
            return []
        return [k.strip() for k in self.api_key.get_secret_value().split(",") if k.strip()]

    @staticmethod
    def split(value: str | None) -> list[str]:
        return split_list(value)

    @property
    def kv_cache_fraction(self: _Fields) -> float | None:
        """NIM_KV_CACHE_PERCENT as a fraction: values above 1 are percentages."""
        if self.kv_cache_percent is None:
            return None
        return self.kv_cache_percent / 100 if self.kv_cache_percent > 1 else self.kv_cache_percent

    @property
    def python_log_level(self: _Fields) -> str:
        return {"DEFAULT": "INFO", "TRACE": "DEBUG"}.get(self.log_level, self.log_level)
