"""Model profiles: which prebuilt precision/parallelism variant runs on this system, and why.

Selection, in order:
  1. Drop what cannot run, with the reason: the engine is not importable or refuses the profile;
     the profile needs more GPUs (tp x pp) than are visible, or a GPU at all; it was built for
     another GPU family; TensorRT-LLM's compute capability lacks the precision (fp8 needs 8.9+,
     nvfp4 10.0+; bf16 needs 8.0+ on either engine); or the weights plus a KV cache for the full
     context do not fit per device by the KV formula (2 x layers x kv_heads x head_dim x bytes per
     token, split over tp and pp). The torch engine runs every precision, natively or emulated:
     each verdict says which. Every fact about a precision here is its spec's
     (service.engine.precision).
  2. A profile whose weights fit but whose full context does not is "low memory": it is offered
     with the longest context that fits (a multiple of 1,024 tokens, at least MIN_CONTEXT).
  3. Rank the rest: native precision over emulated (an emulated profile runs when asked for, and
     is never chosen over a native one), TensorRT-LLM over torch, hardware-specific over generic,
     lower precision first (last: a torch precision whose CUDA kernel has not been measured on a
     GPU, and, on a CPU without bf16 instructions, bf16 and the int kernels), the configured
     profile type (throughput or latency) first, then the smallest tp for throughput (the largest
     for latency), LoRA-less and model-dtype KV cache before variants.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from service.engine.precision import PRECISION_SPECS, SPECS, Mode, precision_mode
from service.engine.precision import why as precision_why
from service.engine.registry import EngineSupport
from service.engine.trtllm import release as trtllm_release
from service.host import cxx_compiler_found
from service.selection.manifests import PRECISIONS, Architecture, Manifest, Profile, ProfileError
from service.selection.system_info import SystemInfo
from service.util import cdiv

Status = Literal["compatible", "low_memory", "incompatible"]

# Bytes per KV element of an explicit KV cache dtype ("auto" is the activation dtype).
KV_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1}
_CPU_FLOATS = " or ".join(spec.name for spec in SPECS if spec.dtype is not None and spec.runs_on_cpu)
GPU_MEMORY_UTILIZATION = 0.9  # share of a GPU's memory the engine may plan for
CPU_MEMORY_UTILIZATION = 0.8
RUNTIME_OVERHEAD_BYTES = 1 << 30  # activations, workspaces, CUDA context
MIN_CONTEXT = 1024


# --- Compatibility -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What the operator asked for; everything else comes from the system."""

    engines: frozenset[str]  # engines this build can serve with
    engine_notes: tuple[tuple[str, str], ...] = ()  # (engine, why it is unavailable)
    profile_type: Literal["throughput", "latency"] = "throughput"
    max_model_len: int | None = None
    tensor_parallel_size: int | None = None
    precision: str | None = None  # only profiles of this precision tag (NIM_DTYPE), None: any
    # NIM_DTYPE's tag for a weight-only profile NIM_MODEL_PROFILE names: not a filter there, but the
    # float precision its activations (and an auto KV cache) compute in; None: the hardware's choice
    activations: str | None = None
    # What each engine can run (service.engine.registry); engines absent here are not checked.
    engine_support: Mapping[str, EngineSupport] = field(default_factory=dict)
    # Why the model cannot be sharded over N torch ranks (None: it can; ModelConfig's rule), where
    # its config is known before its files are fetched; None: not checked until the engine loads.
    tensor_parallel_refusal: Callable[[int], str | None] | None = None
    # NIM_CPU_INT4_KERNEL=auto: int4_wo on the CPU runs the W4A8 kernel where the CPU has its
    # instructions (service/engine/torch/int4_kernel.py), which changes how int4_wo ranks there.
    w4a8_int4: bool = True


