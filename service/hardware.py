"""What this machine offers the PyTorch engine: device and the fastest sound dtype.

(NVML-based GPU inventory for profile selection grows here; this part answers only
"where and in what precision do we run".)
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """ISA flags from /proc/cpuinfo (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls beat fp32 only with native bf16 instructions (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def choose_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("NIM_DEVICE=cuda but no CUDA device is available to PyTorch")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def available_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
