"""Manifests of the mixture-of-experts models: Qwen3-30B-A3B-Instruct-2507 and Mixtral-8x7B-Instruct.

Their weights_gb count every expert (a token runs 8 of 128, or 2 of 8, but all are held): the
sizes are recomputed here from the public configs' shapes, per precision as the quantized formats
store them (quantized at load: attention and experts; the router, norms, embedding and lm_head
stay bf16). Selection on the tests' fixture systems picks and explains them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from service.selection.manifests import ProfileError, find_manifest, load_manifests
from service.selection.profiles import Policy, select
from service.selection.system_info import SystemInfo, load_system

SYSTEMS = Path(__file__).parent / "systems"
TORCH_ONLY = Policy(engines=frozenset({"torch"}))
QWEN = "Qwen/Qwen3-30B-A3B-Instruct-2507"
MIXTRAL = "mistralai/Mixtral-8x7B-Instruct-v0.1"


@dataclass(frozen=True)
class MoeShape:
    hidden: int
    layers: int
    experts: int
    expert_intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool

    def weights_gb(self, precision: str) -> float:
        """Every expert of every layer, in `precision` as the engine holds it (GB = 1e9 bytes)."""
        q, kv, hidden = self.q_heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        attention = hidden * q + 2 * hidden * kv + q * hidden
        experts = self.experts * 3 * hidden * self.expert_intermediate
        quantized = self.layers * (attention + experts)
        rows = self.layers * (q + 2 * kv + hidden + self.experts * (2 * self.expert_intermediate + hidden))
        norms = 2 * hidden + (2 * self.head_dim if self.qk_norm else 0)
        floats = self.layers * (self.experts * hidden + norms) + 2 * self.vocab * hidden + hidden
        per_weight = {"bf16": 2.0, "int8_wo": 1.0, "fp8": 1.0, "int4_wo": 0.5 + 4 / 128}[precision]
        per_row = {"bf16": 0, "int8_wo": 2, "fp8": 4, "int4_wo": 0}[precision]
        return (quantized * per_weight + rows * per_row + floats * 2) / 1e9


SHAPES = {
    QWEN: MoeShape(2048, 48, 128, 768, 32, 4, 128, 151936, qk_norm=True),
    MIXTRAL: MoeShape(4096, 32, 8, 14336, 32, 8, 128, 32000, qk_norm=False),
}


def system(name: str) -> SystemInfo:
    return load_system(SYSTEMS / f"{name}.json")


@pytest.fixture(scope="module")
def manifests():
    return load_manifests()


@pytest.mark.parametrize("hub_id", list(SHAPES))
def test_weights_count_every_expert(manifests, hub_id: str) -> None:
    manifest = find_manifest(hub_id, manifests)
    assert manifest is not None
    shape = SHAPES[hub_id]
    assert {p.llm_engine for p in manifest.profiles} == {"torch"}
    assert {p.precision for p in manifest.profiles} == {"bf16", "fp8", "int8_wo", "int4_wo"}
    assert any(p.tp == 2 for p in manifest.profiles)
    for profile in manifest.profiles:
        assert profile.weights_gb == pytest.approx(shape.weights_gb(profile.precision), abs=0.05), (
            profile.name
        )
        assert profile.source is not None and profile.source.repo == hub_id
    assert manifest.architecture.num_layers == shape.layers
    assert manifest.architecture.num_kv_heads == shape.kv_heads
    assert manifest.architecture.head_dim == shape.head_dim
    # The whole model, not the active experts: 30.5B and 46.7B parameters in bf16.
    bf16 = next(p for p in manifest.profiles if p.precision == "bf16")
    assert bf16.weights_gb == {QWEN: 61.1, MIXTRAL: 93.4}[hub_id]


@pytest.mark.parametrize(
    ("system_name", "hub_id", "expected", "because"),
    [
        # fp8 runs natively on Hopper and Blackwell, but ranks below bf16 (measured slower at batch 1
        # on Hopper, unmeasured on Blackwell): chosen where bf16 does not fit (full context, one H100)
        ("h100x1", QWEN, "torch-generic-fp8-tp1-pp1-throughput", "chosen because none of them fits"),
        ("h100x1", MIXTRAL, "torch-generic-fp8-tp1-pp1-throughput", "fp8, native"),
        ("b200x1", MIXTRAL, "torch-generic-bf16-tp1-pp1-throughput", "torch fp8 ranked below the float"),
        # int4 runs natively on the CPU
        ("cpu_only", QWEN, "torch-generic-int4_wo-tp1-pp1-throughput", "int4_wo, native"),
        ("cpu_only", MIXTRAL, "torch-generic-int4_wo-tp1-pp1-throughput", "int4_wo, native"),
        # a 40 GB A100 holds Mixtral only as int4 (25.2 GB), emulated there
        ("a100_40gb_x1", MIXTRAL, "torch-generic-int4_wo-tp1-pp1-throughput", "int4_wo emulated"),
    ],
)
def test_selection_picks_and_explains_moe_profiles(
    manifests, system_name: str, hub_id: str, expected: str, because: str
) -> None:
    manifest = find_manifest(hub_id, manifests)
    assert manifest is not None
    selection = select(manifest, system(system_name), TORCH_ONLY)
    assert selection.chosen.profile.name == expected, selection.explanation
    assert selection.explanation[0].startswith(f"selected {expected}")
    assert because in selection.explanation[0], selection.explanation


def test_a_gpu_too_small_for_every_expert_is_explained(manifests) -> None:
    """A 24 GB card holds no Mixtral profile: even int4 needs 25.2 GB for the weights alone."""
    manifest = find_manifest(MIXTRAL, manifests)
    assert manifest is not None
    with pytest.raises(
        ProfileError, match=r"no profile of mistralai/mixtral-8x7b-instruct-v0\.1 fits"
    ) as error:
        select(manifest, system("rtx4090_x1"), TORCH_ONLY)
    assert "torch-generic-bf16-tp2-pp1-throughput: needs 2 GPUs" in str(error.value)


def test_bf16_across_two_gpus_is_offered_where_two_hold_the_experts(manifests) -> None:
    manifest = find_manifest(MIXTRAL, manifests)
    assert manifest is not None
    bf16 = Policy(engines=TORCH_ONLY.engines, precision="bf16")
    selection = select(manifest, system("h100x8"), bf16)  # 93.4 GB: one 80 GB H100 is too small
    assert selection.chosen.profile.name == "torch-generic-bf16-tp2-pp1-throughput", selection.explanation
