"""The TensorRT-LLM adapter (service/engine/trtllm) against the test double in tests/fakes.

In process: the LLM arguments the profile and settings become, for each backend (the double
accepts exactly the fields recorded from the real argument classes), start-up refusals, the
sampling mapping field by field and what each release's sampler would ignore (refused), streaming
deltas and finish reasons, logprobs as the real sampler returns them (top-k only, a stop token
trimmed from the ids but not the logprobs), abort, a failed request or an unmappable output next
to a dead executor, stats from the first request on, and the built-engine cache (build, reuse,
rebuild on a version change or a corrupt slot, one build for concurrent starts). Over HTTP, with
the double installed as tensorrt_llm and a simulated H100: list-model-profiles shows the
tensorrt_llm profile runnable and selected and states what its release honours, and the server
serves completions and chat through the adapter with the official client.

The double plays tensorrt_llm 1.2.1 unless a test sets TRTLLM_DOUBLE_VERSION (`double_release`).

What only the double has checked (no GPU and no tensorrt_llm here): see the README's TensorRT-LLM
section.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from service.engine.config import EngineConfig, UnsupportedConfigError
from service.engine.protocol import GenerationRequest, GuidedDecoding, RequestRefusedError, SamplingParams
from tests.conftest import start_server, wait_ready
from tests.test_cli import run_cli
from tests.test_quantization import _byte_level_tokenizer
from tests.test_tensor_parallel import _checkpoint

FAKES = Path(__file__).parent / "fakes"
SYSTEMS = Path(__file__).parent / "systems"
NAME = "tiny-trt"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("trt") / NAME
    _checkpoint(directory, vocab_size=256, max_position_embeddings=512)
    _byte_level_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return directory


def _forget_double() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The double importable as tensorrt_llm; yields the file it records its constructions in."""
    _forget_double()
    monkeypatch.syspath_prepend(str(FAKES))
    record = tmp_path / "double.jsonl"
    monkeypatch.setenv("TRTLLM_DOUBLE_LOG", str(record))
    yield record
    _forget_double()


@pytest.fixture
def double_release(double: Path, monkeypatch: pytest.MonkeyPatch):
    """Have the double play another tensorrt_llm release (call it before importing tensorrt_llm)."""

    def play(version: str) -> None:
        _forget_double()
        monkeypatch.setenv("TRTLLM_DOUBLE_VERSION", version)

    return play


def _config(checkpoint: Path, tmp_path: Path, **changes: object) -> EngineConfig:
    from service.config_loading import load_settings
    from service.selection.planning import make_plan, model_source
    from service.serving import engine_config

    settings = load_settings(model_name=str(checkpoint), cache_path=str(tmp_path / "cache"))
    plan = make_plan(settings)
    base = engine_config(settings, plan, model_source(plan, settings))
    return replace(base, engine="tensorrt_llm", precision="bf16", dtype="bfloat16", **changes)  # type: ignore[arg-type]


def _encode(checkpoint: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(text).ids


def _request(prompt: list[int], request_id: str = "r", **sampling: object) -> GenerationRequest:
    params = SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **sampling})  # type: ignore[arg-type]
    return GenerationRequest(request_id, prompt, params)


# --- configuration ---------------------------------------------------------------------------------


def test_the_profile_and_settings_become_llm_arguments_the_api_accepts(
    double: Path, checkpoint: Path, tmp_path: Path
) -> None:
    from service.engine.trtllm.api import import_api
    from service.engine.trtllm.loading import llm_kwargs, load

    config = _config(checkpoint, tmp_path, max_model_len=256)
    kwargs = llm_kwargs(config, import_api())
    assert kwargs["trust_remote_code"] is False and kwargs["enable_iter_perf_stats"] is True
    assert kwargs["max_seq_len"] == 256 and kwargs["enable_chunked_prefill"] is True
    assert kwargs["kv_cache_config"].enable_block_reuse == config.kv_cache.enable_prefix_caching
    # NIM_KV_BLOCK_SIZE is TensorRT-LLM's tokens_per_block, and what the engine reports
    assert kwargs["kv_cache_config"].tokens_per_block == config.kv_cache.block_size == 16
    loaded = load(config)
    assert loaded.info.kv_block_size == 16
    llm = asyncio.run(_start_stop(loaded.engine))
    [constructed] = [json.loads(line) for line in double.read_text().splitlines()]
    assert constructed["constructed"] == "LLM" and constructed["model"] == str(checkpoint)
    assert constructed["max_batch_size"] == config.scheduler.max_num_seqs
    assert loaded.info.engine == "tensorrt_llm" and not loaded.info.features.prompt_logprobs
    # no request ran: its iteration stats were never polled (TensorRT-LLM warns on each poll then)
    assert llm.stats_polls_before_first_request == 0


