"""Profile manifests, ids, and selection on injected systems (no GPU needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from service.engine.precision import PRECISION_SPECS, CudaMeasurement
from service.selection import profiles
from service.selection.manifests import (
    Architecture,
    ProfileError,
    find_manifest,
    generic_manifest,
    load_manifests,
)
from service.selection.profiles import Policy, assess, select
from service.selection.system_info import SystemInfo, load_system

SYSTEMS = Path(__file__).parent / "systems"
CONTAINER = Policy(engines=frozenset({"tensorrt_llm", "torch"}))  # the GPU image: both engines
TORCH_ONLY = Policy(engines=frozenset({"torch"}))


def system(name: str) -> SystemInfo:
    return load_system(SYSTEMS / f"{name}.json")


def with_isa_flags(host: SystemInfo, flags: tuple[str, ...]) -> SystemInfo:
    """`host` with its CPU's ISA flags replaced by `flags`."""
    return dataclasses.replace(host, cpu=dataclasses.replace(host.cpu, isa_flags=flags))


@pytest.fixture(scope="module")
def manifests():
    return load_manifests()


def manifest(manifests, name: str):
    found = find_manifest(name, manifests)
    assert found is not None, name
    return found


def test_manifests_ship_for_the_required_models(manifests) -> None:
    for hub_id in (
        "embedded",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.3-70B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
        "mistralai/Mistral-7B-Instruct-v0.3",
    ):
        assert find_manifest(hub_id, manifests) is not None, hub_id
    assert find_manifest("META-LLAMA/llama-3.1-8b-instruct", manifests) is not None  # case-insensitive
    assert find_manifest("someone/unknown-model", manifests) is None


def test_profile_ids_are_stable_content_hashes(manifests) -> None:
    ids = [p.id for m in manifests for p in m.profiles]
    assert all(len(i) == 64 and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) == len(ids)
    again = [p.id for m in load_manifests() for p in m.profiles]
    assert again == ids
    names = [p.name for m in manifests for p in m.profiles]
    assert "tensorrt_llm-h100-fp8-tp2-pp1-latency" in names


@pytest.mark.parametrize(
    ("system_name", "model", "policy", "expected"),
    [
        ("cpu_only", "embedded", TORCH_ONLY, "torch-generic-int4_wo-tp1-pp1-throughput"),
        ("h100x1", "meta-llama/Llama-3.1-8B-Instruct", CONTAINER, "tensorrt_llm-h100-fp8-tp1-pp1-throughput"),
        # fp8 runs natively on Hopper, but the torch engine's fp8 kernels were measured slower than bf16
        # at batch 1 there (H200, 2026-11-28): bf16 ranks first (nvfp4, emulated there, below both)
        ("h100x1", "meta-llama/Llama-3.1-8B-Instruct", TORCH_ONLY, "torch-generic-bf16-tp1-pp1-throughput"),
        (
            "h100x8",
            "meta-llama/Llama-3.3-70B-Instruct",
            CONTAINER,
            "tensorrt_llm-h100-fp8-tp2-pp1-throughput",
        ),
        (
            "h100x8",
            "meta-llama/Llama-3.3-70B-Instruct",
            Policy(engines=CONTAINER.engines, profile_type="latency"),
            "tensorrt_llm-h100-fp8-tp4-pp1-latency",
        ),
        (
            "h200x1",
            "meta-llama/Llama-3.3-70B-Instruct",
            CONTAINER,
            "tensorrt_llm-h200-fp8-tp1-pp1-throughput",
        ),
        (
            "b200x1",
            "meta-llama/Llama-3.1-8B-Instruct",
            CONTAINER,
            "tensorrt_llm-b200-nvfp4-tp1-pp1-throughput-kvfp8",
        ),
        (
            "a100_80gb_x1",
            "meta-llama/Llama-3.1-8B-Instruct",
            CONTAINER,
            "tensorrt_llm-a100-bf16-tp1-pp1-throughput",
        ),
        (
            "a100_40gb_x1",
            "meta-llama/Llama-3.1-8B-Instruct",
            CONTAINER,
            "tensorrt_llm-a100-bf16-tp1-pp1-throughput",
        ),
        (
            "l40s_x1",
            "meta-llama/Llama-3.1-8B-Instruct",
            CONTAINER,
            "tensorrt_llm-l40s-fp8-tp1-pp1-throughput",
        ),
        (
            "rtx4090_x1",
            "meta-llama/Llama-3.1-8B-Instruct",
            CONTAINER,
            "tensorrt_llm-generic-fp8-tp1-pp1-throughput",
        ),
        (
            "a100_mig_slice",
            "Qwen/Qwen2.5-7B-Instruct",
            CONTAINER,
            "tensorrt_llm-generic-int4_wo-tp1-pp1-throughput",
        ),
    ],
)
def test_selection(manifests, system_name: str, model: str, policy: Policy, expected: str) -> None:
    selection = select(manifest(manifests, model), system(system_name), policy)
    assert selection.chosen.profile.name == expected, selection.explanation
    assert selection.chosen.status == "compatible"
    assert selection.explanation[0].startswith(f"selected {expected}")


