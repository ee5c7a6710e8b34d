"""From settings to a serving model: plan, fetch, configure, load, meter, start.

The entry point's side of the engine seam. Settings (the environment) and the selected profile
become one typed `EngineConfig` here, once; the registry loads the engine the profile names;
metering wraps it; the API receives a `Ready` and never sees Settings fields it does not own or
an engine package.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from importlib import resources

from service.api.app import BringUp, FatalHandler
from service.api.state import ModelInfo, Ready
from service.config import Settings
from service.engine.config import (
    PRECISION_DTYPES,
    DType,
    EngineConfig,
    KVCacheConfig,
    LoraConfig,
    SchedulerLimits,
)
from service.engine.precision import PRECISION_SPECS
from service.engine.process import ENGINE_PROCESS_SETTING, EngineProcessError, load_in_process, not_in_process
from service.engine.protocol import LoadedEngine, PathChoice
from service.engine.registry import load_engine
from service.selection.manifests import Profile
from service.selection.planning import Plan, make_plan, model_source
from service.store.checkpoint import ModelSource
from service.store.license import model_license
from service.telemetry.metering import MeteredEngine
from service.telemetry.metrics import Metrics
from service.text.tokenizer import Tokenizer
from service.util import on_new_thread, one_line

log = logging.getLogger(__name__)


def engine_config(settings: Settings, plan: Plan, source: ModelSource) -> EngineConfig:
    """The engine's whole configuration: the profile's tags, with the operator's overrides.

    The profile decides engine, precision, tp/pp and LoRA (NIM_DTYPE and NIM_TENSOR_PARALLEL_SIZE
    take part in selecting it); an explicit NIM_KV_CACHE_DTYPE overrides the profile's KV cache
    dtype, which is logged.
    """
    profile = plan.profile
    kv_dtype = profile.kv_cache_dtype
    if settings.kv_cache_dtype != "auto" and settings.kv_cache_dtype != kv_dtype:
        if kv_dtype != "auto":
            log.info(
                "NIM_KV_CACHE_DTYPE=%s overrides profile %s's KV cache dtype %s",
                settings.kv_cache_dtype,
                profile.name,
                kv_dtype,
            )
        kv_dtype = settings.kv_cache_dtype
    lora = settings.lora
    if lora is None and profile.feat_lora:
        lora = LoraConfig.with_defaults(None, profile.lora_max_rank)
    return EngineConfig(
        engine=profile.llm_engine,
        model_path=source.path,
        model_format=source.kind,
        checkpoint=source.checkpoint,
        served_name=source.served_name,
        profile_name=profile.name,
        precision=profile.precision,
        dtype=_activation_dtype(settings, profile),
        device=settings.device,
        tensor_parallel_size=profile.tp,
        pipeline_parallel_size=profile.pp,
        max_model_len=settings.max_model_len,
        scheduler=SchedulerLimits(settings.max_num_seqs, settings.max_num_batched_tokens),
        kv_cache=KVCacheConfig(
            dtype=kv_dtype,  # type: ignore[arg-type]  # profiles carry the same vocabulary
            block_size=settings.kv_block_size,
            memory_fraction=settings.kv_cache_fraction,
            max_tokens=settings.kv_cache_max_tokens,
            enable_prefix_caching=settings.enable_kv_cache_reuse,
        ),
        lora=lora,
        enforce_eager=settings.enforce_eager,
        collective_timeout_s=settings.collective_timeout_seconds,
        fused_kernels=settings.fused_kernels,
        unified_attention=settings.unified_attention == "auto",
        fp8_scaled_mm=settings.fp8_scaled_mm != "off",
        fp8_rows_kernel=settings.fp8_scaled_mm == "auto",
        compact_logits=settings.compact_logits != "off",
        w8a8_logits=settings.compact_logits == "auto",
        dense_prompt_rows=settings.dense_prompt_rows == "auto",
        w4a8_int4=settings.cpu_int4_kernel == "auto",
        cpu_fused_ops=settings.cpu_fused_ops == "auto",
        num_threads=settings.num_threads,
        weight_cache_dir=settings.cache_path / "quantized",
        build_engine=profile.trtllm_buildable,
        guided_decoding_backend=settings.guided_decoding_backend,
        guided=settings.guided_limits,
        engine_cache_dir=settings.cache_path / "trtllm-engines" / profile.id,
        speculative=settings.speculative,
    )


def _activation_dtype(settings: Settings, profile: Profile) -> DType:
    """What the engine computes in: a float profile's own dtype; for a weight-only profile
    (int8_wo, int4_wo) NIM_DTYPE's, which selection only lets through where NIM_MODEL_PROFILE names
    the profile; else "auto" (the hardware's choice: service.engine.torch.device.choose_dtype)."""
    if profile.precision in PRECISION_DTYPES:
        return PRECISION_DTYPES[profile.precision]
    return settings.dtype if PRECISION_SPECS[profile.precision].weight_only else "auto"


# SmolLM2-Instruct's own chat template renders no tools; this one (Hermes format) does, and renders
# exactly as that template without them. It goes with the model's template, so the embedded model
# gets it however it was named (no model, its path, a copy of the file) and so do SmolLM2 checkpoints.
EMBEDDED_TOOL_TEMPLATE = "smollm2_tool_use.jinja"
SMOLLM2_TEMPLATE_SHA256 = "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788"


def embedded_tool_template() -> str:
    """The tool-rendering template shipped for the embedded model (package data of service.text)."""
    return resources.files("service.text").joinpath("templates", EMBEDDED_TOOL_TEMPLATE).read_text("utf-8")


def shipped_tool_template(templates: Mapping[str, str]) -> str | None:
    """The tool_use template this server ships for a model with these chat templates: the Hermes
    one for SmolLM2-Instruct's own template (recognised by its text) when the model has no tool_use
    template of its own; else None."""
    default = templates.get("default")
    if "tool_use" in templates or default is None:
        return None
    if hashlib.sha256(default.encode("utf-8")).hexdigest() != SMOLLM2_TEMPLATE_SHA256:
        return None
    return embedded_tool_template()


def use_chat_templates(settings: Settings, tokenizer: Tokenizer) -> None:
    """The chat templates conversations are rendered with: NIM_CHAT_TEMPLATE's, when set, instead of
    all the model's own (its tool_use template too); otherwise the model's own, plus the shipped
    tool_use template where one fits them (`shipped_tool_template`), so that requests with tools
    work out of the box on the embedded model."""
    source = settings.chat_template_source
    if source is not None:
        tokenizer.replace_templates({"default": source})
        log.info("NIM_CHAT_TEMPLATE: conversations are rendered with the configured template "
                 "(%d characters), not the model's", len(source))  # fmt: skip
    elif (tool_use := shipped_tool_template(tokenizer.templates)) is not None:
        tokenizer.replace_templates({**tokenizer.templates, "tool_use": tool_use})


async def load(
    settings: Settings, config: EngineConfig, died: Callable[[BaseException], None]
) -> tuple[LoadedEngine, PathChoice]:
    """The engine loaded in a process of its own or in this one (NIM_ENGINE_PROCESS), and that
    choice. Under `auto`, an engine process that cannot start, or ends before it says why, falls
    back to loading in this process with one log line; the engine's own refusals stand."""
    mode = settings.engine_process
    why_not = not_in_process(mode, config)

    def chosen(used: bool, reason: str) -> PathChoice:
        return PathChoice("engine_process", used, reason, ENGINE_PROCESS_SETTING)

    # Loading runs parallel CPU ops (weight prepacking); a thread that ends with it leaves no
    # OpenMP pool behind to compete with the engine's own thread.
    if why_not is not None:
        return await on_new_thread(load_engine, config, died, name="engine-load"), chosen(False, why_not)
    try:
        loaded = await on_new_thread(load_in_process, config, died, name="engine-load")
    except EngineProcessError as exc:
        if mode == "on":
            raise
        log.warning("%s; loading the engine in the server's process instead (%s skips the engine process)",
                    one_line(exc), ENGINE_PROCESS_SETTING)  # fmt: skip
        loaded = await on_new_thread(load_engine, config, died, name="engine-load")
        return loaded, chosen(False, f"{one_line(exc)}; running in the server's process instead")
    return loaded, chosen(True, f"NIM_ENGINE_PROCESS={mode}: the engine core runs in a process of its own")


def config_for(settings: Settings) -> EngineConfig:
    """Plan, fetch and configure in one blocking call (for tools, benchmarks and tests)."""
    plan = make_plan(settings)
    return engine_config(settings, plan, model_source(plan, settings))


def bring_up_model(settings: Settings) -> BringUp:
    """The API's BringUp for these settings: plan, fetch, load, meter and start the engine."""

    async def bring_up(metrics: Metrics, on_engine_death: FatalHandler) -> Ready:
        plan = await asyncio.to_thread(make_plan, settings)
        for line in plan.selection.explanation:
            log.info("%s", line)
        source = await asyncio.to_thread(model_source, plan, settings)
        config = engine_config(settings, plan, source)

        def died(exc: BaseException) -> None:
            on_engine_death(f"engine failed: {one_line(exc, with_type=True)}")

        loaded, process_path = await load(settings, config, died)
        use_chat_templates(settings, loaded.tokenizer)
        engine = MeteredEngine(loaded.engine, metrics)
        await engine.start()
        started = loaded.engine.info  # with what the engine decided while it started (its graphs)
        embedded = plan.profile.source.repo == "embedded"
        licence = await asyncio.to_thread(model_license, source.checkpoint, embedded)
        info = ModelInfo(
            served_name=source.served_name,
            source=str(source.path),
            engine=replace(started, paths=(*started.paths, process_path)),
            profile_id=plan.profile.id,
            profile_name=plan.profile.name,
            profile_tags=plan.profile.tags(),
            selection=tuple(plan.selection.explanation[:1]),
            license=licence,
        )
        return Ready(engine=engine, tokenizer=loaded.tokenizer, info=info, adapters=loaded.adapters)

    return bring_up
