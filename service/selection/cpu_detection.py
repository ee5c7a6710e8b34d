"""The host CPU as `CPUInfo`: its model name and ISA flags from /proc/cpuinfo (and service.host's
flags), its cores and memory bounded by this process's affinity and the container's cgroup limit."""

from __future__ import annotations

import platform
from pathlib import Path

from service.host import (
    available_cpu_count,
    cgroup_memory_limit,
    cpu_flags,
    host_memory_available,
    meminfo_total,
)
from service.selection.system_info import CPUInfo

# Only the flags that change a decision (bf16/fp16/int8 kernels, AMX) or that a person reading
# `list-model-profiles` looks for; /proc/cpuinfo lists a hundred more.
INTERESTING_ISA_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2", "bf16", "i8mm",  # aarch64 (Grace): /proc/cpuinfo "Features"
)  # fmt: skip


def detect_cpu() -> CPUInfo:
    """The host CPU from /proc (Linux), bounded by this process's affinity and cgroup memory limit."""
    block = _cpuinfo_first_block()
    model = block.get("model name") or block.get("Model") or block.get("Hardware") or platform.processor()
    flags = cpu_flags() | frozenset(block.get("Features", "").split())
    total = meminfo_total()
    limit = cgroup_memory_limit()
    if limit is not None:
        total = min(total, limit)
    return CPUInfo(
        model_name=(model or platform.machine() or "unknown").strip(),
        cores=available_cpu_count(),
        memory_total=total,
        memory_available=min(host_memory_available(), total),
        isa_flags=tuple(f for f in INTERESTING_ISA_FLAGS if f in flags),
        architecture=platform.machine(),
    )


def _cpuinfo_first_block() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields
