"""vLLM's runtime LoRA API over HTTP, on the real server: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (httpx for those calls, the official client for generation).

The tiny float32 checkpoint of tests/test_lora_serving.py is named only by NIM_MODEL_PATH (a local
directory). Its adapter source holds adapters in a `library/` subdirectory the start-up scan does
not list; they are served once loaded. What is checked:
- a loaded adapter answers as its merged weights W + scale * B @ A served as a model of its own,
  is listed by /v1/models with the base model as parent, and counted by the LoRA metrics; unloaded,
  it is a 404 and gone from the list;
- loads are refused with vLLM's statuses and a line saying why: a path outside the source (also
  through a symlink), a path holding no adapter, an adapter with NaN weights or too large a rank,
  a name loaded already (load_inplace replaces it), a missing field; unloading a name not served is
  a 404; the API wants the API key;
- a streamed request running with an adapter finishes after the adapter is unloaded (and a rescan
  does not bring the adapter back);
- with the engine core in a process of its own (NIM_ENGINE_PROCESS=on, the switch under vLLM's
  VLLM_ALLOW_RUNTIME_LORA_UPDATING name) the same load answers the same tokens, and unloading
  while a request runs lets it finish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from service.engine.lora import TARGETS
from tests import test_lora
from tests.conftest import ServerProcess
from tests.test_lora_serving import FP32, NAME, PROMPTS, TOKENS, _config, _merged, checkpoint, write_adapter
from tests.test_quantization import serving

__all__ = ["checkpoint"]  # the module fixture, shared with tests/test_lora_serving.py

KEY = "lora-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = 300  # tokens: a stream that outlasts an unload


@pytest.fixture(scope="module")
def source(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter source with one scanned adapter and a library of adapters loaded at run time."""
    root = tmp_path_factory.mktemp("runtime-adapters")
    config = _config(checkpoint)
    write_adapter(root / "scanned", config, seed=40)
    library = root / "library"
    write_adapter(library / "fresh", config, seed=41)
    write_adapter(library / "other", config, seed=42)
    write_adapter(library / "too-big", config, seed=43, rank=32)  # above NIM_MAX_LORA_RANK=16
    test_lora.poison(test_lora.write_adapter(library / "poisoned", 44, 8, 16.0, TARGETS, config))
    outside = tmp_path_factory.mktemp("outside")
    write_adapter(outside / "escaped", config, seed=45)
    (library / "link-out").symlink_to(outside / "escaped", target_is_directory=True)
    return root


def _env(checkpoint: Path, source: Path) -> dict[str, str]:
    return {
        **FP32,
        "NIM_MODEL_PATH": str(checkpoint),
        "NIM_PEFT_SOURCE": str(source),
        "NIM_PEFT_REFRESH_INTERVAL": "0.2",  # rescans run throughout: they must not undo the API's changes
        "NIM_MAX_LORA_RANK": "16",
        "NIM_MAX_GPU_LORAS": "2",
        "NIM_API_KEY": KEY,
    }


@pytest.fixture(scope="module")
def lora_server(
    checkpoint: Path, source: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    env = {**_env(checkpoint, source), "NIM_ALLOW_RUNTIME_LORA_UPDATING": "1", "NIM_ENGINE_PROCESS": "off"}
    with serving(tmp_path_factory.mktemp("runtime-lora") / "server.log", env) as server:
        yield server


def _http(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120)


def _load(server: ServerProcess, name: str, path: str, **extra: object) -> httpx.Response:
    with _http(server) as http:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra})


def _unload(server: ServerProcess, name: str) -> httpx.Response:
    with _http(server) as http:
        return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _greedy(server: ServerProcess, model: str, prompt: str) -> tuple[list[str], list[float]]:
    out = _client(server).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    logprobs = out.choices[0].logprobs
    assert out.model == model and logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    return logprobs.tokens, [float(x) for x in logprobs.token_logprobs]


