"""GPU/CPU inventory: NVML detection against a fake pynvml, CUDA_VISIBLE_DEVICES, and injected systems."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from service.host import available_cpu_count, cpu_flags, cpu_has_fast_bf16
from service.selection.cpu_detection import detect_cpu
from service.selection.hardware import detect_system
from service.selection.system_info import CPUInfo, GPUInfo, SystemInfo, describe, gpu_family, load_system

SYSTEMS = Path(__file__).resolve().parent / "systems"
MiB = 2**20
CPU = CPUInfo("Test CPU", 4, 16 * 2**30, 12 * 2**30, ("avx2", "avx512f", "avx512_bf16"), "x86_64")


# --- a fake pynvml ----------------------------------------------------------------------------------------


@dataclass
class FakeMig:
    uuid: str
    name: str
    total_mib: int


@dataclass
class FakeGPU:
    name: str
    uuid: str
    cc: tuple[int, int]
    total_mib: int
    pci_device_id: int  # NVML packing: device << 16 | vendor
    bus_id: str
    mig: int | None = 0  # current MIG mode; None: NotSupported
    mig_devices: list[FakeMig | None] = field(default_factory=list)  # None: an empty slot
    links: list[str] | None = None  # far-end PCI bus id of each active NVLink; None: NVLink NotSupported
    fail: dict[str, type[Exception]] = field(default_factory=dict)  # function name -> error it raises


class FakeNVML:
    """Stands in for the `pynvml` module: same function names, real pynvml error classes.

    Handles are ("gpu", i) or ("mig", i, k). `p2p` is the set of physical pairs NVML reports NVLink P2P for;
    None makes nvmlDeviceGetP2PStatus raise NotSupported (detection then matches NVLink remote PCI ids).
    """

    NVMLError = pynvml.NVMLError
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_P2P_CAPS_INDEX_NVLINK = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    NVML_P2P_STATUS_OK = pynvml.NVML_P2P_STATUS_OK

    def __init__(
        self,
        gpus: list[FakeGPU],
        *,
        p2p: set[frozenset[int]] | None = None,
        init_error: type[Exception] | None = None,
        driver: str = "570.124.06",
        cuda: int = 12080,
    ) -> None:
        self.gpus = gpus
        self.p2p = p2p
        self.init_error = init_error
        self.driver = driver
        self.cuda = cuda
        self.inits = 0
        self.shutdowns = 0

    def _gpu(self, handle: tuple, fn: str) -> FakeGPU:
        gpu = self.gpus[handle[1]]
        if fn in gpu.fail:
            raise gpu.fail[fn]()
        return gpu

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error()

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple:
        if not 0 <= i < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        self._gpu(("gpu", i), "nvmlDeviceGetHandleByIndex")
        return ("gpu", i)

    def nvmlDeviceGetName(self, h: tuple) -> str:
        gpu = self._gpu(h, "nvmlDeviceGetName")
        return gpu.mig_devices[h[2]].name if h[0] == "mig" else gpu.name

    def nvmlDeviceGetUUID(self, h: tuple) -> str:
        gpu = self._gpu(h, "nvmlDeviceGetUUID")
        return gpu.mig_devices[h[2]].uuid if h[0] == "mig" else gpu.uuid

    def nvmlDeviceGetMemoryInfo(self, h: tuple) -> SimpleNamespace:
        gpu = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        total = (gpu.mig_devices[h[2]].total_mib if h[0] == "mig" else gpu.total_mib) * MiB
        used = 500 * MiB
        return SimpleNamespace(total=total, free=total - used, used=used)

    def nvmlDeviceGetCudaComputeCapability(self, h: tuple) -> tuple[int, int]:
        if h[0] == "mig":
            raise pynvml.NVMLError_NotSupported()  # callers must ask the parent
        return self._gpu(h, "nvmlDeviceGetCudaComputeCapability").cc

    def nvmlDeviceGetPciInfo(self, h: tuple) -> SimpleNamespace:
        gpu = self._gpu(h, "nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=gpu.bus_id.encode(), pciDeviceId=gpu.pci_device_id)

    def nvmlDeviceGetMigMode(self, h: tuple) -> list[int]:
        gpu = self._gpu(h, "nvmlDeviceGetMigMode")
        if gpu.mig is None:
            raise pynvml.NVMLError_NotSupported()
        return [gpu.mig, gpu.mig]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: tuple) -> int:
        return 7 if self._gpu(h, "nvmlDeviceGetMaxMigDeviceCount").mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: tuple, k: int) -> tuple:
        gpu = self._gpu(h, "nvmlDeviceGetMigDeviceHandleByIndex")
        if k >= len(gpu.mig_devices) or gpu.mig_devices[k] is None:
            raise pynvml.NVMLError_NotFound()
        return ("mig", h[1], k)

    def nvmlDeviceGetNvLinkState(self, h: tuple, link: int) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetNvLinkState")
        if gpu.links is None:
            raise pynvml.NVMLError_NotSupported()
        if link >= 18:  # H100: 18 links; past the last NVML answers InvalidArgument
            raise pynvml.NVMLError_InvalidArgument()
        return pynvml.NVML_FEATURE_ENABLED if link < len(gpu.links) else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: tuple, link: int) -> SimpleNamespace:
        gpu = self._gpu(h, "nvmlDeviceGetNvLinkRemotePciInfo")
        assert gpu.links is not None
        return SimpleNamespace(busId=gpu.links[link].encode(), pciDeviceId=0)

    def nvmlDeviceGetP2PStatus(self, h1: tuple, h2: tuple, index: int) -> int:
        assert index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        if self.p2p is None:
            raise pynvml.NVMLError_NotSupported()
        ok = frozenset((h1[1], h2[1])) in self.p2p
        return pynvml.NVML_P2P_STATUS_OK if ok else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED


def h100x8(**kwargs: Any) -> FakeNVML:
    """A DGX/HGX H100: eight SXM GPUs, 18 links each into NVSwitches (the links' far ends are switches)."""
    buses = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
    gpus = [
        FakeGPU(
            "NVIDIA H100 80GB HBM3",
            f"GPU-{i:08x}-1111-2222-3333-444455556666",
            (9, 0),
            81559,
            0x233010DE,
            f"00000000:{bus}:00.0",
            links=[f"00000000:{0xC0 + k % 4:02X}:00.0" for k in range(18)],  # NVSwitch addresses
        )
        for i, bus in enumerate(buses)
    ]
    p2p = {frozenset((a, b)) for a in range(8) for b in range(8) if a != b}
    return FakeNVML(gpus, p2p=p2p, **kwargs)


def l40s(**kwargs: Any) -> FakeNVML:
    """A PCIe card without MIG or NVLink: those queries raise NotSupported."""
    gpu = FakeGPU("NVIDIA L40S", "GPU-aaaaaaaa-0000", (8, 9), 46068, 0x26B910DE, "00000000:01:00.0", mig=None)
    return FakeNVML([gpu], **kwargs)


# --- detection --------------------------------------------------------------------------------------------


def test_h100x8_all_gpus_nvlink_all_to_all() -> None:
    nvml = h100x8()
    system = detect_system(None, nvml, cpu=CPU)
    assert nvml.inits == nvml.shutdowns == 1
    assert system.nvml_status == "ok" and system.notes == ()
    assert system.gpu_count == 8
    assert system.driver_version == "570.124.06"
    assert system.cuda_driver_version == 12080 and system.cuda_version_str == "12.8"
    g = system.gpus[3]
    assert (g.index, g.physical_index, g.name, g.family) == (3, 3, "NVIDIA H100 80GB HBM3", "h100")
    assert g.uuid == "GPU-00000003-1111-2222-3333-444455556666"
    assert g.pci_device_id == "2330:10de" and g.pci_bus_id == "00000000:5D:00.0"
    assert g.compute_capability == (9, 0)
    assert g.memory_total == 81559 * MiB and g.memory_free == g.memory_total - 500 * MiB
    assert g.mig_mode is False
    for gpu in system.gpus:
        assert gpu.nvlink_peers == tuple(j for j in range(8) if j != gpu.index)
    assert system.cpu == CPU


@pytest.mark.parametrize(
    ("visible", "physical"),
    [
        (None, [0, 1, 2, 3, 4, 5, 6, 7]),
        ("4,5", [4, 5]),
        ("6, 2", [6, 2]),  # order is the caller's; spaces tolerated
        ("GPU-00000007-1111-2222-3333-444455556666", [7]),
        ("GPU-00000001,GPU-00000000-1111", [1, 0]),  # unique prefixes
        ("GPU-00000006,3", [6, 3]),  # UUIDs and indices mixed
        ("0,1,9,2", [0, 1]),  # out of range: it and the rest are dropped
        ("0,-1,2", [0]),
        ("-1", []),  # the usual "hide every GPU" idiom
        ("2,2,3", [2]),  # a repeat ends the list too
        ("GPU-0000000,1", []),  # ambiguous prefix matches no single GPU
        ("GPU-deadbeef", []),
        ("1,MIG-0000", [1]),  # no MIG device by that id
        ("0,,1", [0]),  # empty entry
        ("3,", [3]),
    ],
)
def test_cuda_visible_devices(visible: str | None, physical: list[int]) -> None:
    system = detect_system(visible, h100x8(), cpu=CPU)
    assert [g.physical_index for g in system.gpus] == physical
    assert [g.index for g in system.gpus] == list(range(len(physical)))
    # NVLink peers are logical indices among the visible GPUs only
    for g in system.gpus:
        assert g.nvlink_peers == tuple(j for j in range(len(physical)) if j != g.index)
    if physical:
        assert system.nvml_status == "ok"
    else:
        assert (
            system.nvml_status.startswith("CUDA_VISIBLE_DEVICES=") and "selects no GPU" in system.nvml_status
        )
    if visible is not None and len(physical) < len(visible.split(",")):
        assert any("CUDA_VISIBLE_DEVICES entry" in n for n in system.notes)


@pytest.mark.parametrize("visible", ["", "  "])
def test_cuda_visible_devices_empty_means_no_gpu(visible: str) -> None:
    nvml = h100x8()
    system = detect_system(visible, nvml, cpu=CPU)
    assert system.gpus == () and system.nvml_status == "CUDA_VISIBLE_DEVICES is empty"
    assert system.driver_version == "570.124.06"  # NVML still answered
    assert nvml.shutdowns == 1


def test_direct_nvlink_pairs_without_p2p_status() -> None:
    """Bridged pairs (0-1, 2-3): with no P2P status from NVML, links' remote PCI addresses decide."""
    buses = [f"00000000:{b}:00.0" for b in ("17", "31", "B1", "CA")]
    pair = {0: 1, 1: 0, 2: 3, 3: 2}
    gpus = [
        FakeGPU(
            "NVIDIA A100 80GB PCIe",
            f"GPU-{i}",
            (8, 0),
            81920,
            0x20B510DE,
            buses[i],
            links=[buses[pair[i]].replace("00000000:", "0000:")] * 4,  # 4-digit domain spelling
        )
        for i in range(4)
    ]
    system = detect_system(None, FakeNVML(gpus, p2p=None), cpu=CPU)
    assert [g.nvlink_peers for g in system.gpus] == [(1,), (0,), (3,), (2,)]
    system = detect_system("3,1,2", FakeNVML(gpus, p2p=None), cpu=CPU)
    assert [g.physical_index for g in system.gpus] == [3, 1, 2]
    assert [g.nvlink_peers for g in system.gpus] == [(2,), (), (0,)]


def test_nvlink_active_but_p2p_status_says_no() -> None:
    nvml = h100x8()
    nvml.p2p = {frozenset((0, 1))}
    system = detect_system("0,1,2", nvml, cpu=CPU)
    assert [g.nvlink_peers for g in system.gpus] == [(1,), (0,), ()]


def test_gpu_without_active_links_has_no_peers() -> None:
    nvml = h100x8()
    nvml.gpus[2].links = []
    system = detect_system("0,1,2", nvml, cpu=CPU)
    assert [g.nvlink_peers for g in system.gpus] == [(1,), (0,), ()]


def test_mig_and_nvlink_not_supported_degrade_to_unknown() -> None:
    nvml = l40s()
    system = detect_system(None, nvml, cpu=CPU)
    (g,) = system.gpus
    assert (g.name, g.family, g.compute_capability) == ("NVIDIA L40S", "l40s", (8, 9))
    assert g.memory_total == 46068 * MiB and g.pci_device_id == "26b9:10de"
    assert g.mig_mode is None and g.nvlink_peers == ()
    assert system.nvml_status == "ok" and nvml.shutdowns == 1


def test_failing_optional_queries_only_degrade_fields() -> None:
    nvml = h100x8()
    for gpu in nvml.gpus:
        gpu.fail = {
            "nvmlDeviceGetPciInfo": pynvml.NVMLError_Unknown,
            "nvmlDeviceGetMigMode": pynvml.NVMLError_NoPermission,
            "nvmlDeviceGetNvLinkState": pynvml.NVMLError_NotSupported,
        }
    system = detect_system(None, nvml, cpu=CPU)
    assert system.gpu_count == 8 and system.nvml_status == "ok"
    for g in system.gpus:
        assert (g.pci_device_id, g.pci_bus_id, g.mig_mode, g.nvlink_peers) == ("", "", None, ())
        assert g.memory_total == 81559 * MiB


def test_failing_required_query_keeps_the_gpu_with_zeros_and_a_note() -> None:
    """Logical indices must keep matching CUDA's, so a GPU NVML cannot describe stays, unplannable."""
    nvml = h100x8()
    nvml.gpus[1].fail = {"nvmlDeviceGetMemoryInfo": pynvml.NVMLError_GpuIsLost}
    nvml.gpus[2].fail = {"nvmlDeviceGetHandleByIndex": pynvml.NVMLError_GpuIsLost}
    system = detect_system("0,1,2,3", nvml, cpu=CPU)
    assert [g.physical_index for g in system.gpus] == [0, 1, 2, 3]
    assert system.gpus[1].memory_total == 0 and system.gpus[1].name == "NVIDIA H100 80GB HBM3"
    assert system.gpus[2].name == "unknown" and system.gpus[2].memory_total == 0
    assert system.gpus[2].compute_capability == (0, 0)
    assert any("GPU 1: memory query failed" in n for n in system.notes)
    assert any("GPU 2: NVML gave no handle" in n for n in system.notes)
    assert system.gpus[0].nvlink_peers == (1, 3)


def a100_mig(**kwargs: Any) -> FakeNVML:
    slices: list[FakeMig | None] = [
        FakeMig("MIG-11111111-aaaa", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40192),
        None,
        FakeMig("MIG-22222222-bbbb", "NVIDIA A100-SXM4-80GB MIG 2g.20gb", 19968),
    ]
    name, cc, pci = "NVIDIA A100-SXM4-80GB", (8, 0), 0x20B210DE
    gpus = [
        FakeGPU(name, "GPU-a100-0", cc, 81920, pci, "00000000:07:00.0", mig=1, mig_devices=slices, links=[]),
        FakeGPU(name, "GPU-a100-1", cc, 81920, pci, "00000000:0F:00.0", links=[]),
    ]
    return FakeNVML(gpus, **kwargs)


def test_mig_enabled_a100_is_seen_as_its_first_slice() -> None:
    system = detect_system(None, a100_mig(), cpu=CPU)
    mig, whole = system.gpus
    assert (mig.index, mig.physical_index, mig.uuid) == (0, 0, "MIG-11111111-aaaa")
    assert mig.name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb" and mig.family == "a100"
    assert mig.mig_mode is True and mig.is_mig_slice
    assert mig.memory_total == 40192 * MiB
    assert mig.compute_capability == (8, 0) and mig.pci_device_id == "20b2:10de"  # from the parent GPU
    assert (whole.index, whole.physical_index, whole.mig_mode, whole.is_mig_slice) == (1, 1, False, False)
    assert any("one MIG device per process" in n for n in system.notes)


@pytest.mark.parametrize(
    ("visible", "uuids"),
    [
        ("MIG-22222222-bbbb", ["MIG-22222222-bbbb"]),
        ("MIG-2222", ["MIG-22222222-bbbb"]),
        ("GPU-a100-1,MIG-22222222-bbbb", ["GPU-a100-1", "MIG-22222222-bbbb"]),
        ("MIG-11111111-aaaa,MIG-22222222-bbbb", ["MIG-11111111-aaaa"]),  # CUDA: one MIG device only
        ("GPU-a100-0", ["MIG-11111111-aaaa"]),
        ("1", ["GPU-a100-1"]),  # index 0 is the MIG slice, 1 the whole GPU
        ("MIG-GPU-a100-0/1/0", []),  # the pre-R470 form is not matched
    ],
)
def test_mig_cuda_visible_devices(visible: str, uuids: list[str]) -> None:
    system = detect_system(visible, a100_mig(), cpu=CPU)
    assert [g.uuid for g in system.gpus] == uuids


def test_mig_mode_without_slices_or_listing() -> None:
    nvml = a100_mig()
    nvml.gpus[0].mig_devices = [None, None]
    system = detect_system(None, nvml, cpu=CPU)
    assert [g.uuid for g in system.gpus] == ["GPU-a100-1"]
    assert any("no MIG device created" in n for n in system.notes)

    nvml = a100_mig()
    nvml.gpus[0].fail = {"nvmlDeviceGetMigDeviceHandleByIndex": pynvml.NVMLError_NoPermission}
    system = detect_system(None, nvml, cpu=CPU)
    assert [(g.uuid, g.mig_mode) for g in system.gpus] == [("GPU-a100-0", True), ("GPU-a100-1", False)]
    assert system.gpus[0].memory_total == 81920 * MiB
    assert any("would not list its MIG devices" in n for n in system.notes)

    nvml = FakeNVML([replace(a100_mig().gpus[0], mig_devices=[None])])
    system = detect_system(None, nvml, cpu=CPU)
    assert system.gpus == () and "MIG" in system.nvml_status


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (pynvml.NVMLError_LibraryNotFound, "library not found"),
        (pynvml.NVMLError_DriverNotLoaded, "driver not loaded"),
        (pynvml.NVMLError_NoPermission, "no permission"),
        (pynvml.NVMLError_Unknown, "nvmlInit failed: Unknown Error"),
        (pynvml.NVMLLibraryMismatchError, "nvmlInit failed: "),
    ],
)
def test_nvml_init_failure_gives_cpu_only(error: type[Exception], status: str) -> None:
    nvml = h100x8(init_error=error)
    system = detect_system(None, nvml, cpu=CPU)
    assert system.gpus == () and system.nvml_status.startswith(status)
    assert system.driver_version is None and system.cuda_driver_version is None
    assert system.cpu == CPU


