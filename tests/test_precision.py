"""Weight precisions (service.engine.precision): every precision has a complete spec, and every
table that names precisions is what the specs say.

The specs are the one definition; these tests check the derivations and the classes the specs
name, and pin the facts selection explains to users (so a spec edit that changes them is seen).
"""

from __future__ import annotations

import pytest
import torch

from service.engine import config as engine_config
from service.engine.models import quant_cache, quant_linear
from service.engine.models.quant import FORMATS, Int4Weight, quantize
from service.engine.precision import (
    FLOAT_PRECISIONS,
    PRECISION_SPECS,
    QUANTIZED_PRECISIONS,
    SPECS,
    TORCH_PRECISIONS,
    TRTLLM_PRECISIONS,
    PrecisionSpec,
    precision_mode,
    why,
)
from service.engine.registry import ENGINES
from service.engine.torch.scripted_decode import linear_args
from service.model.quantization import QuantizationError
from service.selection import manifests

QUANTIZED = [s for s in SPECS if s.quantized]


def test_every_precision_has_one_complete_spec() -> None:
    assert len(PRECISION_SPECS) == len(SPECS)  # names are unique
    assert set(PRECISION_SPECS) == {"nvfp4", "fp8", "int4_wo", "int8_wo", "bf16", "fp16", "fp32"}
    for s in SPECS:
        assert s.weight_bytes > 0
        if s.quantized:
            assert s.dtype is None and s.storage_format and s.layer, s
            assert (s.native_cuda is None) == (s.native_cuda_capability is None), s
        else:
            assert s.dtype in ("bfloat16", "float16", "float32") and s.layer is None, s
            assert s.native_cpu is None and s.native_cuda is None, s  # floats are native wherever they run
        assert s.trtllm or s.trtllm_min_capability is None, s
    assert {"bf16", "fp16", "fp32"} == FLOAT_PRECISIONS
    assert FLOAT_PRECISIONS | QUANTIZED_PRECISIONS == TORCH_PRECISIONS == set(PRECISION_SPECS)


@pytest.mark.parametrize(
    "fields",
    [
        {"weight_bytes": 1.0},  # neither a dtype nor a storage format
        {"weight_bytes": 1.0, "dtype": "bfloat16", "storage_format": "X", "layer": "Y"},
        {"weight_bytes": 1.0, "storage_format": "X"},  # no layer
        {"weight_bytes": 1.0, "storage_format": "X", "layer": "Y", "native_cuda": "kernel"},  # no capability
    ],
)
def test_an_incomplete_spec_is_refused(fields) -> None:
    with pytest.raises(ValueError, match="precision p"):
        PrecisionSpec("p", **fields)


@pytest.mark.parametrize("s", QUANTIZED, ids=lambda s: s.name)
def test_quantized_classes_are_the_ones_the_spec_names(s: PrecisionSpec) -> None:
    storage = FORMATS[s.name]
    assert storage.__name__ == s.storage_format and storage.precision == s.name
    layer = quant_linear._LINEARS[storage]
    assert layer.__name__ == s.layer and layer.precision == s.name
    assert quant_cache._FORMATS[storage.__name__] is storage
    assert set(FORMATS) == QUANTIZED_PRECISIONS
    assert len(quant_linear._LINEARS) == len(quant_cache._FORMATS) == len(QUANTIZED)


@pytest.mark.parametrize("s", QUANTIZED, ids=lambda s: s.name)
def test_quantize_at_load_is_what_the_spec_says(s: PrecisionSpec) -> None:
    weight = torch.randn(8, 64)
    if s.quantized_at_load:
        quantized = quantize(weight, s.name, "w", int4_group=32)
        assert type(quantized) is FORMATS[s.name] and quantized.shape == (8, 64)
    else:
        with pytest.raises(QuantizationError, match=f"w: weights are not quantized to {s.name} at load"):
            quantize(weight, s.name, "w")


