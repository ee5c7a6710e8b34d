"""The engine core in its own process (service.engine.process) on the embedded model: the same greedy
tokens as the engine in process, streamed deltas, aborts that reach the engine, stats that move,
refusals from the engine's check, outputs batched per step, and the ends: the engine process
killed mid-generation (requests fail, readiness fails, on_fatal fires, nothing is left), the API
process killed (the engine process leaves too), a refusal at load, and a real server whose engine
runs in its own process and whose step loop fails."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import httpx
import pytest

from service.config_loading import load_settings
from service.engine.config import EngineConfig, UnsupportedConfigError
from service.engine.guided.specs import xgrammar_available
from service.engine.process import ProcessEngine, load_in_process, wrap_in_process
from service.engine.protocol import (
    Engine,
    EngineDeadError,
    GenerationRequest,
    GuidedDecoding,
    RequestOutput,
    RequestRefusedError,
    SamplingParams,
)
from service.engine.torch.loading import build_engine
from service.serving import config_for
from service.text.tokenizer import Tokenizer
from tests.conftest import EMBEDDED_NAME, TEST_THREADS, ServerProcess, process_alive, start_server, wait_ready
from tests.test_engine_failure import DOOMED_PROMPT, FAULT

REPO = Path(__file__).resolve().parent.parent
SETTINGS: dict[str, object] = {
    "num_threads": TEST_THREADS,
    "max_model_len": 2048,
    "kv_cache_max_tokens": 8192,
    "max_num_batched_tokens": 256,
}
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village,",
]


def make_config(**overrides: object) -> EngineConfig:
    return config_for(load_settings(**{**SETTINGS, **overrides}))


# The engine process's OpenMP threads sleep rather than spin while they wait for each other: on this
# shared two-core machine spinning threads spend each other's time slices (a CPU step was 4-5x slower
# in the engine process, which owns exactly as many OpenMP threads as there are cores, than in the
# test's process, whose extra pools make GNU OpenMP throttle its spinning). Results do not change.
PASSIVE_OPENMP = {"OMP_WAIT_POLICY": "PASSIVE"}


def start_process_engine(fatal: list[BaseException] | None = None, **overrides: object) -> ProcessEngine:
    with mock.patch.dict(os.environ, PASSIVE_OPENMP):  # read by the spawned process as it starts
        loaded = load_in_process(make_config(**overrides), None if fatal is None else fatal.append)
    assert isinstance(loaded.engine, ProcessEngine)
    asyncio.run(loaded.engine.start())
    return loaded.engine


@pytest.fixture(scope="module")
def engine() -> Iterator[ProcessEngine]:
    engine = start_process_engine()
    yield engine
    asyncio.run(engine.stop())
    assert engine.child.exit_code == 0


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return make_config().load_tokenizer()


def request(rid: str, prompt: list[int], **params: object) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(**{"max_tokens": 16, "temperature": 0.0, **params}))


def run_all(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list[RequestOutput]]:
    async def one(request: GenerationRequest) -> list[RequestOutput]:
        return [out async for out in engine.generate(request)]

    async def run() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(one(r) for r in requests))

    return {r.request_id: outs for r, outs in zip(requests, asyncio.run(run()), strict=True)}


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (Linux /proc), but multiprocessing's resource tracker (one per
    process that spawns, shared, living as long as it)."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return {p for p in found if b"resource_tracker" not in _cmdline(p)}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_greedy_tokens_equal_the_engine_in_process(engine: ProcessEngine, tokenizer: Tokenizer) -> None:
    requests = [request(f"g{i}", tokenizer.encode(p), max_tokens=24) for i, p in enumerate(PROMPTS)]
    remote = run_all(engine, requests)
    local_engine = build_engine(make_config())
    asyncio.run(local_engine.start())
    try:
        local = run_all(local_engine, requests)
    finally:
        asyncio.run(local_engine.stop())
    for r in requests:
        assert tokens(remote[r.request_id]) == tokens(local[r.request_id]), r.request_id
        assert "".join(o.text for o in remote[r.request_id]) == "".join(o.text for o in local[r.request_id])
        assert remote[r.request_id][-1].finish_reason == local[r.request_id][-1].finish_reason


def test_outputs_stream_as_deltas_and_end_once(engine: ProcessEngine, tokenizer: Tokenizer) -> None:
    outputs = run_all(
        engine, [request("s", tokenizer.encode("Count: one, two,"), max_tokens=12, ignore_eos=True)]
    )
    stream = outputs["s"]
    assert len(stream) >= 6  # one delta a step, not one reply at the end
    assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
    assert stream[-1].finish_reason == "length" and stream[-1].num_generated_tokens == 12
    assert len(tokens(stream)) == 12
    assert all(o.first_scheduled_time is not None and o.time >= o.first_scheduled_time for o in stream)


def test_a_step_of_many_requests_travels_in_one_message(engine: ProcessEngine, tokenizer: Tokenizer) -> None:
    batches: list[int] = []
    deliver = engine._streams.deliver

    def counting(outputs: list[RequestOutput]) -> None:
        batches.append(len(outputs))
        deliver(outputs)

    engine._streams.deliver = counting  # type: ignore[method-assign]
    try:
        requests = [
            request(f"b{i}", tokenizer.encode(PROMPTS[i % 4]), max_tokens=8, ignore_eos=True)
            for i in range(8)
        ]
        run_all(engine, requests)
    finally:
        del engine._streams.deliver
    assert sum(batches) >= len(requests) * 8  # every token arrived
    assert max(batches) == len(requests)  # a decode step of all eight arrives as one message
    assert len(batches) < sum(batches) / 4


def test_closing_the_iterator_and_abort_reach_the_engine(engine: ProcessEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Tell me a very long story:")

    async def close_early() -> list[RequestOutput]:
        seen = []
        stream = engine.generate(request("closed", prompt, max_tokens=1000, ignore_eos=True))
        async for out in stream:
            seen.append(out)
            if len(seen) == 2:
                break
        await stream.aclose()
        return seen

    assert len(asyncio.run(close_early())) == 2
    wait_for(lambda: engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0)

    async def aborted() -> list[RequestOutput]:
        seen = []
        async for out in engine.generate(request("aborted", prompt, max_tokens=1000, ignore_eos=True)):
            seen.append(out)
            if len(seen) == 2:
                engine.abort("aborted")
        return seen

    outputs = asyncio.run(aborted())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert outputs[-1].num_generated_tokens < 100
    wait_for(lambda: engine.stats().num_running == 0)


def test_stats_are_pushed_and_move(engine: ProcessEngine, tokenizer: Tokenizer) -> None:
    before = engine.stats()
    assert before.kv_blocks_total == engine.info.kv_num_blocks > 0
    run_all(engine, [request("st", tokenizer.encode("Stats, please:"), max_tokens=6, ignore_eos=True)])
    wait_for(lambda: engine.stats().num_steps >= before.num_steps + 6 and engine.stats().num_running == 0)
    after = engine.stats()
    assert after.step_tokens.total >= before.step_tokens.total + 6
    assert after.prefix_queries > before.prefix_queries


def test_check_refusals_come_from_the_engine_process(engine: ProcessEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Hi")
    with pytest.raises(RequestRefusedError, match="LoRA adapter 'nope' requested"):
        asyncio.run(engine.check(dataclasses.replace(request("a", prompt), adapter="nope")))
    asyncio.run(engine.check(request("fine", prompt)))  # nothing to refuse
    if not xgrammar_available():
        return
    bad = GuidedDecoding("grammar", "root ::= ")
    with pytest.raises(RequestRefusedError, match="invalid grammar"):
        asyncio.run(engine.check(request("g", prompt, guided=bad)))
    assert engine.ready  # a refused request harms nothing


# Injected into the engine process: while TEST_STEP_GATE/hold exists, the next step is held open
# (before it runs) until TEST_STEP_GATE/release appears, at most 20 s; `held` and `ended` mark it.
# And the check of a request with the id "broken-check" fails unexpectedly.
HELD_STEP = """
import os, time
from pathlib import Path
from service.engine.torch import core as torch_core