def test_reasons_for_incompatible_profiles(manifests) -> None:
    verdicts = {
        v.profile.name: v
        for v in select(
            manifest(manifests, "meta-llama/Llama-3.1-8B-Instruct"), system("a100_80gb_x1"), CONTAINER
        ).verdicts
    }
    fp8 = verdicts["tensorrt_llm-generic-fp8-tp1-pp1-throughput"]
    assert fp8.status == "incompatible" and any("compute capability 8.9" in r for r in fp8.reasons)
    h100 = verdicts["tensorrt_llm-h100-fp8-tp1-pp1-throughput"]
    assert any("built for H100" in r for r in h100.reasons)
    tp2 = verdicts["tensorrt_llm-h100-fp8-tp2-pp1-latency"]
    assert any("needs 2 GPUs" in r for r in tp2.reasons)
    nvfp4 = verdicts["tensorrt_llm-b200-nvfp4-tp1-pp1-throughput-kvfp8"]
    assert any("10.0" in r for r in nvfp4.reasons)

    cpu = {
        v.profile.name: v
        for v in select(
            manifest(manifests, "meta-llama/Llama-3.1-8B-Instruct"), system("cpu_only"), TORCH_ONLY
        ).verdicts
    }
    assert any("not installed" in r for r in cpu["tensorrt_llm-h100-fp8-tp1-pp1-throughput"].reasons)


def test_low_memory_profiles_suggest_a_context(manifests) -> None:
    m = manifest(manifests, "meta-llama/Llama-3.1-8B-Instruct")
    torch_bf16 = next(
        v
        for v in assess(m, system("rtx4090_x1"), TORCH_ONLY)
        if v.profile.name == "torch-generic-bf16-tp1-pp1-throughput"
    )
    assert torch_bf16.status == "low_memory"
    assert torch_bf16.max_context and 1024 <= torch_bf16.max_context < 131072
    assert f"--max-model-len={torch_bf16.max_context}" in torch_bf16.summary()
    # With that context it fits.
    shorter = Policy(engines=TORCH_ONLY.engines, max_model_len=torch_bf16.max_context, precision="bf16")
    chosen = select(
        manifest(manifests, "meta-llama/Llama-3.1-8B-Instruct"), system("rtx4090_x1"), shorter
    ).chosen
    assert chosen.profile.name == "torch-generic-bf16-tp1-pp1-throughput"


def test_no_profile_fits_is_explained(manifests) -> None:
    with pytest.raises(ProfileError, match=r"no profile of meta/llama-3\.3-70b-instruct fits"):
        select(manifest(manifests, "meta-llama/Llama-3.3-70B-Instruct"), system("rtx4090_x1"), CONTAINER)
    with pytest.raises(ProfileError, match=r"needs an NVIDIA GPU|requires"):
        select(manifest(manifests, "meta-llama/Llama-3.3-70B-Instruct"), system("cpu_only"), CONTAINER)


