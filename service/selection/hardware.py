"""What this machine offers: the accelerators NVML reports, the CPU, and the engine's device and dtype.

* `detect_system()` builds a `SystemInfo` (GPUs with compute capability, memory, MIG mode and NVLink
  peers; driver and CUDA versions; the CPU) through NVML. Every later decision (profile selection,
  `list-model-profiles`) takes a `SystemInfo`, never NVML itself, so tests and `--system FILE` can inject a
  description (`load_system`, JSON written by `SystemInfo.to_dict`) and exercise any GPU box on a laptop.
  Detection never crashes for want of a GPU: no `pynvml`, no `libnvidia-ml`, no driver all give a CPU-only
  `SystemInfo` whose `nvml_status` says why.
* The host's own facts (CPU flags, the container's CPUs and memory) come from service.host; where
  and in what precision the PyTorch engine runs is service.engine.torch.device's.
"""

from __future__ import annotations

import contextlib
import json
import platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from service.host import (
    available_cpu_count,
    cgroup_memory_limit,
    cpu_flags,
    host_memory_available,
    meminfo_total,
)

# ---------------------------------------------------------------------------------------------------------
# System inventory: data model
# ---------------------------------------------------------------------------------------------------------

# GPU family tags. The name is lower-cased and split into alphanumeric tokens ("NVIDIA A100-SXM4-40GB" ->
# nvidia, a100, sxm4, 40gb); the first token that is a key here gives the family, so "h200" never reads as
# "h20" nor "a100" as "a10". RTX names follow their own rule (below). The mapping, with real names:
#   NVIDIA GB200 / GB300                                  -> gb200 / gb300
#   NVIDIA B200 / B300 / B100                             -> b200 / b300 / b100
#   NVIDIA GH200 480GB                                    -> gh200
#   NVIDIA H200, NVIDIA H200 NVL                          -> h200
#   NVIDIA H100 80GB HBM3, NVIDIA H100 PCIe, H100 NVL     -> h100  (pci_device_id tells 2330/2331/2321 apart)
#   NVIDIA H800 / NVIDIA H20                              -> h800 / h20
#   NVIDIA A100-SXM4-40GB, NVIDIA A100 80GB PCIe          -> a100  (a MIG slice "... MIG 3g.40gb" as well)
#   NVIDIA A800, A10G, A10, A30, A40, A16, A2             -> a800, a10g, a10, a30, a40, a16, a2
#   NVIDIA L40S / L40 / L20 / L4                          -> l40s / l40 / l20 / l4
#   Tesla T4, Tesla V100-SXM2-16GB                        -> t4, v100
#   NVIDIA GeForce RTX 4090 (5090, 3090 Ti, ...)          -> rtx4090 (rtx5090, rtx3090ti, ...)
#   NVIDIA RTX 6000 Ada Generation (4000 SFF Ada, ...)    -> rtx6000_ada (rtx4000_ada, ...)
#   NVIDIA RTX A6000                                      -> rtx_a6000
#   NVIDIA RTX PRO 6000 Blackwell Server Edition          -> rtx_pro6000
#   anything else                                         -> generic
GPU_FAMILIES: dict[str, str] = {
    token: token
    for token in (
        "gb200", "gb300", "b200", "b300", "b100", "gh200", "h200", "h100", "h800", "h20",
        "a100", "a800", "a10g", "a10", "a30", "a40", "a16", "a2", "l40s", "l40", "l20", "l4", "t4", "v100",
    )
}  # fmt: skip
GENERIC_FAMILY = "generic"


def gpu_family(name: str) -> str:
    """The family tag profiles are built for (see the table above GPU_FAMILIES); "generic" if unknown."""
    tokens = re.findall(r"[a-z0-9]+", name.lower())
    if "rtx" in tokens:
        rest = tokens[tokens.index("rtx") + 1 :]
        if rest[:1] == ["pro"] and rest[1:2] and rest[1].isdigit():
            return f"rtx_pro{rest[1]}"
        if rest and re.fullmatch(r"a\d{4}", rest[0]):
            return f"rtx_{rest[0]}"
        if rest and rest[0].isdigit():
            return f"rtx{rest[0]}" + ("ti" if "ti" in rest[1:2] else "") + ("_ada" if "ada" in rest else "")
    for token in tokens:
        if token in GPU_FAMILIES:
            return GPU_FAMILIES[token]
    return GENERIC_FAMILY


