"""Stop strings, finish reasons and sampling, without a server."""

from __future__ import annotations

import math
import random
from typing import ClassVar

import pytest
import torch

from service.engine.output import OutputProcessor, StopStringMatcher
from service.engine.protocol import SamplingParams
from service.engine.torch.sampler import (
    SamplingRow,
    filtered_probs,
    greedy,
    ranked,
    request_seed,
    sample,
    top_ids,
    uniform,
)


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    emitted = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


@pytest.mark.parametrize(
    ("pieces", "stop", "expected", "stopped"),
    [
        (["Hello", " wor", "ld!"], ("world",), "Hello ", True),
        (["ab", "c"], ("bc",), "a", True),
        (["a", "b", "c", "d"], ("bcd", "cd"), "a", True),  # earliest occurrence wins
        (["no stop here"], ("zz",), "no stop here", False),
        (["x"], (), "x", False),
        (["END"], ("END",), "", True),
        (["a\n", "\nb"], ("\n\n",), "a", True),
    ],
)
def test_stop_strings_across_pieces(pieces, stop, expected, stopped) -> None:
    assert feed_all(StopStringMatcher(stop), pieces) == (expected, stopped)


def test_stop_string_property_random_split() -> None:
    rng = random.Random(0)
    alphabet = "abc "
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        )
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        # Generation stops at the first piece after which some stop string is complete, cut at the
        # earliest occurrence present at that moment.
        expected, seen = (text, False), ""
        for piece in pieces:
            seen += piece
            hits = [i for i in (seen.find(s) for s in stops) if i >= 0]
            if hits:
                expected = (seen[: min(hits)], True)
                break
        assert feed_all(StopStringMatcher(stops), pieces) == expected, (text, stops, pieces)


class FakeDetokenizer:
    def __init__(self, vocab: dict[int, str]) -> None:
        self.vocab = vocab

    def add(self, ids) -> str:
        return "".join(self.vocab[i] for i in ids)

    def flush(self) -> str:
        return ""


class FakeTokenizer:
    eos_token_ids = (0,)
    vocab: ClassVar[dict[int, str]] = {0: "<eos>", 1: "a", 2: "b", 3: "STOP", 4: "c"}

    def detokenizer(self, skip_special_tokens: bool = True) -> FakeDetokenizer:
        return FakeDetokenizer(self.vocab)


def run(params: SamplingParams, tokens: list[int], prompt_len: int = 3, max_model_len: int = 100):
    proc = OutputProcessor(FakeTokenizer(), params, prompt_len, max_model_len)  # type: ignore[arg-type]
    texts = []
    for t in tokens:
        text, reason = proc.process(t)
        texts.append(text)
        if reason:
            return "".join(texts), reason, proc.num_generated
    return "".join(texts), None, proc.num_generated


def test_eos_stops_and_is_counted_but_not_shown() -> None:
    assert run(SamplingParams(max_tokens=10), [1, 2, 0, 1]) == ("ab", "stop", 3)


def test_ignore_eos_keeps_going() -> None:
    assert run(SamplingParams(max_tokens=4, ignore_eos=True), [1, 0, 2, 4]) == ("a<eos>bc", "length", 4)


def test_stop_token_ids_and_strings() -> None:
    assert run(SamplingParams(max_tokens=10, stop_token_ids=(4,)), [1, 4, 2]) == ("a", "stop", 2)
    assert run(SamplingParams(max_tokens=10, stop=("ST",)), [1, 3, 2]) == ("a", "stop", 2)


def test_length_limits_by_max_tokens_and_context() -> None:
    assert run(SamplingParams(max_tokens=2), [1, 2, 1]) == ("ab", "length", 2)
    # 98-token prompt in a 100-token context leaves room for 2.
    assert run(SamplingParams(max_tokens=50), [1, 2, 1], prompt_len=98) == ("ab", "length", 2)


def row(params: SamplingParams, tokens=(1, 2, 3), num_prompt: int = 3, end=frozenset({0})) -> SamplingRow:
    return SamplingRow(params, request_seed(params), list(tokens), num_prompt, end)