def test_explicit_profile_by_id_name_or_default(manifests) -> None:
    m = manifest(manifests, "meta-llama/Llama-3.1-8B-Instruct")
    h100 = system("h100x1")
    best = select(m, h100, CONTAINER).chosen.profile
    assert select(m, h100, CONTAINER, "default").chosen.profile == best
    torch_profile = next(p for p in m.profiles if p.llm_engine == "torch")
    assert select(m, h100, CONTAINER, torch_profile.id).chosen.profile == torch_profile
    assert select(m, h100, CONTAINER, torch_profile.name).chosen.profile == torch_profile
    with pytest.raises(ProfileError, match="cannot run here"):
        select(m, h100, CONTAINER, "tensorrt_llm-b200-nvfp4-tp1-pp1-throughput-kvfp8")
    with pytest.raises(ProfileError, match="names no profile"):
        select(m, h100, CONTAINER, "f" * 64)


def test_tensor_parallel_override(manifests) -> None:
    m = manifest(manifests, "meta-llama/Llama-3.3-70B-Instruct")
    policy = Policy(engines=CONTAINER.engines, tensor_parallel_size=4)
    assert select(m, system("h100x8"), policy).chosen.profile.tp == 4


def test_generic_profiles_for_unknown_models() -> None:
    arch = Architecture(num_layers=4, num_kv_heads=2, head_dim=16, max_context=2048)
    m = generic_manifest("my-model", "/models/my-model", arch, weights_bytes=10_000_000)
    chosen = select(m, system("cpu_only"), TORCH_ONLY).chosen
    assert chosen.profile.llm_engine == "torch" and chosen.profile.gpu == "generic"
    assert {p.precision for p in m.profiles} == {"bf16", "fp16", "fp32", "fp8", "int8_wo", "int4_wo"}
    fp16 = next(
        v for v in select(m, system("cpu_only"), TORCH_ONLY).verdicts if v.profile.precision == "fp16"
    )
    assert fp16.status == "incompatible"


def test_native_precision_ranks_above_emulated(manifests) -> None:
    m = manifest(manifests, "meta-llama/Llama-3.1-8B-Instruct")
    # An A100 (8.0) has no fp8 tensor cores: the torch fp8 and nvfp4 profiles run emulated there.
    verdicts = {v.profile.name: v for v in assess(m, system("a100_80gb_x1"), TORCH_ONLY)}
    fp8 = verdicts["torch-generic-fp8-tp1-pp1-throughput"]
    assert fp8.status == "compatible" and fp8.mode == "emulated"
    assert "compute capability 8.9" in fp8.summary()
    chosen = select(m, system("a100_80gb_x1"), TORCH_ONLY).chosen
    assert chosen.mode == "native" and chosen.profile.precision == "bf16"
    # Emulated profiles still run when asked for by name.
    asked = select(m, system("a100_80gb_x1"), TORCH_ONLY, "torch-generic-fp8-tp1-pp1-throughput")
    assert asked.chosen.mode == "emulated"
    # On Hopper the same fp8 profile is native.
    h100 = {v.profile.name: v for v in assess(m, system("h100x1"), TORCH_ONLY)}
    assert h100["torch-generic-fp8-tp1-pp1-throughput"].mode == "native"
    assert h100["torch-generic-int4_wo-tp1-pp1-throughput"].mode == "emulated"


def test_cpu_runs_int_weights_natively_and_fp8_nvfp4_emulated(manifests) -> None:
    m = manifest(manifests, "embedded")
    verdicts = {v.profile.precision: v for v in assess(m, system("cpu_only"), TORCH_ONLY)}
    assert verdicts["int4_wo"].mode == "native" and verdicts["int8_wo"].mode == "native"
    assert verdicts["fp8"].mode == "emulated" and verdicts["fp8"].status == "compatible"