_step = torch_core.TorchEngineCore.step
GATE = Path(os.environ["TEST_STEP_GATE"])


def step(self):
    if (GATE / "hold").exists() and not (GATE / "held").exists():
        (GATE / "held").touch()
        deadline = time.monotonic() + 20
        while not (GATE / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        (GATE / "ended").touch()
    return _step(self)


torch_core.TorchEngineCore.step = step
_prepare = torch_core.TorchEngineCore.prepare


def prepare(self, request):
    if request.request_id == "broken-check":
        raise RuntimeError("injected fault in a check")
    return _prepare(self, request)


torch_core.TorchEngineCore.prepare = prepare
"""


def test_a_check_is_answered_while_a_step_is_in_progress(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """The engine process answers checks on its reader thread, not between steps: a request that
    arrives during a long step (on a GPU an 8192-token prefill step takes ~0.2 s) is not held a
    whole step before its Submit is even sent. Here a step is held open until the check returns. A
    check that fails unexpectedly fails its own request; the engine serves on."""
    gate = tmp_path / "gate"
    gate.mkdir()
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(HELD_STEP)
    path = os.pathsep.join(p for p in (str(tmp_path / "inject"), os.environ.get("PYTHONPATH")) if p)
    with mock.patch.dict(os.environ, {"PYTHONPATH": path, "TEST_STEP_GATE": str(gate)}):
        engine = start_process_engine()
    prompt = tokenizer.encode("Hold on")

    async def run() -> tuple[bool, list[RequestOutput]]:
        (gate / "hold").touch()

        async def collect() -> list[RequestOutput]:
            return [out async for out in engine.generate(request("held", prompt, max_tokens=2))]

        held = asyncio.ensure_future(collect())
        while not (gate / "held").exists():
            await asyncio.sleep(0.01)
        await engine.check(request("arriving", prompt))
        answered_during_the_step = not (gate / "ended").exists()
        (gate / "release").touch()
        return answered_during_the_step, await held

    try:
        answered_during_the_step, outputs = asyncio.run(run())
        assert answered_during_the_step
        assert outputs[-1].finish_reason == "length" and len(tokens(outputs)) == 2
        with pytest.raises(RequestRefusedError, match="LoRA adapter 'nope' requested"):  # refusals too
            asyncio.run(engine.check(dataclasses.replace(request("a", prompt), adapter="nope")))
        with pytest.raises(RuntimeError, match="injected fault in a check"):  # fails that request alone
            asyncio.run(engine.check(request("broken-check", prompt)))
        assert engine.ready and tokens(run_all(engine, [request("after", prompt, max_tokens=2)])["after"])
    finally:
        asyncio.run(engine.stop())


def test_a_duplicate_request_id_fails_alone(engine: ProcessEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Twice")

    async def run() -> tuple[list[RequestOutput], list[RequestOutput]]:
        first = engine.generate(request("dup", prompt, max_tokens=4))
        got = [await first.__anext__()]
        second = [out async for out in engine.generate(request("dup", prompt, max_tokens=4))]
        got += [out async for out in first]
        return got, second

    first, second = asyncio.run(run())
    assert first[-1].finish_reason == "length"
    assert second[-1].error is not None and "duplicate request id" in second[-1].error


def test_wrap_in_process_follows_the_setting() -> None:
    config = make_config()  # the CPU
    assert wrap_in_process("on", config) and not wrap_in_process("off", config)
    assert not wrap_in_process("auto", config)  # off on CPUs until their bars are measured with it
    assert wrap_in_process("auto", dataclasses.replace(config, device="cuda"))
    tp2 = dataclasses.replace(config, device="cuda", tensor_parallel_size=2)
    assert not wrap_in_process("auto", tp2) and wrap_in_process("on", tp2)  # ranks under it: untested
    trtllm = dataclasses.replace(config, engine="tensorrt_llm")
    assert not wrap_in_process("auto", trtllm)
    with pytest.raises(UnsupportedConfigError, match="NIM_ENGINE_PROCESS=on: only the torch engine"):
        wrap_in_process("on", trtllm)


def test_a_refusal_at_load_is_raised_here_and_leaves_no_process() -> None:
    before = descendants(os.getpid())
    with pytest.raises(UnsupportedConfigError, match="NIM_FUSED_KERNELS=1 needs a CUDA device"):
        load_in_process(make_config(fused_kernels=True))
    assert descendants(os.getpid()) <= before


def test_killing_the_engine_process_fails_requests_and_readiness() -> None:
    fatal: list[BaseException] = []
    engine = start_process_engine(fatal, kv_cache_max_tokens=4096)
    pid = engine.child.pid
    assert pid is not None
    below = descendants(pid) | {pid}
    prompt = [1, 2, 3, 4, 5]

    async def run() -> list[RequestOutput]:
        seen = []
        async for out in engine.generate(request("doomed", prompt, max_tokens=1000, ignore_eos=True)):
            seen.append(out)
            if len(seen) == 2:
                os.kill(pid, signal.SIGKILL)
        return seen

    try:
        outputs = asyncio.run(run())
        last = outputs[-1]
        assert last.finished and last.finish_reason is None and last.error is not None
        assert last.error == f"engine failure: the engine process (pid {pid}) was killed by SIGKILL"
        assert not engine.ready and engine.failure is not None and "SIGKILL" in engine.failure
        wait_for(lambda: len(fatal) == 1, 5)
        assert isinstance(fatal[0], EngineDeadError) and "SIGKILL" in str(fatal[0])

        async def late() -> None:
            async for _ in engine.generate(request("late", prompt)):
                pass

        with pytest.raises(EngineDeadError, match="SIGKILL"):
            asyncio.run(late())
        assert engine.child.exit_code == -signal.SIGKILL
        wait_for(lambda: not any(process_alive(p) for p in below), 10)
    finally:
        asyncio.run(engine.stop())  # after a death: returns at once


PARENT = """
import sys, time
from service.config_loading import load_settings
from service.engine.process import load_in_process
from service.serving import config_for
from service.text.tokenizer import Tokenizer

if __name__ == "__main__":
    loaded = load_in_process(config_for(load_settings(**{settings!r})))
    print(loaded.engine.child.pid, flush=True)
    time.sleep(600)
"""


def test_the_engine_process_leaves_when_the_api_process_dies(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PARENT.format(settings=SETTINGS)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIM_")}
    # The repository ahead of what PYTHONPATH already holds (on the GPU machine: the carried wheels).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env.update({"PYTHONPATH": path, **PASSIVE_OPENMP})
    parent = subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert process_alive(child)
        parent.kill()
        parent.wait(10)
        wait_for(lambda: not process_alive(child), 10)
    finally:
        parent.kill()
        parent.wait(10)


def start_process_server(tmp_path: Path, inject: str) -> tuple[ServerProcess, int]:
    """A real server whose engine runs in its own process (NIM_ENGINE_PROCESS=on), with `inject` run
    at start-up in both processes; the engine process's pid."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(inject)
    path = os.pathsep.join(p for p in (str(tmp_path / "inject"), os.environ.get("PYTHONPATH")) if p)
    server = start_server(
        tmp_path / "log", env={"PYTHONPATH": path, "NIM_ENGINE_PROCESS": "on", **PASSIVE_OPENMP}
    )
    try:
        wait_ready(server)
    except BaseException:
        server.stop()
        raise
    line = next(x for x in server.log().splitlines() if "the engine core runs in process" in x)
    core = int(line.rsplit(" ", 1)[1])
    assert core in descendants(server.process.pid)
    return server, core


def stream_in_background(server: ServerProcess, max_tokens: int) -> tuple[threading.Thread, list[str]]:
    """A streamed completion on a thread; returns once its first frame has arrived."""
    frames: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": EMBEDDED_NAME, "prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line:
                    frames.append(line)
                    started.set()

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(60)
    return worker, frames


def test_a_server_with_an_engine_process_serves_drains_and_stops(tmp_path: Path) -> None:
    server, core = start_process_server(tmp_path, "")
    try:
        # sampled (the API's default temperature is 1): without ignore_eos it may end early
        body = {"model": EMBEDDED_NAME, "prompt": "The capital of", "max_tokens": 5, "ignore_eos": True}
        reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
        worker, frames = stream_in_background(server, 24)
        server.process.send_signal(signal.SIGTERM)  # the drain lets the stream finish
        worker.join(60)
        assert frames[-1] == "data: [DONE]"
        chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 12
        assert server.process.wait(60) == 0
        assert not process_alive(core)
    finally:
        server.stop()


def test_a_server_whose_engine_process_fails_ends_requests_and_exits(tmp_path: Path) -> None:
    server, core = start_process_server(tmp_path, FAULT)
    try:
        worker, frames = stream_in_background(server, 500)
        doomed = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": EMBEDDED_NAME, "prompt": DOOMED_PROMPT, "max_tokens": 4},
            timeout=60,
        )
        worker.join(60)
        assert doomed.status_code == 500
        error = doomed.json()["error"]
        assert error["code"] == "engine_error" and "injected device fault" in error["message"]
        assert frames[-1] == "data: [DONE]"
        assert "injected device fault" in json.loads(frames[-2].removeprefix("data: "))["error"]["message"]
        assert server.process.wait(30) == 1
        assert not process_alive(core)
        assert "engine failed: RuntimeError: injected device fault" in server.log()
    finally:
        server.stop()


