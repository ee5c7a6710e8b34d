"""What this machine offers, detected: the GPUs this process may use through NVML, and the CPU.

* `detect_system()` builds a `SystemInfo` (service.selection.system_info: GPUs with compute capability,
  memory, MIG mode and NVLink peers; driver and CUDA versions; the CPU from
  service.selection.cpu_detection) through NVML. Every later decision (profile selection,
  `list-model-profiles`) takes a `SystemInfo`, never NVML itself, so tests and `--system FILE` can inject a
  description (`load_system`, JSON written by `SystemInfo.to_dict`) and exercise any GPU box on a laptop.
  Detection never crashes for want of a GPU: no `pynvml`, no `libnvidia-ml`, no driver all give a CPU-only
  `SystemInfo` whose `nvml_status` says why.
* The host's own facts (CPU flags, the container's CPUs and memory) come from service.host; where
  and in what precision the PyTorch engine runs is service.engine.torch.device's.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from service.selection.cpu_detection import detect_cpu
from service.selection.system_info import CPUInfo, GPUInfo, SystemInfo

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
