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
    make_generator,
    sample,
    top_ids,
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
    return SamplingRow(params, make_generator(params, torch.device("cpu")), list(tokens), num_prompt, end)


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
    probs = filtered_probs(logits[0], SamplingParams(max_tokens=1, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.count_nonzero(filtered_probs(logits[0], SamplingParams(max_tokens=1, top_p=1e-9))) == 1


def test_top_k_and_min_p_filters_per_row() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    params = [
        SamplingParams(max_tokens=1, top_k=2),
        SamplingParams(max_tokens=1, min_p=0.6),  # keeps p >= 0.6 * 0.4
        SamplingParams(max_tokens=1),
    ]
    probs = torch.stack([filtered_probs(logits[i], p) for i, p in enumerate(params)])
    assert torch.count_nonzero(probs[0]) == 2 and torch.allclose(probs[0, :2], torch.tensor([4 / 7, 3 / 7]))
    assert torch.count_nonzero(probs[1]) == 2
    assert torch.allclose(probs[2], torch.tensor([0.4, 0.3, 0.2, 0.1]))


def test_temperature_sharpens() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.4]]))
    probs = filtered_probs(logits[0], SamplingParams(max_tokens=1, temperature=0.5))
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
    top2 = filtered_probs(logits[0], SamplingParams(max_tokens=1, top_k=2))
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
        counts[sample(logits.clone(), [r])[0].token_id] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_invalid_sampling_params_are_refused() -> None:
    for kwargs in ({"max_tokens": 0}, {"max_tokens": 1, "temperature": -1}, {"max_tokens": 1, "top_p": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