def test_lora_adapters_are_served_and_mirrored_from_the_engine_process(tmp_path: Path) -> None:
    """The API process's adapter catalogue is what the engine process's store lists, rescans
    included; an adapter's greedy tokens are the in-process engine's."""
    from service.model.config import ModelConfig
    from tests import test_lora
    from tests.test_lora_serving import TARGETS
    from tests.test_tensor_parallel import _checkpoint
    from tests.test_tensor_parallel_serving import _distinct_tokens

    checkpoint = _checkpoint(tmp_path / "tiny", vocab_size=256, max_position_embeddings=512)
    _distinct_tokens(checkpoint)
    model = ModelConfig.from_hf_config(json.loads((checkpoint / "config.json").read_text()))
    source = tmp_path / "adapters"
    test_lora.write_adapter(source / "sql", 100, 8, 16.0, TARGETS, model, std=0.15)
    settings = {
        "model_name": str(checkpoint),
        "model_profile": "torch-generic-fp32-tp1-pp1-throughput",
        "peft_source": source,
        "peft_refresh_interval": 0.2,
        "max_lora_rank": 16,
        "max_gpu_loras": 2,
        "num_threads": TEST_THREADS,
        "max_model_len": None,
        "kv_cache_max_tokens": 4096,
    }
    with mock.patch.dict(os.environ, PASSIVE_OPENMP):
        loaded = load_in_process(config_for(load_settings(**settings)))
    engine = loaded.engine
    assert isinstance(engine, ProcessEngine) and loaded.adapters is not None
    asyncio.run(engine.start())
    try:
        assert loaded.info.features.lora and loaded.adapters.names() == ["sql"]
        with pytest.raises(KeyError):
            loaded.adapters.prepare("chat")
        test_lora.write_adapter(source / "chat", 101, 8, 16.0, TARGETS, model, std=0.15)
        wait_for(lambda: loaded.adapters is not None and loaded.adapters.names() == ["chat", "sql"], 15)
        loaded.adapters.prepare("chat")
        prompt = loaded.tokenizer.encode("Once upon a time")
        requests = [
            request("base", prompt, max_tokens=8),
            dataclasses.replace(request("sql", prompt, max_tokens=8), adapter="sql"),
            dataclasses.replace(request("chat", prompt, max_tokens=8), adapter="chat"),
        ]
        remote = run_all(engine, requests)
        local_engine = build_engine(config_for(load_settings(**settings)))
        asyncio.run(local_engine.start())
        try:
            local = run_all(local_engine, requests)
        finally:
            asyncio.run(local_engine.stop())
        for r in requests:
            assert tokens(remote[r.request_id]) == tokens(local[r.request_id]), r.request_id
        assert tokens(remote["sql"]) != tokens(remote["base"])  # the adapter ran
    finally:
        asyncio.run(engine.stop())


def test_a_request_the_client_has_ended_is_no_longer_counted(
    engine: ProcessEngine, tokenizer: Tokenizer
) -> None:
    """The engine process sends a step's stats with its outputs, applied here before the outputs
    are released (issue 43): a client holding its last output, or whose closed stream has
    returned (its abort taken by the engine), reads a gauge that no longer counts it."""
    prompt = tokenizer.encode("Count the stats:")

    async def finished(rid: str) -> int:
        async for out in engine.generate(request(rid, prompt, max_tokens=2)):
            if out.finished:
                return engine.stats().num_running
        raise AssertionError("no finished output")

    async def closed(rid: str) -> int:
        stream = engine.generate(request(rid, prompt, max_tokens=500, ignore_eos=True))
        async for out in stream:
            if out.num_generated_tokens >= 2:
                break
        await stream.aclose()
        return engine.stats().num_running

    assert [asyncio.run(finished(f"last-{i}")) for i in range(5)] == [0] * 5
    assert [asyncio.run(closed(f"closed-{i}")) for i in range(5)] == [0] * 5
