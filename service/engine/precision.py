"""Which weight precisions the torch engine runs natively, and which it emulates, on a device.

Native: a kernel computes with the stored format. Emulated: the weights stay compact in memory
and each layer is dequantized into the activation dtype when it runs (slower, same memory).
Selection (service.profiles) ranks native above emulated and says which; the layers
(service.engine.models.quant_linear) dispatch on the same answer. Pure: no torch import.
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["native", "emulated"]
DeviceType = Literal["cpu", "cuda"]

FLOAT_PRECISIONS = frozenset({"bf16", "fp16", "fp32"})
QUANTIZED_PRECISIONS = frozenset({"fp8", "nvfp4", "int8_wo", "int4_wo"})
TORCH_PRECISIONS = FLOAT_PRECISIONS | QUANTIZED_PRECISIONS

# Lowest CUDA compute capability with a native kernel, per quantized precision and device.
_NATIVE_CUDA = {"fp8": (8, 9)}  # torch._scaled_mm on e4m3
_NATIVE_CPU = frozenset({"int8_wo", "int4_wo"})  # aten's packed weight-only kernels


def precision_mode(precision: str, device_type: str, capability: tuple[int, int] | None = None) -> Mode:
    """How `precision` runs on a device of `device_type` (with `capability` for CUDA)."""
    if precision in FLOAT_PRECISIONS:
        return "native"
    if precision not in QUANTIZED_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}")
    if device_type == "cpu":
        return "native" if precision in _NATIVE_CPU else "emulated"
    needed = _NATIVE_CUDA.get(precision)
    if needed is not None and capability is not None and capability >= needed:
        return "native"
    return "emulated"


def why(precision: str, device_type: str, capability: tuple[int, int] | None = None) -> str:
    """One phrase: how and why `precision` runs this way here (for the start-up explanation)."""
    mode = precision_mode(precision, device_type, capability)
    if precision in FLOAT_PRECISIONS:
        return "native"
    if mode == "native":
        return "native (packed int kernels)" if device_type == "cpu" else "native (e4m3 tensor cores)"
    if precision == "fp8" and device_type == "cuda":
        return "emulated (fp8 matmuls need compute capability 8.9+): weights dequantized per layer"
    if precision == "nvfp4":
        return "emulated (no native nvfp4 kernel in this release): weights dequantized per layer"
    where = "the CPU" if device_type == "cpu" else "CUDA in this release"
    return f"emulated (no {precision} kernel on {where}): weights dequantized per layer"
