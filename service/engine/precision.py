"""Weight precisions: one `PrecisionSpec` each, from which every precision table derives.

A spec says what a precision costs (bytes per weight), how it is stored (the format class in
service.engine.models.quant, also the name the quantized-weights cache records), which layer
computes with it (service.engine.models.quant_linear), whether float checkpoints are quantized
into it at load, where a kernel computes with it natively, and what each engine needs of a GPU.
Selection (service.selection.profiles), the engine registry and the quantized layers read these specs;
none keeps a table of its own. Class references are names, resolved by the modules that define
the classes (this module stays pure: no torch import, no import of the engine).

Native: a kernel computes with the stored format. Emulated: the weights stay compact in memory
and each layer is dequantized into the activation dtype when it runs (slower, same memory).
Float precisions are native everywhere they run. Selection ranks native above emulated and says
which; the layers dispatch on the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["native", "emulated"]
DeviceType = Literal["cpu", "cuda"]
Capability = tuple[int, int]


@dataclass(frozen=True)
class CudaMeasurement:
    """One GPU run of a precision's native CUDA kernel beside bf16: the same random checkpoint, the
    same server settings and client, one session (bench/gpu_session.sh), recorded under `record`."""

    capability: Capability  # the GPU's compute capability: the measurement stands for its kernels
    gpu: str  # the card it ran on
    vs_bf16_batch1: float  # its batch-1 output tok/s over bf16's
    record: str  # the bench/results/ folder with the summary and the command

    @property
    def beats_bf16(self) -> bool:
        return self.vs_bf16_batch1 > 1.0

    def statement(self) -> str:
        return (
            f"measured at {self.vs_bf16_batch1:.2f}x bf16's tok/s at batch 1 on an {self.gpu} "
            f"(compute capability {self.capability[0]}.{self.capability[1]}; {self.record})"
        )


@dataclass(frozen=True)
class PrecisionSpec:
    """Everything the server knows about one weight precision (a profile's `precision` tag)."""

    name: str
    weight_bytes: float  # bytes per weight, scales included
    dtype: str | None = None  # float precisions: the torch dtype the weights are held in
    storage_format: str | None = None  # quantized: its format class in service.engine.models.quant
    layer: str | None = None  # quantized: its layer class in service.engine.models.quant_linear
    quantized_at_load: bool = False  # float checkpoints are quantized into it (its format's `quantize`)
    native_cpu: str | None = None  # quantized: the CPU kernel that computes with it, in a phrase
    native_cuda: str | None = None  # quantized: the CUDA kernel that computes with it, in a phrase
    native_cuda_capability: Capability | None = None  # the lowest compute capability `native_cuda` runs on
    # `native_cuda` measured on GPUs, one entry per compute capability: where it has no entry, or its
    # entry does not beat bf16, selection ranks it below the float precisions (asked for, it runs).
    native_cuda_measured: tuple[CudaMeasurement, ...] = ()
    runs_on_cpu: bool = True  # the torch engine computes in it on a CPU
    cpu_wants_bf16: bool = False  # fast on a CPU only with bf16 instructions (it computes in bf16)
    # Quantized weights only, activations never: NIM_DTYPE, with a profile of it named by
    # NIM_MODEL_PROFILE, says which float dtype its activations compute in (its kernels take each).
    weight_only: bool = False
    torch_min_capability: Capability | None = None  # the torch engine refuses older GPUs (no emulation)
    trtllm: bool = False  # TensorRT-LLM runs it
    trtllm_min_capability: Capability | None = None  # TensorRT-LLM's lowest compute capability for it

    @property
    def quantized(self) -> bool:
        return self.storage_format is not None

    def cuda_measurement(self, capability: Capability) -> CudaMeasurement | None:
        """The measurement of `native_cuda` on GPUs of `capability`, if one was made."""
        return next((m for m in self.native_cuda_measured if m.capability == capability), None)

    def min_capability(self, engine: str) -> Capability | None:
        """The lowest compute capability `engine` ("torch" or "tensorrt_llm") runs this precision on."""
        return self.torch_min_capability if engine == "torch" else self.trtllm_min_capability

    def __post_init__(self) -> None:
        if (self.dtype is not None) == self.quantized:
            raise ValueError(f"precision {self.name}: exactly one of dtype and storage_format")
        if self.quantized != (self.layer is not None):
            raise ValueError(f"precision {self.name}: a storage format needs a layer class, and only it")
        if (self.native_cuda is None) != (self.native_cuda_capability is None):
            raise ValueError(f"precision {self.name}: a native CUDA kernel states its compute capability")
        if self.native_cuda_measured and self.native_cuda is None:
            raise ValueError(f"precision {self.name}: only a native CUDA kernel is measured")
        if self.weight_only and not self.quantized:
            raise ValueError(f"precision {self.name}: only a quantized precision is weight-only")


# In the order selection prefers them (service.selection.manifests.PRECISIONS), other things equal.
SPECS: tuple[PrecisionSpec, ...] = (
    PrecisionSpec(
        "nvfp4",
        weight_bytes=0.5625,  # blocks of 16 with an e4m3 scale
        storage_format="NVFP4Weight",
        layer="NVFP4Linear",
        trtllm=True,
        trtllm_min_capability=(10, 0),
    ),
    PrecisionSpec(
        "fp8",
        weight_bytes=1.0,
        storage_format="FP8Weight",
        layer="FP8Linear",
        quantized_at_load=True,
        native_cuda="e4m3 tensor cores",  # torch._scaled_mm on e4m3
        native_cuda_capability=(8, 9),
        # torch._scaled_mm with each activation quantized per call: correct (its start-up check agreed
        # with the dequantized matmul), but slower than bf16 at batch 1 on Hopper (120 vs 168 tok/s).
        native_cuda_measured=(CudaMeasurement((9, 0), "H200", 0.72, "bench/results/h200-2026-11-28"),),
        trtllm=True,
        trtllm_min_capability=(8, 9),
    ),
    PrecisionSpec(
        "int4_wo",
        weight_bytes=0.625,  # groups of 32 with a 16-bit scale and zero
        storage_format="Int4Weight",
        layer="Int4Linear",
        quantized_at_load=True,
        native_cpu="packed int kernels",  # aten._weight_int4pack_mm_for_cpu
        cpu_wants_bf16=True,
        weight_only=True,
        trtllm=True,
        trtllm_min_capability=(7, 5),
    ),
    PrecisionSpec(
        "int8_wo",
        weight_bytes=1.0,
        storage_format="Int8Weight",
        layer="Int8Linear",
        quantized_at_load=True,
        native_cpu="packed int kernels",  # aten._weight_int8pack_mm
        cpu_wants_bf16=True,
        weight_only=True,
        trtllm=True,
        trtllm_min_capability=(7, 5),
    ),
    PrecisionSpec(
        "bf16",
        weight_bytes=2.0,
        dtype="bfloat16",
        cpu_wants_bf16=True,
        torch_min_capability=(8, 0),
        trtllm=True,
        trtllm_min_capability=(8, 0),
    ),
    PrecisionSpec("fp16", weight_bytes=2.0, dtype="float16", runs_on_cpu=False, trtllm=True),
    PrecisionSpec("fp32", weight_bytes=4.0, dtype="float32"),
)
PRECISION_SPECS: dict[str, PrecisionSpec] = {spec.name: spec for spec in SPECS}

FLOAT_PRECISIONS = frozenset(spec.name for spec in SPECS if not spec.quantized)
QUANTIZED_PRECISIONS = frozenset(spec.name for spec in SPECS if spec.quantized)
TORCH_PRECISIONS = FLOAT_PRECISIONS | QUANTIZED_PRECISIONS
TRTLLM_PRECISIONS = frozenset(spec.name for spec in SPECS if spec.trtllm)


def spec(precision: str) -> PrecisionSpec:
    """The spec of `precision`; ValueError naming the known ones for any other tag."""
    found = PRECISION_SPECS.get(precision)
    if found is None:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISION_SPECS)}")
    return found


