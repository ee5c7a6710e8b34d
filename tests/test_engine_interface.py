"""The engine seam: the import boundary, the registry, typed config refusals, the picklable step
plan, metering outside the engine, and sliding-window models."""

from __future__ import annotations

import ast
import asyncio
import pickle
import subprocess
import sys
from collections.abc import AsyncGenerator
from dataclasses import replace
from pathlib import Path

import pytest

from service.config_loading import load_settings
from service.engine.config import UnsupportedConfigError
from service.engine.protocol import (
    EngineInfo,
    EngineStats,
    GenerationRequest,
    Histogram,
    RequestOutput,
    SamplingParams,
)
from service.engine.registry import ENGINES, EngineUnavailableError, availability, load_engine
from service.engine.torch.loading import context_length
from service.engine.torch.step_plan import NewRequest, ScheduledSequence, build_plan
from service.model.config import ModelConfig
from service.serving import config_for
from service.telemetry.metering import EngineStatsCollector, MeteredEngine
from service.telemetry.metrics import Metrics

REPO = Path(__file__).resolve().parent.parent
SERVICE = REPO / "service"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _violations(package: Path, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted(package.rglob("*.py"))
        for name in sorted(_imports(path))
        if name.startswith(forbidden)
    ]


ENGINE_PACKAGES = ("service.engine.torch", "service.engine.models", "service.engine.trtllm", "torch")


def test_api_imports_no_engine_package() -> None:
    assert _violations(SERVICE / "api", ENGINE_PACKAGES) == []
    for module in ("service/telemetry/metering.py", "service/telemetry/metrics.py"):
        assert not {n for n in _imports(REPO / module) if n.startswith(ENGINE_PACKAGES)}, module


def test_engines_import_neither_settings_nor_metrics_nor_the_api() -> None:
    forbidden = (
        "service.config",
        "service.telemetry.metrics",
        "service.telemetry.metering",
        "service.api",
        "service.serving",
    )
    assert _violations(SERVICE / "engine", forbidden) == []


def test_importing_the_api_loads_no_engine() -> None:
    """At run time too: the app module pulls in the protocol and registry, never an engine."""
    code = (
        "import sys, service.api.app\n"
        "engines = ('service.engine.torch', 'service.engine.models')\n"
        "print([m for m in sys.modules if m.startswith(engines)])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_registry_reports_unavailable_engines_with_a_reason() -> None:
    torch_state = availability("torch")
    assert torch_state.available and torch_state.reason == ""
    trt = availability("tensorrt_llm")
    assert not trt.available and "tensorrt_llm" in trt.reason and "\n" not in trt.reason
    unknown = availability("vllm")
    assert not unknown.available and "unknown engine" in unknown.reason
    config = replace(config_for(load_settings()), engine="tensorrt_llm")
    with pytest.raises(EngineUnavailableError, match="tensorrt_llm"):
        load_engine(config)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tensor_parallel_size": 2}, "tensor parallelism"),
        ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
        ({"precision": "int2_wo"}, "not int2_wo"),
    ],
)
def test_a_profile_field_the_engine_cannot_honour_is_refused(change: dict, message: str) -> None:
    config = replace(config_for(load_settings()), **change)
    with pytest.raises(UnsupportedConfigError, match=message) as refused:
        load_engine(config)
    assert "\n" not in str(refused.value)


def test_fused_kernels_without_a_gpu_are_refused_not_ignored() -> None:
    config = config_for(load_settings(fused_kernels=True))
    assert config.fused_kernels
    with pytest.raises(UnsupportedConfigError, match="NIM_FUSED_KERNELS=1 needs a CUDA device"):
        load_engine(replace(config, device="cpu"))


def test_a_lora_profile_without_adapters_is_refused_not_ignored() -> None:
    from service.engine.config import LoraConfig

    config = replace(config_for(load_settings()), lora=LoraConfig.with_defaults(None))
    with pytest.raises(UnsupportedConfigError, match="serves LoRA adapters: set NIM_PEFT_SOURCE") as refused:
        load_engine(config)
    assert "\n" not in str(refused.value)