def _listed(server: ServerProcess) -> dict[str, str | None]:
    return {m.id: getattr(m, "parent", None) for m in _client(server).models.list().data}


def test_a_loaded_adapter_answers_as_its_merged_weights_and_unloaded_is_a_404(
    lora_server: ServerProcess, checkpoint: Path, source: Path, tmp_path: Path
) -> None:
    assert _listed(lora_server) == {NAME: None, "scanned": NAME}
    with pytest.raises(openai.NotFoundError):
        _client(lora_server).completions.create(model="fresh", prompt="hi", max_tokens=2)
    loaded = _load(lora_server, "fresh", str(source / "library" / "fresh"))
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'fresh' added successfully."
    assert _listed(lora_server) == {NAME: None, "scanned": NAME, "fresh": NAME}
    adapted = [_greedy(lora_server, "fresh", prompt) for prompt in PROMPTS]
    base = [_greedy(lora_server, NAME, prompt) for prompt in PROMPTS]
    metrics = httpx.get(f"{lora_server.base_url}/v1/metrics", timeout=10).text
    assert f'nim_lora_requests_total{{lora_name="fresh",model_name="{NAME}"}} {len(PROMPTS)}.0' in metrics
    time.sleep(0.5)  # rescans (every 0.2 s) keep an adapter the API loaded
    assert "fresh" in _listed(lora_server)

    unloaded = _unload(lora_server, "fresh")
    assert (
        unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'fresh' removed successfully."
    )
    assert "fresh" not in _listed(lora_server)
    with pytest.raises(openai.NotFoundError) as caught:
        _client(lora_server).completions.create(model="fresh", prompt="hi", max_tokens=2)
    assert caught.value.code == "model_not_found"

    # The adapter's merged weights, served as a model of their own, answer the same.
    deltas = write_adapter(tmp_path / "copy" / "fresh", _config(checkpoint), seed=41)
    merged = _merged(checkpoint, deltas, tmp_path / NAME)
    with serving(tmp_path / "merged.log", {**FP32, "NIM_MODEL_PATH": str(merged)}) as server:
        want = [_greedy(server, NAME, prompt) for prompt in PROMPTS]
    assert [tokens for tokens, _ in base] != [tokens for tokens, _ in want]  # the adapter matters
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(adapted, want, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=2e-3)


def test_loads_are_refused_with_vllms_statuses_and_why(lora_server: ServerProcess, source: Path) -> None:
    outside = source.parent / "elsewhere"
    cases = [
        (("far", str(source.parent)), 400, "outside the adapter source"),
        (("far", "library/link-out"), 400, "outside the adapter source"),
        (("far", "../" + source.name + "/../.."), 400, "outside the adapter source"),
        (("nothing", "library/none-here"), 404, "no adapter at library/none-here"),
        (("poisoned", "library/poisoned"), 400, "lora_A holds NaN"),
        (("too-big", "library/too-big"), 400, "rank 32 is above NIM_MAX_LORA_RANK=16"),
        (("bad/name", "library/other"), 400, "adapter name 'bad/name' is not valid"),
        ((NAME, "library/other"), 400, "the served model's own name"),
        (("scanned", "library/other"), 400, "The lora adapter 'scanned' has already been loaded"),
        (("x", str(outside)), 400, "outside the adapter source"),
    ]
    for (name, path), status, why in cases:
        answer = _load(lora_server, name, path)
        assert answer.status_code == status, (name, path, answer.text)
        error = answer.json()["error"]
        assert why in error["message"], (name, path, error)
    assert set(_listed(lora_server)) == {NAME, "scanned"}  # nothing refused was listed
    with _http(lora_server) as http:
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
        unknown = http.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"] == "The lora adapter 'never-loaded' cannot be found."
    no_key = httpx.post(
        f"{lora_server.base_url}/v1/load_lora_adapter", json={"lora_name": "o", "lora_path": "library/other"}
    )
    assert no_key.status_code == 401
    # load_inplace replaces a loaded adapter (here: a scanned one, by files of another adapter)
    before = _greedy(lora_server, "scanned", PROMPTS[0])[0]
    assert _load(lora_server, "scanned", "library/other", load_inplace=True).status_code == 200
    assert _greedy(lora_server, "scanned", PROMPTS[0])[0] != before
    assert _unload(lora_server, "scanned").status_code == 200
    time.sleep(0.5)  # a rescan finds scanned/ in the source still: an unloaded adapter stays unloaded
    assert set(_listed(lora_server)) == {NAME}