async def _start_stop(engine):
    await engine.start()
    llm = engine.llm
    await engine.stop()
    return llm


def test_the_double_refuses_arguments_the_real_llm_refuses(double: Path, checkpoint: Path) -> None:
    import tensorrt_llm
    import tensorrt_llm.llmapi

    with pytest.raises(ValueError, match="LLM got invalid argument: max_num_seqs"):
        tensorrt_llm.LLM(str(checkpoint), max_num_seqs=4)
    with pytest.raises(ValueError, match="specific to TensorRT backend"):
        tensorrt_llm.LLM(str(checkpoint), build_config=None)
    with pytest.raises(ValueError, match="does not exist"):
        tensorrt_llm.llmapi.LoRARequest("a", 1, str(checkpoint / "missing"))
    # derived from the recorded field lists: a TorchLlmArgs field the adapter never passes is taken
    assert tensorrt_llm.LLM(str(checkpoint), print_iter_log=True).args["print_iter_log"] is True


def test_the_built_engine_llm_refuses_pytorch_only_arguments(double: Path, checkpoint: Path) -> None:
    """As the real _tensorrt_engine.LLM: its TrtLlmArgs has no PyTorch-backend fields."""
    from tensorrt_llm._tensorrt_engine import LLM

    for pytorch_only in ("enable_iter_perf_stats", "cuda_graph_config", "sampler_type"):
        with pytest.raises(ValueError, match=f"LLM got invalid argument: {pytorch_only}"):
            LLM(str(checkpoint), **{pytorch_only: None})


def test_the_built_engine_path_passes_only_what_that_backend_accepts(
    double: Path, checkpoint: Path, tmp_path: Path
) -> None:
    from service.engine.trtllm.api import import_api
    from service.engine.trtllm.engine_cache import load_or_build
    from service.engine.trtllm.loading import engine_kwargs, load

    api = import_api()
    config = _config(
        checkpoint, tmp_path, build_engine=True, engine_cache_dir=tmp_path / "slot", enforce_eager=True
    )
    kwargs = engine_kwargs(config, api)
    assert set(kwargs) <= {"tensor_parallel_size", "pipeline_parallel_size", "dtype", "trust_remote_code",
                           "kv_cache_config", "guided_decoding_backend"}  # fmt: skip
    assert kwargs["kv_cache_config"].dtype == "auto"  # the TensorRT backend takes no other
    assert kwargs["kv_cache_config"].tokens_per_block == config.kv_cache.block_size
    built = load_or_build(api, config, kwargs)  # the double refuses PyTorch-only arguments here
    assert (
        built.built and "enable_iter_perf_stats" not in built.args and "cuda_graph_config" not in built.args
    )
    assert built.args["build_config"].max_batch_size == config.scheduler.max_num_seqs
    assert not load_or_build(api, config, kwargs).built  # the saved engine loads with the same arguments
    loaded = load(config)
    assert not loaded.info.features.logprobs  # a built engine gathers no generation logits: 400


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lora": True}, "LoRA in a built engine"),
        ({"guided_decoding_backend": "llguidance"}, "xgrammar only"),
        ({"kv_cache": "fp8"}, "fp8 KV cache in a built engine"),
    ],
)
def test_a_built_engine_refuses_what_it_was_not_built_for(
    double: Path, checkpoint: Path, tmp_path: Path, changes: dict, message: str
) -> None:
    from service.engine.config import LoraConfig
    from service.engine.trtllm.loading import load

    config = _config(checkpoint, tmp_path, build_engine=True, engine_cache_dir=tmp_path / "slot")
    if "lora" in changes:
        changes = {"lora": LoraConfig.with_defaults(tmp_path)}
    if "kv_cache" in changes:
        changes = {"kv_cache": replace(config.kv_cache, dtype=changes["kv_cache"])}
    with pytest.raises(UnsupportedConfigError, match=message) as refused:
        load(replace(config, **changes))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kv_cache": "int8"}, "NIM_KV_CACHE_DTYPE=int8"),
        ({"num_threads": 2}, "NIM_NUM_THREADS applies to the torch engine"),
        ({"fp8_rows_kernel": False}, "NIM_FP8_SCALED_MM applies to the torch engine"),
        ({"dense_prompt_rows": False}, "NIM_DENSE_PROMPT_ROWS applies to the torch engine"),
        ({"w8a8_logits": False}, "NIM_COMPACT_LOGITS applies to the torch engine"),
        ({"w4a8_int4": False}, "NIM_CPU_INT4_KERNEL applies to the torch engine"),
        ({"cpu_fused_ops": False}, "NIM_CPU_FUSED_OPS applies to the torch engine"),
        ({"device": "cpu"}, "runs on NVIDIA GPUs only"),
        ({"model_format": "gguf"}, "not GGUF files"),
        ({"kv_block_size": 48}, "NIM_KV_BLOCK_SIZE=48: .* power of two"),
    ],
)
def test_settings_tensorrt_llm_cannot_honour_are_refused_at_start(
    double: Path, checkpoint: Path, tmp_path: Path, changes: dict, message: str
) -> None:
    from service.engine.trtllm import load

    config = _config(checkpoint, tmp_path)
    if "kv_cache" in changes:
        changes = {"kv_cache": replace(config.kv_cache, dtype=changes["kv_cache"])}
    if "kv_block_size" in changes:
        changes = {"kv_cache": replace(config.kv_cache, block_size=changes["kv_block_size"])}
    with pytest.raises(UnsupportedConfigError, match=message) as refused:
        load(replace(config, **changes))
    assert "\n" not in str(refused.value)


