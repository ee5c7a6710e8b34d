"""The TensorRT-LLM adapter (service/engine/trtllm) against the test double in tests/fakes.

In process: the LLM arguments the profile and settings become (the double refuses unknown ones as
the real constructor does), start-up refusals, the sampling mapping field by field, streaming
deltas and finish reasons, abort, a failed request next to a dead engine, stats, and the
built-engine cache (build, reuse, rebuild on a version change or a corrupt slot, one build for
concurrent starts). Over HTTP, with the double installed as tensorrt_llm and a simulated H100:
list-model-profiles shows the tensorrt_llm profile runnable and selected, and the server serves
completions and chat through the adapter with the official client.

What only the double has checked (no GPU and no tensorrt_llm here): see the README's TensorRT-LLM
section.
"""

from __future__ import annotations

import asyncio
import json
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


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The double importable as tensorrt_llm; yields the file it records its constructions in."""
    monkeypatch.syspath_prepend(str(FAKES))
    record = tmp_path / "double.jsonl"
    monkeypatch.setenv("TRTLLM_DOUBLE_LOG", str(record))
    yield record
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


def _config(checkpoint: Path, tmp_path: Path, **changes: object) -> EngineConfig:
    from service.config import load_settings
    from service.planning import make_plan, model_source
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
    from service.engine.trtllm import llm_kwargs, load
    from service.engine.trtllm.api import import_api

    config = _config(checkpoint, tmp_path, max_model_len=256)
    kwargs = llm_kwargs(config, import_api())
    assert kwargs["trust_remote_code"] is False and kwargs["enable_iter_perf_stats"] is True
    assert kwargs["max_seq_len"] == 256 and kwargs["enable_chunked_prefill"] is True
    assert kwargs["kv_cache_config"].enable_block_reuse == config.kv_cache.enable_prefix_caching
    loaded = load(config)
    asyncio.run(_start_stop(loaded.engine))
    [constructed] = [json.loads(line) for line in double.read_text().splitlines()]
    assert constructed["constructed"] == "LLM" and constructed["model"] == str(checkpoint)
    assert constructed["max_batch_size"] == config.scheduler.max_num_seqs
    assert loaded.info.engine == "tensorrt_llm" and not loaded.info.features.prompt_logprobs


async def _start_stop(engine) -> None:
    await engine.start()
    await engine.stop()


def test_the_double_refuses_arguments_the_real_llm_refuses(double: Path, checkpoint: Path) -> None:
    import tensorrt_llm
    import tensorrt_llm.llmapi

    with pytest.raises(ValueError, match="LLM got invalid argument: max_num_seqs"):
        tensorrt_llm.LLM(str(checkpoint), max_num_seqs=4)
    with pytest.raises(ValueError, match="specific to TensorRT backend"):
        tensorrt_llm.LLM(str(checkpoint), build_config=None)
    with pytest.raises(ValueError, match="does not exist"):
        tensorrt_llm.llmapi.LoRARequest("a", 1, str(checkpoint / "missing"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kv_cache": "int8"}, "NIM_KV_CACHE_DTYPE=int8"),
        ({"num_threads": 2}, "NIM_NUM_THREADS applies to the torch engine"),
        ({"device": "cpu"}, "runs on NVIDIA GPUs only"),
        ({"model_format": "gguf"}, "not GGUF files"),
    ],
)
def test_settings_tensorrt_llm_cannot_honour_are_refused_at_start(
    double: Path, checkpoint: Path, tmp_path: Path, changes: dict, message: str
) -> None:
    from service.engine.trtllm import load

    config = _config(checkpoint, tmp_path)
    if "kv_cache" in changes:
        changes = {"kv_cache": replace(config.kv_cache, dtype=changes["kv_cache"])}
    with pytest.raises(UnsupportedConfigError, match=message) as refused:
        load(replace(config, **changes))
    assert "\n" not in str(refused.value)


def test_sampling_fields_map_one_by_one(double: Path) -> None:
    from service.engine.trtllm.api import import_api
    from service.engine.trtllm.sampling import to_trtllm

    api = import_api()
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


def _engine(checkpoint: Path, tmp_path: Path):
    from service.engine.trtllm import load

    return load(_config(checkpoint, tmp_path)).engine


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


# --- built engines --------------------------------------------------------------------------------


def test_a_built_engine_is_cached_reused_and_rebuilt_when_stale(
    double: Path, checkpoint: Path, tmp_path: Path
) -> None:
    from service.engine.trtllm import llm_kwargs
    from service.engine.trtllm.api import import_api
    from service.engine.trtllm.engine_cache import MANIFEST, load_or_build

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
    double: Path, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tensorrt_llm._tensorrt_engine as engine_module  # the double's

    from service.engine.trtllm import load

    monkeypatch.delattr(engine_module, "LLM")  # as on tensorrt_llm 1.3 and later
    config = _config(checkpoint, tmp_path, build_engine=True, engine_cache_dir=tmp_path / "slot")
    with pytest.raises(UnsupportedConfigError, match="cannot build engines"):
        load(config)


# --- over HTTP ----------------------------------------------------------------------------------------


def _with_double(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONPATH": f"{FAKES}", "NIM_SYSTEM_INFO": str(SYSTEMS / "h100x1.json")}


def test_list_model_profiles_shows_tensorrt_llm_profiles_runnable(checkpoint: Path) -> None:
    done = run_cli("list-model-profiles", env=_with_double({"NIM_MODEL_NAME": str(checkpoint)}))
    assert done.returncode == 0, done.stderr
    runnable = done.stdout.split("Compatible with system and runnable:")[1].split("Compatible with")[0]
    selected = next(line for line in runnable.splitlines() if "(selected)" in line)
    assert "tensorrt_llm-generic-bf16-tp1-pp1-throughput" in selected
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
        out = client.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 8
        assert out.choices[0].finish_reason == "length"
        streamed = client.completions.create(
            model=NAME, prompt="Hello", max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
    finally:
        assert server.stop() == 0, server.log()