def test_emulated_profiles_are_not_chosen_when_a_native_one_fits_with_a_shorter_context(manifests) -> None:
    # 8B on a 24 GB CPU host: only the emulated fp8/nvfp4 profiles fit the full 128k context; the
    # native int4 one fits a shorter one. Selection says so instead of picking a slow emulated one.
    m = manifest(manifests, "meta-llama/Llama-3.1-8B-Instruct")
    host = system("cpu_only")
    small = dataclasses.replace(host, cpu=dataclasses.replace(host.cpu, memory_total=24 * 2**30))
    with pytest.raises(ProfileError, match=r"runs natively .* --max-model-len=.*NIM_MODEL_PROFILE"):
        select(m, small, TORCH_ONLY)
    # With the shorter context the native int4 profile is chosen.
    shorter = Policy(engines=TORCH_ONLY.engines, max_model_len=32768)
    assert select(m, small, shorter).chosen.profile.name == "torch-generic-int4_wo-tp1-pp1-throughput"


def test_torch_tensor_parallel_profiles_need_that_many_gpus_with_room(manifests) -> None:
    m = manifest(manifests, "meta-llama/Llama-3.3-70B-Instruct")
    h100x8 = system("h100x8")
    chosen = select(m, h100x8, TORCH_ONLY)  # bf16 (fp8 measured slower on Hopper): 4 GPUs for its weights
    assert chosen.chosen.profile.name == "torch-generic-bf16-tp4-pp1-throughput"
    assert "on GPUs 0, 1, 2, 3" in chosen.explanation[0]
    assert "torch fp8 ranked below the float precisions" in chosen.explanation[0]
    asked = select(m, h100x8, TORCH_ONLY, "torch-generic-fp8-tp2-pp1-throughput")
    assert asked.chosen.profile.tp == 2 and "on GPUs 0, 1" in asked.chosen.summary()
    one_gpu = {v.profile.name: v for v in assess(m, system("h100x1"), TORCH_ONLY)}
    assert "needs 2 GPUs (tp=2 x pp=1), found 1" in one_gpu["torch-generic-fp8-tp2-pp1-throughput"].summary()
    # GPU 1 mostly taken by another process: neither tp profile over GPUs 0.. can run.
    gpus = list(h100x8.gpus)
    gpus[1] = dataclasses.replace(gpus[1], memory_free=10 * 10**9)
    busy = dataclasses.replace(h100x8, gpus=tuple(gpus))
    verdicts = {v.profile.name: v for v in assess(m, busy, TORCH_ONLY)}
    fp8_tp2 = verdicts["torch-generic-fp8-tp2-pp1-throughput"]
    assert fp8_tp2.status == "incompatible" and "GPU 1 has 10.0 GB free" in fp8_tp2.summary()


def test_cpu_tensor_parallelism_only_when_asked() -> None:
    arch = Architecture(num_layers=4, num_kv_heads=2, head_dim=16, max_context=2048)
    m = generic_manifest("my-model", "/models/my-model", arch, weights_bytes=10_000_000)
    cpu = system("cpu_only")
    assert {v.profile.tp for v in assess(m, cpu, TORCH_ONLY)} == {1}
    asked = Policy(engines=TORCH_ONLY.engines, tensor_parallel_size=2)
    verdicts = assess(m, cpu, asked)
    chosen = select(m, cpu, asked).chosen
    assert chosen.profile.tp == 2 and "as 2 CPU processes (NIM_TENSOR_PARALLEL_SIZE=2)" in chosen.summary()
    one_rank = next(v for v in verdicts if v.profile.tp == 1 and v.profile.precision == "bf16")
    assert "tp=1, but NIM_TENSOR_PARALLEL_SIZE=2" in one_rank.summary()
    # A manifest's tp=2 torch profile on a CPU, not asked for: listed with the reason.
    big = manifest(load_manifests(), "meta-llama/Llama-3.3-70B-Instruct")
    listed = {v.profile.name: v for v in assess(big, cpu, TORCH_ONLY)}
    tp2 = listed["torch-generic-fp8-tp2-pp1-throughput"]
    assert "only when NIM_TENSOR_PARALLEL_SIZE=2 asks for it" in tp2.summary()


INT8_WO = "torch-generic-int8_wo-tp1-pp1-throughput"