def test_device_count_failure_gives_cpu_only_and_still_shuts_down() -> None:
    nvml = h100x8()
    nvml.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(pynvml.NVMLError_Unknown())  # type: ignore[method-assign]
    system = detect_system(None, nvml, cpu=CPU)
    assert system.gpus == () and system.nvml_status.startswith("nvmlDeviceGetCount failed")
    assert nvml.shutdowns == 1


def test_no_gpus_reported() -> None:
    system = detect_system(None, FakeNVML([]), cpu=CPU)
    assert system.gpus == () and system.nvml_status == "no GPU found by NVML"


def test_real_pynvml_here_is_cpu_only() -> None:
    """This machine has no NVIDIA library: the real module must give CPU-only, not an exception."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine")
    for system in (detect_system(), detect_system(None, pynvml)):
        assert system.gpus == ()
        assert system.nvml_status in ("library not found", "driver not loaded")
        assert system.cpu.cores >= 1 and system.cpu.memory_total > 0
        assert "SYSTEM INFO" in describe(system)


def test_pynvml_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    system = detect_system(None, cpu=CPU)
    assert system.gpus == () and system.nvml_status == "pynvml not installed"


def test_detect_cpu() -> None:
    cpu = detect_cpu()
    assert cpu.cores >= 1 and 0 < cpu.memory_available <= cpu.memory_total
    assert set(cpu.isa_flags) <= cpu_flags() | {"asimd", "sve", "sve2", "bf16", "i8mm"}
    assert ("avx512_bf16" in cpu.isa_flags or "amx_bf16" in cpu.isa_flags) == cpu_has_fast_bf16()


# --- family -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA H100 NVL", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200"),
        ("NVIDIA H20", "h20"),
        ("NVIDIA H800", "h800"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GB200", "gb200"),
        ("NVIDIA A100-SXM4-40GB", "a100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA A100-PCIE-40GB", "a100"),
        ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "a100"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA A40", "a40"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA L4", "l4"),
        ("Tesla T4", "t4"),
        ("Tesla V100-SXM2-16GB", "v100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA GeForce RTX 5090", "rtx5090"),
        ("NVIDIA GeForce RTX 3090 Ti", "rtx3090ti"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx6000_ada"),
        ("NVIDIA RTX 4000 SFF Ada Generation", "rtx4000_ada"),
        ("NVIDIA RTX A6000", "rtx_a6000"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx_pro6000"),
        ("NVIDIA GeForce GTX 1080 Ti", "generic"),
        ("Some Future Accelerator", "generic"),
        ("", "generic"),
    ],
)
def test_family(name: str, family: str) -> None:
    assert gpu_family(name) == family
    assert GPUInfo(0, 0, name, "", "", (9, 0), 1, 1, None).family == family


# --- injected descriptions --------------------------------------------------------------------------------

FIXTURES = sorted(p.stem for p in SYSTEMS.glob("*.json"))
EXPECTED = {  # fixture: (gpu count, family, compute capability, GiB per GPU (rounded))
    "cpu_only": (0, None, None, None),
    "h100x1": (1, "h100", (9, 0), 80),
    "h100x8": (8, "h100", (9, 0), 80),
    "h200x1": (1, "h200", (9, 0), 140),
    "b200x1": (1, "b200", (10, 0), 179),
    "a100_40gb_x1": (1, "a100", (8, 0), 40),
    "a100_80gb_x1": (1, "a100", (8, 0), 80),
    "l40s_x1": (1, "l40s", (8, 9), 45),
    "rtx4090_x1": (1, "rtx4090", (8, 9), 24),
    "a100_mig_slice": (1, "a100", (8, 0), 39),
}


def test_every_fixture_is_expected() -> None:
    assert set(FIXTURES) == set(EXPECTED)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_load_system_fixture(fixture: str) -> None:
    path = SYSTEMS / f"{fixture}.json"
    system = load_system(path)
    count, family, cc, gib = EXPECTED[fixture]
    assert system.gpu_count == count
    assert system.cpu.cores >= 1 and system.cpu.memory_available <= system.cpu.memory_total
    for g in system.gpus:
        assert (g.family, g.compute_capability, round(g.memory_total / 2**30)) == (family, cc, gib)
        assert g.pci_device_id.endswith(":10de")
    if count:
        assert system.nvml_status == "ok" and system.cuda_version_str is not None
    else:
        assert system.nvml_status != "ok"
    # JSON round trip, byte for byte: the file is exactly what `detect` would print
    assert SystemInfo.from_dict(system.to_dict()) == system
    assert json.loads(path.read_text()) == system.to_dict()
    assert json.loads(json.dumps(system.to_dict())) == system.to_dict()


def test_fixture_specifics() -> None:
    h100x8 = load_system(SYSTEMS / "h100x8.json")
    assert all(len(g.nvlink_peers) == 7 for g in h100x8.gpus)
    mig = load_system(SYSTEMS / "a100_mig_slice.json").gpus[0]
    assert mig.mig_mode is True and mig.is_mig_slice and "MIG 3g.40gb" in mig.name
    assert load_system(SYSTEMS / "b200x1.json").gpus[0].pci_device_id == "2901:10de"
    assert load_system(SYSTEMS / "cpu_only.json").cpu.isa_flags
    assert load_system(SYSTEMS / "l40s_x1.json").gpus[0].mig_mode is None


def test_detected_system_round_trips() -> None:
    for system in (
        detect_system(None, h100x8(), cpu=CPU),
        detect_system(None, a100_mig(), cpu=CPU),
        detect_system("", l40s(), cpu=CPU),
    ):
        assert SystemInfo.from_dict(json.loads(json.dumps(system.to_dict()))) == system


def test_from_dict_accepts_hand_written_shortcuts() -> None:
    d = load_system(SYSTEMS / "h100x1.json").to_dict()
    gpu = d["gpus"][0]
    gpu["compute_capability"] = "9.0"
    for optional in ("memory_free", "mig_mode", "nvlink_peers", "pci_bus_id"):
        del gpu[optional]
    for optional in ("driver_version", "cuda_driver_version", "nvml_status", "notes"):
        del d[optional]
    system = SystemInfo.from_dict(d)
    g = system.gpus[0]
    assert g.compute_capability == (9, 0) and g.memory_free == g.memory_total and g.mig_mode is None
    assert system.nvml_status == "ok" and system.cuda_version_str is None


def _broken(edit: Any) -> dict[str, Any]:
    d = load_system(SYSTEMS / "h100x8.json").to_dict()
    edit(d)
    return d


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("cpu"), "system: missing cpu"),
        (lambda d: d.update(gpus={}), "gpus: expected a list"),
        (lambda d: d.update(extra=1), "system: unknown key(s) extra"),
        (lambda d: d["gpus"][1].pop("name"), "gpus[1]: missing name"),
        (lambda d: d["gpus"][1].update(memory=1), "gpus[1]: unknown key(s) memory"),
        (lambda d: d["gpus"][2].update(memory_total="80GB"), "gpus[2].memory_total: expected an integer"),
        (lambda d: d["gpus"][2].update(memory_total=True), "gpus[2].memory_total: expected an integer"),
        (lambda d: d["gpus"][2].update(memory_free=10**12), "gpus[2].memory_free: 1000000000000 exceeds"),
        (
            lambda d: d["gpus"][0].update(compute_capability=[9]),
            "gpus[0].compute_capability: expected [major",
        ),
        (lambda d: d["gpus"][0].update(compute_capability="sm90"), "gpus[0].compute_capability"),
        (
            lambda d: d["gpus"][0].update(pci_device_id="0x2330"),
            "gpus[0].pci_device_id: expected 'dddd:vvvv'",
        ),
        (lambda d: d["gpus"][0].update(mig_mode="no"), "gpus[0].mig_mode: expected true, false or null"),
        (lambda d: d["gpus"][3].update(index=5), "gpus[3].index: expected 3"),
        (lambda d: d["gpus"][3].update(uuid=d["gpus"][0]["uuid"]), "gpus[3].uuid: 'GPU-"),
        (lambda d: d["gpus"][0].update(nvlink_peers=[0]), "gpus[0].nvlink_peers: 0 is not another GPU"),
        (lambda d: d["gpus"][0].update(nvlink_peers=[8]), "gpus[0].nvlink_peers: 8 is not another GPU"),
        (lambda d: d["gpus"][0].update(nvlink_peers=[1, 1]), "gpus[0].nvlink_peers: repeated"),
        (lambda d: d["gpus"][1].update(nvlink_peers=[0, 2]), "gpus[3].nvlink_peers: lists 1, but gpus[1]"),
        (lambda d: d["gpus"][0].update(nvlink_peers="all"), "gpus[0].nvlink_peers: expected a list"),
        (lambda d: d["cpu"].update(cores=0), "cpu.cores: expected an integer >= 1"),
        (lambda d: d["cpu"].update(isa_flags="avx2"), "cpu.isa_flags: expected a list of strings"),
        (lambda d: d.update(cpu=[]), "cpu: expected an object"),
        (lambda d: d.update(driver_version=570), "driver_version: expected a string"),
        (lambda d: d.update(cuda_driver_version="12.8"), "cuda_driver_version: expected an integer"),
        (lambda d: d.update(notes="x"), "notes: expected a list of strings"),
    ],
)
def test_from_dict_rejects_with_a_clear_message(edit: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SystemInfo.from_dict(_broken(edit))
    assert message in str(info.value)


def test_load_system_errors_name_the_file(tmp_path: Path) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: "):
        load_system(bad_json)
    bad_field = tmp_path / "field.json"
    bad_field.write_text(json.dumps({"gpus": [], "cpu": {"model_name": "x"}}))
    with pytest.raises(ValueError, match=r"field\.json: cpu: missing cores"):
        load_system(bad_field)
    with pytest.raises(FileNotFoundError):
        load_system(tmp_path / "absent.json")


# --- describe ---------------------------------------------------------------------------------------------


def test_describe_gpu_system() -> None:
    text = describe(load_system(SYSTEMS / "h100x8.json"))
    lines = text.splitlines()
    assert lines[0] == "SYSTEM INFO"
    assert "- Driver: 570.124.06, CUDA 12.8" in lines
    assert "- GPUs (8):" in lines
    gpu_lines = [line for line in lines if "NVIDIA H100 80GB HBM3" in line]
    assert len(gpu_lines) == 8
    assert gpu_lines[0].startswith("  - [2330:10de] (0) NVIDIA H100 80GB HBM3 (H100): CC 9.0, 79.6 GiB")
    assert "NVLink to 1,2,3,4,5,6,7" in gpu_lines[0]
    cpu_line = next(line for line in lines if line.startswith("- CPU: "))
    assert "Intel(R) Xeon(R) Platinum 8480C (x86_64), 224 cores, 2015.0 GiB memory" in cpu_line
    assert "amx_bf16" in cpu_line


def test_describe_mig_and_subset() -> None:
    text = describe(load_system(SYSTEMS / "a100_mig_slice.json"))
    assert "NVIDIA A100-SXM4-80GB MIG 3g.40gb (A100): CC 8.0, 39.2 GiB" in text and "MIG slice" in text
    text = describe(detect_system("5", h100x8(), cpu=CPU))
    assert "(0, NVML 5) NVIDIA H100 80GB HBM3" in text


def test_describe_cpu_only_says_why() -> None:
    text = describe(load_system(SYSTEMS / "cpu_only.json"))
    assert "- GPUs: none (library not found: no libnvidia-ml in this container" in text
    assert "Driver" not in text and "- CPU: AMD EPYC 9R14" in text
    text = describe(detect_system("0,9,1", h100x8(), cpu=CPU))
    assert "- Note: CUDA_VISIBLE_DEVICES entry '9' matches no GPU" in text


# --- CPU quota ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, None),  # no cgroup files: not limited
        ({"cpu.max": "max 100000"}, None),
        ({"cpu.max": "400000 100000"}, 4),
        ({"cpu.max": "150000 100000"}, 2),  # 1.5 CPUs: two threads, not one
        ({"cpu.max": "10000 100000"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000"}, 2),
    ],
)
def test_cpu_count_follows_the_container_quota(
    tmp_path: Path, files: dict[str, str], expected: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    unlimited = available_cpu_count(tmp_path / "absent")
    counted = available_cpu_count(tmp_path)
    assert counted == (unlimited if expected is None else min(expected, unlimited))
