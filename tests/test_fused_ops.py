"""The model's fused CUDA kernels (RMSNorm with the residual add, SiLU-mul, RoPE) against the
PyTorch ops they replace: in Triton's interpreter where no GPU is present, natively on one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.engine.models import triton_ops
from service.engine.models.llama_layers import RMSNorm
from service.engine.models.rope import TableRope
from tests.conftest import TEST_THREADS

pytestmark = pytest.mark.skipif(not triton_ops.available(), reason="needs triton (pip install triton)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
# Triton's interpreter (no GPU) truncates when it converts float32 to bfloat16 where the GPU rounds
# to nearest even, so there bf16 results are checked for the algorithm (close), on a GPU for the
# rounding (bit for bit, or within the stated ulps).
INTERPRETED = DEVICE.type == "cpu"


def _interpreted_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    if not (INTERPRETED and want.dtype != torch.float32):
        return False
    assert torch.allclose(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    return True


def _exact(got: torch.Tensor, want: torch.Tensor) -> None:
    if not _interpreted_bf16(got, want):
        assert torch.equal(got, want)


def _within(got: torch.Tensor, want: torch.Tensor, ulps: float) -> None:
    if not _interpreted_bf16(got, want):
        assert _ulps(got, want) <= ulps


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the dtype's resolution at each value (0: bit-identical)."""
    step = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(1e-3)
    return float(((got.float() - want.float()).abs() / step).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 576, 4096])
def test_rms_norm_and_residual_add(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(width)
    norm = RMSNorm(width, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(width))
    x = torch.randn(7, width, device=DEVICE).to(dtype)
    residual = torch.randn(7, width, device=DEVICE).to(dtype)
    with torch.inference_mode():
        want_sum = x + residual
        want = norm.weight * F.rms_norm(want_sum.float(), (width,), eps=1e-5).to(dtype)
        reference = RMSNorm.forward(norm, want_sum) if not want_sum.is_cuda else want
        got, got_sum = triton_ops.add_rms_norm(x, residual, norm.weight, 1e-5)
        alone = triton_ops.rms_norm(want_sum, norm.weight, 1e-5)
    _exact(got_sum, want_sum)  # the residual add rounds as eager does
    # The row's sum of squares is reduced in another order: a few float32 ulps apart, which a
    # bf16 result rounds away (or leaves a rounding step apart).
    _within(got, reference, 8.0 if dtype == torch.float32 else 1.0)
    assert torch.equal(triton_ops.rms_norm(got_sum, norm.weight, 1e-5), got)  # one kernel, two modes
    _within(alone, reference, 8.0 if dtype == torch.float32 else 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(5, 2 * 1536, device=DEVICE).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    # exp is computed differently (a few float32 ulps), then rounded as eager rounds.
    _within(triton_ops.silu_mul(gate_up), F.silu(gate) * up, 8.0 if dtype == torch.float32 else 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_matches_rotate_half(dtype: torch.dtype, head_dim: int) -> None:
    torch.manual_seed(head_dim)
    tokens, heads = 6, 5
    positions = torch.tensor([0, 1, 7, 100, 4095, 3], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_table, sin_table = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    # q and k heads as the model lays them out: a view into the fused qkv projection.
    qkv = torch.randn(tokens, (heads + 2) * head_dim, device=DEVICE).to(dtype)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos = cos_table[positions].to(dtype).unsqueeze(1)
    sin = sin_table[positions].to(dtype).unsqueeze(1)
    want = TableRope(torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))(x.clone())  # eager
    untouched = qkv[:, heads * head_dim :].clone()
    triton_ops.rotary_(x, positions, cos_table, sin_table)
    _exact(x, want)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


def test_the_model_computes_the_same_through_the_fused_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole forward pass (the residual stream handed from layer to layer through the fused
    add + norm) gives the unfused pass's logits."""
    from service.config_loading import load_settings
    from service.engine.models.attention import CausalAttention
    from service.engine.models.base import BuildOptions
    from service.engine.models.loader import build_model, load_gguf
    from service.engine.torch.loading import build_engine
    from service.serving import config_for

    config = config_for(load_settings(num_threads=TEST_THREADS, max_model_len=256, dtype="float32"))
    engine = build_engine(config)
    model = engine.core.model
    device = engine.core.config.device
    model_config, weights = load_gguf(config.checkpoint, config.precision)
    fused_model = build_model(model_config, weights, torch.float32, device, BuildOptions(fused_kernels=True))
    ids = torch.tensor(engine.tokenizer.encode("The quick brown fox jumps over"), device=device)
    positions = torch.arange(ids.shape[0], device=ids.device)
    monkeypatch.setattr(triton_ops, "runs_on", lambda x: True)  # the interpreter takes CPU tensors
    with torch.inference_mode():
        plain = model.compute_logits(model(ids, positions, CausalAttention()))
        fused = fused_model.compute_logits(fused_model(ids, positions, CausalAttention()))
    assert torch.allclose(fused, plain, atol=1e-4, rtol=1e-4)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
