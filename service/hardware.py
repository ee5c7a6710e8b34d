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


def free_memory_bytes(device: torch.device) -> int:
    """Memory this process could still allocate on `device`.

    On CPU: the kernel's MemAvailable, lowered to the cgroup's remaining allowance when the
    container has a memory limit (what an orchestrator enforces, not what the host has).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    available = _meminfo_available()
    cgroup_room = _cgroup_room()
    return min(available, cgroup_room) if cgroup_room is not None else available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_room() -> int | None:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None
