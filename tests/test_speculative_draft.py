"""Speculative decoding with a draft model: the embedded model drafting for itself accepts every
greedy token and changes no greedy output, in a batch beside a sampled row (whose drafts carry the
draft's distribution q); a draft whose vocabulary is not the target's stops the start in one line;
rejection sampling against a proposer's q keeps the target's distribution."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.config_loading import load_settings
from service.engine.config import UnsupportedConfigError
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.speculative_config import SpeculativeConfig
from service.engine.torch.core import TorchEngineCore
from service.engine.torch.loading import build_core
from service.engine.torch.sampler import SamplingRow
from service.engine.torch.speculative.draft import check_draft
from service.engine.torch.speculative.rejection import invert_cdf, verify
from service.serving import config_for
from tests.test_speculative import CHI2_CRITICAL_5, _chi_square
from tests.test_tensor_parallel import _checkpoint

EMBEDDED = Path(__file__).resolve().parents[1] / "model_store" / "smollm2-135m-instruct"
GGUF = EMBEDDED / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def core() -> Iterator[TorchEngineCore]:
    spec = f'{{"model": "{GGUF}", "num_speculative_tokens": 3}}'
    # float32: kernels that compute a row alike at every row count on every CPU (bf16 activations
    # take the int4 profile, whose aten kernel blocks rows by 4): the draft's one row then equals
    # its verify row bit for bit, which is what 100% acceptance checks.
    settings = load_settings(num_threads=1, max_model_len=256, speculative_config=spec, dtype="float32")
    core = build_core(config_for(settings))
    core.start(lambda: None, lambda error: None)
    yield core
    core.shutdown()


def _run(core: TorchEngineCore, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for request in requests:
        core.add_request(request)
    while core.has_work():
        for out in core.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def _requests(core: TorchEngineCore, tag: str, sampled: bool = False) -> list[GenerationRequest]:
    encode = core.tokenizer.encode

    def request(name: str, text: str, **params: object) -> GenerationRequest:
        sampling = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **params})
        return GenerationRequest(f"{tag}-{name}", encode(text, True), sampling, time.monotonic())

    greedy = [request("a", "The capital of France is"), request("b", "List three colours:")]
    if not sampled:
        return greedy
    return [greedy[0], request("sampled", "Once upon a time", temperature=0.9, seed=3, max_tokens=8)]


def test_the_embedded_model_drafting_for_itself_accepts_every_greedy_token(core: TorchEngineCore) -> None:
    speculator = core.speculator
    assert speculator is not None and speculator.draft is not None
    core.speculator = None
    try:
        want = _run(core, _requests(core, "plain"))
    finally:
        core.speculator = speculator
    speculator.reset_counts()
    got = _run(core, _requests(core, "spec"))
    assert got["spec-a"] == want["plain-a"] and got["spec-b"] == want["plain-b"]
    counts = speculator.counts
    assert counts.num_draft_tokens >= 12
    assert counts.num_accepted_tokens == counts.num_draft_tokens, counts  # acceptance 100%
    # A sampled row beside a greedy one: its drafts carry q; the greedy row is still unchanged.
    got = _run(core, _requests(core, "mixed", sampled=True))
    assert got["mixed-a"] == want["plain-a"]
    assert len(got["mixed-sampled"]) == 8
    assert speculator.draft.num_cached_requests == 0  # every request's draft KV dropped at its end
    pool = core.pool
    assert pool.num_free == pool.num_blocks
    choice = next(p for p in core.info.paths if p.name == "speculative_decoding")
    assert choice.used and "draft model" in choice.reason


def test_a_draft_with_another_vocabulary_stops_the_start_in_one_line(tmp_path: Path) -> None:
    other = _checkpoint(tmp_path / "other", vocab_size=256, max_position_embeddings=512)
    spec = f'{{"model": "{other}", "num_speculative_tokens": 2}}'
    with pytest.raises(UnsupportedConfigError) as refused:
        build_core(config_for(load_settings(num_threads=1, max_model_len=256, speculative_config=spec)))
    message = str(refused.value)
    assert "\n" not in message and "256 tokens" in message and "share the target's tokenizer" in message


def test_a_draft_under_tensor_parallelism_is_refused_before_anything_loads() -> None:
    draft = SpeculativeConfig("draft_model", 2, model="/models/draft")
    check_draft(draft, 1)
    check_draft(SpeculativeConfig("ngram", 2), 4)
    with pytest.raises(UnsupportedConfigError, match="tensor parallelism 2"):
        check_draft(draft, 2)


def test_rejection_sampling_against_a_drafts_distribution_keeps_the_targets() -> None:
    """Drafts drawn from q, accepted with min(1, p/q), a rejection drawn from norm(max(0, p - q)):
    the first token is distributed as p_0, the second (after an accepted first) as p_1."""
    torch.manual_seed(1)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(max_tokens=8, temperature=1.0)
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax(torch.randn(2, 6), dim=-1)  # an unrelated proposer
    first, second = [0] * 6, [0] * 6
    for seed in range(1500):
        draw = random.Random(seed)  # the proposer's own numbers, independent of the verifier's
        drafts = [invert_cdf(q[j], draw.random()) for j in range(2)]
        rows = [SamplingRow(params, seed * 31 + 7, [0, *drafts[:j]], 1, frozenset()) for j in range(3)]
        verdict = verify(logits.clone(), rows, drafts, q)
        tokens = [*verdict.accepted, verdict.token.token_id]
        first[tokens[0]] += 1
        if verdict.accepted[:1] == drafts[:1]:
            second[tokens[1]] += 1
    assert _chi_square(first, p[0].tolist()) < CHI2_CRITICAL_5
    assert sum(second) > 200
    assert _chi_square(second, p[1].tolist()) < CHI2_CRITICAL_5
