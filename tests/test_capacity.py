"""Step capacity by device (NIM_MAX_NUM_SEQS / NIM_MAX_NUM_BATCHED_TOKENS defaults) and the KV
pool's memory budget: on CUDA what the largest step and the decode graphs need is measured and
set aside before the pool is sized; on the CPU nothing changes. The CUDA arithmetic runs here on
fakes (free memory, measured peaks); tests/test_gpu.py measures on a GPU."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from service.config_loading import load_settings
from service.engine.config import (
    CPU_DEFAULTS,
    GIB,
    EngineConfig,
    KVCacheConfig,
    SchedulerLimits,
    step_defaults,
)
from service.engine.torch import rank_loading
from service.engine.torch.cuda_graphs import batch_buckets
from service.engine.torch.engine import TorchEngine
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.loading import build_engine
from service.engine.torch.memory_budget import (
    GRAPH_ALLOWANCE,
    LOGIT_BYTES,
    SAMPLING_COPIES,
    MemoryBudget,
    Reservations,
    StepShape,
    decode_step,
    largest_step,
    profile_plan,
    reserve,
    run_step,
)
from service.engine.torch.rank_loading import (
    DEFAULT_KV_FRACTION,
    KVCacheTooSmallError,
    decode_graph_batches,
    resolve_step_limits,
    size_kv_cache,
)
from service.serving import config_for
from tests.conftest import TEST_THREADS, start_server, wait_ready

H100 = SimpleNamespace(total_memory=80 * GIB, name="NVIDIA H100 80GB HBM3")
L4 = SimpleNamespace(total_memory=23 * GIB, name="NVIDIA L4")
A100 = SimpleNamespace(total_memory=80 * GIB, name="NVIDIA A100-SXM4-80GB")
CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


# --- Defaults by device -------------------------------------------------------------------------


def test_device_defaults() -> None:
    assert (CPU_DEFAULTS.max_num_seqs, CPU_DEFAULTS.max_num_batched_tokens) == (64, 1024)
    assert step_defaults("cpu") == CPU_DEFAULTS
    large = step_defaults("cuda", H100.total_memory, H100.name)
    assert (large.max_num_seqs, large.max_num_batched_tokens) == (256, 8192)
    assert "H100" in large.device and "80 GiB" in large.device
    small = step_defaults("cuda", L4.total_memory, L4.name)
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (256, 2048)
    # vLLM keeps A100s at the smaller budget (a larger one measured slower there).
    assert step_defaults("cuda", A100.total_memory, A100.name).max_num_batched_tokens == 2048


def test_explicit_limits_win_on_every_device() -> None:
    both = SchedulerLimits(12, 345)
    for defaults in (CPU_DEFAULTS, step_defaults("cuda", H100.total_memory, H100.name)):
        resolved = both.for_device(defaults)
        assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == (12, 345)
    one = SchedulerLimits(None, 512).for_device(step_defaults("cuda", H100.total_memory, H100.name))
    assert (one.max_num_seqs, one.max_num_batched_tokens) == (256, 512)
    other = SchedulerLimits(8, None).for_device(CPU_DEFAULTS)
    assert (other.max_num_seqs, other.max_num_batched_tokens) == (8, 1024)


def test_unresolved_limits_read_as_a_large_gpu() -> None:
    """TensorRT-LLM's adapter reads the limits without resolving them: it always runs on a GPU."""
    limits = SchedulerLimits()
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (256, 8192)


def test_describe_names_the_source_of_each_value() -> None:
    line = SchedulerLimits(None, 300).for_device(CPU_DEFAULTS).describe()
    assert line == (
        "step capacity: 64 sequences (default for CPU; NIM_MAX_NUM_SEQS sets it), "
        "300 tokens (NIM_MAX_NUM_BATCHED_TOKENS) per step"
    )


def test_settings_leave_unset_limits_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NIM_MAX_NUM_SEQS", raising=False)
    monkeypatch.delenv("NIM_MAX_NUM_BATCHED_TOKENS", raising=False)
    monkeypatch.delenv("NIM_MAX_PENDING_REQUESTS", raising=False)
    settings = load_settings(device="cpu")
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (None, None)
    assert settings.scheduler_limits == SchedulerLimits(None, None)
    assert settings.pending_limit == 4 * 64  # as before on the CPU
    assert load_settings(device="cuda").pending_limit == 4 * 256
    monkeypatch.setenv("NIM_MAX_NUM_SEQS", "10")
    assert load_settings(device="cuda").pending_limit == 40
    assert load_settings(device="cuda", max_pending_requests=7).pending_limit == 7


def engine_config(**overrides: object) -> EngineConfig:
    return config_for(load_settings(**{"num_threads": TEST_THREADS, "max_model_len": 512, **overrides}))