def test_sampling_fields_map_one_by_one(double: Path) -> None:
    from service.engine.trtllm.api import import_api
    from service.engine.trtllm.release import release
    from service.engine.trtllm.sampling import to_trtllm as mapped

    api = import_api()

    def to_trtllm(api, params, vocab_size):  # as the 1.2 release takes them
        return mapped(api, params, vocab_size, release(api.version))

    greedy = to_trtllm(api, SamplingParams(max_tokens=5, temperature=0.0, top_p=0.5), 256)
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, None, None)
    assert (greedy.max_tokens, greedy.n) == (5, 1)
    sampled = to_trtllm(
        api,
        SamplingParams(
            max_tokens=9, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
            presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: 5.0}, seed=3, stop=("END",),
            stop_token_ids=(9,), include_stop_str_in_output=True, ignore_eos=True, min_tokens=2,
            logprobs=3, skip_special_tokens=False,
        ),
        256,
    )  # fmt: skip
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.min_p) == (0.7, 0.9, 40, 0.05)
    assert (sampled.repetition_penalty, sampled.presence_penalty) == (1.1, 0.5)
    assert sampled.frequency_penalty == 0.25
    assert sampled.embedding_bias.shape == (256,) and float(sampled.embedding_bias[7]) == 5.0
    assert (sampled.seed, sampled.stop, sampled.stop_token_ids) == (3, ["END"], [9])
    assert sampled.include_stop_str_in_output and sampled.ignore_eos and sampled.min_tokens == 2
    assert sampled.logprobs == 3 and sampled.skip_special_tokens is False
    # our top_k 0 / min_p 0 / penalties at 1 and 0 mean "off": left unset, as TensorRT-LLM expects
    plain = to_trtllm(api, SamplingParams(max_tokens=1), 256)
    assert plain.top_k is plain.min_p is plain.repetition_penalty is plain.presence_penalty is None
    assert to_trtllm(api, SamplingParams(max_tokens=1, logprobs=0), 256).logprobs == 1

    # structured output: GuidedDecodingParams, one guide each
    def guide(kind: str, spec: str = "") -> object:
        return to_trtllm(
            api, SamplingParams(max_tokens=1, guided=GuidedDecoding(kind, spec)), 256
        ).guided_decoding

    assert guide("json_schema", '{"type": "object"}').json == '{"type": "object"}'
    assert guide("choice", '["a", "b"]').grammar == 'root ::= "a" | "b"'
    assert guide("json_object").json_object and guide("regex", "a+").regex == "a+"


# --- serving in process ------------------------------------------------------------------------------


def _engine(checkpoint: Path, tmp_path: Path, **changes: object):
    from service.engine.trtllm import load

    return load(_config(checkpoint, tmp_path, **changes)).engine


