"""Activations as the integer-dot-product kernels (q8.cpp, w4a8.cpp) see them: the Python side of
quantize.h, for the kernels' float64 references.

Each block of 32 inputs of a row is rounded to int8 steps of max|x| / 127 (llama.cpp's Q8
activations), in float32 arithmetic, as the kernels round them.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32  # inputs per activation block


def rounded_activations(x: Tensor) -> Tensor:
    """x [M, K] (K a multiple of BLOCK) as the kernels use it: each block's int8 steps times its
    scale, in float64."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax as the kernels divide (aten's scalar / tensor multiplies by a reciprocal instead)
    inverse = torch.full_like(amax, 127.0).div_(amax)
    steps = (blocks * torch.where((amax > 0) & inverse.isfinite(), inverse, 0.0)).round().clamp(-127, 127)
    return (steps.double() * (amax / 127.0).double()).view(m, k)