def test_resolution_with_the_device_known(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("NIM_MAX_NUM_SEQS", raising=False)
    monkeypatch.delenv("NIM_MAX_NUM_BATCHED_TOKENS", raising=False)
    config = engine_config()
    with caplog.at_level(logging.INFO, logger="service.engine.torch.rank_loading"):
        cpu = resolve_step_limits(config, torch.device("cpu")).scheduler
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (64, 1024)
    assert "step capacity: 64 sequences (default for CPU" in caplog.text
    for props, tokens in ((H100, 8192), (L4, 2048)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _device, p=props: p)
        gpu = resolve_step_limits(config, CUDA).scheduler
        assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (256, tokens)
    explicit = resolve_step_limits(engine_config(max_num_seqs=5, max_num_batched_tokens=96), CUDA)
    assert (explicit.scheduler.max_num_seqs, explicit.scheduler.max_num_batched_tokens) == (5, 96)


@pytest.fixture(scope="module")
def cpu_engine() -> Iterator[TorchEngine]:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("NIM_MAX_NUM_SEQS", raising=False)
        patch.delenv("NIM_MAX_NUM_BATCHED_TOKENS", raising=False)
        yield build_engine(engine_config(device="cpu", kv_cache_max_tokens=4096))


def test_cpu_engine_keeps_its_limits(cpu_engine: TorchEngine) -> None:
    config = cpu_engine.core.scheduler.config
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 1024)
    assert cpu_engine.info.max_num_seqs == 64  # NIM's num_request_max


# --- Graph buckets ------------------------------------------------------------------------------