@dataclass(frozen=True)
class Verdict:
    profile: Profile
    status: Status
    reasons: tuple[str, ...] = ()
    max_context: int | None = None  # the context that fits, for low-memory profiles
    required_gb_per_device: float = 0.0
    mode: Mode = "native"  # how its precision runs here
    mode_note: str = "native"  # why, in a phrase
    placement: str = ""  # where a tensor-parallel profile's ranks run (" on GPUs 0, 1")

    def summary(self) -> str:
        if self.status == "compatible":
            fits = f"fits: {self.required_gb_per_device:.1f} GB per device{self.placement}"
            return fits if self.mode == "native" else f"{fits}; {self.profile.precision} {self.mode_note}"
        return "; ".join(self.reasons)


def kv_bytes_per_token_per_device(
    profile: Profile, arch: Architecture, activations: str | None = None
) -> float:
    """`activations`: the precision a weight-only profile's activations compute in (NIM_DTYPE)."""
    if profile.kv_cache_dtype == "auto":  # the activation dtype: a float precision's own, else 16-bit
        spec = PRECISION_SPECS.get(profile.precision if activations is None else activations)
        element = KV_BYTES[spec.dtype] if spec is not None and spec.dtype is not None else 2
    else:
        element = KV_BYTES.get(profile.kv_cache_dtype, 2)
    heads_per_device = max(1, arch.num_kv_heads // profile.tp)
    layers_per_device = cdiv(arch.num_layers, profile.pp)
    return 2 * layers_per_device * heads_per_device * arch.head_dim * element


def evaluate(profile: Profile, arch: Architecture, system: SystemInfo, policy: Policy) -> Verdict:
    reasons: list[str] = []
    if profile.llm_engine not in policy.engines:
        notes = dict(policy.engine_notes)
        reasons.append(notes.get(profile.llm_engine, f"{profile.llm_engine} is not installed in this image"))
    elif profile.llm_engine in policy.engine_support:
        refusal = policy.engine_support[profile.llm_engine].refusal(
            profile.precision, profile.tp, profile.pp, profile.feat_lora
        )
        if refusal is not None:
            reasons.append(f"the {profile.llm_engine} engine {refusal}")
    if policy.tensor_parallel_size is not None and profile.tp != policy.tensor_parallel_size:
        reasons.append(f"tp={profile.tp}, but NIM_TENSOR_PARALLEL_SIZE={policy.tensor_parallel_size}")
    if profile.tp > 1 and profile.llm_engine == "torch" and policy.tensor_parallel_refusal is not None:
        refusal = policy.tensor_parallel_refusal(profile.tp)
        if refusal is not None:
            reasons.append(refusal)
    if policy.precision is not None and profile.precision != policy.precision:
        reasons.append(f"precision {profile.precision}, but NIM_DTYPE asks for {policy.precision}")
    if policy.activations is not None:
        reasons += _activation_refusals(policy.activations, system)
    devices = profile.tp * profile.pp
    gpus = system.gpus[:devices]
    spec = PRECISION_SPECS.get(profile.precision)
    if not system.gpus:
        if profile.llm_engine == "tensorrt_llm":
            reasons.append(f"needs an NVIDIA GPU; none found ({system.nvml_status})")
        elif profile.tp > 1 and policy.tensor_parallel_size != profile.tp:
            reasons.append(
                f"needs {devices} GPUs, none found ({system.nvml_status}); on the CPU, tensor "
                f"parallelism runs only when NIM_TENSOR_PARALLEL_SIZE={profile.tp} asks for it"
            )
        elif spec is not None and not spec.runs_on_cpu:
            reasons.append(
                f"{profile.precision} needs a GPU; on the CPU the engine computes in {_CPU_FLOATS}"
            )
    else:
        if len(system.gpus) < devices:
            reasons.append(
                f"needs {devices} GPUs (tp={profile.tp} x pp={profile.pp}), found {len(system.gpus)}"
            )
        family = system.gpus[0].family
        if profile.gpu != "generic" and profile.gpu != family:
            reasons.append(f"built for {profile.gpu.upper()}; this system has {family.upper()}")
        # the torch engine emulates what the GPU lacks, except where the spec says it cannot
        needed = None if spec is None else spec.min_capability(profile.llm_engine)
        if needed is not None:
            low = min(g.compute_capability for g in gpus)
            if low < needed:
                reasons.append(
                    f"{profile.precision} needs compute capability {needed[0]}.{needed[1]}+, "
                    f"the GPU has {low[0]}.{low[1]}"
                )
    if reasons:
        return Verdict(profile, "incompatible", tuple(reasons))
    verdict = _check_memory(profile, arch, system, policy)
    mode, note = _precision_mode(profile, system)
    return dataclasses.replace(verdict, mode=mode, mode_note=note)


def _activation_refusals(activations: str, system: SystemInfo) -> list[str]:
    """Why activations of float precision `activations` (NIM_DTYPE over weight-only weights) do not
    run on this system's devices: the same as for weights of that precision."""
    spec = PRECISION_SPECS[activations]
    if not system.gpus:
        if spec.runs_on_cpu:
            return []
        return [f"NIM_DTYPE={spec.dtype}: activations in {spec.dtype} need a GPU; on the CPU the engine "
                f"computes in {_CPU_FLOATS}"]  # fmt: skip
    needed = spec.torch_min_capability
    low = min(g.compute_capability for g in system.gpus)
    if needed is not None and low < needed:
        return [f"NIM_DTYPE={spec.dtype}: activations in {spec.dtype} need compute capability "
                f"{needed[0]}.{needed[1]}+, the GPU has {low[0]}.{low[1]}"]  # fmt: skip
    return []


def dtype_names_activations(profile: Profile, policy: Policy) -> bool:
    """Whether NIM_DTYPE, for `profile` named by NIM_MODEL_PROFILE, names the dtype its activations
    compute in (a weight-only precision) rather than a precision it does not have."""
    return policy.precision is not None and PRECISION_SPECS[profile.precision].weight_only


def _precision_mode(profile: Profile, system: SystemInfo) -> tuple[Mode, str]:
    """How the profile's precision runs here (TensorRT-LLM builds only what its GPU runs)."""
    if profile.llm_engine != "torch":
        return "native", "native"
    device = "cuda" if system.gpus else "cpu"
    capability = (
        min(g.compute_capability for g in system.gpus[: profile.tp * profile.pp]) if system.gpus else None
    )
    return (
        precision_mode(profile.precision, device, capability),
        precision_why(profile.precision, device, capability),
    )


def _check_memory(profile: Profile, arch: Architecture, system: SystemInfo, policy: Policy) -> Verdict:
    devices = profile.tp * profile.pp
    per_token = kv_bytes_per_token_per_device(profile, arch, policy.activations)
    overhead = RUNTIME_OVERHEAD_BYTES
    if system.gpus:
        capacity = min(g.memory_total for g in system.gpus[:devices]) * GPU_MEMORY_UTILIZATION
        where = "GPU"
        weights = profile.weights_gb * 1e9 / devices
    else:  # tensor-parallel ranks on the CPU share one host's memory
        capacity = system.cpu.memory_total * CPU_MEMORY_UTILIZATION
        where = "host memory"
        weights, overhead, per_token = profile.weights_gb * 1e9, overhead * devices, per_token * devices
    context = min(policy.max_model_len or arch.max_context, arch.max_context)
    required = weights + overhead + per_token * context
    gb = 1e9
    if system.gpus and devices > 1:
        short = [g for g in system.gpus[:devices] if g.memory_free < weights + overhead]
        if short:
            busy = ", ".join(f"GPU {g.index} has {g.memory_free / gb:.1f} GB free" for g in short)
            return Verdict(
                profile,
                "incompatible",
                (f"needs {(weights + overhead) / gb:.1f} GB free on each of {devices} GPUs; {busy}",),
                required_gb_per_device=required / gb,
            )
    if weights + overhead + per_token * MIN_CONTEXT > capacity:
        return Verdict(
            profile,
            "incompatible",
            (f"requires >= {required / gb:.1f} GB per {where}, {capacity / gb:.1f} GB usable",),
            required_gb_per_device=required / gb,
        )
    placed = ""
    if devices > 1:
        placed = f" on GPUs {', '.join(str(g.index) for g in system.gpus[:devices])}" if system.gpus else ""
        placed = placed or f" as {devices} CPU processes (NIM_TENSOR_PARALLEL_SIZE={profile.tp})"
    if required <= capacity:
        return Verdict(profile, "compatible", required_gb_per_device=required / gb, placement=placed)
    fits = int((capacity - weights - overhead) / per_token) // MIN_CONTEXT * MIN_CONTEXT
    return Verdict(
        profile,
        "low_memory",
        (f"requires >= {required / gb:.1f} GB per {where} for {context} tokens, try --max-model-len={fits}",),
        max_context=fits,
        required_gb_per_device=required / gb,
    )


_FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# What the W4A8 kernel's AVX2 path needs (native/isa.h); every AVX-512 CPU has them too.
_W4A8_FLAGS = ("avx2", "fma", "f16c")


def _w4a8_here(profile: Profile, system: SystemInfo, policy: Policy) -> bool:
    """Whether int4_wo would run the W4A8 kernel on this CPU: NIM_CPU_INT4_KERNEL=auto, its
    instructions present, and a C++ compiler to build it with (a build that still fails falls
    back to aten's kernel at load, logged)."""
    return (
        profile.precision == "int4_wo"
        and policy.w4a8_int4
        and not system.gpus
        and set(_W4A8_FLAGS) <= set(system.cpu.isa_flags)
        and cxx_compiler_found()
    )


def _slow_here(profile: Profile, system: SystemInfo, policy: Policy) -> bool:
    """Measured on CPUs without bf16 instructions (AVX2 and AVX-512 alike; bench/README.md "CPU
    precisions by measurement"): bf16 runs slower than fp32 at every batch size; aten's
    weight-only int kernels (bf16 inside, fp32 around them) are about 2x faster than fp32 at batch
    1 but 1.4-1.9x slower at batch 32. Selection ranks them last there for throughput, and lets
    them lead for latency. int4_wo on the W4A8 kernel (integer sums, no bf16) was measured ahead
    of fp32 at 1, 8 and 32 streams on AVX2 (bench/README.md "int4 layers on integer dot
    products"): it keeps its place wherever that kernel runs."""
    spec = PRECISION_SPECS[profile.precision]
    fast_bf16 = bool(set(_FAST_BF16_FLAGS) & set(system.cpu.isa_flags))
    if system.gpus or fast_bf16 or not spec.cpu_wants_bf16 or _w4a8_here(profile, system, policy):
        return False
    return not (spec.weight_only and policy.profile_type == "latency")


# Measured on an AMX host (bench/README.md "The CPU bars on an AMX host"); kept first because the
# product's seeded requests reproduce whatever else is in the batch, which AMX's bf16 kernels break.
_AMX_NOTE = (
    "kept ahead of bf16 on this AMX CPU although bf16 measured faster from batch 8 (2x at 32, 3x lower "
    "TTFT): oneDNN's AMX bf16 matmuls round a row differently with the batch's size, so seeded requests "
    "would not reproduce (NIM_MODEL_PROFILE names the bf16 profile to take that trade)"
)


def _cuda_demotion(verdict: Verdict, system: SystemInfo) -> str | None:
    """Why selection ranks the profile last, below the float precisions, if it does: the torch engine
    would run its precision through a native CUDA kernel that was not measured on GPUs of this
    compute capability, or was and lost to bf16 there (PrecisionSpec.native_cuda_measured). Asked
    for by NIM_MODEL_PROFILE, it runs."""
    spec = PRECISION_SPECS[verdict.profile.precision]
    if not (
        system.gpus
        and verdict.profile.llm_engine == "torch"
        and verdict.mode == "native"
        and spec.native_cuda is not None
    ):
        return None
    capability = system.gpus[0].compute_capability
    measured = spec.cuda_measurement(capability)
    if measured is None:
        return (
            f"its CUDA kernels have not been measured on a GPU of compute capability "
            f"{capability[0]}.{capability[1]} yet"
        )
    return None if measured.beats_bf16 else f"its CUDA kernels were {measured.statement()}"


def rank_key(verdict: Verdict, system: SystemInfo, policy: Policy) -> tuple:
    p = verdict.profile
    family = system.gpus[0].family if system.gpus else "cpu"
    last = _slow_here(p, system, policy) or _cuda_demotion(verdict, system) is not None
    precision_rank = len(PRECISIONS) if last else PRECISIONS.index(p.precision)
    tp_rank = p.tp if policy.profile_type == "throughput" else -p.tp
    return (
        verdict.mode == "emulated",
        0 if p.llm_engine == "tensorrt_llm" else 1,
        0 if p.gpu == family else 1,
        precision_rank,
        0 if p.profile == policy.profile_type else 1,
        tp_rank,
        p.feat_lora,
        p.kv_cache_dtype != "auto",
        p.name,
    )


@dataclass
class Selection:
    chosen: Verdict
    verdicts: list[Verdict] = field(default_factory=list)
    explanation: list[str] = field(default_factory=list)


def candidates(manifest: Manifest, policy: Policy) -> tuple[Profile, ...]:
    """The manifest's profiles, plus its tp=1 torch profiles at NIM_TENSOR_PARALLEL_SIZE: the
    torch engine shards weights as it loads them, so it runs any of its profiles at any tensor-
    parallel size the model's heads divide into (TensorRT-LLM profiles are built for theirs)."""
    size = policy.tensor_parallel_size
    if size is None or size == 1:
        return manifest.profiles
    names = {p.name for p in manifest.profiles}
    sharded = (
        dataclasses.replace(p, tp=size) for p in manifest.profiles if p.llm_engine == "torch" and p.tp == 1
    )
    return manifest.profiles + tuple(p for p in sharded if p.name not in names)


def assess(manifest: Manifest, system: SystemInfo, policy: Policy) -> list[Verdict]:
    """Every profile's verdict; compatible ones first, in preference order."""
    profiles = candidates(manifest, policy)
    verdicts = [evaluate(p, manifest.architecture, system, policy) for p in profiles]
    order = {"compatible": 0, "low_memory": 1, "incompatible": 2}
    return sorted(verdicts, key=lambda v: (order[v.status], rank_key(v, system, policy)))


def select(manifest: Manifest, system: SystemInfo, policy: Policy, requested: str | None = None) -> Selection:
    """The profile to run: `requested` (id, readable name or "default") or the best compatible one."""
    verdicts = assess(manifest, system, policy)
    if requested and requested != "default":
        matches = [v for v in verdicts if requested in (v.profile.id, v.profile.name)]
        if not matches:
            known = ", ".join(sorted(v.profile.name for v in verdicts))
            raise ProfileError(
                f"NIM_MODEL_PROFILE={requested!r} names no profile of {manifest.model}; known: {known}"
            )
        chosen = matches[0]
        why = [f"selected {chosen.profile.name} ({chosen.profile.id[:12]}) as requested by NIM_MODEL_PROFILE"]
        activations = policy.precision
        if activations is not None and dtype_names_activations(chosen.profile, policy):
            asked = dataclasses.replace(policy, precision=None, activations=activations)
            chosen = evaluate(chosen.profile, manifest.architecture, system, asked)
            verdicts = [chosen if v.profile == chosen.profile else v for v in verdicts]
            why[0] += f", its activations in {PRECISION_SPECS[activations].dtype} as NIM_DTYPE asks"
        if chosen.status == "incompatible":
            raise ProfileError(f"profile {chosen.profile.name} cannot run here: {chosen.summary()}")
        return Selection(chosen, verdicts, why + explain(verdicts))
    runnable = [v for v in verdicts if v.status == "compatible"]
    low = [v for v in verdicts if v.status == "low_memory"]
    native = [v for v in runnable if v.mode == "native"]
    # An emulated profile is chosen only where no native one runs even with a shorter context.
    native_low = [v for v in low if v.mode == "native"]
    if not native and native_low and runnable:
        emulated = ", ".join(v.profile.name for v in runnable)
        raise ProfileError(
            f"no profile of {manifest.model} runs natively with its full context here; with a shorter "
            f"context: {native_low[0].profile.name} ({native_low[0].summary()}); profiles that fit but run "
            f"emulated (slower) can be chosen with NIM_MODEL_PROFILE: {emulated}"
        )
    if not runnable:
        hint = f"; with a shorter context: {low[0].profile.name} ({low[0].summary()})" if low else ""
        details = "; ".join(f"{v.profile.name}: {v.summary()}" for v in verdicts[:4])
        raise ProfileError(f"no profile of {manifest.model} fits this system ({details}){hint}")
    chosen = (native or runnable)[0]
    reasons = _why_first(chosen, runnable, system, policy)
    why = [f"selected {chosen.profile.name} ({chosen.profile.id[:12]}): {reasons}"]
    # A profile that would have won but for its engine missing from this image: say so once.
    notes = dict(policy.engine_notes)
    missing = [
        v
        for v in verdicts
        if v.profile.llm_engine != chosen.profile.llm_engine
        and v.profile.llm_engine in notes
        and v.reasons == (notes[v.profile.llm_engine],)
    ]
    if missing:
        engine = missing[0].profile.llm_engine
        why.append(
            f"{missing[0].profile.name} would run on this system, but {notes[engine]}: serving with "
            f"{chosen.profile.llm_engine} instead"
        )
    return Selection(chosen, verdicts, why + explain(verdicts))


def _why_first(chosen: Verdict, runnable: Sequence[Verdict], system: SystemInfo, policy: Policy) -> str:
    p = chosen.profile
    parts = [chosen.summary()]
    if p.llm_engine == "tensorrt_llm":
        parts.append("TensorRT-LLM is preferred over torch")
        version = trtllm_release.installed_version()
        if version is not None:  # what its sampler honours, decided by the installed release
            parts.append(trtllm_release.release(version, p.trtllm_buildable).statement())
    if p.gpu != "generic":
        parts.append(f"built for this GPU ({p.gpu.upper()})")
    parts.append(f"lowest runnable precision ({p.precision}, {chosen.mode_note})")
    demoted = sorted({v.profile.precision for v in runnable if _slow_here(v.profile, system, policy)})
    fast_bf16 = bool(set(_FAST_BF16_FLAGS) & set(system.cpu.isa_flags))
    if not fast_bf16 and any(_w4a8_here(v.profile, system, policy) for v in runnable):
        parts.append(
            "int4_wo kept in its place on this CPU without bf16 instructions: its W4A8 kernel "
            "(activations rounded to int8, integer dot products) was measured ahead of fp32 at 1, 8 "
            "and 32 streams (NIM_CPU_INT4_KERNEL=weight-only ranks it with int8_wo)"
        )
    if demoted:
        int_demoted = [precision for precision in demoted if PRECISION_SPECS[precision].weight_only]
        latency = f" (NIM_PROFILE_TYPE=latency ranks {' and '.join(int_demoted)} first: 2x fp32 at batch 1)"
        parts.append(
            f"{', '.join(demoted)} ranked last: this CPU has no {' or '.join(_FAST_BF16_FLAGS)}, "
            "without which they were measured slower than fp32 at batch 32"
            + (latency if policy.profile_type == "throughput" and int_demoted else "")
        )
    if (
        not system.gpus
        and "amx_bf16" in system.cpu.isa_flags
        and policy.profile_type == "throughput"
        and PRECISION_SPECS[p.precision].weight_only
    ):
        parts.append(_AMX_NOTE)
    if not system.gpus and policy.profile_type == "latency" and PRECISION_SPECS[p.precision].weight_only:
        parts.append("weight-only int ranked first for latency: measured 2x fp32 at batch 1 on such CPUs")
    demotions = {v.profile.precision: why for v in runnable if (why := _cuda_demotion(v, system))}
    if (why := _cuda_demotion(chosen, system)) is not None:
        parts.append(f"{why}: ranked below the float precisions, chosen because none of them fits here")
    else:
        parts += [
            f"torch {precision} ranked below the float precisions: {why} (select it by NIM_MODEL_PROFILE "
            "to run it)"
            for precision, why in sorted(demotions.items())
        ]
    if len(runnable) > 1:
        parts.append(f"{len(runnable) - 1} other compatible profile(s) ranked lower")
    return "; ".join(parts)


def explain(verdicts: Sequence[Verdict]) -> list[str]:
    return [f"  {v.status:<12} {v.profile.name:<52} {v.summary()}" for v in verdicts]