def test_profile_tables_derive_from_the_specs() -> None:
    assert manifests.PRECISIONS == ("nvfp4", "fp8", "int4_wo", "int8_wo", "bf16", "fp16", "fp32")
    assert tuple(s.name for s in SPECS) == manifests.PRECISIONS
    assert {s.name: s.weight_bytes for s in SPECS} == manifests.WEIGHT_BYTES
    generic = {s.name for s in SPECS if not s.quantized or s.quantized_at_load}
    assert set(manifests.GENERIC_PRECISIONS) == generic
    assert generic == {"bf16", "fp16", "fp32", "fp8", "int8_wo", "int4_wo"}
    assert {s.name: s.dtype for s in SPECS if not s.quantized} == engine_config.PRECISION_DTYPES
    assert ENGINES["torch"].support.precisions == TORCH_PRECISIONS
    assert ENGINES["tensorrt_llm"].support.precisions == TRTLLM_PRECISIONS
    assert {s.name for s in SPECS if s.trtllm} == TRTLLM_PRECISIONS
    assert "fp32" not in TRTLLM_PRECISIONS


def test_capabilities_each_engine_needs() -> None:
    trtllm = {s.name: s.min_capability("tensorrt_llm") for s in SPECS}
    assert trtllm == {"nvfp4": (10, 0), "fp8": (8, 9), "bf16": (8, 0), "int4_wo": (7, 5), "int8_wo": (7, 5),
                      "fp16": None, "fp32": None}  # fmt: skip
    # the torch engine emulates what a GPU lacks, but computes in bf16 only where the GPU does
    assert {s.name: s.min_capability("torch") for s in SPECS if s.min_capability("torch")} == {"bf16": (8, 0)}


@pytest.mark.parametrize("s", SPECS, ids=lambda s: s.name)
def test_precision_mode_is_what_the_spec_says(s: PrecisionSpec) -> None:
    expected_cpu = "native" if not s.quantized or s.native_cpu else "emulated"
    assert precision_mode(s.name, "cpu") == expected_cpu
    for capability in [(7, 5), (8, 0), (8, 9), (9, 0), (10, 0)]:
        needed = s.native_cuda_capability
        native = not s.quantized or (needed is not None and capability >= needed)
        assert precision_mode(s.name, "cuda", capability) == ("native" if native else "emulated")


def test_the_explanations_selection_gives() -> None:
    per_layer = "weights dequantized per layer"
    on_cuda = "kernel on CUDA in this release"
    assert why("bf16", "cpu") == why("fp16", "cuda", (9, 0)) == "native"
    assert why("int4_wo", "cpu") == why("int8_wo", "cpu") == "native (packed int kernels)"
    assert why("fp8", "cuda", (9, 0)) == "native (e4m3 tensor cores)"
    assert why("fp8", "cuda", (8, 0)) == f"emulated (fp8 matmuls need compute capability 8.9+): {per_layer}"
    assert why("fp8", "cpu") == f"emulated (no fp8 kernel on the CPU): {per_layer}"
    assert why("int4_wo", "cuda", (9, 0)) == f"emulated (no int4_wo {on_cuda}): {per_layer}"
    nowhere = f"emulated (no native nvfp4 kernel in this release): {per_layer}"
    assert why("nvfp4", "cpu") == why("nvfp4", "cuda", (10, 0)) == nowhere
    with pytest.raises(ValueError, match="unknown precision 'int2'"):
        precision_mode("int2", "cpu")


@pytest.mark.parametrize("s", [s for s in QUANTIZED if s.native_cpu], ids=lambda s: s.name)
def test_the_scripted_decode_runs_every_native_cpu_layer(s: PrecisionSpec) -> None:
    weight = quantize(torch.randn(32, 64), s.name, "w", int4_group=32)
    if isinstance(weight, Int4Weight):
        assert weight.group_size == 32
    layer = quant_linear.make_linear(weight, None, torch.bfloat16, torch.device("cpu"))
    assert layer.native and linear_args(layer) is not None