def test_streaming_deltas_finish_reasons_and_logprobs(double: Path, checkpoint: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = _engine(checkpoint, tmp_path)
        await engine.start()
        try:
            prompt = [72, 105, 33]  # the double echoes the prompt cyclically
            outs = [o async for o in engine.generate(_request(prompt, max_tokens=7, logprobs=1))]
            assert [t for o in outs for t in o.token_ids] == (prompt * 3)[:7]
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert all(len(o.logprobs or []) == len(o.token_ids) for o in outs)
            assert outs[-1].num_generated_tokens == 7 and outs[0].num_prompt_tokens == 3
            stopped = [o async for o in engine.generate(_request(prompt, "s", stop_token_ids=(33,)))]
            assert [t for o in stopped for t in o.token_ids] == [72, 105]
            assert stopped[-1].finish_reason == "stop"
            # a client that leaves: closing the generator aborts the request in TensorRT-LLM
            stream = engine.generate(_request(prompt, "gone", max_tokens=400))
            await stream.__anext__()
            handle = engine._handles["gone"]
            await stream.aclose()
            assert handle.aborted() and "gone" not in engine._handles
            # an abort from the server side ends the stream with finish reason abort
            stream = engine.generate(_request(prompt, "cut", max_tokens=400))
            first = await stream.__anext__()
            engine.abort("cut")
            rest = [o async for o in stream]
            assert not first.finished and rest[-1].finish_reason == "abort"
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_a_failed_request_ends_alone_and_a_failed_executor_kills_the_engine(
    double: Path, checkpoint: Path, tmp_path: Path
) -> None:
    from service.engine.protocol import EngineDeadError

    async def scenario() -> None:
        died: list[BaseException] = []
        engine = _engine(checkpoint, tmp_path)
        engine.on_fatal = died.append
        await engine.start()
        fail = _encode(checkpoint, "<<fail>>")  # the double fails requests whose prompt says so
        outs = [o async for o in engine.generate(_request(fail))]
        assert outs[-1].error is not None and "simulated executor error" in outs[-1].error
        assert engine.ready and not died
        ok = [o async for o in engine.generate(_request([65, 66]))]
        assert ok[-1].finish_reason == "length"
        # the executor going away: the engine is dead, says why, and refuses new requests
        engine.llm.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            [o async for o in engine.generate(_request([65]))]
        assert not engine.ready and died and "shutting down" in (engine.failure or "")
        await engine.stop()

    asyncio.run(scenario())


def test_stats_follow_iterations_and_idle_reads_zero(double: Path, checkpoint: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = _engine(checkpoint, tmp_path)
        await engine.start()
        stream = engine.generate(_request([65, 66], "long", max_tokens=400))
        await stream.__anext__()
        await asyncio.sleep(0.2)
        busy = engine.stats()
        assert busy.num_running == 1 and busy.kv_blocks_total == 1000 and busy.num_steps > 0
        await stream.aclose()
        idle = engine.stats()
        assert idle.num_running == 0 and idle.kv_blocks_used == 0
        await engine.stop()

    asyncio.run(scenario())


def test_parameters_tensorrt_llm_refuses_are_a_request_error(
    double: Path, checkpoint: Path, tmp_path: Path
) -> None:
    engine = _engine(checkpoint, tmp_path)
    with pytest.raises(RequestRefusedError, match="prompt logprobs"):
        asyncio.run(engine.check(_request([65], prompt_logprobs=1)))
    with pytest.raises(RequestRefusedError, match="serves none"):
        asyncio.run(engine.check(replace(_request([65]), adapter="x")))


# --- what each release's sampler honours ------------------------------------------------------------


def test_the_release_decides_what_is_refused() -> None:
    from service.engine.trtllm.release import release

    old = release("1.2.1")
    assert old.ignored == ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "seed")
    assert not old.sampled_logprob
    assert release("1.3.0rc23").ignored == old.ignored  # pre-releases before the TorchSampler fixes
    assert release("1.3.0rc24").ignored == ("min_p", "seed")
    newer = release("1.3.0rc26")
    assert newer.ignored == ("seed",) and newer.sampled_logprob
    assert release("1.3.0").ignored == ("seed",) and release("1.4.0rc1").sampled_logprob
    assert release("unknown").ignored == old.ignored  # unreadable: the oldest behaviour
    assert release("1.2.1", built_engine=True).ignored == ()  # the C++ executor samples
    line = old.statement()
    assert line.startswith("tensorrt_llm 1.2.1: its sampler ignores repetition_penalty") and "\n" not in line


def test_the_installed_version_is_read_without_importing_tensorrt_llm(double: Path) -> None:
    from service.engine.trtllm.release import installed_version

    assert installed_version() == "1.2.1"  # the double's version.py
    assert "tensorrt_llm" not in sys.modules


@pytest.mark.parametrize(
    ("version", "field", "value", "refused"),
    [
        ("1.2.1", "presence_penalty", 0.5, True),
        ("1.2.1", "repetition_penalty", 1.2, True),
        ("1.2.1", "frequency_penalty", -0.5, True),
        ("1.2.1", "min_p", 0.1, True),
        ("1.2.1", "seed", 7, True),
        ("1.3.0rc26", "presence_penalty", 0.5, False),
        ("1.3.0rc26", "repetition_penalty", 1.2, False),
        ("1.3.0rc26", "min_p", 0.1, False),
        ("1.3.0rc26", "seed", 7, True),
    ],
)
def test_penalties_min_p_and_seed_are_refused_where_the_release_ignores_them(
    double_release, checkpoint: Path, tmp_path: Path, version: str, field: str, value: object, refused: bool
) -> None:
    double_release(version)
    engine = _engine(checkpoint, tmp_path)
    request = _request([65, 66], temperature=0.7, **{field: value})
    if refused:
        with pytest.raises(
            RequestRefusedError, match=re.escape(f"{field} is not applied by tensorrt_llm {version}")
        ):
            asyncio.run(engine.check(request))
        return
    asyncio.run(engine.check(request))
    assert getattr(engine._sampling(request), field) == value  # passed to TensorRT-LLM as asked


def test_greedy_requests_need_neither_min_p_nor_a_seed(
    double: Path, checkpoint: Path, tmp_path: Path
) -> None:
    engine = _engine(checkpoint, tmp_path)
    asyncio.run(engine.check(_request([65], temperature=0.0, seed=7, min_p=0.2)))


def test_sampled_logprobs_follow_the_release(double_release, checkpoint: Path, tmp_path: Path) -> None:
    """1.2's sampler returns the top k only, without the sampled token at some positions: the
    request is refused with a 400 before it starts. From 1.3.0rc26 the sampled token is always
    there, and the sampled token alone is logprobs=0."""
    double_release("1.2.1")
    engine = _engine(checkpoint, tmp_path)
    with pytest.raises(
        RequestRefusedError, match=re.escape("logprobs with temperature > 0: tensorrt_llm 1.2.1")
    ):
        asyncio.run(engine.check(_request([65], temperature=0.8, logprobs=2)))

    double_release("1.3.0rc26")
    engine = _engine(checkpoint, tmp_path)
    assert engine._sampling(_request([65], temperature=0.8, logprobs=0)).logprobs == 0

    async def scenario() -> None:
        await engine.start()
        prompt = [72, 105, 33, 64]
        outs = [o async for o in engine.generate(_request(prompt, temperature=0.8, logprobs=2, max_tokens=6))]
        await engine.stop()
        assert outs[-1].finish_reason == "length" and all(o.error is None for o in outs)
        entries = [e for o in outs for e in o.logprobs or []]
        assert [e.token_id for e in entries] == (prompt * 2)[:6]
        assert [e.rank for e in entries] == [1, 3, 1, 3, 1, 3]  # odd positions: below the top 2
        assert all(len(e.top) == 2 for e in entries) and entries[1].top[0][0] != entries[1].token_id

    asyncio.run(scenario())


def test_a_position_without_the_sampled_token_fails_that_request_alone(
    double: Path, checkpoint: Path, tmp_path: Path
) -> None:
    """The mapping is total: were a release to return the top k without the sampled token (as 1.2
    does when sampling), the request ends with an error frame and the engine serves on."""
    engine = _engine(checkpoint, tmp_path)
    engine.sampler = replace(engine.sampler, sampled_logprob=True)  # as if 1.2 included it

    async def scenario() -> None:
        await engine.start()
        outs = [o async for o in engine.generate(_request([72, 105], temperature=0.8, logprobs=1))]
        assert outs[-1].finished and "no logprob for the sampled token 105 at position 1" in (
            outs[-1].error or ""
        )
        assert engine.ready and engine.failure is None
        ok = [o async for o in engine.generate(_request([72, 105], "next", logprobs=1))]
        assert ok[-1].finish_reason == "length"
        await engine.stop()

    asyncio.run(scenario())


def test_logprobs_with_a_stop_token_finish(double: Path, checkpoint: Path, tmp_path: Path) -> None:
    """TensorRT-LLM trims the stop token from token_ids but not from logprobs: the delta pairs
    tokens with their logprobs by position, and the request ends normally."""
    engine = _engine(checkpoint, tmp_path)

    async def scenario() -> None:
        await engine.start()
        prompt = [72, 105, 33]
        outs = [o async for o in engine.generate(_request(prompt, logprobs=1, stop_token_ids=(33,)))]
        assert outs[-1].finish_reason == "stop" and outs[-1].error is None
        assert [t for o in outs for t in o.token_ids] == [72, 105]
        assert [e.token_id for o in outs for e in o.logprobs or []] == [72, 105]
        handle_logprobs = len(engine.llm._running[-1].outputs[0].logprobs)
        assert handle_logprobs == 3  # the double, as the real one, kept the stop token's logprob
        assert engine.ready
        await engine.stop()

    asyncio.run(scenario())


def test_logprobs_are_paired_with_tokens_by_position(double: Path, checkpoint: Path, tmp_path: Path) -> None:
    """Cumulative logprobs longer than the ids (a trimmed stop token), bare floats (the C++
    executor's), and a release that would hand only each step's: all map, one per token."""
    from types import SimpleNamespace

    from service.engine.trtllm.engine import _Handed

    engine = _engine(checkpoint, tmp_path)
    request = _request([1], logprobs=0)

    def step(ids, text, logprobs, diff=None, finished=False):
        completion = SimpleNamespace(token_ids=ids, text=text, logprobs=logprobs, logprobs_diff=diff,
                                     finish_reason="stop" if finished else None)  # fmt: skip
        return SimpleNamespace(outputs=[completion], finished=finished)

    handed = _Handed()
    first = engine._delta(request, step([5, 6], "ab", [-0.5, -1.0]), handed)
    last = engine._delta(request, step([5, 6, 7], "abc", [-0.5, -1.0, -2.0, -3.0], finished=True), handed)
    assert [e.logprob for e in (first.logprobs or []) + (last.logprobs or [])] == [-0.5, -1.0, -2.0]
    assert last.token_ids == [7] and last.text == "c" and last.finish_reason == "stop"
    handed = _Handed(tokens=2, text=2)
    per_step = engine._delta(request, step([5, 6, 7], "abc", [-2.0], diff=[-2.0]), handed)
    assert [e.logprob for e in per_step.logprobs or []] == [-2.0]
    floor = engine._delta(request, step([8], "d", [float("-inf")]), _Handed())
    assert [e.logprob for e in floor.logprobs or []] == [
        -9999.0
    ]  # as trtllm-serve floors it: JSON has no -inf


def test_only_an_executor_failure_kills_the_engine(
    double: Path, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.engine.protocol import EngineDeadError
    from service.engine.trtllm import engine as engine_module

    async def scenario() -> None:
        died: list[BaseException] = []
        engine = _engine(checkpoint, tmp_path)
        engine.on_fatal = died.append
        await engine.start()
        # an exception while mapping one request's output: that request fails, alone
        real = engine_module.token_logprob
        monkeypatch.setattr(engine_module, "token_logprob", lambda *a: 1 / 0)
        outs = [o async for o in engine.generate(_request([65, 66], logprobs=1))]
        assert outs[-1].finished and "division by zero" in (outs[-1].error or "")
        assert engine.ready and not died
        monkeypatch.setattr(engine_module, "token_logprob", real)
        # the C++ executor failing: every request ends, the engine is dead and says why
        crash = _encode(checkpoint, "<<crash>>")
        outs = [o async for o in engine.generate(_request(crash))]
        assert "engine failure" in (outs[-1].error or "") and died and not engine.ready
        with pytest.raises(EngineDeadError, match="CppExecutorError"):
            [o async for o in engine.generate(_request([65]))]
        await engine.stop()

    asyncio.run(scenario())


def test_stats_are_polled_from_the_first_request_on(double: Path, checkpoint: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = _engine(checkpoint, tmp_path)
        await engine.start()
        await asyncio.sleep(0.1)
        assert engine._stats_task is None
        [o async for o in engine.generate(_request([65, 66]))]
        assert engine._stats_task is not None and engine.llm.stats_polls_before_first_request == 0
        await engine.stop()

    asyncio.run(scenario())


# --- built engines --------------------------------------------------------------------------------


def test_a_built_engine_is_cached_reused_and_rebuilt_when_stale(
    double: Path, checkpoint: Path, tmp_path: Path
) -> None:
    from service.engine.trtllm.api import import_api
    from service.engine.trtllm.engine_cache import MANIFEST, load_or_build
    from service.engine.trtllm.loading import engine_kwargs as llm_kwargs

    api = import_api()
    config = _config(checkpoint, tmp_path, build_engine=True, engine_cache_dir=tmp_path / "slot")
    kwargs = llm_kwargs(config, api)

    def builds() -> int:
        return sum('"built"' in line for line in double.read_text().splitlines())

    first = load_or_build(api, config, kwargs)
    assert first.built and builds() == 1 and (tmp_path / "slot" / MANIFEST).is_file()
    again = load_or_build(api, config, kwargs)
    assert not again.built and builds() == 1  # loaded from the slot
    manifest = json.loads((tmp_path / "slot" / MANIFEST).read_text())
    (tmp_path / "slot" / MANIFEST).write_text(json.dumps({**manifest, "tensorrt_llm": "1.1.0"}))
    assert load_or_build(api, config, kwargs).built and builds() == 2  # another version: rebuilt
    (tmp_path / "slot" / "engine" / "rank0.engine").unlink()
    assert load_or_build(api, config, kwargs).built and builds() == 3  # corrupt: rebuilt
    other = replace(config, max_model_len=128)
    assert load_or_build(api, other, llm_kwargs(other, api)).built and builds() == 4  # other settings
    # Starts racing for one slot: one builds, the others wait and reuse it.
    fresh = replace(config, engine_cache_dir=tmp_path / "race")
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(load_or_build(api, fresh, kwargs).built))
               for _ in range(3)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False, False, True] and builds() == 5


def test_a_build_where_tensorrt_llm_cannot_build_is_refused(
    double_release, checkpoint: Path, tmp_path: Path
) -> None:
    from service.engine.trtllm import load

    double_release("1.3.0rc26")  # no tensorrt_llm._tensorrt_engine
    config = _config(checkpoint, tmp_path, build_engine=True, engine_cache_dir=tmp_path / "slot")
    with pytest.raises(
        UnsupportedConfigError, match=re.escape("tensorrt_llm 1.3.0rc26 cannot build engines")
    ):
        load(config)


# --- over HTTP ----------------------------------------------------------------------------------------


def _with_double(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONPATH": f"{FAKES}", "NIM_SYSTEM_INFO": str(SYSTEMS / "h100x1.json")}


def test_list_model_profiles_shows_tensorrt_llm_profiles_runnable(checkpoint: Path) -> None:
    done = run_cli("list-model-profiles", "--explain", env=_with_double({"NIM_MODEL_NAME": str(checkpoint)}))
    assert done.returncode == 0, done.stderr
    runnable = done.stdout.split("Compatible with system and runnable:")[1].split("Compatible with")[0]
    selected = next(line for line in runnable.splitlines() if "(selected)" in line)
    assert "tensorrt_llm-generic-bf16-tp1-pp1-throughput" in selected
    # the selection states what the installed release's sampler honours, decided by its version
    why = done.stdout.split("SELECTION")[1].splitlines()[1]
    assert "tensorrt_llm 1.2.1: its sampler ignores repetition_penalty, presence_penalty" in why
    assert "logprobs at temperature 0 only" in why
    # Without tensorrt_llm the same system moves on to torch, and says so in one line.
    env = {"NIM_MODEL_NAME": str(checkpoint), "NIM_SYSTEM_INFO": str(SYSTEMS / "h100x1.json")}
    done = run_cli("list-model-profiles", "--explain", env=env)
    assert done.returncode == 0, done.stderr
    selection = done.stdout.split("SELECTION")[1]
    assert "selected torch-generic-" in selection
    assert (
        "tensorrt_llm-generic-bf16-tp1-pp1-throughput would run on this system, but tensorrt_llm is not "
        "installed in this image: serving with torch instead" in selection
    )


def test_the_server_serves_through_tensorrt_llm(checkpoint: Path, tmp_path: Path) -> None:
    env = _with_double({"NIM_MODEL_NAME": str(checkpoint), "NIM_CACHE_PATH": str(tmp_path / "cache")})
    server = start_server(tmp_path / "server.log", env, unset=("NIM_NUM_THREADS",))  # a torch setting
    try:
        wait_ready(server)
        meta = httpx.get(f"{server.base_url}/v1/metadata", timeout=10).json()
        assert meta["selectedProfile"]["name"] == "tensorrt_llm-generic-bf16-tp1-pp1-throughput"
        assert meta["selectedProfile"]["runtime"]["engine"] == "tensorrt_llm"
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model=NAME, prompt="Hello", max_tokens=7, temperature=0)
        assert out.choices[0].text == "HelloHe" and out.choices[0].finish_reason == "length"
        assert out.usage is not None and out.usage.completion_tokens == 7
        two = client.completions.create(model=NAME, prompt="abc", max_tokens=4, n=2, stop=["c"])
        assert [c.text for c in two.choices] == ["ab", "ab"]
        assert {c.finish_reason for c in two.choices} == {"stop"}
        chunks = list(
            client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "user: " and chunks[-1].choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="prompt logprobs"):
            client.completions.create(model=NAME, prompt="x", max_tokens=2, echo=True, logprobs=1)
        # what tensorrt_llm 1.2's sampler would ignore is a 400 naming the field and the release
        with pytest.raises(
            openai.BadRequestError, match=r"presence_penalty is not applied by tensorrt_llm 1\.2\.1"
        ):
            client.completions.create(model=NAME, prompt="x", max_tokens=2, presence_penalty=0.5)
        with pytest.raises(openai.BadRequestError, match="logprobs with temperature > 0"):
            client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0.8, logprobs=1)
        assert "tensorrt_llm 1.2.1: its sampler ignores" in meta["selectedProfile"]["selection"][0]
        # logprobs with a stop-token finish: one per token, the request ends normally
        stopped = client.completions.create(
            model=NAME,
            prompt="Hello",
            max_tokens=6,
            temperature=0,
            logprobs=1,
            extra_body={"stop_token_ids": _encode(checkpoint, "l")},
        )
        assert stopped.choices[0].text == "He" and stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].logprobs is not None and stopped.choices[0].logprobs.tokens == ["H", "e"]
        metrics = httpx.get(f"{server.base_url}/v1/metrics", timeout=10).text
        assert 'vllm:num_requests_running{model_name="tiny-trt"}' in metrics
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.trtllm
@pytest.mark.gpu
def test_the_real_tensorrt_llm_serves_a_small_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    """Where tensorrt_llm really imports (the gpu image on a GPU): the same checkpoint end to end,
    without the double. Skipped elsewhere, saying why."""
    env = {"NIM_MODEL_NAME": str(checkpoint), "NIM_CACHE_PATH": str(tmp_path / "cache")}
    server = start_server(tmp_path / "server.log", env, unset=("NIM_NUM_THREADS",))
    try:
        wait_ready(server)
        meta = httpx.get(f"{server.base_url}/v1/metadata", timeout=10).json()
        assert meta["selectedProfile"]["runtime"]["engine"] == "tensorrt_llm"
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        # ignore_eos: the random model's eos (byte "#") is within a nat of its greedy token
        no_eos = {"ignore_eos": True}
        out = client.completions.create(
            model=NAME, prompt="Hello", max_tokens=8, temperature=0, extra_body=no_eos
        )
        assert out.usage is not None and out.usage.completion_tokens == 8
        assert out.choices[0].finish_reason == "length"
        streamed = client.completions.create(
            model=NAME, prompt="Hello", max_tokens=8, temperature=0, stream=True, extra_body=no_eos
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
        _real_logprobs_and_penalties(client, checkpoint)
    finally:
        assert server.stop() == 0, server.log()


def _real_logprobs_and_penalties(client: openai.OpenAI, checkpoint: Path) -> None:
    """What the installed release honours works, and what it would ignore is a 400 naming it."""
    from service.engine.trtllm.release import installed_version, release

    version = installed_version()
    assert version is not None
    honours = release(version)
    # logprobs while sampling: one per token where the release returns the sampled token's
    if honours.sampled_logprob:
        sampled = client.completions.create(
            model=NAME, prompt="Hello", max_tokens=8, temperature=0.8, logprobs=2
        )
        lp = sampled.choices[0].logprobs
        assert lp is not None and sampled.usage is not None
        assert len(lp.token_logprobs or []) == sampled.usage.completion_tokens
    else:
        with pytest.raises(openai.BadRequestError, match=re.escape(f"tensorrt_llm {version}")):
            client.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0.8, logprobs=2)
    # a stop-token finish with logprobs: TensorRT-LLM trims the stop token from the ids only
    greedy = client.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0, logprobs=1)
    assert greedy.choices[0].logprobs is not None
    ids = _encode(checkpoint, greedy.choices[0].text)
    if len(ids) >= 3:
        stop_id = ids[2]
        stopped = client.completions.create(
            model=NAME, prompt="Hello", max_tokens=8, temperature=0, logprobs=1,
            extra_body={"stop_token_ids": [stop_id]},
        )  # fmt: skip
        choice = stopped.choices[0]
        assert choice.finish_reason == "stop" and choice.logprobs is not None
        assert len(choice.logprobs.tokens or []) == len(choice.logprobs.token_logprobs or [])
        assert stopped.usage is not None and stopped.usage.completion_tokens <= 3
    # a penalty: applied where the release's sampler applies it, else refused naming it
    if "presence_penalty" in honours.ignored:
        with pytest.raises(openai.BadRequestError, match="presence_penalty"):
            client.completions.create(model=NAME, prompt="Hello", max_tokens=4, presence_penalty=1.0)
    else:
        penalised = client.completions.create(
            model=NAME, prompt="Hello", max_tokens=4, temperature=0, presence_penalty=1.0
        )
        assert penalised.choices[0].finish_reason in ("stop", "length")
