"""Prompt rows through dense bf16 weights (service/engine/models/prompt_rows.py): aten's int4
layout unpacked to exactly the kernel's weights, 64-row calls computing every row alike, a layer
splitting a step's rows between the dense copy and the int4 kernel, and on the embedded model: a
prompt computed the same however it is chunked or batched, greedy output as the int4 kernel's, the
setting and /v1/metadata."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from service.config_loading import load_settings
from service.engine.models import prompt_rows
from service.engine.models.quant import Int4Weight
from service.engine.models.quant_linear import Int4Linear
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.core import TorchEngineCore
from service.engine.torch.loading import build_core
from service.host import cpu_has_fast_bf16
from service.serving import config_for

BF16 = pytest.mark.skipif(
    not (cpu_has_fast_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="dense prompt rows need a CPU with a bf16 matmul (AVX512-BF16 or AMX): this one runs fp32",
)


def _layer(out_features: int, in_features: int, seed: int = 0) -> Int4Linear:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    groups = in_features // 32
    scale = torch.rand(out_features, groups, generator=generator) * 0.02
    zero = torch.randn(out_features, groups, generator=generator) * 0.02
    return Int4Linear(Int4Weight(q, scale, zero, 32), None, torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize(("out_features", "in_features"), [(64, 128), (960, 576), (576, 1536)])
def test_aten_int4_layout_unpacks_to_the_kernels_own_weights(out_features: int, in_features: int) -> None:
    layer = _layer(out_features, in_features)
    weight = prompt_rows.dense_int4(
        layer.packed, layer.scales_zeros, layer.group_size, out_features, in_features
    )
    assert isinstance(weight, torch.Tensor)
    one_hot = torch.eye(in_features, dtype=layer.scales_zeros.dtype)  # every column: W.T exactly
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(one_hot, layer.packed, 32, layer.scales_zeros)
    assert torch.equal(weight, kernel[:, :out_features].t().to(torch.bfloat16))
    odd = _layer(80, 128)  # 80 output rows (the kernel pads to 16): in no block layout known here
    assert odd.attach_dense() is not None and odd.dense is None


@BF16
def test_dense_calls_compute_a_row_alike_wherever_it_sits_and_whatever_shares_it() -> None:
    assert prompt_rows.tile_problem(576, 3072) is None
    generator = torch.Generator().manual_seed(1)
    dense = prompt_rows.DenseWeight((torch.randn(3072, 576, generator=generator) * 0.05).to(torch.bfloat16))
    rows = torch.randn(150, 576, generator=generator).to(torch.bfloat16)
    together = dense.matmul(rows)  # three calls of 64 rows, the last padded
    for row in (0, 63, 64, 149):
        assert torch.equal(dense.matmul(rows[row : row + 1])[0], together[row])
        shuffled = torch.randn(40, 576, generator=generator).to(torch.bfloat16)
        shuffled[17] = rows[row]
        assert torch.equal(dense.matmul(shuffled)[17], together[row])


@BF16
def test_a_layer_sends_the_steps_prompt_rows_dense_and_the_rest_to_the_int4_kernel() -> None:
    layer = _layer(960, 576)
    x = torch.randn(20, 576).to(torch.bfloat16)
    int4 = layer(x)
    assert layer.attach_dense() is None and layer.dense is not None
    assert torch.equal(layer(x), int4)  # no step split: every row int4
    with prompt_rows.split(20, list(range(12))):
        split = layer(x)
        assert torch.equal(layer(x[:5]), int4[:5])  # another row count: not the step's rows
    assert torch.equal(split[12:], int4[12:])
    assert torch.equal(split[:12], layer.dense.matmul(x[:12]))
    assert (split[:12].float() - int4[:12].float()).abs().max() < 0.05  # the bf16 rounding of W only


@pytest.fixture(scope="module")
def cores() -> Iterator[dict[str, TorchEngineCore]]:
    built = {}
    for name, chunk, dense in (("big", 512, "auto"), ("small", 16, "auto"), ("off", 512, "off")):
        # aten's int4 kernel: the copies are compared with the weights it multiplies (W4A8 rounds
        # the activations too, test_w4a8.py)
        settings = load_settings(
            num_threads=1, max_model_len=512, max_num_batched_tokens=chunk, dense_prompt_rows=dense,
            cpu_int4_kernel="weight-only",
        )  # fmt: skip
        core = build_core(config_for(settings))
        core.start(lambda: None, lambda error: None)
        built[name] = core
    yield built
    for core in built.values():
        core.shutdown()


def _run(core: TorchEngineCore, prompts: dict[str, list[int]], **params: object) -> dict[str, list]:
    sampling = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "logprobs": 1, **params}
    for rid, prompt in prompts.items():
        core.add_request(GenerationRequest(rid, prompt, SamplingParams(**sampling), time.monotonic()))
    got: dict[str, list] = {rid: [] for rid in prompts}
    while core.has_work():
        for out in core.step():
            assert out.error is None, out.error
            got[out.request_id].extend((e.token_id, e.logprob, e.top) for e in out.logprobs or [])
    core.pool.reset_cache()
    return got


@BF16
def test_a_prompt_computes_alike_however_it_is_chunked_and_batched(cores: dict[str, TorchEngineCore]) -> None:
    big, small = cores["big"], cores["small"]
    choice = next(p for p in big.info.paths if p.name == "dense_prompt_rows")
    # Where the probe refused this CPU's tiles every row runs int4: the same must hold then.
    assert choice.used == big.runner.dense_prompts
    assert "64 rows a call" in choice.reason if choice.used else "int4 kernel" in choice.reason
    encode = big.tokenizer.encode
    prompt = encode("The history of the printing press begins in the fifteenth century, when " * 4, True)
    others = {f"o{i}": encode(f"Question {i}: what is {i} times {i + 3}?", True) for i in range(3)}
    alone = _run(big, {"p": prompt})["p"]
    assert _run(small, {"p": prompt})["p"] == alone  # 16-token chunks: bitwise the same
    assert _run(big, {**others, "p": prompt})["p"] == alone  # beside other prompts
    assert _run(small, {**others, "p": prompt})["p"] == alone


@BF16
def test_dense_prompt_rows_keep_the_int4_kernels_greedy_answers(cores: dict[str, TorchEngineCore]) -> None:
    """The copies are the int4 weights rounded to bf16 once (perplexity within 0.03% of the int4
    kernel's, bench/README.md): the same greedy answers on the embedded model's chat prompts up to
    where the int4 kernel's own top two were within a rounding of each other, first-token
    logprobs within 0.25."""
    dense, int4 = cores["big"], cores["off"]
    off = next(p for p in int4.info.paths if p.name == "dense_prompt_rows")
    assert not off.used and "NIM_DENSE_PROMPT_ROWS=off" in off.reason and not int4.runner.dense_prompts
    tokenizer = dense.tokenizer
    questions = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
                 "Explain gravity to a child.", "List the planets.", "Why is the sky blue?"]  # fmt: skip
    prompts = {
        f"q{i}": tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True), False
        )
        for i, q in enumerate(questions)
    }
    got = _run(dense, prompts, max_tokens=24, logprobs=2)
    want = _run(int4, prompts, max_tokens=24, logprobs=2)
    identical = 0
    for rid in prompts:
        assert got[rid][0][1] == pytest.approx(want[rid][0][1], abs=0.25), rid
        pairs = enumerate(zip(got[rid], want[rid], strict=True))
        split = next((i for i, (a, b) in pairs if a[0] != b[0]), None)
        if split is None:
            identical += 1
            continue
        top = want[rid][split][2]  # the int4 kernel's two most likely tokens there
        assert len(top) == 2 and top[0][1] - top[1][1] < 0.3, (rid, split, top)
    assert identical, "no answer the same"


@BF16
def test_a_prompt_continuing_an_answer_computes_alike_warm_or_cold(
    cores: dict[str, TorchEngineCore],
) -> None:
    """A chat's next turn holds the last answer: its blocks, cached from output rows (int4), are
    hashed apart from prompt blocks (block_pool.OUTPUT_TAG), so the turn computes them dense
    itself, as it would with nothing cached: the same answer bitwise either way."""
    core = cores["big"]
    block = core.config.kv_spec.block_size
    encode = core.tokenizer.encode
    prompt = encode("Tell me about the oceans of the world and the animals living in them. " * 2, True)

    def run(rid: str, tokens: list[int]) -> tuple[list, int]:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
        core.add_request(GenerationRequest(rid, tokens, params, time.monotonic()))
        got, cached = [], 0
        while core.has_work():
            for out in core.step():
                got.extend((e.token_id, e.logprob) for e in out.logprobs or [])
                cached = out.num_cached_tokens
        return got, cached

    core.pool.reset_cache()
    answer, _ = run("first", prompt)
    follow_up = [*prompt, *(token for token, _ in answer), *encode(" Say that again, shorter.", False)]
    warm, cached = run("warm", follow_up)  # the first turn's blocks are in the cache
    assert 0 < cached <= (len(prompt) // block) * block  # its prompt's blocks, not its answer's
    core.pool.reset_cache()
    cold, cached = run("cold", follow_up)
    assert cached == 0 and warm == cold
    core.pool.reset_cache()