@dataclass(frozen=True)
class GPUInfo:
    """One CUDA device as this process sees it.

    A MIG slice is its own device: `uuid` starts with "MIG-", `mig_mode` is True, `name` is what NVML calls
    the slice ("NVIDIA A100-SXM4-80GB MIG 3g.40gb"), memory is the slice's, while compute capability, PCI ids
    and `physical_index` are its parent GPU's. A GPU in MIG mode whose slices NVML would not list keeps its
    "GPU-" uuid with `mig_mode` True. `family` is derived from the name, so a slice keeps its parent's family.
    """

    index: int  # logical index: what CUDA (and torch "cuda:N") calls it after CUDA_VISIBLE_DEVICES
    physical_index: int  # NVML index
    name: str
    uuid: str
    pci_device_id: str  # "2330:10de" (device:vendor, lower-case hex), as NIM's gpu_device tag; "" unknown
    compute_capability: tuple[int, int]
    memory_total: int  # bytes
    memory_free: int  # bytes
    mig_mode: bool | None  # None: not supported or unknown
    nvlink_peers: tuple[int, ...] = ()  # logical indices of other visible GPUs over active NVLink
    pci_bus_id: str = ""  # "00000000:18:00.0"; "" unknown

    @property
    def family(self) -> str:
        return gpu_family(self.name)

    @property
    def is_mig_slice(self) -> bool:
        return self.uuid.startswith("MIG-")

    @property
    def compute_capability_str(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


# Only the flags that change a decision (bf16/fp16/int8 kernels, AMX) or that a person reading
# `list-model-profiles` looks for; /proc/cpuinfo lists a hundred more.
INTERESTING_ISA_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2", "bf16", "i8mm",  # aarch64 (Grace): /proc/cpuinfo "Features"
)  # fmt: skip


@dataclass(frozen=True)
class CPUInfo:
    model_name: str
    cores: int  # logical CPUs this process may run on
    memory_total: int  # bytes; the cgroup limit where lower than the host's
    memory_available: int  # bytes this process could still allocate
    isa_flags: tuple[str, ...]  # subset of INTERESTING_ISA_FLAGS
    architecture: str = ""  # platform.machine(): "x86_64", "aarch64"