def probs_of(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] -> the normalised distribution the sampler draws from for one row."""
    kept = filtered_probs(logits[None].clone(), [params])[0]
    return kept / kept.sum()


def test_greedy_sampling_is_argmax_and_seeded_rows_reproduce_in_any_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    seeded = SamplingParams(max_tokens=1, temperature=1.0, seed=42)
    alone = sample(logits[1:2].clone(), [row(seeded)])
    batch = sample(
        logits[[0, 1, 2]].clone(),
        [row(greedy), row(seeded), row(SamplingParams(max_tokens=1, temperature=0.7, top_k=5))],
    )
    assert batch[0].token_id == int(torch.argmax(logits[0]))
    assert batch[1].token_id == alone[0].token_id


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = probs_of(logits[0], SamplingParams(max_tokens=1, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.count_nonzero(probs_of(logits[0], SamplingParams(max_tokens=1, top_p=1e-9))) == 1


def test_top_k_and_min_p_filters_per_row() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    params = [
        SamplingParams(max_tokens=1, top_k=2),
        SamplingParams(max_tokens=1, min_p=0.6),  # keeps p >= 0.6 * 0.4
        SamplingParams(max_tokens=1),
    ]
    probs = filtered_probs(logits.clone(), params)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    assert torch.count_nonzero(probs[0]) == 2 and torch.allclose(probs[0, :2], torch.tensor([4 / 7, 3 / 7]))
    assert torch.count_nonzero(probs[1]) == 2
    assert torch.allclose(probs[2], torch.tensor([0.4, 0.3, 0.2, 0.1]))


def test_temperature_sharpens() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.4]]))
    probs = probs_of(logits[0], SamplingParams(max_tokens=1, temperature=0.5))
    assert torch.allclose(probs, torch.tensor([0.36 / 0.52, 0.16 / 0.52]))


def test_penalties_bias_and_min_tokens() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    # Token 4 is generated twice, token 2 once; token 1 only in the prompt.
    tokens = [1, 4, 2, 4]
    rep = sample(
        logits.clone(), [row(SamplingParams(max_tokens=9, temperature=0, repetition_penalty=4.0), tokens, 1)]
    )
    # Seen tokens (prompt and output): 1 -> 2/4, 4 -> 3/4, 2 -> -1*4; unseen 0 stays 1.0 and wins.
    assert rep[0].token_id == 0
    freq = SamplingParams(max_tokens=9, temperature=0, frequency_penalty=2.0)
    assert sample(logits.clone(), [row(freq, tokens, 1)])[0].token_id == 1  # 4: 3 - 4 = -1
    presence = SamplingParams(max_tokens=9, temperature=0, presence_penalty=2.0)
    assert sample(logits.clone(), [row(presence, tokens, 1)])[0].token_id == 1  # 4: 3 - 2 = 1 < 2
    bias = SamplingParams(max_tokens=9, temperature=0, logit_bias={2: 10.0})
    assert sample(logits.clone(), [row(bias)])[0].token_id == 2
    min_tokens = SamplingParams(max_tokens=9, temperature=0, min_tokens=2)
    assert sample(logits.clone(), [row(min_tokens, [1, 2, 3], 2, frozenset({4}))])[0].token_id == 1


def test_logprobs_are_the_models_and_ranked() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    out = sample(logits.clone(), [row(SamplingParams(max_tokens=1, temperature=0, logprobs=2))])[0]
    assert out.token_id == 0 and out.logprob is not None
    assert out.logprob.rank == 1 and abs(out.logprob.logprob - math.log(0.5)) < 1e-5
    assert [t for t, _ in out.logprob.top] == [0, 1]


def test_ties_rank_in_ascending_token_id_everywhere() -> None:
    """bf16 logits tie exactly: the greedy choice, top_k's k and the top logprobs all take the
    lowest id first, so top_k=1 is greedy and greedy is the first of its top logprobs."""
    # Tied maxima at ids 7, 3 and 40 among 64 (torch.topk orders such ties arbitrarily).
    logits = torch.full((1, 64), -2.0)
    logits[0, [40, 7, 3]] = 21.5
    logits[0, 11] = 21.375
    assert top_ids(logits[0], 2).tolist() == [3, 7]
    assert top_ids(logits[0], 4).tolist() == [3, 7, 40, 11]
    greedy = sample(logits.clone(), [row(SamplingParams(max_tokens=1, temperature=0, logprobs=3))])[0]
    assert greedy.token_id == 3 and greedy.logprob is not None
    assert [t for t, _ in greedy.logprob.top] == [3, 7, 40]
    for seed in range(20):
        top1 = SamplingParams(max_tokens=1, temperature=1.5, top_k=1, seed=seed)
        assert sample(logits.clone(), [row(top1)])[0].token_id == 3
    top2 = probs_of(logits[0], SamplingParams(max_tokens=1, top_k=2))
    assert top2.nonzero().squeeze(1).tolist() == [3, 7]  # exactly k tokens, not every tie


@pytest.mark.parametrize("vocab", [49152, 32000, 151936, 2 * 1009, 4099, 100])
def test_greedy_is_the_first_maximum_in_blocks_and_whole_rows(vocab: int) -> None:
    """The CPU greedy cuts rows into blocks where a width of 64 to 1024 divides the vocabulary
    (4099, a prime, and 100 fall back to the whole-row max): it must still answer argmax's first
    maximum, with ties inside a block, across blocks, at both ends, in rows of -inf, bf16-rounded
    and strided rows."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=generator).bfloat16().float()  # bf16 steps: many ties
    top = logits.max()
    logits[1, [vocab - 1, vocab // 2, 5]] = top + 1  # across blocks: 5 is first
    logits[2, [vocab - 2, vocab - 1]] = top + 1  # the tail only
    logits[3, [0, 1]] = top + 1  # the head only
    logits[4] = -math.inf  # everything masked: argmax answers 0
    logits[5] = 7.0  # all tied
    logits[6, vocab - 1] = top + 1  # the last id
    expected = torch.argmax(logits, dim=-1)
    values, ids = greedy(logits)
    assert ids.tolist() == expected.tolist()
    assert values.tolist() == logits.amax(dim=-1).tolist()
    assert greedy(logits[::2])[1].tolist() == expected[::2].tolist()  # not contiguous
    assert greedy(logits[3:4])[1].tolist() == [0]
    logits[7, vocab // 3] = math.nan  # a NaN row says so in its value
    values, ids = greedy(logits)
    assert math.isnan(values[7]) and ids.tolist()[:7] == expected.tolist()[:7]
    assert 0 <= int(ids[7]) < vocab


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    r = row(SamplingParams(max_tokens=1, temperature=1.0, seed=3))
    counts = [0, 0, 0]
    for _ in range(3000):
        token = sample(logits.clone(), [r])[0].token_id
        counts[token] += 1
        r.token_ids.append(token)  # the next position: the next draw of the seed's stream
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_invalid_sampling_params_are_refused() -> None:
    for kwargs in ({"max_tokens": 0}, {"max_tokens": 1, "temperature": -1}, {"max_tokens": 1, "top_p": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row [V], written plainly (a full stable sort): top_k by logit, then min_p against the
    most likely token, then the smallest prefix reaching top_p of the top_k set's mass."""
    vocab = logits.shape[0]
    order = torch.sort(logits, descending=True, stable=True).indices.tolist()
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    kept = order[: p.top_k] if 0 < p.top_k < vocab else order
    whole = sum(float(probs[t]) for t in kept)
    top = float(probs.max())
    kept = [t for i, t in enumerate(kept) if i == 0 or float(probs[t]) >= top * p.min_p]
    nucleus, mass = [], 0.0
    for t in kept:
        if nucleus and p.top_p < 1.0 and mass >= p.top_p * whole:
            break
        nucleus.append(t)
        mass += float(probs[t])
    out = torch.zeros(vocab, dtype=torch.float64)
    out[nucleus] = probs[nucleus]
    return out / out.sum()


MIXED_PARAMS = [
    SamplingParams(max_tokens=9, temperature=0),
    SamplingParams(max_tokens=9, temperature=0.8, seed=1),
    SamplingParams(max_tokens=9, temperature=1.3, top_k=7, seed=2),
    SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=3),
    SamplingParams(max_tokens=9, temperature=1.0, top_k=40, top_p=0.5, min_p=0.05, seed=4),
    SamplingParams(max_tokens=9, temperature=1.0, min_p=0.2, seed=5, logprobs=3),
    SamplingParams(max_tokens=9, temperature=0, logprobs=5, repetition_penalty=1.3, logit_bias={17: 3.0}),
    SamplingParams(max_tokens=9, temperature=0.9, frequency_penalty=0.8, presence_penalty=0.4, seed=6),
    SamplingParams(max_tokens=9, temperature=1.1, min_tokens=5, top_k=3, seed=7, logprobs=0),
]


@pytest.mark.parametrize("vocab", [320, 49152])
def test_filtered_distributions_match_a_plain_reference(vocab: int) -> None:
    """The batched filters (one call for all rows) keep exactly the tokens a row-by-row sorted
    reference keeps, with its probabilities, on bf16-rounded logits full of ties."""
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(len(MIXED_PARAMS), vocab, generator=generator) * 3).bfloat16().float()
    sampled = [p for p in MIXED_PARAMS if not p.greedy]
    kept = filtered_probs(logits[: len(sampled)].clone(), sampled).double()
    for i, params in enumerate(sampled):
        expected = reference_probs(logits[i], params)
        got = kept[i] / kept[i].sum()
        assert got.nonzero().squeeze(1).tolist() == expected.nonzero().squeeze(1).tolist(), params
        assert torch.allclose(got, expected, atol=1e-5), params


def test_nucleus_wider_than_the_candidates_ranks_the_whole_row() -> None:
    """A flat distribution over 1,000 tokens: top_p 0.9 keeps 900 (the likelier one, then 899),
    past the 256 candidates the CPU looks at first; with top_k 300, 270."""
    logits = torch.zeros(2, 1000)
    logits[:, 999] = 1e-3  # one token a little more likely, at the end
    params = [SamplingParams(max_tokens=1, top_p=0.9), SamplingParams(max_tokens=1, top_p=0.9, top_k=300)]
    kept = filtered_probs(logits.clone(), params)
    assert [int(torch.count_nonzero(row)) for row in kept] == [900, 270]
    for i, p in enumerate(params):
        assert torch.equal(kept[i] > 0, reference_probs(logits[i], p) > 0)
    # the most likely, then the lowest ids
    assert kept[0, 999] > 0 and kept[0, :899].gt(0).all() and kept[0, 899] == 0


def test_ranked_orders_ties_by_ascending_id_and_is_exact_at_the_kth() -> None:
    generator = torch.Generator().manual_seed(11)
    values = torch.randint(0, 6, (5, 300), generator=generator).float()  # ties everywhere
    for k in (1, 7, 64, 300):
        expected = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ranked(values, k), expected), k


def test_a_row_in_a_batch_samples_as_it_does_alone() -> None:
    """Every kind of row, sampled in one mixed batch, gets bitwise the token and logprobs it gets
    alone, over many positions of its seed's stream."""
    generator = torch.Generator().manual_seed(3)
    vocab = 2048
    for position in range(12):
        logits = (torch.randn(len(MIXED_PARAMS), vocab, generator=generator) * 4).bfloat16().float()
        tokens = [1, 17, 17, 5, *range(100, 100 + position)]
        rows = [row(p, tokens, 4, frozenset({0, 1})) for p in MIXED_PARAMS]
        batch = sample(logits.clone(), rows)
        for i, r in enumerate(rows):
            alone = sample(logits[i : i + 1].clone(), [r])[0]
            assert alone == batch[i], (position, MIXED_PARAMS[i])
        assert batch[0].token_id == int(torch.argmax(logits[0]))
        assert all(token.error is None for token in batch)


def test_seeded_streams_are_fixed_by_seed_and_position() -> None:
    assert uniform(42, 3) == uniform(42, 3)
    draws = [uniform(seed, position) for seed in range(20) for position in range(50)]
    assert len(set(draws)) == len(draws) and all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03
    assert request_seed(SamplingParams(max_tokens=1, seed=-1)) == 2**64 - 1
    assert request_seed(SamplingParams(max_tokens=1)) != request_seed(SamplingParams(max_tokens=1))


def test_a_bad_row_fails_alone() -> None:
    """A logit_bias naming a token past the logits, and a row of NaN logits, end their own requests;
    the rows beside them are sampled as if alone."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 64, generator=generator)
    logits[2] = math.nan
    good = [
        SamplingParams(max_tokens=1, temperature=0.8, seed=9),
        SamplingParams(max_tokens=1, temperature=0),
    ]
    bad_bias = SamplingParams(max_tokens=1, temperature=0.8, logit_bias={64: 1.0}, seed=1)
    rows = [
        row(good[0]),
        row(bad_bias),
        row(SamplingParams(max_tokens=1, temperature=0.5, seed=2)),
        row(good[1]),
    ]
    batch = sample(logits.clone(), rows)
    assert batch[1].error is not None and "logit_bias token id 64" in batch[1].error
    assert batch[2].error is not None and "NaN" in batch[2].error
    assert batch[0] == sample(logits[0:1].clone(), [rows[0]])[0] and batch[0].error is None
    assert batch[3].token_id == int(torch.argmax(logits[3])) and batch[3].error is None


def test_a_batched_fault_is_redone_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """When a batched operation raises for one row's sake, the rows are redone one by one: that row
    fails, and the others get bitwise what the batch would have given them."""
    from service.engine.torch import sampler

    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(len(MIXED_PARAMS), 512, generator=generator)
    rows = [row(p, [1, 2, 3, 4], 2) for p in MIXED_PARAMS]
    clean = sample(logits.clone(), rows)
    original = sampler.filtered_probs

    def poisoned(values: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        if any(p.seed == 4 for p in params):
            raise RuntimeError("injected")
        return original(values, params)

    monkeypatch.setattr(sampler, "filtered_probs", poisoned)
    faulty = sample(logits.clone(), rows)
    victim = next(i for i, p in enumerate(MIXED_PARAMS) if p.seed == 4)
    assert faulty[victim].error == "sampling failed: injected"
    assert [t for i, t in enumerate(faulty) if i != victim] == [t for i, t in enumerate(clean) if i != victim]
