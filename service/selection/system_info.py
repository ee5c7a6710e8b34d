"""What this machine offers, as data: `SystemInfo` (the GPUs with compute capability, memory, MIG mode
and NVLink peers; driver and CUDA versions; the CPU), its JSON form (`to_dict`, `from_dict`,
`load_system` for `--system FILE` and NIM_SYSTEM_INFO), and `describe`, the summary
`list-model-profiles` prints.

Every decision (profile selection, `list-model-profiles`) takes a `SystemInfo`, never NVML itself, so
tests and a description file can exercise any GPU box on a laptop. service.selection.hardware detects
one through NVML; service.selection.cpu_detection reads the CPU.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


_STATUS_HINTS = {
    "pynvml not installed": "the nvidia-ml-py package is missing from this environment",
    "library not found": "no libnvidia-ml in this container; run it with the NVIDIA Container Toolkit "
    "(docker --gpus all, Kubernetes runtimeClassName nvidia)",
    "driver not loaded": "the NVIDIA kernel driver is not loaded on the host",
    "no permission": "this process may not open /dev/nvidia*",
    "driver/library version mismatch": "libnvidia-ml and the loaded kernel driver differ (reboot the host)",
}


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