@dataclass(frozen=True)
class SystemInfo:
    """Everything profile selection needs to know about the machine, as detected or as injected.

    `nvml_status` is "ok" when NVML answered and at least one GPU is visible; otherwise it says, in a few
    words, why there are no GPUs ("library not found", "driver not loaded", "CUDA_VISIBLE_DEVICES is
    empty", ...), ready to be quoted in a reason. `notes` records anything detection degraded or ignored.
    """

    gpus: tuple[GPUInfo, ...]
    cpu: CPUInfo
    driver_version: str | None = None
    cuda_driver_version: int | None = None  # 12080 -> CUDA 12.8
    nvml_status: str = "ok"
    notes: tuple[str, ...] = ()

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def cuda_version_str(self) -> str | None:
        if self.cuda_driver_version is None:
            return None
        return f"{self.cuda_driver_version // 1000}.{self.cuda_driver_version % 1000 // 10}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "nvml_status": self.nvml_status,
            "notes": list(self.notes),
            "gpus": [
                {
                    "index": g.index,
                    "physical_index": g.physical_index,
                    "name": g.name,
                    "uuid": g.uuid,
                    "pci_device_id": g.pci_device_id,
                    "pci_bus_id": g.pci_bus_id,
                    "compute_capability": list(g.compute_capability),
                    "memory_total": g.memory_total,
                    "memory_free": g.memory_free,
                    "mig_mode": g.mig_mode,
                    "nvlink_peers": list(g.nvlink_peers),
                }
                for g in self.gpus
            ],
            "cpu": {
                "model_name": self.cpu.model_name,
                "architecture": self.cpu.architecture,
                "cores": self.cpu.cores,
                "memory_total": self.cpu.memory_total,
                "memory_available": self.cpu.memory_available,
                "isa_flags": list(self.cpu.isa_flags),
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SystemInfo:
        """The inverse of `to_dict`; a hand-written description gets a ValueError naming the bad field.

        Optional: driver_version, cuda_driver_version, nvml_status, notes; per GPU pci_bus_id, mig_mode,
        nvlink_peers, memory_free (defaults to memory_total); per CPU architecture. Unknown keys are errors
        (a misspelt key would otherwise silently take its default).
        """
        _check_keys(
            d, "system", ("gpus", "cpu"), ("driver_version", "cuda_driver_version", "nvml_status", "notes")
        )
        if not isinstance(d["gpus"], list):
            raise ValueError(f"gpus: expected a list, got {_kind(d['gpus'])}")
        gpus = tuple(_gpu_from_dict(g, i) for i, g in enumerate(d["gpus"]))
        _check_gpus(gpus)
        cuda = d.get("cuda_driver_version")
        notes = d.get("notes", [])
        if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
            raise ValueError(f"notes: expected a list of strings, got {notes!r}")
        return cls(
            gpus=gpus,
            cpu=_cpu_from_dict(d["cpu"]),
            driver_version=_str(d.get("driver_version"), "driver_version", optional=True),
            cuda_driver_version=None if cuda is None else _int(cuda, "cuda_driver_version"),
            nvml_status=_str(d.get("nvml_status", "ok"), "nvml_status"),
            notes=tuple(notes),
        )


_GPU_REQUIRED = (
    "index",
    "physical_index",
    "name",
    "uuid",
    "pci_device_id",
    "compute_capability",
    "memory_total",
)
_GPU_OPTIONAL = ("memory_free", "mig_mode", "nvlink_peers", "pci_bus_id")


def _gpu_from_dict(g: Any, i: int) -> GPUInfo:
    where = f"gpus[{i}]"
    _check_keys(g, where, _GPU_REQUIRED, _GPU_OPTIONAL)
    total = _int(g["memory_total"], f"{where}.memory_total")
    free = _int(g.get("memory_free", total), f"{where}.memory_free")
    if free > total:
        raise ValueError(f"{where}.memory_free: {free} exceeds memory_total {total}")
    pci = _str(g["pci_device_id"], f"{where}.pci_device_id")
    if pci and not re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{4}", pci):
        raise ValueError(
            f"{where}.pci_device_id: expected 'dddd:vvvv' lower-case hex like '2330:10de', got {pci!r}"
        )
    mig = g.get("mig_mode")
    if mig is not None and not isinstance(mig, bool):
        raise ValueError(f"{where}.mig_mode: expected true, false or null, got {mig!r}")
    peers = g.get("nvlink_peers", [])
    if not isinstance(peers, list):
        raise ValueError(f"{where}.nvlink_peers: expected a list of GPU indices, got {_kind(peers)}")
    return GPUInfo(
        index=_int(g["index"], f"{where}.index"),
        physical_index=_int(g["physical_index"], f"{where}.physical_index"),
        name=_str(g["name"], f"{where}.name"),
        uuid=_str(g["uuid"], f"{where}.uuid"),
        pci_device_id=pci,
        compute_capability=_capability(g["compute_capability"], f"{where}.compute_capability"),
        memory_total=total,
        memory_free=free,
        mig_mode=mig,
        nvlink_peers=tuple(_int(p, f"{where}.nvlink_peers[{k}]") for k, p in enumerate(peers)),
        pci_bus_id=_str(g.get("pci_bus_id", ""), f"{where}.pci_bus_id"),
    )


def _check_gpus(gpus: tuple[GPUInfo, ...]) -> None:
    """Cross-GPU consistency: logical indices 0..n-1 in order, unique uuids, symmetric NVLink peers."""
    seen_uuids: dict[str, int] = {}
    for i, g in enumerate(gpus):
        if g.index != i:
            raise ValueError(
                f"gpus[{i}].index: expected {i} (logical indices run 0..n-1 in list order), got {g.index}"
            )
        if g.uuid:
            if g.uuid in seen_uuids:
                raise ValueError(f"gpus[{i}].uuid: {g.uuid!r} repeats gpus[{seen_uuids[g.uuid]}]")
            seen_uuids[g.uuid] = i
        if len(set(g.nvlink_peers)) != len(g.nvlink_peers):
            raise ValueError(f"gpus[{i}].nvlink_peers: repeated index in {list(g.nvlink_peers)}")
        for p in g.nvlink_peers:
            if p == i or p >= len(gpus):
                raise ValueError(
                    f"gpus[{i}].nvlink_peers: {p} is not another GPU's index (0..{len(gpus) - 1})"
                )
            if i not in gpus[p].nvlink_peers:
                raise ValueError(f"gpus[{i}].nvlink_peers: lists {p}, but gpus[{p}].nvlink_peers lacks {i}")


def _cpu_from_dict(c: Any) -> CPUInfo:
    _check_keys(
        c, "cpu", ("model_name", "cores", "memory_total", "memory_available", "isa_flags"), ("architecture",)
    )
    flags = c["isa_flags"]
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise ValueError(f"cpu.isa_flags: expected a list of strings, got {flags!r}")
    return CPUInfo(
        model_name=_str(c["model_name"], "cpu.model_name"),
        cores=_int(c["cores"], "cpu.cores", minimum=1),
        memory_total=_int(c["memory_total"], "cpu.memory_total"),
        memory_available=_int(c["memory_available"], "cpu.memory_available"),
        isa_flags=tuple(flags),
        architecture=_str(c.get("architecture", ""), "cpu.architecture"),
    )


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_keys(d: Any, where: str, required: Sequence[str], optional: Sequence[str]) -> None:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: expected an object, got {_kind(d)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        known = ", ".join([*required, *optional])
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; known: {known}")


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _str(value: Any, where: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {_kind(value)}")
    return value


def _capability(value: Any, where: str) -> tuple[int, int]:
    """[9, 0] as to_dict writes it; "9.0" accepted too, as people write it."""
    if isinstance(value, str) and re.fullmatch(r"\d+\.\d+", value):
        major, minor = value.split(".")
        return int(major), int(minor)
    if isinstance(value, list | tuple) and len(value) == 2:
        return _int(value[0], f"{where}[0]"), _int(value[1], f"{where}[1]")
    raise ValueError(f'{where}: expected [major, minor] like [9, 0] (or "9.0"), got {value!r}')


def load_system(path: str | Path) -> SystemInfo:
    """An injected system description: the JSON `SystemInfo.to_dict` writes (what `detect` prints)."""
    path = Path(path)
    try:
        return SystemInfo.from_dict(json.loads(path.read_text()))
    except ValueError as exc:  # json.JSONDecodeError included
        raise ValueError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------------------

# NVML return codes (a stable ABI); named here so a stand-in module need not define them.
_NVML_ERROR_INVALID_ARGUMENT = 2
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_NO_PERMISSION = 4
_NVML_ERROR_NOT_FOUND = 6
_NVML_ERROR_DRIVER_NOT_LOADED = 9
_NVML_ERROR_LIBRARY_NOT_FOUND = 12
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18

# Keyed by object: it is looked up with whatever an exception's `value` holds, None included.
_INIT_FAILURES: dict[object, str] = {
    _NVML_ERROR_LIBRARY_NOT_FOUND: "library not found",
    _NVML_ERROR_DRIVER_NOT_LOADED: "driver not loaded",
    _NVML_ERROR_NO_PERMISSION: "no permission",
    _NVML_ERROR_LIB_RM_VERSION_MISMATCH: "driver/library version mismatch",
}
_STATUS_HINTS = {
    "pynvml not installed": "the nvidia-ml-py package is missing from this environment",
    "library not found": "no libnvidia-ml in this container; run it with the NVIDIA Container Toolkit "
    "(docker --gpus all, Kubernetes runtimeClassName nvidia)",
    "driver not loaded": "the NVIDIA kernel driver is not loaded on the host",
    "no permission": "this process may not open /dev/nvidia*",
    "driver/library version mismatch": "libnvidia-ml and the loaded kernel driver differ (reboot the host)",
}


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


def detect_system(
    cuda_visible_devices: str | None = None, nvml: ModuleType | None = None, *, cpu: CPUInfo | None = None
) -> SystemInfo:
    """The GPUs this process can use, through NVML, and the CPU; CPU-only (never an exception) without NVML.

    `cuda_visible_devices` is the caller's CUDA_VISIBLE_DEVICES (None: unset, every GPU). NVML lists every
    physical GPU whatever that variable says, so its CUDA semantics are applied here: comma-separated
    entries, each an index or a "GPU-"/"MIG-" UUID (a unique prefix suffices); "" selects nothing; the first
    entry that matches no GPU (or repeats one) ends the list, as CUDA does. Indices are taken in NVML
    (PCI bus) order, i.e. CUDA_DEVICE_ORDER=PCI_BUS_ID. CUDA enumerates at most one MIG slice per process,
    so does this. `nvml` is a pynvml-compatible module (default: `import pynvml`), for tests.
    Optional queries (MIG mode, NVLink, PCI) that fail degrade their field; a failing name, memory or
    compute-capability query leaves the GPU listed (so logical indices still match CUDA's) with zeros and
    a note, so nothing gets planned onto it.
    """
    cpu = cpu if cpu is not None else detect_cpu()
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return SystemInfo((), cpu, nvml_status="pynvml not installed")
        nvml = pynvml
    error = _nvml_error_class(nvml)
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError, or NVMLLibraryMismatchError / OSError from a broken install
        code = getattr(exc, "value", None) if isinstance(exc, error) else None
        return SystemInfo((), cpu, nvml_status=_INIT_FAILURES.get(code, f"nvmlInit failed: {exc}"))
    try:
        return _inventory(_Nvml(nvml, error), cuda_visible_devices, cpu)
    finally:
        with contextlib.suppress(error):
            nvml.nvmlShutdown()


def _nvml_error_class(nvml: Any) -> type[Exception]:
    cls = getattr(nvml, "NVMLError", None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls
    try:
        import pynvml
    except ImportError:
        return Exception
    return pynvml.NVMLError


class _Nvml:
    """The module plus its error class; `optional` turns an NVMLError, or a function this pynvml lacks, into
    a default, for the queries whose failure should only degrade a field."""

    def __init__(self, module: Any, error: type[Exception]) -> None:
        self.m = module
        self.error = error

    def optional(self, name: str, *args: Any, default: Any = None) -> Any:
        fn = getattr(self.m, name, None)
        if fn is None:
            return default
        try:
            return fn(*args)
        except self.error:
            return default

    def const(self, name: str, fallback: int) -> int:
        return getattr(self.m, name, fallback)


@dataclass(eq=False)
class _Device:
    """A CUDA-enumerable device before CUDA_VISIBLE_DEVICES applies: a whole GPU or one MIG slice."""

    physical_index: int
    handle: Any  # this device's handle (a MIG device handle for a slice); None: NVML gave none
    parent: Any  # the physical GPU's handle
    uuid: str
    parent_uuid: str
    mig_mode: bool | None
    is_mig: bool


def _inventory(q: _Nvml, cuda_visible_devices: str | None, cpu: CPUInfo) -> SystemInfo:
    notes: list[str] = []
    driver = _text(q.optional("nvmlSystemGetDriverVersion"))
    cuda = q.optional("nvmlSystemGetCudaDriverVersion")
    cuda = int(cuda) if cuda is not None else None
    try:
        count = int(q.m.nvmlDeviceGetCount())
    except q.error as exc:
        return SystemInfo((), cpu, driver, cuda, nvml_status=f"nvmlDeviceGetCount failed: {exc}")
    every = _enumerate(q, count, notes)
    default_order = _one_mig_slice(every, notes)
    chosen = _one_mig_slice(_apply_visible(every, default_order, cuda_visible_devices, notes), notes)
    gpus = [_gpu_info(q, logical, device, notes) for logical, device in enumerate(chosen)]
    peers = _nvlink_peers(q, chosen, gpus)
    gpus = [replace(g, nvlink_peers=p) for g, p in zip(gpus, peers, strict=True)]
    if gpus:
        status = "ok"
    elif count == 0:
        status = "no GPU found by NVML"
    elif cuda_visible_devices is not None and not cuda_visible_devices.strip():
        status = "CUDA_VISIBLE_DEVICES is empty"
    elif cuda_visible_devices is not None:
        status = f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} selects no GPU"
    else:
        status = "no GPU usable by CUDA (MIG mode without MIG devices)"
    return SystemInfo(tuple(gpus), cpu, driver, cuda, nvml_status=status, notes=tuple(notes))


def _enumerate(q: _Nvml, count: int, notes: list[str]) -> list[_Device]:
    devices: list[_Device] = []
    for i in range(count):
        try:
            handle = q.m.nvmlDeviceGetHandleByIndex(i)
        except q.error as exc:
            notes.append(f"GPU {i}: NVML gave no handle ({exc}); listed with unknown properties")
            devices.append(_Device(i, None, None, "", "", None, False))
            continue
        uuid = _text(q.optional("nvmlDeviceGetUUID", handle)) or ""
        mig = _mig_mode(q, handle)
        if not mig:
            devices.append(_Device(i, handle, handle, uuid, uuid, mig, False))
            continue
        slices = _mig_slices(q, handle)
        if slices is None:
            notes.append(
                f"GPU {i}: MIG mode is on but NVML would not list its MIG devices; shown as the whole GPU"
            )
            devices.append(_Device(i, handle, handle, uuid, uuid, True, False))
        elif not slices:
            notes.append(f"GPU {i}: MIG mode is on with no MIG device created; CUDA cannot use it")
        else:
            devices += [_Device(i, h, handle, mig_uuid, uuid, True, True) for h, mig_uuid in slices]
    return devices


def _mig_mode(q: _Nvml, handle: Any) -> bool | None:
    mode = q.optional("nvmlDeviceGetMigMode", handle)
    if mode is None:
        return None
    current = mode[0] if isinstance(mode, list | tuple) else mode
    return int(current) == q.const("NVML_DEVICE_MIG_ENABLE", 1)


def _mig_slices(q: _Nvml, handle: Any) -> list[tuple[Any, str]] | None:
    """(handle, uuid) of each MIG device on a GPU; None where NVML cannot say."""
    get_max = getattr(q.m, "nvmlDeviceGetMaxMigDeviceCount", None)
    get_slice = getattr(q.m, "nvmlDeviceGetMigDeviceHandleByIndex", None)
    if get_max is None or get_slice is None:
        return None
    try:
        most = int(get_max(handle))
    except q.error:
        return None
    slices = []
    for k in range(most):
        try:
            mig_handle = get_slice(handle, k)
        except q.error as exc:
            if getattr(exc, "value", None) in (_NVML_ERROR_NOT_FOUND, _NVML_ERROR_INVALID_ARGUMENT):
                continue  # an empty slot
            return None
        slices.append((mig_handle, _text(q.optional("nvmlDeviceGetUUID", mig_handle)) or ""))
    return slices


def _one_mig_slice(devices: list[_Device], notes: list[str]) -> list[_Device]:
    """CUDA enumerates a single MIG device per process: keep the first, drop (and note) the others."""
    kept: list[_Device] = []
    dropped = 0
    for device in devices:
        if device.is_mig and any(k.is_mig for k in kept):
            dropped += 1
        else:
            kept.append(device)
    if dropped:
        note = f"CUDA enumerates one MIG device per process; {dropped} more MIG device(s) not counted"
        if note not in notes:
            notes.append(note)
    return kept


def _apply_visible(
    every: list[_Device], default_order: list[_Device], visible: str | None, notes: list[str]
) -> list[_Device]:
    if visible is None:
        return default_order
    if not visible.strip():
        return []
    chosen: list[_Device] = []
    for raw in visible.split(","):
        entry = raw.strip()
        device = _match_visible(entry, every, default_order)
        if device is None or device in chosen:
            problem = "matches no GPU" if device is None else "repeats a GPU"
            notes.append(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} {problem}; "
                "like CUDA, it and the entries after it are ignored"
            )
            break
        chosen.append(device)
    return chosen


def _match_visible(entry: str, every: list[_Device], default_order: list[_Device]) -> _Device | None:
    if re.fullmatch(r"\d+", entry):
        k = int(entry)
        return default_order[k] if k < len(default_order) else None
    key = entry.lower()
    if key.startswith(
        "gpu-"
    ):  # a whole GPU by (a unique prefix of) its UUID; a MIG-mode GPU: its first slice
        parents = {d.physical_index for d in every if d.parent_uuid.lower().startswith(key)}
        if len(parents) != 1:
            return None
        return next(d for d in every if d.physical_index in parents)
    if key.startswith(
        "mig-"
    ):  # one MIG slice by its UUID (the older MIG-GPU-<uuid>/gi/ci form is not matched)
        hits = [d for d in every if d.is_mig and d.uuid.lower().startswith(key)]
        return hits[0] if len(hits) == 1 else None
    return None


def _gpu_info(q: _Nvml, logical: int, device: _Device, notes: list[str]) -> GPUInfo:
    unknown = GPUInfo(
        logical, device.physical_index, "unknown", device.uuid, "", (0, 0), 0, 0, device.mig_mode
    )
    if device.handle is None:
        return unknown

    def required(what: str, name: str, handle: Any) -> Any:
        try:
            return getattr(q.m, name)(handle)
        except q.error as exc:
            notes.append(f"GPU {device.physical_index}: {what} query failed ({exc})")
            return None

    name = _text(required("name", "nvmlDeviceGetName", device.handle))
    if name is None and device.is_mig:
        name = _text(q.optional("nvmlDeviceGetName", device.parent))
    capability = required("compute capability", "nvmlDeviceGetCudaComputeCapability", device.parent)
    memory = required("memory", "nvmlDeviceGetMemoryInfo", device.handle)
    pci = q.optional("nvmlDeviceGetPciInfo", device.parent)
    return GPUInfo(
        index=logical,
        physical_index=device.physical_index,
        name=name or unknown.name,
        uuid=device.uuid,
        pci_device_id=_pci_device_id(pci),
        compute_capability=(int(capability[0]), int(capability[1])) if capability else (0, 0),
        memory_total=int(memory.total) if memory is not None else 0,
        memory_free=int(memory.free) if memory is not None else 0,
        mig_mode=device.mig_mode,
        pci_bus_id=(_text(getattr(pci, "busId", None)) or "") if pci is not None else "",
    )


def _pci_device_id(pci: Any) -> str:
    """NVML's pciDeviceId packs device << 16 | vendor: 0x233010DE -> "2330:10de"."""
    value = getattr(pci, "pciDeviceId", None)
    if value is None:
        return ""
    value = int(value)
    return f"{(value >> 16) & 0xFFFF:04x}:{value & 0xFFFF:04x}"


def _nvlink_peers(q: _Nvml, chosen: list[_Device], gpus: list[GPUInfo]) -> list[tuple[int, ...]]:
    """Pairs of visible whole GPUs joined by active NVLink (directly or through NVSwitch).

    A GPU with no active link has no peers. For two GPUs that both have active links, NVML's own NVLink P2P
    status decides (it covers NVSwitch fabrics, where a link's far end is a switch, not a GPU); where that
    query is unavailable, a direct link counts: one GPU's active link whose remote PCI address is the other's.
    """
    peers: list[set[int]] = [set() for _ in chosen]
    links = {
        k: _active_links(q, d.parent) for k, d in enumerate(chosen) if d.handle is not None and not d.is_mig
    }
    linked = [k for k, active in links.items() if active]
    remote: dict[int, set[Any]] = {}

    def remote_buses(k: int) -> set[Any]:
        if k not in remote:
            infos = (
                q.optional("nvmlDeviceGetNvLinkRemotePciInfo", chosen[k].parent, link) for link in links[k]
            )
            remote[k] = {_bus_key(_text(getattr(i, "busId", None)) or "") for i in infos if i is not None}
        return remote[k]

    nvlink_caps = q.const("NVML_P2P_CAPS_INDEX_NVLINK", 2)
    for n, a in enumerate(linked):
        for b in linked[n + 1 :]:
            status = q.optional("nvmlDeviceGetP2PStatus", chosen[a].parent, chosen[b].parent, nvlink_caps)
            if status is not None:
                joined = int(status) == q.const("NVML_P2P_STATUS_OK", 0)
            else:
                bus_a, bus_b = _bus_key(gpus[a].pci_bus_id), _bus_key(gpus[b].pci_bus_id)
                joined = bool(gpus[a].pci_bus_id and gpus[b].pci_bus_id) and (
                    bus_b in remote_buses(a) or bus_a in remote_buses(b)
                )
            if joined:
                peers[a].add(b)
                peers[b].add(a)
    return [tuple(sorted(p)) for p in peers]


def _active_links(q: _Nvml, handle: Any) -> list[int]:
    get_state = getattr(q.m, "nvmlDeviceGetNvLinkState", None)
    if get_state is None:
        return []
    active = []
    enabled = q.const("NVML_FEATURE_ENABLED", 1)
    for link in range(q.const("NVML_NVLINK_MAX_LINKS", 18)):
        try:
            state = get_state(handle, link)
        except q.error as exc:
            if getattr(exc, "value", None) in (
                _NVML_ERROR_NOT_SUPPORTED,
                _NVML_ERROR_INVALID_ARGUMENT,
                _NVML_ERROR_FUNCTION_NOT_FOUND,
            ):
                break  # no NVLink on this GPU, or past its last link
            continue
        if int(state) == enabled:
            active.append(link)
    return active


def _bus_key(bus_id: str) -> tuple[int, ...] | str:
    """A PCI address comparable across NVML's 8- and 4-digit domain spellings ("00000000:18:00.0")."""
    m = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])", bus_id.strip())
    return tuple(int(x, 16) for x in m.groups()) if m else bus_id.strip().lower()


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