def test_graph_buckets_cover_256_sequences() -> None:
    buckets = batch_buckets(256)
    assert buckets == [1, 2, 4, *range(8, 65, 8), *range(80, 257, 16)]
    for batch in range(1, 257):
        bucket = next(b for b in buckets if b >= batch)
        assert bucket - batch < max(8, batch // 4)  # padding: under 8 rows or a quarter of the batch


# --- Memory budget: the arithmetic on fakes -----------------------------------------------------


class FakeProbe:
    """Peaks as a function of the step's shape, recording what it was asked."""

    def __init__(self) -> None:
        self.shapes: list[StepShape] = []

    def peak_bytes(self, shape: StepShape) -> int:
        self.shapes.append(shape)
        return 1000 * shape.num_tokens + 7 * max(shape.context_lens)


def test_largest_step_fills_the_budget_with_full_contexts() -> None:
    assert largest_step(8192, 256, 4096) == StepShape((4096, 4096), (4096, 4096))
    assert largest_step(8192, 256, 131072) == StepShape((8192,), (131072,))
    assert largest_step(1000, 256, 300) == StepShape((300, 300, 300, 100), (300,) * 4)
    assert largest_step(8192, 2, 16) == StepShape((16, 16), (16, 16))  # max_num_seqs caps it
    assert decode_step(3, 64) == StepShape((1, 1, 1), (64, 64, 64))


def test_reservations_measure_the_largest_step_and_graph() -> None:
    probe = FakeProbe()
    vocab = 1000
    reserved = reserve(probe, 8192, 256, 4096, vocab, batch_buckets(256))
    assert probe.shapes == [largest_step(8192, 256, 4096), decode_step(256, 4096)]
    assert reserved.activations == 1000 * 8192 + 7 * 4096
    graphs = 1000 * 256 + 7 * 4096 + 256 * vocab * LOGIT_BYTES + GRAPH_ALLOWANCE * len(batch_buckets(256))
    assert reserved.graphs == graphs
    assert reserved.sampling == SAMPLING_COPIES * 256 * vocab * LOGIT_BYTES
    assert reserved.total == reserved.activations + graphs + reserved.sampling
    assert (reserved.tokens, reserved.graph_batch) == (8192, 256)
    # No graphs (eager, tensor parallel): nothing set aside for them, one step measured.
    eager = reserve(FakeProbe(), 1024, 64, 512, vocab, [])
    assert (eager.graphs, eager.graph_batch) == (0, 0)


def test_pool_gets_the_share_less_the_reservations() -> None:
    reserved = Reservations(
        activations=3 * GIB, graphs=GIB // 2, sampling=GIB // 4, tokens=8192, graph_batch=256
    )
    memory = MemoryBudget(free=70 * GIB, fraction=0.9, reserved=reserved)
    assert memory.share == int(70 * GIB * 0.9)
    assert memory.pool_bytes == int(70 * GIB * 0.9) - reserved.total
    line = memory.describe()
    for part in (
        "70.00 GiB free after weights x 0.9 = 63.00 GiB",
        "3.00 GiB for the activations of a 8192-token step (measured)",
        "0.50 GiB for decode graphs up to 256 sequences",
        "0.25 GiB for sampling",
        "headroom 7.00 GiB",
        "pool 59.25 GiB",
    ):
        assert part in line, line
    # Reservations beyond the share leave nothing, never a negative pool.
    assert MemoryBudget(free=GIB, fraction=0.9, reserved=reserved).pool_bytes == 0
    assert MemoryBudget(free=10 * GIB, fraction=0.5, sharers=2).pool_bytes == int(10 * GIB * 0.5 / 2)


SPEC = KVCacheSpec(
    num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, cache_dtype="auto", model_dtype=torch.bfloat16
)
KV = KVCacheConfig(
    dtype="auto", block_size=16, memory_fraction=None, max_tokens=None, enable_prefix_caching=True
)


def test_cuda_sizing_subtracts_the_reservations(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    free = 4 * GIB
    monkeypatch.setattr(rank_loading, "free_memory_bytes", lambda device: free)
    reserved = Reservations(GIB, GIB // 4, GIB // 8, 8192, 256)
    per_token = SPEC.bytes_per_token()
    with caplog.at_level(logging.INFO, logger="service.engine.torch.rank_loading"):
        blocks = size_kv_cache(SPEC, KV, 10**6, CUDA, 1024, reservations=lambda: reserved)
    pool = int(free * DEFAULT_KV_FRACTION["cuda"]) - reserved.total
    assert blocks == pool // per_token // SPEC.block_size
    unreserved = size_kv_cache(SPEC, KV, 10**6, CUDA, 1024)  # tensor parallelism: as before
    assert unreserved == int(free * 0.9) // per_token // SPEC.block_size
    assert blocks < unreserved
    assert re.search(
        r"free after weights x 0\.9 = 3\.60 GiB; reserved 1\.00 GiB .* pool 2\.22 GiB", caplog.text
    )


def test_cpu_sizing_is_unchanged(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    free = 3 * GIB
    monkeypatch.setattr(rank_loading, "free_memory_bytes", lambda device: free)
    with caplog.at_level(logging.INFO, logger="service.engine.torch.rank_loading"):
        blocks = size_kv_cache(SPEC, KV, 10**6, torch.device("cpu"), 1024, sharers=2)
    assert blocks == int(free * 0.1 / 2) // SPEC.bytes_per_token() // SPEC.block_size
    assert "KV cache memory" not in caplog.text  # the CPU's one line is the pool's, as before


def test_too_small_a_pool_names_the_reservations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_loading, "free_memory_bytes", lambda device: 2 * GIB)
    reserved = Reservations(2 * GIB, 0, 0, 8192, 0)
    with pytest.raises(KVCacheTooSmallError) as info:
        size_kv_cache(SPEC, KV, 256, CUDA, 1024, reservations=lambda: reserved)
    message = str(info.value)
    assert "2.00 GiB for the activations of a 8192-token step" in message
    assert "NIM_MAX_NUM_BATCHED_TOKENS" in message and "\n" not in message


# --- The profile step runs through the real model runner ----------------------------------------


def test_profile_plan_layout() -> None:
    plan = profile_plan(StepShape((20, 1, 1), (40, 33, 17)), 16)
    assert plan.query_lens == (1, 1, 20) and plan.context_lens == (33, 17, 40)  # decodes first
    assert plan.num_decodes == 2 and plan.num_tokens == 22
    assert plan.positions == (32, 16, *range(20, 40))
    assert plan.block_tables == ((0, 0, 0), (0, 0), (0, 0, 0))
    assert all(0 <= slot < 16 for slot in plan.slot_mapping)  # every write lands in block 0


def test_profile_steps_run_on_the_real_model(cpu_engine: TorchEngine) -> None:
    """The shapes the CUDA probe measures are steps the model runner accepts over a one-block
    cache: logits for each sampled sequence, finite."""
    pool = KVPool(cpu_engine.core.config.kv_spec, 1, torch.device("cpu"))
    for shape in (largest_step(96, 4, 40), decode_step(3, 40), StepShape((1, 1, 24), (40, 17, 24))):
        logits = run_step(cpu_engine.core.model, pool, torch.device("cpu"), False, shape)
        assert logits.shape == (len(shape.query_lens), cpu_engine.core.model_config.vocab_size)
        assert torch.isfinite(logits).all()


# --- A server on the CPU reports what it did before ---------------------------------------------


def test_cpu_server_reports_its_limits(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.log", unset=("NIM_MAX_NUM_SEQS", "NIM_MAX_NUM_BATCHED_TOKENS"))
    try:
        wait_ready(server)
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    finally:
        server.stop()
    assert re.search(r"^num_request_max 64\.0$", metrics, re.MULTILINE), metrics
    log = server.log()
    assert "step capacity: 64 sequences (default for CPU; NIM_MAX_NUM_SEQS sets it), 1024 tokens" in log


def test_graph_batches_follow_the_decodes_a_step_can_hold() -> None:
    """Graphs up to max_num_seqs, or to the token budget when that is smaller; none where the
    engine captures none (CPU, eager, no kernel, tensor parallelism)."""
    config = engine_config(max_num_seqs=200, max_num_batched_tokens=1000)
    assert decode_graph_batches(config, CUDA, True, 512) == batch_buckets(200)
    small_budget = engine_config(max_num_seqs=200, max_num_batched_tokens=100)
    assert decode_graph_batches(small_budget, CUDA, True, 512)[-1] == 100
    assert decode_graph_batches(config, torch.device("cpu"), True, 512) == []
    assert decode_graph_batches(config, CUDA, False, 512) == []
    assert decode_graph_batches(config, CUDA, True, 512, ranks=2) == []
    assert decode_graph_batches(engine_config(enforce_eager=True), CUDA, True, 512) == []