def test_nim_dtype_names_the_activations_of_a_weight_only_profile_it_names(manifests) -> None:
    """NIM_DTYPE filters profiles by precision; with NIM_MODEL_PROFILE naming an int8_wo or int4_wo
    profile it says what the activations compute in instead (issue 43: NIM_DTYPE=float32 refused
    int8_wo, so float32 activations over quantized weights could not be asked for)."""
    embedded, cpu = manifest(manifests, "embedded"), system("cpu_only")
    fp32 = dataclasses.replace(TORCH_ONLY, precision="fp32")
    assert select(embedded, cpu, fp32).chosen.profile.precision == "fp32"  # a filter, as before
    for name in (INT8_WO, "torch-generic-int4_wo-tp1-pp1-throughput"):
        chosen = select(embedded, cpu, fp32, name)
        assert chosen.chosen.profile.name == name and chosen.chosen.status == "compatible"
        assert "its activations in float32 as NIM_DTYPE asks" in chosen.explanation[0]
    with pytest.raises(ProfileError, match="activations in float16 need a GPU"):
        select(embedded, cpu, dataclasses.replace(TORCH_ONLY, precision="fp16"), INT8_WO)
    llama = manifest(manifests, "meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(ProfileError, match="precision fp8, but NIM_DTYPE asks for fp32"):  # not weight-only
        select(llama, system("h100x1"), fp32, "torch-generic-fp8-tp1-pp1-throughput")


def test_the_engine_computes_in_what_nim_dtype_names_over_int8_weights() -> None:
    from service.config_loading import load_settings
    from service.serving import config_for

    asked = config_for(load_settings(dtype="float32", model_profile=INT8_WO))
    assert (asked.precision, asked.dtype) == ("int8_wo", "float32")
    assert config_for(load_settings(model_profile=INT8_WO)).dtype == "auto"  # the hardware's choice
    assert config_for(load_settings(dtype="float32")).precision == "fp32"


@pytest.mark.parametrize(
    "flags", [("avx2",), ("avx2", "avx512f", "avx512bw", "avx512vl")], ids=["avx2", "avx512"]
)
def test_a_cpu_without_bf16_ranks_precisions_by_what_was_measured_for_the_profile_type(
    manifests, flags
) -> None:
    # Measured (bench/README.md "CPU precisions by measurement"): without bf16 instructions aten's
    # weight-only int kernels are ~2x fp32 at batch 1 and slower at batch 32; bf16 is slower at both.
    # (No f16c here, or NIM_CPU_INT4_KERNEL=weight-only: int4_wo runs aten's kernel.)
    m = manifest(manifests, "embedded")
    host = system("cpu_only")
    plain = with_isa_flags(host, ("sse4_2", "fma", *flags))
    assert (
        select(
            m,
            with_isa_flags(host, ("sse4_2", "fma", "f16c", *flags)),
            dataclasses.replace(TORCH_ONLY, w4a8_int4=False),
        ).chosen.profile.precision
        == "fp32"
    )
    throughput = select(m, plain, TORCH_ONLY)
    assert throughput.chosen.profile.precision == "fp32"
    assert "measured slower than fp32 at batch 32" in throughput.explanation[0]
    assert "NIM_PROFILE_TYPE=latency ranks int4_wo and int8_wo first" in throughput.explanation[0]
    latency = select(m, plain, Policy(engines=TORCH_ONLY.engines, profile_type="latency"))
    assert latency.chosen.profile.precision == "int4_wo"
    assert "bf16 ranked last" in latency.explanation[0]
    assert "weight-only int ranked first for latency" in latency.explanation[0]
    # With bf16 instructions int4_wo leads for either profile type.
    assert select(m, host, TORCH_ONLY).chosen.profile.precision == "int4_wo"


@pytest.mark.parametrize(
    "flags", [("avx2",), ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")], ids=["avx2", "avx512"]
)
def test_int4_keeps_its_place_where_the_w4a8_kernel_runs(manifests, flags, monkeypatch) -> None:
    """int4_wo on the W4A8 kernel (integer sums, no bf16) was measured ahead of fp32 at 1, 8 and
    32 streams on AVX2 (bench/README.md "int4 layers on integer dot products"): on a CPU with its
    instructions (AVX2, FMA, F16C) and a compiler to build it, it stays first for throughput; bf16
    and int8_wo stay last. Without a compiler it ranks with int8_wo."""
    monkeypatch.setattr(profiles, "cxx_compiler_found", lambda: True)
    m = manifest(manifests, "embedded")
    host = with_isa_flags(system("cpu_only"), ("sse4_2", "fma", "f16c", *flags))
    chosen = select(m, host, TORCH_ONLY)
    assert chosen.chosen.profile.precision == "int4_wo"
    assert "int4_wo kept in its place on this CPU without bf16 instructions" in chosen.explanation[0]
    assert "NIM_CPU_INT4_KERNEL=weight-only ranks it with int8_wo" in chosen.explanation[0]
    assert "bf16, int8_wo ranked last" in chosen.explanation[0]
    monkeypatch.setattr(profiles, "cxx_compiler_found", lambda: False)
    assert select(m, host, TORCH_ONLY).chosen.profile.precision == "fp32"


def test_an_amx_cpu_keeps_int4_first_and_says_what_bf16_would_trade(manifests) -> None:
    # Measured on an AMX host (bench/README.md): bf16 beats int4_wo from batch 8 and in prefill, but
    # its AMX kernels are not batch invariant; the default keeps the invariant profile and says so.
    m = manifest(manifests, "embedded")
    host = system("cpu_only")
    amx = with_isa_flags(host, (*host.cpu.isa_flags, "amx_bf16"))
    throughput = select(m, amx, TORCH_ONLY)
    assert throughput.chosen.profile.precision == "int4_wo"
    assert "kept ahead of bf16 on this AMX CPU" in throughput.explanation[0]
    assert "seeded requests would not reproduce" in throughput.explanation[0]
    latency = select(m, amx, Policy(engines=TORCH_ONLY.engines, profile_type="latency"))
    assert latency.chosen.profile.precision == "int4_wo"
    assert "AMX" not in latency.explanation[0]
    assert "AMX" not in select(m, host, TORCH_ONLY).explanation[0]  # AVX512-BF16 alone: nothing to trade


def test_a_native_cuda_kernel_ranks_by_what_was_measured_on_that_compute_capability(
    manifests, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch fp8 was measured on an H200 (compute capability 9.0) slower than bf16 at batch 1: on
    Hopper it ranks below bf16 and says the measurement; on Blackwell (10.0) it was never measured
    and says so; a measurement that beats bf16 on a capability lets it lead there, and only there."""
    m = manifest(manifests, "meta-llama/Llama-3.1-8B-Instruct")
    for name in ("h100x1", "h200x1"):
        chosen = select(m, system(name), TORCH_ONLY)
        assert chosen.chosen.profile.name == "torch-generic-bf16-tp1-pp1-throughput"
        assert (
            "torch fp8 ranked below the float precisions: its CUDA kernels were measured at 0.72x"
            in (chosen.explanation[0])
        )
        assert "on an H200 (compute capability 9.0; bench/results/h200-2026-11-28)" in chosen.explanation[0]
    blackwell = select(m, system("b200x1"), TORCH_ONLY)
    assert "not been measured on a GPU of compute capability 10.0 yet" in blackwell.explanation[0]
    fp8 = PRECISION_SPECS["fp8"]
    faster = CudaMeasurement((9, 0), "H200", 1.6, "bench/results/test")
    monkeypatch.setitem(PRECISION_SPECS, "fp8", dataclasses.replace(fp8, native_cuda_measured=(faster,)))
    chosen_on = {n: select(m, system(n), TORCH_ONLY).chosen.profile.name for n in ("h200x1", "b200x1")}
    assert chosen_on == {
        "h200x1": "torch-generic-fp8-tp1-pp1-throughput",
        "b200x1": "torch-generic-bf16-tp1-pp1-throughput",
    }
