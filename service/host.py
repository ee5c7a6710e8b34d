"""What this host offers the process, read from Linux itself (no torch, no NVML): its CPU's ISA flags,
the CPUs and memory the container may use (affinity, cgroup v1/v2 limits). Hardware detection
(service.selection.hardware) and the engine's device choice (service.engine.torch.device) both read
it.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
from pathlib import Path


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


@functools.cache
def cxx_compiler_found() -> bool:
    """Whether the C++ compiler torch.utils.cpp_extension runs by default (`c++`) is on PATH: the
    native CPU ops (service/engine/native) are built with it on first use."""
    return shutil.which("c++") is not None


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls beat fp32 only with native bf16 instructions (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_cpu_count(cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may use: its affinity, lowered to the container's CPU quota (rounded up).

    A pod limited to 4 CPUs on a 64-core node still sees 64 in its affinity; running 64 threads
    under a 4-CPU quota is throttled into long stalls (and missed health probes)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def _cgroup_cpu_quota(root: Path) -> float | None:
    """CPUs' worth of time per period allowed by cgroup v2 (cpu.max) or v1 (cfs quota), if limited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError, ZeroDivisionError):
        return None


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


def meminfo_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_memory_limit() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return None if limit == "max" else int(limit)
    except (OSError, ValueError):
        return None


def host_memory_available() -> int:
    """Memory this process could still allocate on the host: the kernel's MemAvailable, lowered to
    the cgroup's remaining allowance when the container has a memory limit (what an orchestrator
    enforces, not what the host has)."""
    available = _meminfo_available()
    cgroup_room = _cgroup_room()
    return min(available, cgroup_room) if cgroup_room is not None else available