def _stream_in_background(
    server: ServerProcess, model: str
) -> tuple[threading.Thread, list, threading.Event]:
    """A long greedy stream of `model`, read on a thread; `started` is set at its first chunk."""
    chunks: list = []
    started = threading.Event()

    def read() -> None:
        stream = _client(server).completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=LONG, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            chunks.append(chunk)
            started.set()

    thread = threading.Thread(target=read)
    thread.start()
    assert started.wait(60)
    return thread, chunks, started


def _finished_in_full(chunks: list) -> bool:
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return (
        reasons == ["length"] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == LONG
    )


def test_a_request_running_with_an_adapter_finishes_after_it_is_unloaded(lora_server: ServerProcess) -> None:
    assert _load(lora_server, "other", "library/other").status_code == 200
    thread, chunks, _ = _stream_in_background(lora_server, "other")
    assert _unload(lora_server, "other").status_code == 200
    metrics = httpx.get(f"{lora_server.base_url}/v1/metrics", timeout=10).text
    assert 'running_lora_adapters="other"' in metrics  # still running, after the unload
    with pytest.raises(openai.NotFoundError):
        _client(lora_server).completions.create(model="other", prompt="hi", max_tokens=2)
    thread.join(120)
    assert _finished_in_full(chunks)


def test_runtime_lora_with_the_engine_in_its_own_process(
    lora_server: ServerProcess, checkpoint: Path, source: Path, tmp_path: Path
) -> None:
    assert _load(lora_server, "fresh", "library/fresh").status_code == 200
    want = _greedy(lora_server, "fresh", PROMPTS[2])
    assert _unload(lora_server, "fresh").status_code == 200
    env = {**_env(checkpoint, source), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "NIM_ENGINE_PROCESS": "on"}
    with serving(tmp_path / "process.log", env) as server:
        assert _load(server, "fresh", "library/fresh").status_code == 200
        assert _listed(server) == {NAME: None, "scanned": NAME, "fresh": NAME}  # at once, in the API process
        tokens, logprobs = _greedy(server, "fresh", PROMPTS[2])
        assert tokens == want[0] and logprobs == pytest.approx(want[1], abs=1e-4)
        assert (
            _load(server, "fresh", "library/fresh").status_code == 400
        )  # loaded already, in the engine process
        assert (
            "outside the adapter source" in _load(server, "x", str(source.parent)).json()["error"]["message"]
        )
        thread, chunks, _ = _stream_in_background(server, "fresh")
        assert _unload(server, "fresh").status_code == 200
        assert "fresh" not in _listed(server)
        thread.join(120)
        assert _finished_in_full(chunks)
        assert "the engine core runs in process" in server.log()


def test_the_api_is_off_without_the_switch(server: ServerProcess) -> None:
    """The session's embedded-model server: no switch, so both paths are 404s saying so."""
    bodies = {
        "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "b"},
        "/v1/unload_lora_adapter": {"lora_name": "a"},
    }
    for path, body in bodies.items():
        answer = httpx.post(f"{server.base_url}{path}", json=body, timeout=10)
        assert answer.status_code == 404
        assert "set NIM_ALLOW_RUNTIME_LORA_UPDATING=1" in answer.json()["error"]["message"]
