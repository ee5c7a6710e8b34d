"""Speculative decoding's parts that need no model: the vLLM-shaped config, prompt lookup, the
back-off, and rejection sampling's distribution (a chi-square test on fixed distributions)."""

from __future__ import annotations

import pytest
import torch

from service.config_loading import ConfigError, load_settings
from service.engine.protocol import SamplingParams
from service.engine.speculative_config import (
    SpeculativeConfig,
    SpeculativeConfigError,
    parse_speculative_config,
)
from service.engine.torch.request import Request
from service.engine.torch.sampler import SamplingRow
from service.engine.torch.speculative.draft_length import DraftLength
from service.engine.torch.speculative.ngram import lookup, propose_ngram
from service.engine.torch.speculative.rejection import verify
from service.engine.torch.speculative.speculator import MAX_BACKOFF_STEPS, Speculator
from service.serve_flags import parse_serve_flags


def test_vllm_speculative_config_is_read_as_vllm_reads_it() -> None:
    ngram = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    )
    assert ngram == SpeculativeConfig("ngram", 4, prompt_lookup_min=4, prompt_lookup_max=4)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig(
        "ngram", 3, 5, 5
    )
    draft = parse_speculative_config('{"model": "/m/draft", "num_speculative_tokens": 2}')
    assert draft == SpeculativeConfig("draft_model", 2, model="/m/draft")
    assert parse_speculative_config(None, "/m/draft") == SpeculativeConfig("draft_model", 4, model="/m/draft")
    assert parse_speculative_config(None) is None
    settings = load_settings(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert settings.speculative == SpeculativeConfig("ngram", 2, 5, 5)
    flags = parse_serve_flags(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert flags.values["speculative_config"] == '{"method": "ngram", "num_speculative_tokens": 2}'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 4, "topk": 2}', "unknown key 'topk'"),
        ('{"method": "eagle", "num_speculative_tokens": 4}', "method 'eagle' is not implemented here"),
        ('{"method": "lookahead", "num_speculative_tokens": 4}', "method 'lookahead' is unknown"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0 is not a positive"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min=5 is more than prompt_lookup_max=2",
        ),
        ("ngram", "is not JSON"),
    ],
)
def test_what_is_not_understood_stops_the_start_in_one_line(text: str, message: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=message):
        parse_speculative_config(text)
    with pytest.raises(ConfigError) as caught:
        load_settings(speculative_config=text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_prompt_lookup_proposes_what_followed_the_longest_recent_suffix() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 6, 7, 1, 2, 3, 4]
    # suffix [2, 3, 4] (3 tokens) last occurred at 7..9, followed by 6, 7, 1
    assert propose_ngram(tokens, 3, 1, 3) == [6, 7, 1]
    assert propose_ngram(tokens, 2, 1, 4) == [5, 9]  # [1, 2, 3, 4] occurred only at the start
    assert propose_ngram([5, 6, 7, 8], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([7, 7], 4, 1, 1) == [7]  # what exists after the occurrence
    # token ids whose bytes could match across a token boundary are not matched there
    assert propose_ngram([256, 1, 0, 0, 1], 2, 1, 1) == [0, 0]
    assert lookup(tokens, 3, 1, 3) == ([6, 7, 1], 3)  # with the length of the suffix that matched
    assert lookup([5, 6, 7, 8], 3, 1, 3) == ([], 0)


def _request(request_id: str, tokens: list[int], max_tokens: int = 100) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    request = Request(request_id, list(tokens), 3, sampling, 0.0)
    request.num_computed_tokens = len(tokens) - 1  # decoding
    return request


def _rejected_throughout(speculator: Speculator, request: Request, steps: int = 1000) -> int:
    """`steps` steps in which every verification of `request` accepts nothing: how many there were."""
    verifications = 0
    for _ in range(steps):
        speculator.propose([request])
        if request.draft_token_ids:
            verifications += 1
            speculator.verified(request.request_id, len(request.draft_token_ids), 0)
    return verifications


def test_a_request_whose_drafts_are_rejected_backs_off_exponentially() -> None:
    config = SpeculativeConfig("ngram", 3, 1, 2)
    speculator = Speculator(config, max_model_len=10_000)
    request = _request("r", [1, 2, 3, 1, 2, 3, 1, 2])
    verifications = _rejected_throughout(speculator, request)
    # 1 + 2 + 4 + ... + 64, then one verification in every 65 steps
    assert verifications <= 7 + 1000 // (MAX_BACKOFF_STEPS + 1) + 1
    speculator.verified("r", 3, 2)  # an acceptance resets the back-off
    speculator.propose([request])
    assert request.draft_token_ids
    counts = speculator.counts
    assert counts.num_drafts == verifications + 1 and counts.num_accepted_tokens == 2
    assert counts.accepted_per_position == (1, 1, 0)
    # never past max_tokens: one token is left to sample after the drafts
    short = _request("s", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=7)
    speculator.propose([short])
    assert len(short.draft_token_ids) == 1


def _rows(params: SamplingParams, drafts: list[int], seed: int) -> list[SamplingRow]:
    return [SamplingRow(params, seed, [0, *drafts[:j]], 1, frozenset()) for j in range(len(drafts) + 1)]


# chi-square critical value at p = 0.001 for 5 degrees of freedom (6 outcomes)
CHI2_CRITICAL_5 = 20.515


def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Tokens after accepted or rejected point-mass drafts are distributed as the target says: the
    first token against p_0, and the second (given the first draft was accepted) against p_1."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(max_tokens=8, temperature=0.8)
    p = torch.softmax(logits / 0.8, dim=-1)
    drafts = [int(p[0].argmax()), 4]  # a likely first draft, an arbitrary second
    first = [0] * 6
    second = [0] * 6
    trials = 2500
    for seed in range(trials):
        verdict = verify(logits.clone(), _rows(params, drafts, seed * 7919 + 1), drafts)
        tokens = [*verdict.accepted, verdict.token.token_id]
        first[tokens[0]] += 1
        if verdict.accepted[:1] == [drafts[0]]:
            second[tokens[1]] += 1
    assert _chi_square(first, p[0].tolist()) < CHI2_CRITICAL_5
    assert sum(second) > 400
    assert _chi_square(second, p[1].tolist()) < CHI2_CRITICAL_5


def test_greedy_verification_accepts_exactly_the_argmax_run() -> None:
    logits = torch.full((4, 6), -5.0)
    logits[0, 2] = logits[1, 3] = logits[2, 1] = logits[3, 5] = 5.0
    params = SamplingParams(max_tokens=8, temperature=0.0)
    verdict = verify(logits.clone(), _rows(params, [2, 3, 4], 1), [2, 3, 4])
    assert verdict.accepted == [2, 3] and verdict.token.token_id == 1
    verdict = verify(logits.clone(), _rows(params, [2, 3, 1], 1), [2, 3, 1])
    assert verdict.accepted == [2, 3, 1] and verdict.token.token_id == 5  # the bonus token


# A lone request's step cost by rows on a CPU with an int4 profile (bench/README.md): 4-row blocks.
CPU_ROWS = (1.0, 1.07, 1.2, 1.3, 1.85, 1.85, 1.93, 2.07)


def _learned(costs: tuple[float, ...], match: int, drafted: int, accepted: int, times: int) -> DraftLength:
    lengths = DraftLength(costs)
    for _ in range(times):
        lengths.observe(match, drafted, accepted)
    return lengths


def test_draft_length_takes_the_count_with_the_most_tokens_per_step_time() -> None:
    copying = _learned(CPU_ROWS, 4, 7, 7, 30)  # four-token matches: every draft accepted
    assert copying.acceptance(4) > 0.95
    assert copying.choose(4, 7)[0] == 7  # 5 to 8 rows cost about the same: take them all
    assert copying.choose(4, 5)[0] == 5  # no more than the lookup found
    # One-token matches accepted about a third of the time: 4 rows (3 drafts) or fewer, not 5+.
    loose = DraftLength(CPU_ROWS)
    for accepted in [0, 0, 1, 0, 2, 0, 0, 1] * 4:
        loose.observe(1, 7, accepted)
    count, gain = loose.choose(1, 7)
    rate = loose.acceptance(1)
    assert 0.2 < rate < 0.5 and count <= 3
    assert gain == pytest.approx(sum(rate**j for j in range(count + 1)) / CPU_ROWS[count])
    assert all(gain >= sum(rate**j for j in range(k + 1)) / CPU_ROWS[k] for k in range(1, 8))
    assert loose.choose(4, 7)[0] == 2  # an unseen match length starts from even odds: 3 rows
    # Where extra rows cost nothing (a GPU at batch 1), every draft is verified, whatever the odds.
    flat = _learned((1.0,) * 8, 1, 7, 0, 30)
    assert flat.choose(1, 7) == (7, pytest.approx(sum(flat.acceptance(1) ** j for j in range(8))))
    # The estimate follows the workload: a run of full acceptances after rejections lifts it.
    for _ in range(40):
        loose.observe(1, 7, 7)
    assert loose.choose(1, 7)[0] == 7


def test_step_times_become_costs_relative_to_one_row_that_never_fall() -> None:
    lengths = DraftLength.from_step_times([0.010, 0.0105, 0.0102, 0.020])
    assert lengths.row_costs == pytest.approx((1.0, 1.05, 1.05, 2.0))
    assert "1.00, 1.05, 1.05, 2.00" in lengths.describe()
    with pytest.raises(ValueError):
        DraftLength((1.0,))


def test_a_lone_request_verifies_the_chosen_count_and_others_every_draft_found() -> None:
    config = SpeculativeConfig("ngram", 7, 1, 4)
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1]  # [9, 1] occurred: 2, 3, ... 8 follow (7 tokens)
    speculator = Speculator(config, max_model_len=10_000, lengths=_learned(CPU_ROWS, 2, 7, 0, 30))
    alone = _request("alone", tokens)
    speculator.propose([alone])
    assert alone.draft_token_ids == [2]  # two-token matches have been rejected: one draft
    speculator.verified("alone", 1, 1)
    other = _request("other", tokens)
    speculator.propose([alone, other])  # beside another request: every draft the lookup found
    assert alone.draft_token_ids == other.draft_token_ids == [2, 3, 4, 5, 6, 7, 8]
    for _ in range(40):  # both verifications teach the estimate for two-token matches
        speculator.verified("alone", 7, 7)
        speculator.propose([alone, other])
    speculator.propose([alone])
    assert alone.draft_token_ids == [2, 3, 4, 5, 6, 7, 8]


def test_a_lone_request_backs_off_once_its_steps_are_expected_to_lose() -> None:
    config = SpeculativeConfig("ngram", 3, 1, 2)

    def verifications(costs: tuple[float, ...]) -> int:
        speculator = Speculator(config, max_model_len=10_000, lengths=DraftLength(costs))
        return _rejected_throughout(speculator, _request("r", [1, 2, 3, 1, 2, 3, 1, 2]))

    # Extra rows cost: once the estimate says a draft rarely lands, the back-off's schedule holds;
    # rows that cost nothing are verified every step (they lose nothing).
    assert verifications(CPU_ROWS[:4]) <= 30 + 1000 // (MAX_BACKOFF_STEPS + 1) + 8
    assert verifications((1.0,) * 4) == 1000
