"""CPU decode steps run as one TorchScript call (service/engine/torch/scripted_decode.py, and
scripted_gemma.py for Gemma 3): its hidden states are bitwise those of the eager forward it stands
in for, for every linear-layer kind and model family it accepts; where it does not apply, decode
steps run eagerly and the engine's decode path (service/engine/torch/decode_path.py, decided once at
build) says why, once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from torch import Tensor

from service.config_loading import load_settings
from service.engine.models.moe import SparseMoeBlock
from service.engine.native import extension, w4a8
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.decode_path import DecodeAttention
from service.engine.torch.engine import TorchEngine
from service.engine.torch.loading import build_engine
from service.engine.torch.lora_slots import LoraSlots
from service.engine.torch.paged_attention import AttentionMetadata, PagedAttention
from service.engine.torch.scripted_decode import _SERIAL_ELEMENTS, ScriptedDecoder, _expert_mlp, _routed_mlp
from service.serving import config_for
from tests.conftest import TEST_THREADS
from tests.test_model_gemma3 import _hf_config as gemma3_config
from tests.test_model_moe import _hf_model as moe_model
from tests.test_quantization import _SMALL, _byte_level_tokenizer
from tests.test_tensor_parallel import randomize

# int4's group (128) divides every input width.
SMALL = {**_SMALL, "hidden_size": 128, "intermediate_size": 256}


def _checkpoint(directory: Path, architecture: str) -> Path:
    """A random checkpoint: Llama with biases on every projection, Qwen3 (q/k norms), Gemma 3
    (windows of 8 tokens on three of four layers, two RoPE tables, its norms and GeGLU), or a
    mixture of experts (tests/test_model_moe.py's)."""
    if architecture == "llama-bias":
        config: transformers.PretrainedConfig = transformers.LlamaConfig(
            **SMALL, attention_bias=True, mlp_bias=True
        )
    elif architecture == "gemma3":
        config = gemma3_config(hidden_size=128, intermediate_size=256, head_dim=32)
    elif architecture in ("qwen3_moe", "mixtral"):
        model = moe_model(architecture)  # Qwen3-MoE with a dense layer between routed ones
        model.save_pretrained(directory)
        _byte_level_tokenizer(directory)
        return directory
    else:
        config = transformers.Qwen3Config(**SMALL, head_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model)
    model.save_pretrained(directory)
    _byte_level_tokenizer(directory)
    return directory


def _engine(**settings: object) -> TorchEngine:
    defaults: dict[str, object] = {
        "num_threads": TEST_THREADS,
        "max_model_len": 512,
        "kv_cache_max_tokens": 4096,
    }
    engine = build_engine(config_for(load_settings(**{**defaults, **settings})))
    asyncio.run(engine.start())
    return engine


class _BothPaths:
    """Stands in for the runner's ScriptedDecoder: runs the eager forward and the scripted one on
    every decode-only step, records whether they agree bitwise, and returns the scripted result."""

    def __init__(self, engine: TorchEngine) -> None:
        runner = engine.core.runner
        assert runner.scripted is not None
        self.runner, self.scripted = runner, runner.scripted
        self.equal: list[bool] = []
        self.in_place = 0  # steps whose rows (one sequence's) read its blocks in place (else gathered)
        self.native = 0  # steps attended through the native kernel's block tables
        self.rows: list[int] = []  # each step's decode rows
        runner.path = replace(runner.path, scripted=self)  # type: ignore[arg-type]

    def can_run(self, meta: AttentionMetadata) -> bool:
        return self.scripted.can_run(meta)

    def __call__(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        runner = self.runner
        attention = PagedAttention(runner.pool, meta, runner.num_heads, runner.head_dim)
        eager = runner.model(input_ids, positions, attention)
        scripted = self.scripted(input_ids, positions, meta)  # rewrites the same cache slots alike
        self.equal.append(torch.equal(eager, scripted))
        self.in_place += meta.decode_block_run is not None
        self.native += meta.decode_tables is not None
        self.rows.append(meta.num_decodes)
        return scripted


def _generate(engine: TorchEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of `prompts`, run at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(GenerationRequest(f"r{i}", prompt, params)):
            tokens.extend(out.token_ids)
        return tokens

    async def run() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    return asyncio.run(run())


def _assert_bitwise_alike(engine: TorchEngine) -> None:
    both = _BothPaths(engine)
    # A lone request (its blocks one run: read in place), then five at once of different lengths
    # (gathered, batch sizes shrinking from 5 as they finish); through the native kernel
    # (DecodeAttention.NATIVE) every step reads its block tables in place instead.
    _generate(engine, [list(range(3, 40))], max_tokens=24)
    _generate(engine, [[(7 * i + j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(5)], max_tokens=20)
    assert both.equal and all(both.equal), f"{both.equal.count(False)} of {len(both.equal)} steps differ"
    if engine.core.runner.path.attention is DecodeAttention.NATIVE:
        assert both.native == len(both.equal) >= 35 and both.in_place == 0
    else:
        assert both.native == 0 and both.in_place >= 20 and len(both.equal) - both.in_place >= 15


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scripted")
    names = ("llama-bias", "qwen3", "gemma3", "qwen3_moe", "mixtral")
    return {name: _checkpoint(root / name, name) for name in names}


@pytest.mark.parametrize(
    ("architecture", "precision"),
    [
        ("llama-bias", "bf16"),  # oneDNN-packed bf16 linears (small batches padded where needed)
        ("llama-bias", "fp32"),
        ("qwen3", "int8_wo"),
        ("qwen3", "int4_wo"),
        ("gemma3", "fp32"),
        ("gemma3", "int4_wo"),
        ("qwen3_moe", "fp32"),  # float experts: views of the stacked weights
        (
            "mixtral",
            "int4_wo",
        ),  # quantized experts: the W4A8 MoE op where it builds, else one int4 layer each
        ("qwen3_moe", "int4_wo-weight-only"),  # one int4 layer each (aten's kernel)
        ("qwen3_moe", "bf16"),  # the fused norms (q/k too) and routing in bf16
        ("qwen3_moe", "bf16-aten-ops"),  # NIM_CPU_FUSED_OPS=off: aten's norms and routing (q/k norms too)
    ],
)
def test_scripted_decode_matches_eager_bitwise(
    checkpoints: dict[str, Path], tmp_path: Path, architecture: str, precision: str
) -> None:
    precision, _, variant = precision.partition("-")
    engine = _engine(
        model_name=str(checkpoints[architecture]),
        model_profile=f"torch-generic-{precision}-tp1-pp1-throughput",
        cache_path=str(tmp_path / "cache"),
        cpu_int4_kernel="weight-only" if variant == "weight-only" else "auto",
        cpu_fused_ops="off" if variant == "aten-ops" else "auto",
    )
    try:
        fused_ops = {path.name: path.used for path in engine.info.paths}["cpu_fused_ops"]
        assert fused_ops == (variant != "aten-ops" and extension.problem() is None)
        assert engine.core.runner.fused_sampling == fused_ops  # the greedy argmax too
        # decode attention too, where the stack calls the kernel (Gemma 3's gathers its blocks)
        native = fused_ops and architecture != "gemma3"
        assert (engine.core.runner.path.attention is DecodeAttention.NATIVE) == native
        reason = {path.name: path.reason for path in engine.info.paths}["cpu_fused_ops"]  # /v1/metadata's
        if fused_ops:
            assert ("blocks of the paged cache read in place" in reason) == native
            assert ("decode attention gathers its cache blocks" in reason) == (not native)
        if architecture == "mixtral":  # its experts all in one W4A8 call where the kernel builds
            blocks = [m for m in engine.core.runner.model.modules() if isinstance(m, SparseMoeBlock)]
            fused = [block.experts.fused is not None for block in blocks]
            assert fused and all(fused) == (w4a8.serving_problem() is None)
        _assert_bitwise_alike(engine)
    finally:
        asyncio.run(engine.stop())


def test_a_one_token_routed_mlp_runs_its_chosen_experts_without_sorting() -> None:
    """At one token (a lone stream's decode step) `_routed_mlp` runs the token's top-k experts
    directly: no sort, count or scatter, the same output as the grouped path gives that token."""
    generator = torch.Generator().manual_seed(5)
    hidden, experts, inter, top_k = 64, 8, 32, 3
    weights = [torch.randn(experts, hidden, generator=generator)]
    for _ in range(experts):
        weights += [
            torch.randn(2 * inter, hidden, generator=generator) / 8,
            torch.randn(hidden, inter, generator=generator) / 6,
        ]
    count = len(weights)
    args = ([0] * count, weights, [torch.empty(0)] * count, [None] * count, [0] * count,
            [w.shape[0] for w in weights], [0] * count, experts, top_k, inter, True, [], [],
            False)  # fmt: skip
    tokens = torch.randn(4, hidden, generator=generator)
    grouped = _routed_mlp(tokens, 0, *args)
    with torch.profiler.profile() as profile:
        alone = [_routed_mlp(tokens[t : t + 1], 0, *args) for t in range(4)]
    ops = {event.key for event in profile.key_averages()}
    assert not ops & {"aten::argsort", "aten::sort", "aten::bincount", "aten::index_put_"}, ops
    torch.testing.assert_close(torch.cat(alone), grouped, rtol=1e-5, atol=1e-5)
    with torch.profiler.profile() as profile:
        _routed_mlp(tokens, 0, *args)
    assert "aten::argsort" in {event.key for event in profile.key_averages()}  # the profile sees it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("inter", "top_k"), [(77, 3), (30001, 3)], ids=["one-piece", "per-expert"])
def test_a_one_token_routed_mlp_is_bitwise_one_expert_at_a_time(
    dtype: torch.dtype, inter: int, top_k: int
) -> None:
    """The one-token path gives bitwise what one call per chosen expert gives (Experts.expert):
    its single SiLU-mul over the stacked rows, at an intermediate size with a scalar tail after the
    vector loop, on two threads; and past _SERIAL_ELEMENTS its per-expert calls (a threaded split
    there can fall mid-row, where aten's vector and scalar exp differ in the last bit now and then:
    1 element of 3 x 30001 float32 in a trial, value-dependent, so not reproduced here)."""
    assert (top_k * inter > _SERIAL_ELEMENTS) == (inter > 1000)
    generator = torch.Generator().manual_seed(7)
    hidden, experts = 16, 4
    weights = [torch.randn(experts, hidden, generator=generator).to(dtype)]
    for _ in range(experts):
        weights += [
            (torch.randn(2 * inter, hidden, generator=generator) / 4).to(dtype),
            (torch.randn(hidden, inter, generator=generator) / 64).to(dtype),
        ]
    count = len(weights)
    linears = ([0] * count, weights, [torch.empty(0)] * count, [None] * count, [0] * count,
               [w.shape[0] for w in weights], [0] * count)  # fmt: skip
    x = torch.randn(1, hidden, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = _routed_mlp(x, 0, *linears, experts, top_k, inter, True, [], [], False)
        probs = torch.softmax(torch.nn.functional.linear(x, weights[0]), dim=-1, dtype=torch.float32)
        chosen, ids = torch.topk(probs, top_k, dim=-1)
        chosen = (chosen / chosen.sum(dim=-1, keepdim=True)).to(dtype)
        alone = [_expert_mlp(x, 1 + 2 * e, *linears, inter) for e in ids[0].tolist()]
    finally:
        torch.set_num_threads(threads)
    want = (torch.cat(alone) * chosen.reshape(-1, 1)).view(1, top_k, -1).sum(dim=1)
    assert torch.equal(got, want)


def test_scripted_decode_matches_eager_on_the_embedded_model() -> None:
    engine = _engine()  # GGUF Q4_1 weights as int4, bf16 activations and cache
    try:
        _assert_bitwise_alike(engine)
    finally:
        asyncio.run(engine.stop())


def test_draft_verification_runs_scripted_as_decode_rows() -> None:
    """A step of decodes and draft verifications runs as decode rows (each verified token a row
    attending up to itself): scripted, bitwise the eager forward, a lone request's rows reading its
    blocks in place, and greedy output the same as without speculation."""
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    prompts = [list(range(3, 30)) * 3, [(5 * j) % 40 + 3 for j in range(50)]]
    engine = _engine(speculative_config=spec)
    try:
        speculator, engine.core.speculator = engine.core.speculator, None
        want = [_generate(engine, [prompt], max_tokens=24)[0] for prompt in prompts]
        want_together = _generate(engine, prompts, max_tokens=24)
        engine.core.speculator = speculator
        engine.core.pool.reset_cache()  # the same blocks again: each request's one run, read in place
        both = _BothPaths(engine)
        got = [_generate(engine, [prompt], max_tokens=24)[0] for prompt in prompts]
        rows = both.rows
        lone, lone_native = len(rows), both.native
        got_together = _generate(engine, prompts, max_tokens=24)
        assert got == want and got_together == want_together
        assert all(both.equal), f"{both.equal.count(False)} of {len(both.equal)} steps differ"
        # Drafts were accepted (more than 20 on the float32 host this was written on, 20 with bf16
        # activations: the count follows the model's tokens, which the activation dtype moves).
        assert engine.core.speculator is not None and engine.core.speculator.counts.num_accepted_tokens >= 12
        # a lone request's verify rows read in place (a block run, or the native kernel's tables)
        native = engine.core.runner.path.attention is DecodeAttention.NATIVE
        assert max(rows[:lone]) > 1 and (lone_native if native else both.in_place) == lone
        assert max(rows[lone:]) > 2  # two requests' rows, gathered
    finally:
        asyncio.run(engine.stop())


@pytest.fixture
def engine_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="service.engine.torch.decode_path"):
        yield caplog


def test_quantized_kv_cache_decodes_eagerly_and_says_why(engine_log: pytest.LogCaptureFixture) -> None:
    engine = _engine(kv_cache_dtype="int8")
    try:
        assert engine.core.runner.scripted is None and engine.core.runner.path.kind == "eager"
        assert "CPU decode steps run eagerly: the int8 KV cache is dequantized" in engine_log.text
        assert engine_log.text.count("decode steps") == 1  # decided and logged once
        _generate(engine, [list(range(3, 20))], max_tokens=4)  # and serves
    finally:
        asyncio.run(engine.stop())


def test_enforce_eager_turns_it_off(engine_log: pytest.LogCaptureFixture) -> None:
    engine = _engine(enforce_eager=True)
    try:
        assert engine.core.runner.scripted is None
        assert "TorchScript" not in engine_log.text
        assert "CPU decode steps run eagerly: NIM_ENFORCE_EAGER=1" in engine_log.text
    finally:
        asyncio.run(engine.stop())


def test_lora_decodes_eagerly_and_says_why(
    checkpoints: dict[str, Path], tmp_path: Path, engine_log: pytest.LogCaptureFixture
) -> None:
    """The engine offers every CPU model to the scripted step, which refuses LoRA-wrapped
    projections itself (with the reason the decode path logs)."""
    engine = _engine(
        model_name=str(checkpoints["llama-bias"]),
        model_profile="torch-generic-fp32-tp1-pp1-throughput",
        cache_path=str(tmp_path / "cache"),
    )
    try:
        assert engine.core.runner.scripted is not None and engine.core.runner.path.kind == "scripted"
        assert "CPU decode steps run as one TorchScript call (compiled in" in engine_log.text
        LoraSlots.attach(engine.core.model, num_slots=1, max_rank=4)
        assert (
            ScriptedDecoder.build(engine.core.model, engine.core.kv_pool)
            == "LoRA adapters wrap the projections"
        )
    finally:
        asyncio.run(engine.stop())