def precision_mode(precision: str, device_type: str, capability: Capability | None = None) -> Mode:
    """How `precision` runs on a device of `device_type` (with `capability` for CUDA)."""
    s = spec(precision)
    if not s.quantized:
        return "native"
    if device_type == "cpu":
        return "native" if s.native_cpu is not None else "emulated"
    needed = s.native_cuda_capability
    if needed is not None and capability is not None and capability >= needed:
        return "native"
    return "emulated"


def why(precision: str, device_type: str, capability: Capability | None = None) -> str:
    """One phrase: how and why `precision` runs this way here (for the start-up explanation)."""
    s = spec(precision)
    if not s.quantized:
        return "native"
    if precision_mode(precision, device_type, capability) == "native":
        return f"native ({s.native_cpu if device_type == 'cpu' else s.native_cuda})"
    needed = s.native_cuda_capability
    if device_type == "cuda" and needed is not None:
        return (
            f"emulated ({precision} matmuls need compute capability {needed[0]}.{needed[1]}+): "
            "weights dequantized per layer"
        )
    if s.native_cpu is None and s.native_cuda is None:
        return f"emulated (no native {precision} kernel in this release): weights dequantized per layer"
    where = "the CPU" if device_type == "cpu" else "CUDA in this release"
    return f"emulated (no {precision} kernel on {where}): weights dequantized per layer"
