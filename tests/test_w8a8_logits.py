"""The CPU logits projection in integers (service/engine/models/w8a8.py, BuildOptions.logits_format
"w8a8", NIM_COMPACT_LOGITS=auto under bf16 activations where the native Q8 head cannot run).

References are the formula, written here in float64 (int8 rows with one scale each; each input
row's OUTLIERS largest magnitudes quantized apart with a scale of their own, the rest with one), the model's
bf16 head, or the weight-only int8 head; never the code under test:

* the layer equals the formula to float32 rounding, at any number of rows, a NaN row included;
* a row's logits are bitwise the same whatever the batch size and the row's place in it;
* the start-up probe names what fails: a CPU without VNNI or AMX, a kernel whose sums saturate,
  one that scales a row differently by batch (where the real kernel passes; else skipped, the
  reason stated: e.g. ONEDNN_MAX_CPU_ISA=AVX2, whose sums saturate);
* built: the head is W8A8Linear over the weight-only head's int8 table, the embedding int8,
  lookups as the weight-only build's; a step's bytes as the weight-only head's;
* the embedded model's greedy tokens equal the bf16 head's but at near-ties, within one near-tie
  of the weight-only int8 head's;
* where it applies and why (rank_loading._logits_path): bf16 activations where the native Q8 head
  (the first choice) cannot run and the probe passes; NIM_COMPACT_LOGITS=weight-only, a failed
  probe or float32 activations keep the weight-only forms.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from service.config_loading import ConfigError, load_settings
from service.engine.models import w8a8
from service.engine.models.quant import Int8Weight
from service.engine.models.quant_linear import Int8Embedding, Int8Linear
from service.engine.models.w8a8 import OUTLIERS, W8A8Linear, w8a8_problem
from service.engine.native import q8
from service.engine.torch import rank_loading
from service.engine.torch.rank_loading import _logits_path
from service.serving import config_for
from tests.test_cpu_int_kernels import (
    _build,
    _logits,
    _tiny_checkpoint,
    check_bf16_head_agreement,
)

CPU = torch.device("cpu")
_PROBLEM = w8a8_problem(576)  # once, at collection (it names a CPU without VNNI or AMX itself)
needs_int8_dot = pytest.mark.skipif(
    _PROBLEM is not None, reason=f"{_PROBLEM}: the weight-only int8 head serves instead"
)


def _formula(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """Logits of rows x under the int8 table `weight`, written out in float64."""

    def quantized(values: torch.Tensor) -> torch.Tensor:
        step = max(float(values.abs().max()) / 127, torch.finfo(torch.float32).tiny)
        return (values / step).round().clamp(-127, 127) * step

    rows, q, scale = x.double(), weight.q.double(), weight.scale.double()
    out = torch.empty(rows.shape[0], q.shape[0], dtype=torch.float64)
    for i, row in enumerate(rows):
        kept = row.abs().topk(OUTLIERS).indices
        rest, apart = row.clone(), torch.zeros_like(row)
        rest[kept], apart[kept] = 0.0, row[kept]
        out[i] = (quantized(rest) + quantized(apart)) @ q.T * scale
    return out


def _table(rows: int, width: int, seed: int) -> Int8Weight:
    return Int8Weight.quantize(torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)))


def _head_inputs(rows: int, width: int) -> torch.Tensor:
    """Rows like a head's input: mostly small values and a few channels far larger (26x the RMS)."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(5))
    x[:, 17] *= 40
    x[:, width - 3] *= -30
    return x


@needs_int8_dot
def test_the_layer_computes_the_formula() -> None:
    weight = _table(1000, 576, seed=1)
    layer = W8A8Linear(weight, CPU)
    x = _head_inputs(9, 576)
    with torch.inference_mode():
        got = layer(x)
    want = _formula(x, weight)
    assert got.dtype == torch.float32 and got.shape == (9, 1000)
    # float32 scaling of exact integer sums, and the shift's share subtracted in float32.
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    # The outliers matter: quantized with the rest they would move the logits far more.
    coarse = x.double().div(x.abs().amax(1, keepdim=True) / 127).round() * (
        x.abs().amax(1, keepdim=True) / 127
    )
    plain = (coarse @ weight.q.double().T) * weight.scale.double()
    assert float((plain - want).abs().max()) > 10 * float((got.double() - want).abs().max())
    with torch.inference_mode():
        poisoned = layer(torch.cat([x[:2], torch.full((1, 576), float("nan"))]))
    assert torch.equal(poisoned[:2], got[:2]) and bool(poisoned[2].isnan().all())


@needs_int8_dot
def test_a_row_is_computed_alike_at_every_batch_size_and_place() -> None:
    layer = W8A8Linear(_table(3000, 576, seed=2), CPU)
    x = _head_inputs(70, 576)
    with torch.inference_mode():
        whole = layer(x)
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 33, 64):
            for start in (0, 1, 70 - rows):
                assert torch.equal(layer(x[start : start + rows]), whole[start : start + rows]), (rows, start)