# ---------------------------------------------------------------------------------------------------------
# Human-readable summary
# ---------------------------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def describe(system: SystemInfo) -> str:
    """The "SYSTEM INFO" block `list-model-profiles` prints: driver, CUDA, each GPU, the CPU, any notes."""
    lines = ["SYSTEM INFO"]
    if system.driver_version or system.cuda_driver_version is not None:
        cuda = f", CUDA {system.cuda_version_str}" if system.cuda_version_str else ""
        lines.append(f"- Driver: {system.driver_version or 'unknown'}{cuda}")
    if system.gpus:
        lines.append(f"- GPUs ({system.gpu_count}):")
        for g in system.gpus:
            where = f"({g.index})" if g.index == g.physical_index else f"({g.index}, NVML {g.physical_index})"
            facts = [f"CC {g.compute_capability_str}", f"{_gib(g.memory_total)} ({_gib(g.memory_free)} free)"]
            if g.is_mig_slice:
                facts.append("MIG slice")
            elif g.mig_mode:
                facts.append("MIG mode on")
            if g.nvlink_peers:
                facts.append("NVLink to " + ",".join(map(str, g.nvlink_peers)))
            pci = f"[{g.pci_device_id}] " if g.pci_device_id else ""
            lines.append(f"  - {pci}{where} {g.name} ({g.family.upper()}): {', '.join(facts)}")
    else:
        hint = _STATUS_HINTS.get(system.nvml_status)
        lines.append(f"- GPUs: none ({system.nvml_status}{': ' + hint if hint else ''})")
    c = system.cpu
    arch = f" ({c.architecture})" if c.architecture else ""
    isa = f", {' '.join(c.isa_flags)}" if c.isa_flags else ""
    lines.append(
        f"- CPU: {c.model_name}{arch}, {c.cores} cores, {_gib(c.memory_total)} memory "
        f"({_gib(c.memory_available)} available){isa}"
    )
    lines += [f"- Note: {n}" for n in system.notes]
    return "\n".join(lines)