def test_a_collective_timeout_without_tensor_parallelism_is_refused_not_ignored() -> None:
    config = replace(config_for(load_settings()), collective_timeout_s=5.0)
    assert config.tensor_parallel_size == 1
    with pytest.raises(UnsupportedConfigError, match="NIM_COLLECTIVE_TIMEOUT_SECONDS applies to tensor"):
        load_engine(config)


def test_selection_skips_profiles_the_engine_would_refuse() -> None:
    from service.selection.manifests import Profile
    from service.selection.planning import manifest_for, policy_for
    from service.selection.profiles import evaluate
    from service.selection.system_info import load_system

    settings = load_settings()
    manifest = manifest_for(settings)
    torch_profile = next(p for p in manifest.profiles if p.llm_engine == "torch")
    h100x8 = load_system(REPO / "tests/systems/h100x8.json")
    tp16: Profile = replace(torch_profile, tp=16)
    verdict = evaluate(tp16, manifest.architecture, h100x8, policy_for(settings))
    assert verdict.status == "incompatible"
    assert "the torch engine runs tensor parallelism up to 8, not tp=16" in verdict.reasons
    pp2: Profile = replace(torch_profile, pp=2)
    verdict = evaluate(pp2, manifest.architecture, h100x8, policy_for(settings))
    assert verdict.status == "incompatible"
    assert "the torch engine does not run pipeline parallelism (pp=2)" in verdict.reasons
    assert set(ENGINES) == {"torch", "tensorrt_llm"}


def test_nim_dtype_chooses_among_profiles_instead_of_overriding_one() -> None:
    config = config_for(load_settings(dtype="float32"))
    assert (config.precision, config.dtype) == ("fp32", "float32")
    assert config.profile_name.startswith("torch-generic-fp32")


