"""The CPU's int kernels as the engine builds them: in bf16 under fp32 activations
(BuildOptions.int_kernels_in_bf16), and the logits projection held in half the bytes
(BuildOptions.logits_format, NIM_COMPACT_LOGITS): int8 with bf16 activations, float16 (fbgemm,
computed in float32) with float32 activations.

References are the formula (x = q * scale, one scale per row, written here), the same model built
with the exact float32 kernels, or with its float logits layer; never the code under test:

* int kernels in bf16: every native int layer computes in bf16 (its scales held so), the logits
  within bf16 activations' tolerance of the float32 kernels', and the embedded model's greedy
  tokens equal to the float32 kernels' but at near-ties;
* int8 logits, structure: tied embeddings become one int8 table (the Int8Linear head's rows, which
  the Int8Embedding looks up: no float table is kept); untied, both are int8; a decode step reads
  fewer bytes;
* lookups equal the formula's rows; logits equal the float model on the formula's tables within
  the kernel's bf16 rounding;
* vocab-parallel slices: a rank's rows quantize as the whole table's (per-row scales);
* the embedded model (int4_wo with bf16 activations, as a CPU with bf16 instructions serves it):
  greedy tokens equal to its bf16-head build but at near-ties, the chosen tokens' logprobs within
  the bound stated below;
* float16 logits: the head is fbgemm's packed float16 layer, the embedding stays float32 (tied:
  the same table); logits equal the float model on the float16-rounded table to float32 summation
  order; the embedded model's greedy tokens and logprobs against its float32 head, under float32
  activations (as a CPU without bf16 instructions serves int4_wo);
* Q8 logits (native/q8.py): the head holds int8 blocks of 32 with float16 scales, the embedding
  stays float32 (tied: the same table); logits equal the float model on the formula's blocks, its
  input rounded per block of 32, to float32 summation order; the embedded model's greedy tokens
  and logprobs against its float32 head, under float32 activations, within the bound below;
* where each applies: weight-only profiles on the CPU, int8 with bf16 activations, Q8 with float32
  ones where the native kernel builds and passes its check (else, and with
  NIM_COMPACT_LOGITS=weight-only, float16 where the start-up probe passes: a build whose kernel
  computes a row differently at another batch size keeps the float32 head, with the reason);
  NIM_COMPACT_LOGITS=off turns them off; the reason in each case (rank_loading._logits_path, shown
  in /v1/metadata's executionPaths).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn

from service.engine.models import cpu_linear
from service.engine.models.attention import CausalAttention
from service.engine.models.base import BuildOptions, LogitsFormat
from service.engine.models.cpu_linear import HalfPackedLinear, half_packing_problem
from service.engine.models.loader import build_model, load_gguf, load_hf_dir
from service.engine.models.quant import Int8Weight
from service.engine.models.quant_linear import Int4Linear, Int8Embedding, Int8Linear
from service.engine.native import q8
from service.engine.torch import rank_loading
from service.engine.torch.rank_loading import _logits_path
from service.store.model_store import embedded_model_path
from service.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
# The chosen token's logprob under the int8 head against the bf16 head, embedded model, bf16
# activations (where the int8 head applies): measured 0.12 over the prompts below (72 steps, 2
# near-ties taken the other way).
LOGPROB_TOLERANCE = 0.25
PROMPTS = 10
NEW_TOKENS = 8
# The same under the float16 head against the float32 one, float32 activations: measured 0.0034
# over 80 steps, no token flipped.
HALF_LOGPROB_TOLERANCE = 0.02
# The same under the Q8 head against the float32 head, float32 activations: measured 0.070 over
# 40 steps (5 prompts), no token flipped; bench/head_agreement.py: 5 near-ties in 382 steps, each
# within 0.11.
Q8_LOGPROB_TOLERANCE = 0.25
# Logits through bf16 roundings against float32 ones (tests/test_quantization.py's bf16 bound, for
# logits up to 10; scaled with the largest logit beyond that).
BF16_LOGITS_TOLERANCE = 0.15


def _tiny_checkpoint(directory: Path, tied: bool) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _build(
    path: Path, logits_format: str, precision: str = "fp32", dtype: torch.dtype = torch.float32
) -> nn.Module:
    config, weights = load_hf_dir(path, precision)
    return build_model(config, weights, dtype, "cpu", BuildOptions(logits_format=logits_format))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0]), CausalAttention()))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_logits_and_embedding_are_int8_and_match_the_formula(tmp_path: Path, tied: bool) -> None:
    path = _tiny_checkpoint(tmp_path / "tiny", tied)
    floats, quantized = _build(path, "float"), _build(path, "int8")
    head, embedding = quantized.lm_head, quantized.model.embed_tokens
    assert isinstance(head, Int8Linear) and head.native and head.q.dtype == torch.int8
    assert isinstance(embedding, Int8Embedding)
    if tied:  # one table: the lookup reads the head's rows, no float copy is kept
        assert embedding.q.data_ptr() == head.q.data_ptr()
    assert not any(isinstance(m, nn.Embedding) for m in quantized.modules())

    def formula(table: torch.Tensor) -> torch.Tensor:  # one scale per row: its largest magnitude -> 127
        scale = table.abs().amax(1) / 127
        return (table / scale[:, None]).round().clamp(-127, 127) * scale[:, None]

    ids = torch.tensor([0, 5, 319, 5, 77])
    table = floats.model.embed_tokens.weight
    with torch.inference_mode():
        assert torch.allclose(embedding(ids), formula(table)[ids], rtol=0, atol=1e-6)
        # The reference: the float model with the formula's tables (its head too, untied).
        table.copy_(formula(table))
        if not tied:
            floats.lm_head.weight.copy_(formula(floats.lm_head.weight))
    prompt = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(9))
    got, want = _logits(quantized, prompt), _logits(floats, prompt)
    # What is left: the CPU kernel's input, output and scales round through bf16 (2^-9 each).
    assert float((got - want).abs().max()) <= 2**-6 * float(want.abs().max())
    assert quantized.weight_nbytes() < floats.weight_nbytes()


def test_a_vocab_parallel_slice_quantizes_as_the_whole_table() -> None:
    table = torch.randn(96, 32, generator=torch.Generator().manual_seed(4))
    whole = Int8Weight.quantize(table)
    for start, stop in ((0, 48), (48, 96)):
        part = Int8Weight.quantize(table[start:stop])
        assert torch.equal(part.q, whole.q[start:stop]) and torch.equal(part.scale, whole.scale[start:stop])


def _embedded_builds(dtype: torch.dtype, **variants: BuildOptions) -> dict[str, nn.Module]:
    path = embedded_model_path()
    models = {}
    for name, options in variants.items():
        config, weights = load_gguf(path, "int4_wo")
        models[name] = build_model(config, weights, dtype, "cpu", options)
    return models


def _greedy_agreement(
    reference: nn.Module, model: nn.Module, prompts: int = PROMPTS
) -> tuple[int, int, float]:
    """Greedy decoding of the first `prompts` prompts by `reference`, each step checked against
    `model`: its token equal but where the reference's top two are within LOGPROB_TOLERANCE (a
    near-tie rounding decides; there the prompt's comparison ends). Returns (steps compared,
    near-ties taken the other way, the largest |logprob diff| of an agreed token).

    Each step's check is teacher-forced: both models read the reference's whole continuation in
    one forward pass, whose row before each token is that step's prediction (a causal model's row
    sees only what came before it), rather than one pass per step and model."""
    tokenizer = Tokenizer.from_gguf(embedded_model_path())
    lines = [line for line in (REPO / "tests/data/prompts.txt").read_text().splitlines() if line.strip()]
    worst, ties, compared = 0.0, 0, 0
    for line in lines[:prompts]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": line}])
        ids = tokenizer.encode(text, add_special_tokens=False)
        start = len(ids)
        for _ in range(NEW_TOKENS):
            ids.append(int(_logits(reference, torch.tensor(ids))[-1].argmax()))
        sequence = torch.tensor(ids[:-1])
        want_rows = _logits(reference, sequence)[start - 1 :].float().log_softmax(-1)
        got_rows = _logits(model, sequence)[start - 1 :].float().log_softmax(-1)
        for step, (want, got) in enumerate(zip(want_rows, got_rows, strict=True)):
            token, other = ids[start + step], int(got.argmax())
            if int(want.argmax()) != token:  # the reference itself, one pass against the other: a near-tie
                assert float(want.max() - want[token]) <= LOGPROB_TOLERANCE, (line, token)
                break
            compared += 1
            if other != token:
                assert float(want[token] - want[other]) <= LOGPROB_TOLERANCE, (line, token, other)
                ties += 1
                break
            worst = max(worst, abs(float(got[token] - want[token])))
    return compared, ties, worst


def test_the_embedded_model_decodes_the_same_greedy_tokens_with_int8_logits() -> None:
    models = _embedded_builds(
        torch.bfloat16,
        bf16_head=BuildOptions(prepack_cpu=True),
        int8_head=BuildOptions(prepack_cpu=True, logits_format="int8"),
    )
    assert isinstance(models["int8_head"].lm_head, Int8Linear)
    compared, ties, worst = _greedy_agreement(models["bf16_head"], models["int8_head"])
    print(f"int8 logits: {compared} greedy steps, {ties} near-tie(s) flipped; max |logprob diff| {worst:.4f}")
    assert worst <= LOGPROB_TOLERANCE and ties <= PROMPTS // 4


def test_int_kernels_in_bf16_under_fp32_activations(tmp_path: Path) -> None:
    path = _tiny_checkpoint(tmp_path / "tiny", tied=True)
    models = {}
    for name, in_bf16 in (("exact", False), ("bf16", True)):
        config, weights = load_hf_dir(path, "int4_wo")
        options = BuildOptions(prepack_cpu=True, int_kernels_in_bf16=in_bf16)
        models[name] = build_model(config, weights, torch.float32, "cpu", options)
    for name, dtype in (("exact", torch.float32), ("bf16", torch.bfloat16)):
        layers = [m for m in models[name].modules() if isinstance(m, Int4Linear)]
        assert layers and all(layer.native and layer.scales_zeros.dtype == dtype for layer in layers)
    assert not isinstance(models["bf16"].lm_head, Int8Linear)  # float32 logits: the head stays float32
    generator = torch.Generator().manual_seed(2)
    worst, ties = 0.0, 0
    for _ in range(8):
        ids = torch.randint(0, 320, (16,), generator=generator).tolist()
        for _ in range(6):
            exact = _logits(models["exact"], torch.tensor(ids))
            bf16 = _logits(models["bf16"], torch.tensor(ids))
            assert bf16.dtype == torch.float32
            assert float((bf16 - exact).abs().max()) <= BF16_LOGITS_TOLERANCE * max(
                1.0, float(exact.abs().max()) / 10
            )
            want, got = exact[-1].log_softmax(-1), bf16[-1].log_softmax(-1)
            token, other = int(want.argmax()), int(got.argmax())
            if other != token:  # only a near-tie may flip
                assert float(want[token] - want[other]) <= LOGPROB_TOLERANCE
                ties += 1
                break
            worst = max(worst, abs(float(got[token] - want[token])))
            ids.append(token)
    print(f"int kernels in bf16: {ties} near-tie(s) flipped in 8 prompts; max |logprob diff| {worst:.4f}")
    assert worst > 0 and ties <= 2


def _engine_config(precision: str, compact_logits: bool = True, w8a8: bool = False) -> SimpleNamespace:
    # The weight-only forms by default: the bf16 head's input rows in integers are
    # tests/test_w8a8_logits.py's.
    return SimpleNamespace(precision=precision, compact_logits=compact_logits, w8a8_logits=w8a8)


def test_where_the_compact_logits_apply_and_why() -> None:
    cpu, cuda, bf16, fp32 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16, torch.float32
    used, form = _logits_path(_engine_config("int4_wo"), cpu, bf16, 576)
    assert used.used and form == "int8" and used.setting == "NIM_COMPACT_LOGITS=off"
    assert _logits_path(_engine_config("int8_wo"), cpu, bf16, 576)[1] == "int8"
    for dtype in (bf16, fp32):
        for precision in ("fp32", "bf16", "fp8"):
            path, form = _logits_path(_engine_config(precision), cpu, dtype, 576)
            assert not path.used and form == "float" and f"weights are {precision}" in path.reason
        assert "the CPU only" in _logits_path(_engine_config("int4_wo"), cuda, dtype, 576)[0].reason
        off, form = _logits_path(_engine_config("int4_wo", compact_logits=False), cpu, dtype, 576)
        assert not off.used and form == "float" and "NIM_COMPACT_LOGITS=off" in off.reason
    # float32 activations: float16 weights computed in float32, not the int8 kernel's bf16 output.
    for precision in ("int4_wo", "int8_wo"):
        half, form = _logits_path(_engine_config(precision), cpu, fp32, 576)
        assert half.used and form == "fp16" and "float16, computed in float32" in half.reason


def test_a_float16_kernel_that_fails_its_probe_keeps_the_float32_head(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert half_packing_problem(576) is None, "this host's build has fbgemm's float16 matmul"
    plain = HalfPackedLinear.forward

    def batch_dependent(self: HalfPackedLinear, x: torch.Tensor) -> torch.Tensor:
        out = plain(self, x)
        return out + 1e-3 if x.shape[0] == 5 else out  # a kernel that blocks 5 rows differently

    monkeypatch.setattr(cpu_linear.HalfPackedLinear, "forward", batch_dependent)
    problem = half_packing_problem(576)
    assert problem == "fbgemm's float16 matmul computes a row differently at batch 5"
    path, form = _logits_path(_engine_config("int4_wo"), torch.device("cpu"), torch.float32, 576)
    assert not path.used and form == "float" and problem in path.reason
    assert "stays float32 (NIM_COMPACT_LOGITS=off)" in caplog.text
    monkeypatch.setattr(rank_loading, "half_packing_problem", lambda width: "no fbgemm here")
    path, form = _logits_path(_engine_config("int8_wo"), torch.device("cpu"), torch.float32, 576)
    assert form == "float" and "no fbgemm here" in path.reason


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_float16_head_computes_in_float32_from_float16_weights(tmp_path: Path, tied: bool) -> None:
    path = _tiny_checkpoint(tmp_path / "tiny", tied)
    floats, half = _build(path, "float"), _build(path, "fp16")
    assert isinstance(half.lm_head, HalfPackedLinear)
    assert isinstance(half.model.embed_tokens, nn.Embedding)  # lookups stay float32
    assert half.model.embed_tokens.weight.dtype == torch.float32
    prompt = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(9))
    before = _logits(floats, prompt)
    with torch.inference_mode():  # the reference: the float model over the float16-rounded head
        head = floats.model.embed_tokens.weight if tied else floats.lm_head.weight
        rounded = head.half().float()
        hidden = floats(prompt, torch.arange(24), CausalAttention())
        want = hidden @ rounded.T
    got = _logits(half, prompt)
    assert got.dtype == torch.float32
    # Only the float32 summation order differs from the reference; the rounding itself is small.
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert 0 < float((got - before).abs().max()) <= 2**-10 * float(before.abs().max())
    assert half.weight_nbytes() < floats.weight_nbytes()
    # A row's logits do not depend on how many rows share the call.
    rows = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = half.compute_logits(rows)
        assert all(torch.equal(half.compute_logits(rows[:m]), whole[:m]) for m in (1, 2, 3, 7, 9, 33))


def test_the_embedded_model_decodes_the_same_greedy_tokens_with_float16_logits() -> None:
    models = _embedded_builds(
        torch.float32,
        float_head=BuildOptions(prepack_cpu=True, int_kernels_in_bf16=True),
        half_head=BuildOptions(prepack_cpu=True, int_kernels_in_bf16=True, logits_format="fp16"),
    )
    assert isinstance(models["half_head"].lm_head, HalfPackedLinear)
    compared, ties, worst = _greedy_agreement(models["float_head"], models["half_head"], PROMPTS // 2)
    print(
        f"float16 logits: {compared} greedy steps, {ties} near-tie(s) flipped; max |logprob diff| {worst:.5f}"
    )
    assert compared == PROMPTS // 2 * NEW_TOKENS and ties == 0 and worst <= HALF_LOGPROB_TOLERANCE


@pytest.mark.skipif(q8.serving_problem(576) is not None, reason=f"the Q8 kernel: {q8.serving_problem(576)}")
def test_float32_activations_take_the_q8_head_unless_told_or_it_cannot(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cpu, fp32 = torch.device("cpu"), torch.float32
    for precision in ("int4_wo", "int8_wo"):
        path, form = _logits_path(_engine_config(precision, w8a8=True), cpu, fp32, 576)
        assert path.used and form == "q8" and f"the native Q8 kernel, {q8.isa()}" in path.reason
    weight_only, form = _logits_path(
        _engine_config("int4_wo"), cpu, fp32, 576
    )  # NIM_COMPACT_LOGITS=weight-only
    assert form == "fp16" and "NIM_COMPACT_LOGITS=weight-only" in weight_only.reason
    odd, form = _logits_path(_engine_config("int4_wo", w8a8=True), cpu, fp32, 584)
    assert form == "fp16" and "its 584 inputs are not whole blocks of 32, so the input rows" in odd.reason
    monkeypatch.setattr(q8, "serving_problem", lambda width: "the Q8 kernel is 0.1 off its float64 reference")
    with caplog.at_level("INFO"):
        failed, form = _logits_path(_engine_config("int4_wo", w8a8=True), cpu, fp32, 576)
    assert form == "fp16" and failed.used and "0.1 off its float64 reference" in failed.reason
    assert "the logits projection takes the next choice" in caplog.text


@pytest.mark.skipif(q8.serving_problem(576) is not None, reason=f"the Q8 kernel: {q8.serving_problem(576)}")
def test_bf16_activations_take_the_q8_head_first_then_the_integer_rows(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    for precision in ("int4_wo", "int8_wo"):
        path, form = _logits_path(_engine_config(precision, w8a8=True), cpu, bf16, 576)
        assert path.used and form == "q8" and f"the native Q8 kernel, {q8.isa()}" in path.reason
        assert "the embedding as int8, one scale per row" in path.reason
        assert "NIM_COMPACT_LOGITS=weight-only keeps the input rows in bf16" in path.reason
    # NIM_COMPACT_LOGITS=weight-only
    weight_only, form = _logits_path(_engine_config("int4_wo"), cpu, bf16, 576)
    assert form == "int8" and "NIM_COMPACT_LOGITS=weight-only" in weight_only.reason
    # The Q8 kernel cannot run: oneDNN's integer rows next (where they pass their probe), else
    # the weight-only int8 head, each reason kept.
    monkeypatch.setattr(q8, "serving_problem", lambda width: "the Q8 kernel is 0.1 off its float64 reference")
    monkeypatch.setattr(rank_loading, "w8a8_problem", lambda width: None)
    with caplog.at_level("INFO"):
        rows, form = _logits_path(_engine_config("int4_wo", w8a8=True), cpu, bf16, 576)
    assert form == "w8a8" and rows.used and rows.reason.startswith("the Q8 kernel is 0.1 off")
    assert "the logits projection takes the next choice" in caplog.text
    monkeypatch.setattr(rank_loading, "w8a8_problem", lambda width: "no int8 dot products here")
    neither, form = _logits_path(_engine_config("int4_wo", w8a8=True), cpu, bf16, 576)
    assert form == "int8" and neither.used
    assert "0.1 off its float64 reference; no int8 dot products here, so the input rows" in neither.reason


@pytest.mark.skipif(q8.serving_problem(64) is not None, reason=f"the Q8 kernel: {q8.serving_problem(64)}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_q8_head_computes_the_formula_s_blocks(tmp_path: Path, tied: bool, dtype: torch.dtype) -> None:
    path = _tiny_checkpoint(tmp_path / "tiny", tied)
    floats, blocks = _build(path, "float", dtype=dtype), _build(path, "q8", dtype=dtype)
    assert isinstance(blocks.lm_head, q8.Q8Linear)
    if dtype == torch.float32:  # lookups stay float32
        assert isinstance(blocks.model.embed_tokens, nn.Embedding)
        assert blocks.model.embed_tokens.weight.dtype == torch.float32
    else:  # int8 rows, as the weight-only int8 build holds them; no float table kept
        embedding, weight_only = blocks.model.embed_tokens, _build(path, "int8", dtype=dtype)
        assert isinstance(embedding, Int8Embedding)
        assert not any(isinstance(m, nn.Embedding) for m in blocks.modules())
        ids = torch.tensor([0, 5, 319, 5, 77])
        with torch.inference_mode():
            assert torch.equal(embedding(ids), weight_only.model.embed_tokens(ids))

    def formula(table: torch.Tensor) -> torch.Tensor:  # per block of 32: its largest magnitude -> 127 steps
        parts = table.view(table.shape[0], -1, 32)
        scale = (parts.abs().amax(-1, keepdim=True) / 127).half().float()
        return ((parts / scale).round().clamp(-127, 127) * scale).view(table.shape)

    prompt = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        head = (floats.model.embed_tokens.weight if tied else floats.lm_head.weight).float()
        hidden = blocks(prompt, torch.arange(24), CausalAttention()).float()  # its own hidden states
        parts = hidden.view(24, -1, 32)  # the input, rounded per block of 32
        largest = parts.abs().amax(-1, keepdim=True)  # x * (127 / largest), as the kernel rounds
        steps = (parts * (torch.full_like(largest, 127.0) / largest)).round().clamp(-127, 127)
        rounded = (steps * (largest / 127)).view(24, -1)
        want = rounded.double() @ formula(head).double().T
    got = _logits(blocks, prompt)
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert blocks.weight_nbytes() < floats.weight_nbytes()


@pytest.mark.skipif(q8.serving_problem(576) is not None, reason=f"the Q8 kernel: {q8.serving_problem(576)}")
def test_the_embedded_model_decodes_the_same_greedy_tokens_with_q8_logits() -> None:
    models = _embedded_builds(
        torch.float32,
        float_head=BuildOptions(prepack_cpu=True, int_kernels_in_bf16=True),
        q8_head=BuildOptions(prepack_cpu=True, int_kernels_in_bf16=True, logits_format="q8"),
    )
    assert isinstance(models["q8_head"].lm_head, q8.Q8Linear)
    compared, ties, worst = _greedy_agreement(models["float_head"], models["q8_head"], PROMPTS // 2)
    print(f"Q8 logits: {compared} greedy steps, {ties} near-tie(s) flipped; max |logprob diff| {worst:.4f}")
    assert compared >= PROMPTS // 2 * NEW_TOKENS - NEW_TOKENS and worst <= Q8_LOGPROB_TOLERANCE and ties <= 1


def check_bf16_head_agreement(logits_format: LogitsFormat, head_type: type) -> None:
    """The embedded model under bf16 activations with the integer head `logits_format`: greedy
    tokens as the bf16 head's but at near-ties, and no further from it than the weight-only int8
    head (tests/test_w8a8_logits.py's W8A8 head and the Q8 head below)."""
    models = _embedded_builds(
        torch.bfloat16,
        bf16_head=BuildOptions(prepack_cpu=True),
        int8_head=BuildOptions(prepack_cpu=True, logits_format="int8"),
        integer_head=BuildOptions(prepack_cpu=True, logits_format=logits_format),
    )
    assert isinstance(models["integer_head"].lm_head, head_type)
    compared, ties, worst = _greedy_agreement(models["bf16_head"], models["integer_head"])
    print(
        f"{logits_format} logits, bf16: {compared} steps, {ties} near-tie(s) flipped; max |diff| {worst:.4f}"
    )
    assert worst <= LOGPROB_TOLERANCE and ties <= PROMPTS // 4
    weight_only = _greedy_agreement(models["bf16_head"], models["int8_head"])
    assert ties <= weight_only[1] + 1, ("no further from the bf16 head than the int8 head", weight_only)


@pytest.mark.skipif(q8.serving_problem(576) is not None, reason=f"the Q8 kernel: {q8.serving_problem(576)}")
def test_under_bf16_activations_the_q8_head_keeps_the_bf16_head_s_greedy_tokens() -> None:
    check_bf16_head_agreement("q8", q8.Q8Linear)