def test_the_probe_names_a_cpu_without_int8_dot_products(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(w8a8, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert (
        w8a8_problem(576)
        == "this CPU has none of avx512_vnni, avx_vnni, amx_int8 (int8 products without saturation)"
    )


@needs_int8_dot
def test_the_probe_names_a_kernel_that_saturates_or_depends_on_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = W8A8Linear.scaled_sums

    def saturating(self: W8A8Linear, q: torch.Tensor) -> torch.Tensor:  # 16-bit pair sums, as vpmaddubsw
        return plain(self, q).clamp(-(2**15), 2**15 - 1)

    monkeypatch.setattr(W8A8Linear, "scaled_sums", saturating)
    assert w8a8_problem(576) == "oneDNN's int8 matmul does not sum int8 products exactly on this CPU"

    def by_batch(self: W8A8Linear, q: torch.Tensor) -> torch.Tensor:  # a kernel that scales 18 rows apart
        out = plain(self, q)
        return out * (1 + 2**-20) if q.shape[0] == 18 else out  # 9 inputs, each with its outliers' row

    monkeypatch.setattr(W8A8Linear, "scaled_sums", by_batch)
    assert w8a8_problem(576) == "oneDNN's int8 matmul computes a row differently at batch 9"


@needs_int8_dot
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_built_head_and_embedding(tmp_path: Path, tied: bool) -> None:
    path = _tiny_checkpoint(tmp_path / "tiny", tied)
    floats, weight_only, integer = _build(path, "float"), _build(path, "int8"), _build(path, "w8a8")
    head, embedding = integer.lm_head, integer.model.embed_tokens
    assert isinstance(head, W8A8Linear) and isinstance(embedding, Int8Embedding)
    assert isinstance(weight_only.lm_head, Int8Linear)
    # The same int8 table as the weight-only head's: only the input rows are treated differently.
    only = weight_only.lm_head
    assert torch.equal(head.scale.to(only.scale.dtype), only.scale)  # held in that kernel's dtype
    table = Int8Weight(only.q, head.scale)
    x = _head_inputs(5, 64)
    with torch.inference_mode():
        got, want = head(x).double(), _formula(x, table)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    if tied:  # the int8 rows serve the lookups: the float table is not kept
        assert not any(isinstance(module, torch.nn.Embedding) for module in integer.modules())
    ids = torch.tensor([0, 5, 319, 5, 77])
    with torch.inference_mode():
        assert torch.equal(embedding(ids), weight_only.model.embed_tokens(ids))
    prompt = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(9))
    got, want = _logits(integer, prompt), _logits(floats, prompt)
    assert float((got - want).abs().max()) <= 2**-5 * float(want.abs().max())
    # A step reads the packed table once: as many bytes as the weight-only head.
    assert integer.weight_nbytes() < floats.weight_nbytes()
    assert abs(integer.weight_nbytes() - weight_only.weight_nbytes()) <= 320 * (4 + 4 + 8)


@needs_int8_dot
def test_the_embedded_model_decodes_the_same_greedy_tokens_with_integer_logits() -> None:
    check_bf16_head_agreement("w8a8", W8A8Linear)


def test_a_lowered_cpu_capability_keeps_the_avx512_int8_products_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """ATEN_CPU_CAPABILITY=avx2 on an AVX-512 VNNI host: the head an AVX2 host gets (oneDNN would
    otherwise multiply with AVX-512 VNNI beside torch's AVX2 kernels); AVX-VNNI hosts keep it."""
    monkeypatch.setattr(w8a8, "_ops_available", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(w8a8, "cpu_flags", lambda: {"avx512f", "avx512_vnni", "avx2"})
    problem = w8a8_problem(576)
    assert problem is not None and "capability is AVX2 (ATEN_CPU_CAPABILITY)" in problem
    assert "avx512_vnni" in problem
    monkeypatch.setattr(w8a8, "cpu_flags", lambda: {"avx2", "avx_vnni"})
    assert "capability" not in (w8a8_problem(576) or "")


def _engine_config(precision: str = "int4_wo", compact: str = "auto") -> SimpleNamespace:
    return SimpleNamespace(
        precision=precision, compact_logits=compact != "off", w8a8_logits=compact == "auto"
    )


def test_where_the_integer_logits_apply_and_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    monkeypatch.setattr(rank_loading, "w8a8_problem", lambda width: None)
    # The Q8 head comes first under bf16 too (tests/test_cpu_int_kernels.py); here it cannot run.
    monkeypatch.setattr(q8, "serving_problem", lambda width: "no Q8 kernel here")
    for precision in ("int4_wo", "int8_wo"):
        path, form = _logits_path(_engine_config(precision), CPU, bf16, 576)
        assert path.used and form == "w8a8" and "summed in integers" in path.reason
        assert "NIM_COMPACT_LOGITS=weight-only keeps the input rows in bf16" in path.reason
        path, form = _logits_path(_engine_config(precision, "weight-only"), CPU, bf16, 576)
        assert path.used and form == "int8" and "NIM_COMPACT_LOGITS=weight-only" in path.reason
        path, form = _logits_path(_engine_config(precision), CPU, fp32, 576)  # float16 there
        assert form == "fp16" and path.reason.startswith("no Q8 kernel here")
        assert _logits_path(_engine_config(precision, "off"), CPU, bf16, 576)[1] == "float"
    monkeypatch.setattr(rank_loading, "w8a8_problem", lambda width: "no int8 dot products here")
    with caplog.at_level("INFO"):
        path, form = _logits_path(_engine_config(), CPU, bf16, 576)
    assert path.used and form == "int8" and "no int8 dot products here" in path.reason
    assert "no int8 dot products here" in caplog.text


def test_the_setting_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, compact, integer in (
        ("auto", True, True),
        ("weight-only", True, False),
        ("off", False, False),
    ):
        monkeypatch.setenv("NIM_COMPACT_LOGITS", value)
        config = config_for(load_settings())
        assert (config.compact_logits, config.w8a8_logits) == (compact, integer), value
    monkeypatch.setenv("NIM_COMPACT_LOGITS", "int8")
    with pytest.raises(ConfigError, match="NIM_COMPACT_LOGITS"):
        load_settings()