def test_step_plan_round_trips_through_pickle() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=3, logit_bias={5: 1.5}, stop=("x",))
    sequences = [
        ScheduledSequence("prefill", list(range(100, 140)), 16, 24, [7, 3, 9], True, False),
        ScheduledSequence("decode", list(range(20)), 19, 1, [4, 2], True, False),
    ]
    plan = build_plan(
        sequences, 16, (NewRequest("prefill", tuple(range(100, 140)), params, (2,)),), ("gone",)
    )
    assert plan.request_ids == ("decode", "prefill")  # decodes first
    assert plan.positions[0] == 19 and plan.slot_mapping[0] == 2 * 16 + 3
    assert plan.slot_mapping[1:3] == (3 * 16, 3 * 16 + 1)  # position 16 starts block 1 (id 3)
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_sliding_window_models_serve_only_contexts_the_window_covers() -> None:
    mistral = ModelConfig.from_hf_config(
        {
            "architectures": ["MistralForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
        }
    )
    assert context_length(mistral, None) == 4096  # capped, with a warning
    assert context_length(mistral, 2048) == 2048
    with pytest.raises(UnsupportedConfigError, match="NIM_MAX_MODEL_LEN<=4096"):
        context_length(mistral, 8192)
    full = replace(mistral, sliding_window=None)
    assert context_length(full, None) == 32768


# --- Metering ------------------------------------------------------------------------------------


def _scrape(metrics: Metrics) -> dict[str, float]:
    values = {}
    for line in metrics.render().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


INFO = EngineInfo(
    engine="fake",
    architecture="llama",
    max_model_len=128,
    vocab_size=100,
    weight_precision="bf16",
    precision_mode="native",
    kv_cache_dtype="int8",
    kv_block_size=16,
    kv_num_blocks=40,
    device="cpu",
    tensor_parallel_size=1,
)


class FakeEngine:
    """Replays scripted outputs; records aborts."""

    def __init__(self, script: list[RequestOutput], stats: EngineStats | None = None) -> None:
        self.script = script
        self.aborted: list[str] = []
        self._stats = stats or EngineStats()

    info = INFO
    ready = True
    failure = None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def check(self, request: GenerationRequest) -> None: ...

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        for out in self.script:
            yield out


def _out(tokens: int, time: float, **kw: object) -> RequestOutput:
    return RequestOutput("r", "x", [7], 5, tokens, time=time, **kw)  # type: ignore[arg-type]


def test_metering_turns_engine_stats_into_the_gateway_series() -> None:
    histogram = Histogram.empty((1, 8)).observe(1).observe(5).observe(100)
    stats = EngineStats(
        num_running=3,
        num_waiting=2,
        kv_blocks_used=10,
        kv_blocks_total=40,
        prefix_queries=500,
        prefix_hits=128,
        num_preemptions=4,
        step_tokens=histogram,
    )
    metrics = Metrics("m")
    collector = EngineStatsCollector("m")
    metrics.register(collector)
    assert _scrape(metrics)['vllm:num_requests_waiting{model_name="m"}'] == 0  # zeros before load
    collector.attach(FakeEngine([], stats), INFO)
    got = _scrape(metrics)
    label = '{model_name="m"}'
    assert got[f"vllm:num_requests_running{label}"] == 3
    assert got[f"vllm:num_requests_waiting{label}"] == 2
    assert got[f"vllm:kv_cache_usage_perc{label}"] == 0.25
    assert got[f"vllm:gpu_cache_usage_perc{label}"] == 0.25
    assert got["gpu_cache_usage_perc"] == 0.25
    assert got["num_requests_running"] == 3 and got["num_requests_waiting"] == 2
    assert got[f"vllm:num_preemptions_total{label}"] == 4
    assert got[f"vllm:prefix_cache_queries_total{label}"] == 500
    assert got[f"vllm:prefix_cache_hits_total{label}"] == 128
    assert got['vllm:iteration_tokens_total_bucket{le="1.0",model_name="m"}'] == 1
    assert got['vllm:iteration_tokens_total_bucket{le="8.0",model_name="m"}'] == 2
    assert got['vllm:iteration_tokens_total_bucket{le="+Inf",model_name="m"}'] == 3
    assert got[f"vllm:iteration_tokens_total_sum{label}"] == 106
    assert got['vllm:cache_config_info{block_size="16",cache_dtype="int8",num_gpu_blocks="40"}'] == 1


def test_metering_observes_timings_endings_and_abandoned_requests() -> None:
    metrics = Metrics("m")
    script = [
        _out(1, 10.5),
        _out(2, 10.75),
        _out(3, 11.0, finished=True, finish_reason="stop"),
    ]
    request = GenerationRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3), arrival_time=10.0)

    async def consume(engine: MeteredEngine, leave_after: int | None = None) -> None:
        stream = engine.generate(request)
        count = 0
        async for _ in stream:
            count += 1
            if leave_after is not None and count == leave_after:
                break
        await stream.aclose()

    asyncio.run(consume(MeteredEngine(FakeEngine(script), metrics)))
    got = _scrape(metrics)
    label = '{model_name="m"}'
    assert got[f"vllm:prompt_tokens_total{label}"] == 5
    assert got[f"vllm:generation_tokens_total{label}"] == 3
    assert got[f"vllm:time_to_first_token_seconds_sum{label}"] == 0.5
    assert got[f"vllm:inter_token_latency_seconds_count{label}"] == 2
    assert got[f"vllm:inter_token_latency_seconds_sum{label}"] == 0.5
    assert got['vllm:request_success_total{finished_reason="stop",model_name="m"}'] == 1
    assert got[f"vllm:e2e_request_latency_seconds_sum{label}"] == 1.0

    asyncio.run(consume(MeteredEngine(FakeEngine(script), metrics), leave_after=1))  # client leaves
    failed = [_out(0, 12.0, finished=True, error="device fault")]
    asyncio.run(consume(MeteredEngine(FakeEngine(failed), metrics)))
    got = _scrape(metrics)
    assert got['vllm:request_success_total{finished_reason="abort",model_name="m"}'] == 1
    assert got["request_failure_total"] == 1
    assert got['vllm:request_success_total{finished_reason="stop",model_name="m"}'] == 1
