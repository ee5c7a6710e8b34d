"""The CUDA paths that have never run on a GPU here (unified attention, decode graphs, fp8
_scaled_mm, fused kernels, the engine process) are checked at start against the path they replace,
over every shape they will meet, and fall back with one log line when the check fails; each has a
setting that turns it off. On the CPU the kernels run in Triton's interpreter and _scaled_mm on
torch's CPU implementation, so the checks themselves run here; the CUDA-only wiring is driven with
the check's outcome forced."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from service.engine import triton_support
from service.engine.models.base import CausalLM
from service.engine.torch import decode_path
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.startup_checks import (
    check_fp8_rows_kernel,
    check_fp8_scaled_mm,
    check_fused_kernels,
    check_unified_attention,
    token_counts,
    unified_query_lens,
)
from service.engine.torch.triton_unified_attention import launch_shape

needs_triton = pytest.mark.skipif(not triton_support.available(), reason="needs triton (pip install triton)")
CPU = torch.device("cpu")


def fake_model(heads: int = 8, kv_heads: int = 2, head_dim: int = 64, windows: tuple = ()) -> CausalLM:
    """What the attention check reads of a model: its heads, head size, windows and dtype."""
    config = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, layer_windows=windows)
    return SimpleNamespace(config=config, activation_dtype=torch.float32)  # type: ignore[return-value]


def pool_for(model: CausalLM, cache_dtype: str = "auto", block_size: int = 16) -> KVPool:
    config = model.config
    spec = KVCacheSpec(1, config.num_kv_heads, config.head_dim, block_size, cache_dtype, torch.float32)  # type: ignore[arg-type]
    return KVPool(spec, 4, CPU)


# --- Unified attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_the_unified_check_covers_every_launch_shape_a_step_can_pick(group: int) -> None:
    """Every shape launch_shape gives for a longest query run of 1 .. budget tokens is one the
    check launches (and so compiles before the server is ready)."""
    model = fake_model(heads=2 * group, kv_heads=2)
    budget = 300
    every = {launch_shape(m, group, 64, torch.float32, "auto") for m in range(1, budget + 1)}
    checked = {
        launch_shape(m, group, 64, torch.float32, "auto") for m in unified_query_lens(model, "auto", budget)
    }
    assert checked == every
    assert max(unified_query_lens(model, "auto", budget)) <= budget


@needs_triton
@pytest.mark.parametrize(("cache_dtype", "windows"), [("auto", ()), ("int8", (None, 512))])
def test_the_unified_check_passes_for_a_correct_kernel(cache_dtype: str, windows: tuple) -> None:
    model = fake_model(heads=6, kv_heads=2, windows=windows)
    assert check_unified_attention(model, pool_for(model, cache_dtype), CPU, 64) is None


@needs_triton
def test_the_unified_check_names_the_launch_shape_a_kernel_gets_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel right at short query runs and wrong at long ones (a launch shape of its own) is
    caught, and the failure names the run length."""
    from service.engine.torch import paged_attention

    kernel = paged_attention.paged_unified_attention

    def wrong_when_long(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = kernel(q, *args, **kwargs)  # type: ignore[arg-type]
        return out + 1 if kwargs["max_query_len"] >= 8 else out

    monkeypatch.setattr(paged_attention, "paged_unified_attention", wrong_when_long)
    model = fake_model(heads=4, kv_heads=2)
    why = check_unified_attention(model, pool_for(model), CPU, 64)
    assert why is not None and "longest query run 8" in why and "differs by" in why


@needs_triton
def test_the_unified_check_names_a_kernel_that_does_not_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine.torch import paged_attention

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(paged_attention, "paged_unified_attention", broken)
    model = fake_model(heads=4, kv_heads=2)
    why = check_unified_attention(model, pool_for(model), CPU, 16)
    assert why is not None and "RuntimeError: PassManager::run failed" in why


@needs_triton
def test_the_unified_check_covers_windowed_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine.torch import paged_attention

    kernel = paged_attention.paged_unified_attention

    def wrong_windows(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        kwargs["window"] = None  # ignores the window
        return kernel(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_attention, "paged_unified_attention", wrong_windows)
    full = fake_model(heads=4, kv_heads=2)
    assert check_unified_attention(full, pool_for(full), CPU, 8) is None  # no windowed layer
    windowed = fake_model(heads=4, kv_heads=2, windows=(None, 512))
    why = check_unified_attention(windowed, pool_for(windowed), CPU, 8)
    assert why is not None and "window 8" in why


def _kernel_path() -> decode_path.DecodePath:
    return decode_path.DecodePath("eager", decode_path.DecodeAttention.KERNEL, False, "test")


def test_a_failed_unified_check_falls_back_to_gathering_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On CUDA (the check's outcome forced here): a failure leaves steps with prompt chunks on the
    gathered path, logged once and reported; NIM_UNIFIED_ATTENTION=off skips the check."""
    calls = []

    def failing(*args: object) -> str:
        calls.append(args)
        return "the unified attention kernel failed its start-up check (longest query run 8): differs by 2"

    monkeypatch.setattr(decode_path, "check_unified_attention", failing)
    model = fake_model()
    options = decode_path.DecodeOptions(True, False, 8, 256, max_num_batched_tokens=64)
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger=decode_path.__name__):
        used, reason = decode_path._unified(model, pool_for(model), cuda, options, _kernel_path())
    assert not used and "longest query run 8" in reason and "proven path" in reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NIM_UNIFIED_ATTENTION=off" in warnings[0]
    assert calls[0][3] == 64  # checked up to the step's token budget

    off = decode_path.DecodeOptions(True, False, 8, 256, unified=False, max_num_batched_tokens=64)
    used, reason = decode_path._unified(model, pool_for(model), cuda, off, _kernel_path())
    assert not used and "NIM_UNIFIED_ATTENTION=off" in reason and len(calls) == 1

    monkeypatch.setattr(decode_path, "check_unified_attention", lambda *args: None)
    used, reason = decode_path._unified(model, pool_for(model), cuda, options, _kernel_path())
    assert used and "agreed with gathered attention" in reason


# --- fp8 _scaled_mm --------------------------------------------------------------------------------


class _Layers(nn.Module):
    """A stand-in model: a few fp8 layers of different shapes and scalings, on the CPU."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.device = CPU


def _fp8_layers() -> _Layers:
    from service.engine.models.quant import FP8Weight
    from service.engine.models.quant_linear import FP8Linear

    generator = torch.Generator().manual_seed(0)
    layers = []
    for out_features, in_features, static in ((48, 64, False), (32, 64, True), (48, 64, False)):
        weight = FP8Weight.quantize(torch.randn(out_features, in_features, generator=generator) * 0.05)
        if static:  # a ModelOpt checkpoint's static input scale
            weight = FP8Weight(weight.q, weight.scale, torch.tensor(0.02))
        layer = FP8Linear(weight, None, torch.bfloat16, CPU)
        layer.native = True  # torch's CPU _scaled_mm stands in for cuBLAS's here
        layers.append(layer)
    return _Layers(layers)


def _fp8_config(scaled_mm: bool, rows_kernel: bool = True) -> SimpleNamespace:
    """What _fp8_path reads of an EngineConfig."""
    budget = SimpleNamespace(max_num_batched_tokens=64)
    return SimpleNamespace(
        precision="fp8", fp8_scaled_mm=scaled_mm, fp8_rows_kernel=rows_kernel, scheduler=budget
    )


def test_the_fp8_check_passes_scaled_mm_at_every_token_count() -> None:
    assert token_counts(1) == [1]
    assert token_counts(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert token_counts(64) == [1, 2, 4, 8, 16, 32, 64]
    with torch.inference_mode():
        assert check_fp8_scaled_mm(_fp8_layers(), 100) is None


def test_a_wrong_scaled_mm_falls_back_to_the_emulated_layers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A _scaled_mm that reads its scales wrongly (here: from 16 tokens up) fails the check at
    that size; the fallback makes every fp8 layer emulated and logs one line."""
    from service.engine.torch import rank_loading

    scaled_mm = torch._scaled_mm

    def wrong(a: torch.Tensor, b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        out = scaled_mm(a, b, **kwargs)  # type: ignore[arg-type]
        return out * 2 if a.shape[0] >= 16 else out

    monkeypatch.setattr(torch, "_scaled_mm", wrong)
    model = _fp8_layers()
    with torch.inference_mode():
        why = check_fp8_scaled_mm(model, 64)
    assert why is not None and "16 x 64 -> 48" in why and "relative error" in why

    config = _fp8_config(scaled_mm=True)
    with caplog.at_level(logging.WARNING, logger=rank_loading.__name__), torch.inference_mode():
        choice, mode = rank_loading._fp8_path(model, config, "native")  # type: ignore[arg-type]
    assert mode == "emulated" and not choice.used and "16 x 64" in choice.reason
    assert all(not layer.native for layer in model.layers)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NIM_FP8_SCALED_MM=off" in warnings[0]


def test_the_fp8_rows_kernel_agrees_with_the_emulated_layers_and_takes_small_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Triton fp8 rows kernel (in Triton's interpreter here) agrees with each layer emulated at
    every row count it is checked at; chosen, a layer sends steps of at most 16 rows through it and
    larger ones through _scaled_mm."""
    from service.engine.models import triton_fp8
    from service.engine.torch import rank_loading

    model = _fp8_layers()
    with torch.inference_mode():
        assert check_fp8_rows_kernel(model) is None
        choice, mode = rank_loading._fp8_path(model, _fp8_config(scaled_mm=True), "native")  # type: ignore[arg-type]
    assert choice.used and mode == "native" and "steps of at most 16 rows through the Triton" in choice.reason
    assert all(layer.rows_kernel for layer in model.layers)
    rows_seen: list[int] = []
    real = triton_fp8.fp8_rows_linear

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        rows_seen.append(x.shape[0])
        return real(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_fp8, "fp8_rows_linear", spy)
    layer = model.layers[0]
    with torch.inference_mode():
        for rows in (1, 16, 17):
            x = torch.randn(rows, layer.in_features).to(torch.bfloat16)
            assert layer(x).shape == (rows, layer.out_features)
    assert rows_seen == [1, 16]


def test_a_wrong_fp8_rows_kernel_leaves_scaled_mm_at_every_size(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from service.engine.models import triton_fp8
    from service.engine.torch import rank_loading

    real = triton_fp8.fp8_rows_linear

    def wrong(x: torch.Tensor, *args: object) -> torch.Tensor:
        out = real(x, *args)  # type: ignore[arg-type]
        return out * 2 if x.shape[0] >= 5 else out

    monkeypatch.setattr(triton_fp8, "fp8_rows_linear", wrong)
    model = _fp8_layers()
    with caplog.at_level(logging.WARNING, logger=rank_loading.__name__), torch.inference_mode():
        choice, mode = rank_loading._fp8_path(model, _fp8_config(scaled_mm=True), "native")  # type: ignore[arg-type]
    assert choice.used and mode == "native"  # _scaled_mm, still checked and chosen
    assert "the fp8 rows kernel failed its start-up check (5 x 64 -> 48)" in choice.reason
    assert not any(layer.rows_kernel for layer in model.layers)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NIM_FP8_SCALED_MM=scaled-mm" in warnings[0]


def test_nim_fp8_scaled_mm_scaled_mm_keeps_the_rows_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine.torch import rank_loading

    monkeypatch.setattr(rank_loading, "check_fp8_rows_kernel", lambda *a: pytest.fail("checked"))
    model = _fp8_layers()
    config = _fp8_config(scaled_mm=True, rows_kernel=False)
    with torch.inference_mode():
        choice, mode = rank_loading._fp8_path(model, config, "native")  # type: ignore[arg-type]
    assert choice.used and mode == "native" and "NIM_FP8_SCALED_MM=scaled-mm" in choice.reason
    assert not any(layer.rows_kernel for layer in model.layers)


def test_nim_fp8_scaled_mm_off_runs_fp8_emulated_without_a_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine.torch import rank_loading

    monkeypatch.setattr(rank_loading, "check_fp8_scaled_mm", lambda *a: pytest.fail("checked"))
    model = _fp8_layers()
    choice, mode = rank_loading._fp8_path(model, _fp8_config(scaled_mm=False), "native")  # type: ignore[arg-type]
    assert (choice.used, mode) == (False, "emulated") and "NIM_FP8_SCALED_MM=off" in choice.reason
    assert all(not layer.native for layer in model.layers)
    choice, mode = rank_loading._fp8_path(model, SimpleNamespace(precision="bf16"), "native")  # type: ignore[arg-type]
    assert not choice.used and "not fp8" in choice.reason


# --- Fused kernels ---------------------------------------------------------------------------------


def _tiny_llama() -> CausalLM:
    from service.engine.models.loader import build_model
    from service.model.config import ModelConfig

    config = ModelConfig(
        architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False,
        qk_norm=False, bos_token_id=None, eos_token_ids=(0,), torch_dtype=None,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (96, 64), "model.norm.weight": (64,)}
    for i in range(2):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "input_layernorm.weight": (64,), prefix + "post_attention_layernorm.weight": (64,),
            prefix + "self_attn.q_proj.weight": (64, 64), prefix + "self_attn.k_proj.weight": (32, 64),
            prefix + "self_attn.v_proj.weight": (32, 64), prefix + "self_attn.o_proj.weight": (64, 64),
            prefix + "mlp.gate_proj.weight": (128, 64), prefix + "mlp.up_proj.weight": (128, 64),
            prefix + "mlp.down_proj.weight": (64, 128),
        }  # fmt: skip
    weights = {
        name: (1 + 0.1 * torch.randn(shape, generator=generator))
        if name.endswith("norm.weight")
        else 0.1 * torch.randn(shape, generator=generator)
        for name, shape in shapes.items()
    }
    return build_model(config, weights.items(), torch.float32, "cpu")


@needs_triton
def test_the_fused_kernel_check_runs_the_real_kernels_and_catches_a_wrong_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each fused kernel (in Triton's interpreter, let onto the CPU) agrees with the PyTorch op it
    replaces at the model's shapes; a wrong SiLU-mul is caught, and the model is then built
    without the kernels, with one log line."""
    from service.engine.models import triton_ops
    from service.engine.torch import rank_loading

    monkeypatch.setattr(triton_ops, "runs_on", lambda x: True)
    config = _tiny_llama().config
    cpu = torch.device("cpu")
    with torch.inference_mode():
        assert check_fused_kernels(config, torch.float32, cpu) is None
    monkeypatch.setattr(triton_ops, "silu_mul", lambda gate_up: torch.zeros_like(gate_up[..., ::2]))
    with torch.inference_mode():
        why = check_fused_kernels(config, torch.float32, cpu)
    assert why is not None and "failed their start-up check (SiLU-mul, 1 tokens)" in why

    on, off = SimpleNamespace(fused_kernels=True), SimpleNamespace(fused_kernels=False)
    with caplog.at_level(logging.WARNING, logger=rank_loading.__name__), torch.inference_mode():
        choice = rank_loading._fused_path(config, on, torch.float32, cpu)  # type: ignore[arg-type]
    assert not choice.used and "PyTorch's ops" in choice.reason
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1
    assert not rank_loading._fused_path(config, off, torch.float32, cpu).used  # type: ignore[arg-type]


# --- Decode CUDA graphs ----------------------------------------------------------------------------


class _FakeGraph:
    """What capture gives on the CPU: replay runs the bucket's step eagerly (or, for a bucket whose
    graph is broken, writes NaN)."""

    def __init__(self, decoder: object, bucket: int, broken: bool) -> None:
        self.decoder, self.bucket, self.broken = decoder, bucket, broken

    def replay(self) -> None:
        out = self.decoder.output[: self.bucket]  # type: ignore[attr-defined]
        out.copy_(self.decoder.forward(self.bucket))  # type: ignore[attr-defined]
        if self.broken:
            out[0, 0] = float("nan")


@needs_triton
def test_a_bucket_whose_capture_or_check_fails_is_dropped_and_runs_elsewhere(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Capture checks each graph's replay against the eager step on random tokens over real
    blocks: a bucket whose capture raises and one whose replay disagrees are dropped with a line
    each; their batch sizes run in the next captured bucket, above the largest eagerly."""
    from service.engine.torch import cuda_graphs

    model = _tiny_llama()
    pool = KVPool(KVCacheSpec(2, 2, 16, 16, "auto", torch.float32), 48, CPU)
    decoder = cuda_graphs.CudaGraphDecoder(model, pool, 8, 128, CPU)

    def capture(self: cuda_graphs.CudaGraphDecoder, bucket: int, pool: object) -> _FakeGraph:
        if bucket == 4:
            raise RuntimeError("operation not permitted when stream is capturing")
        return _FakeGraph(self, bucket, broken=bucket == 8)

    monkeypatch.setattr(cuda_graphs.CudaGraphDecoder, "_capture", capture)
    monkeypatch.setattr(cuda_graphs, "_free_memory", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    with caplog.at_level(logging.WARNING, logger=cuda_graphs.__name__):
        decoder.capture()
    assert sorted(decoder.graphs) == [1, 2] and sorted(decoder.dropped) == [4, 8]
    assert "not permitted" in decoder.dropped[4] and "non-finite" in decoder.dropped[8]
    assert sum("is dropped" in r.getMessage() for r in caplog.records) == 2
    assert decoder.bucket_for(2) == 2
    choice = decoder.choice()
    assert choice.used and "[1, 2]" in choice.reason and "batch 4" in choice.reason

    plan = SimpleNamespace(decode_only=True, num_sequences=3, sample=(True,) * 3, prompt_logits=(False,) * 3)
    assert decoder.fits(plan) and not decoder.can_run(plan)  # above the largest captured: eager


# --- The engine process, and what /v1/metadata reports ----------------------------------------------


def test_an_engine_process_that_cannot_start_falls_back_in_process_under_auto(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    from service import serving
    from service.config_loading import load_settings
    from service.engine.process import EngineProcessError

    def cannot_start(*args: object, **kwargs: object) -> object:
        raise EngineProcessError("the engine process (pid 7) was killed by SIGKILL while loading")

    loaded_in_process = object()
    monkeypatch.setattr(serving, "load_in_process", cannot_start)
    monkeypatch.setattr(serving, "load_engine", lambda config, died: loaded_in_process)
    monkeypatch.setattr(serving, "not_in_process", lambda mode, config: None)  # as on CUDA
    config = object()

    with caplog.at_level(logging.WARNING, logger=serving.__name__):
        loaded, choice = asyncio.run(serving.load(load_settings(engine_process="auto"), config, print))  # type: ignore[arg-type]
    assert loaded is loaded_in_process and not choice.used and "SIGKILL" in choice.reason
    assert sum("NIM_ENGINE_PROCESS=off" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(EngineProcessError):  # asked for explicitly: no fallback
        asyncio.run(serving.load(load_settings(engine_process="on"), config, print))  # type: ignore[arg-type]


def test_each_setting_reaches_the_engine_config() -> None:
    from service.config_loading import load_settings
    from service.serving import config_for

    default = config_for(load_settings())
    assert default.unified_attention and default.fp8_scaled_mm and not default.fused_kernels
    assert default.fp8_rows_kernel
    off = config_for(load_settings(unified_attention="off", fp8_scaled_mm="off"))
    assert not off.unified_attention and not off.fp8_scaled_mm
    scaled_mm_only = config_for(load_settings(fp8_scaled_mm="scaled-mm"))
    assert scaled_mm_only.fp8_scaled_mm and not scaled_mm_only.fp8_rows_kernel
