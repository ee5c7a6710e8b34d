"""Which kernel the CPU's native int4 layers run (/v1/metadata: executionPaths.int4_kernel).

- W4A8 (native/w4a8.py), first choice: each block of 32 activations rounded to int8, the products
  with the int4 weights summed in integer dot-product instructions (AVX-512 VNNI or AVX2), as
  llama.cpp's Q4_1 x Q8_1. Chosen where the profile is int4_wo on the CPU, NIM_CPU_INT4_KERNEL is
  auto, the kernel builds here with one of those instruction sets (its portable C++ path is for
  tests, not speed), and its start-up check passes (its float64 reference, every row alike at any
  batch size and place, the MoE op too).
- aten's int4 kernel otherwise, weight-only: bf16 activations as they are, float32 ones cast to
  bf16 around each layer (BuildOptions.int_kernels_in_bf16).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import torch
from torch import nn

from service.engine.models.base import CausalLM
from service.engine.models.quant_linear import Int4Linear
from service.engine.native import w4a8
from service.engine.protocol import PathChoice

log = logging.getLogger(__name__)

SETTING = "NIM_CPU_INT4_KERNEL=weight-only"
NAME = "int4_kernel"
Kernel = Literal["aten", "w4a8"]


def choose(precision: str, device: torch.device, enabled: bool) -> tuple[Kernel, str]:
    """The kernel a model's native int4 layers are built for, and why (before the model is built)."""
    if precision != "int4_wo" or device.type != "cpu":
        return "aten", "no native int4 layers (the int4_wo profile on the CPU)"
    if not enabled:
        return "aten", f"off ({SETTING}): aten's int4 kernel, activations not quantized"
    started = time.monotonic()
    problem = w4a8.serving_problem() or w4a8.check()
    if problem is not None:
        log.warning("%s; int4 layers run aten's int4 kernel (%s skips it)", problem, SETTING)
        return "aten", f"{problem}; aten's int4 kernel instead"
    return "w4a8", (
        "each block of 32 activations rounded to int8 (steps of its largest magnitude / 127), the "
        f"products with the int4 weights summed in integers (W4A8, {w4a8.isa()}; checked against its "
        f"float64 reference and batch-invariant at start-up, {time.monotonic() - started:.1f} s; "
        f"{SETTING} keeps the activations unrounded on aten's kernel)"
    )


def path(model: CausalLM, kernel: Kernel, reason: str) -> PathChoice:
    """The choice as /v1/metadata shows it, once the model is built: how many layers took it."""
    assert isinstance(model, nn.Module)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and m.native]
    moved = sum(m.kernel == "w4a8" for m in layers)
    if kernel == "w4a8" and moved < len(layers):
        reason = f"{reason}; {len(layers) - moved} of {len(layers)} layers stay on aten's (logged)"
    return PathChoice(NAME, kernel == "w4a8" and moved > 0, reason, SETTING)
