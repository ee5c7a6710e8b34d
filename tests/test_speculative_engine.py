"""Speculative decoding (prompt lookup) in the engine core, on the embedded model: greedy output
equal to the engine's without speculation in a mixed batch (speculating, plain and sampled rows,
a prompt chunk arriving mid-way), across preemption and prefix-cache hits; the KV cache rolled back
for rejected tokens (every block returned, only accepted tokens' blocks published)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from service.config_loading import load_settings
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.block_pool import OUTPUT_TAG, hash_block, root_hash
from service.engine.torch.core import TorchEngineCore
from service.engine.torch.loading import build_core
from service.serving import config_for

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
TEXT = "one two three four five six seven eight nine ten eleven twelve"


@pytest.fixture(scope="module")
def core() -> Iterator[TorchEngineCore]:
    settings = load_settings(
        num_threads=1,  # one thread: on a shared host, a second one waits at every barrier
        max_model_len=160,
        kv_cache_max_tokens=160,  # the requests together need ~250 tokens of blocks: preemption
        max_num_batched_tokens=128,
        speculative_config=SPEC,
    )
    core = build_core(config_for(settings))
    core.start(lambda: None, lambda error: None)
    yield core
    core.shutdown()


def _run(core: TorchEngineCore, arrivals: dict[int, list[GenerationRequest]]) -> dict[str, list[int]]:
    """Step until every request ended; arrivals[n]: added before step n."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while core.has_work() or any(n >= step for n in arrivals):
        for request in arrivals.get(step, []):
            core.add_request(request)
        for out in core.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    return tokens


def _requests(core: TorchEngineCore, tag: str) -> dict[int, list[GenerationRequest]]:
    encode = core.tokenizer.encode
    repeat = encode(f"Copy: {TEXT}. {TEXT}. {TEXT}. {TEXT}.", True)
    other = encode("The weather in the mountains is", True)

    def request(name: str, prompt: list[int], **params: object) -> GenerationRequest:
        sampling = SamplingParams(**{"max_tokens": 32, "temperature": 0.0, "ignore_eos": True, **params})
        return GenerationRequest(f"{tag}-{name}", prompt, sampling, time.monotonic())

    return {
        0: [request("repeat", repeat), request("plain", other, max_tokens=16)],
        1: [request("sampled", other, temperature=0.8, seed=5, max_tokens=16)],
        3: [request("again", repeat), request("late", encode("Count: 1 2 3 1 2 3 1 2 3", True))],
    }


def test_greedy_output_is_unchanged_by_speculation_and_no_block_leaks(core: TorchEngineCore) -> None:
    speculator = core.speculator
    assert speculator is not None
    core.speculator = None
    try:
        want = _run(core, _requests(core, "plain"))
    finally:
        core.speculator = speculator
    core.pool.reset_cache()
    preemptions, hits = core.scheduler.num_preemptions, core.kv.prefix_hits
    got = _run(core, _requests(core, "spec"))
    for name in ("repeat", "plain", "again", "late"):
        assert got[f"spec-{name}"] == want[f"plain-{name}"], name
    assert len(got["spec-sampled"]) == 16
    counts = speculator.counts
    assert counts.num_accepted_tokens > 20, counts  # it did speculate, and was right often
    assert core.scheduler.num_preemptions > preemptions  # across preemption ...
    assert core.kv.prefix_hits > hits  # ... and prefix-cache hits
    # Rollback: every block is back, and each published block holds exactly the tokens its hash
    # names along some request's final tokens (no rejected token was published).
    pool = core.pool
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks
    size = core.kv.block_size
    valid = set()
    for name, generated in got.items():
        prompt = next(r for rs in _requests(core, "spec").values() for r in rs if r.request_id == name)
        sequence = [*prompt.prompt_token_ids, *generated]
        parent = root_hash(None)
        for i in range(len(sequence) // size):
            # Blocks holding output tokens are tagged where prompt rows run dense (prompt_rows).
            output = core.runner.dense_prompts and (i + 1) * size > len(prompt.prompt_token_ids)
            parent = hash_block(parent, sequence[i * size : (i + 1) * size], OUTPUT_TAG if output else b"")
            valid.add(parent)
    published = {block.block_hash for block in pool.blocks if block.block_hash is not None}
    assert published and published <= valid
    stats = core.stats()
    assert stats.spec_accepted_tokens == counts.num_accepted_tokens
    assert sum(stats.spec_accepted_per_position) == counts.num_accepted_tokens
    choice = next(p for p in core.info.paths if p.name == "speculative_decoding")
    assert choice.used and "ngram" in choice.reason


def test_start_up_times_steps_by_rows_and_leaves_nothing_behind(core: TorchEngineCore) -> None:
    """The warm-up timed a lone request's steps verifying 0..4 drafts (the config's 4): the costs
    the draft count is chosen by, shown in /v1/metadata; its request left no block or count."""
    speculator = core.speculator
    assert speculator is not None and speculator.lengths is not None and speculator.calibrating is None
    costs = speculator.lengths.row_costs
    assert len(costs) == 5 and costs[0] == 1.0
    assert list(costs) == sorted(costs)
    choice = next(p for p in core.info.paths if p.name == "speculative_decoding")
    assert "timed at start" in choice.reason and f"{costs[-1]:.2f}" in choice.reason
    if not core.has_work():
        core.pool.check_invariants()
        assert core.pool.num_free == core.pool.num_blocks


def test_a_context_too_short_to_time_steps_keeps_the_configured_count() -> None:
    settings = load_settings(num_threads=1, max_model_len=24, kv_cache_max_tokens=64, speculative_config=SPEC)
    short = build_core(config_for(settings))
    short.start(lambda: None, lambda error: None)
    try:
        assert short.speculator is not None and short.speculator.lengths is None
        assert short.pool.num_free == short.pool.num_blocks
    finally:
        short.shutdown()
