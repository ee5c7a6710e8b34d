"""Health, readiness, metrics, version and metadata; start-up failures; a free event loop."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from service.engine.native import extension, w4a8
from service.host import cpu_has_fast_bf16
from tests.conftest import EMBEDDED_NAME, embedded_default_precision, start_server, wait_ready


def test_live_and_ready(base_url: str) -> None:
    assert httpx.get(f"{base_url}/v1/health/live").status_code == 200
    ready = httpx.get(f"{base_url}/v1/health/ready")
    assert ready.status_code == 200
    assert ready.json()["message"] == "ready"


def test_version_and_metadata(base_url: str) -> None:
    version = httpx.get(f"{base_url}/v1/version").json()
    assert version["release"]
    meta = httpx.get(f"{base_url}/v1/metadata").json()
    assert meta["modelInfo"][0]["shortName"] == EMBEDDED_NAME
    assert meta["modelInfo"][0]["modelUrl"].endswith(".gguf")
    profile = meta["selectedProfile"]
    assert profile["tags"]["llm_engine"] == "torch"
    assert profile["tags"]["precision"] == embedded_default_precision()
    assert set(meta["versions"]) >= {"service", "torch", "python"}
    # The CUDA paths with a fallback, each with why it runs or not and what turns it off.
    paths = meta["executionPaths"]
    assert set(paths) == {
        "unified_attention",
        "cuda_graphs",
        "fp8_scaled_mm",
        "fused_kernels",
        "engine_process",
        "speculative_decoding",
        "compact_logits",
        "int4_kernel",
        "cpu_fused_ops",
        "dense_prompt_rows",
    }
    # The CPU, defaults: the int8 logits only where the default is int4_wo with bf16 activations,
    # and there (a bf16 matmul) its prompt rows through dense bf16 copies.
    int4 = embedded_default_precision() == "int4_wo"
    assert paths.pop("compact_logits")["used"] == int4
    assert paths.pop("dense_prompt_rows")["used"] == (int4 and cpu_has_fast_bf16())
    # and its int4 layers on the W4A8 kernel where it builds here (g++ and ninja)
    assert paths.pop("int4_kernel")["used"] == (int4 and w4a8.serving_problem() is None)
    # and its norms as fused native ops where the extension builds
    fused = paths.pop("cpu_fused_ops")
    assert fused["used"] == (extension.problem() is None) and fused["setting"] == "NIM_CPU_FUSED_OPS=off"
    assert not any(path["used"] for path in paths.values())
    assert "CUDA only" in paths["unified_attention"]["reason"]
    assert paths["engine_process"]["setting"] == "NIM_ENGINE_PROCESS=off"
    assert "not fp8" in paths["fp8_scaled_mm"]["reason"]
    assert paths["speculative_decoding"]["reason"] == "NIM_SPECULATIVE_CONFIG is unset"


def test_metrics_count_requests_and_tokens(base_url: str) -> None:
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{base_url}/v1/metrics").text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    before = scrape()
    # Prometheus' default path (what the Gateway API Inference Extension scrapes) serves the same.
    root = httpx.get(f"{base_url}/metrics")
    assert root.status_code == 200 and root.headers["content-type"].startswith("text/plain")
    assert "vllm:num_requests_waiting{" in root.text
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model=EMBEDDED_NAME, prompt="Once upon a time", max_tokens=5, temperature=0
    )
    after = scrape()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    label = f'{{model_name="{EMBEDDED_NAME}"}}'
    assert delta(f"vllm:prompt_tokens_total{label}") == out.usage.prompt_tokens
    assert delta(f"vllm:generation_tokens_total{label}") == out.usage.completion_tokens
    assert delta(f"vllm:e2e_request_latency_seconds_count{label}") == 1
    assert delta(f"vllm:time_to_first_token_seconds_count{label}") == 1
    assert delta(f"vllm:inter_token_latency_seconds_count{label}") == out.usage.completion_tokens - 1
    reason = out.choices[0].finish_reason
    assert (
        delta(f'vllm:request_success_total{{finished_reason="{reason}",model_name="{EMBEDDED_NAME}"}}') == 1
    )
    assert delta('http_requests_total{method="POST",route="/v1/completions",status="200"}') == 1
    assert after[f"vllm:num_requests_running{label}"] == 0
    assert "num_requests_waiting" in after


def test_event_loop_is_free_during_generation(base_url: str) -> None:
    """Health checks answer promptly while the engine is busy generating (a long stream, closed
    once the probes are done, so the test takes the same time on a CPU and a GPU)."""
    streaming = threading.Event()
    probes_done = threading.Event()

    def generate() -> None:
        body = {"model": EMBEDDED_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 4000, "stream": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streaming.set()
                if probes_done.is_set():
                    return  # closing the stream aborts the generation

    worker = threading.Thread(target=generate)
    worker.start()
    assert streaming.wait(60)
    latencies = []
    while len(latencies) < 20:
        started = time.monotonic()
        assert httpx.get(f"{base_url}/v1/health/live", timeout=10).status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.05)
    probes_done.set()
    worker.join(60)
    assert not worker.is_alive()
    latencies.sort()
    # A blocked loop would hold each probe for the whole generation (seconds).
    assert latencies[len(latencies) // 2] < 0.5, latencies


def test_ready_is_503_until_loaded_and_live_meanwhile(tmp_path: Path) -> None:
    server = start_server(tmp_path / "log")
    try:
        saw_not_ready = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(f"{server.base_url}/v1/health/ready", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if ready.status_code == 503:
                saw_not_ready = True
                assert ready.headers["retry-after"]
                assert ready.json()["error"]["code"] == "service_unavailable"
                assert httpx.get(f"{server.base_url}/v1/health/live").status_code == 200
                body = {
                    "model": EMBEDDED_NAME,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                }
                # Readiness may flip between the two calls, so a 200 is fine too.
                early = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
                assert early.status_code in (503, 200)
            else:
                assert ready.status_code == 200
                break
            time.sleep(0.05)
        assert saw_not_ready, "readiness never reported loading"
        wait_ready(server)
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("kind", ["missing", "pickle-dir", "pickle-file"])
def test_unloadable_model_exits_non_zero_with_reason(tmp_path: Path, kind: str) -> None:
    if kind == "missing":
        model, expect = str(tmp_path / "nope"), "is not an existing"
    elif kind == "pickle-dir":
        model_dir = tmp_path / "pickled"
        model_dir.mkdir()
        (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
        (model_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not-really-a-pickle")
        model, expect = str(model_dir), "pickled"
    else:
        pickle = tmp_path / "weights.pt"
        pickle.write_bytes(b"\x80\x04")
        model, expect = str(pickle), "pickled"
    server = start_server(tmp_path / "log", env={"NIM_MODEL_NAME": model})
    code = server.process.wait(120)
    assert code != 0
    assert expect in server.log()


def test_invalid_configuration_names_the_variable(tmp_path: Path) -> None:
    server = start_server(tmp_path / "log", env={"NIM_MAX_NUM_SEQS": "lots"})
    assert server.process.wait(60) == 2
    assert "NIM_MAX_NUM_SEQS" in server.log()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NIM_MAX_GPU_LORAS": "4"}, "NIM_MAX_GPU_LORAS set without NIM_PEFT_SOURCE"),
        ({"NIM_PEFT_SOURCE": "/nonexistent/loras"}, "NIM_PEFT_SOURCE=/nonexistent/loras is not a directory"),
        (
            {"NIM_PEFT_SOURCE": ".", "NIM_MAX_GPU_LORAS": "8", "NIM_MAX_CPU_LORAS": "4"},
            "NIM_MAX_CPU_LORAS=4 is below NIM_MAX_GPU_LORAS=8",
        ),
    ],
)
def test_lora_settings_that_cannot_be_honoured_stop_the_start(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    server = start_server(tmp_path / "log", env=env)
    assert server.process.wait(60) == 2
    assert message in server.log()


def test_openapi_documents_the_real_error_shapes(base_url: str) -> None:
    schema = httpx.get(f"{base_url}/openapi.json").json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat  # validation errors are 400s in OpenAI's shape
    assert {"400", "401", "404", "429", "503", "504"} <= set(chat)
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "text/plain" in schema["paths"]["/v1/metrics"]["get"]["responses"]["200"]["content"]
    assert "/tokenize" in schema["paths"] and "/detokenize" in schema["paths"]


@pytest.mark.parametrize(
    ("path", "body", "chunk"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "ChatCompletionChunk"),
        ("/v1/completions", {"prompt": "Once upon"}, "CompletionResponse"),
    ],
)
def test_openapi_describes_the_event_stream_it_sends(
    base_url: str, path: str, body: dict, chunk: str
) -> None:
    """Each event of a real stream matches the documented event schema and its JSON payload."""
    import jsonschema_rs

    schema = httpx.get(f"{base_url}/openapi.json").json()
    ok = schema["paths"][path]["post"]["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}
    event_schema = ok["text/event-stream"]["schema"]
    data_schema = event_schema["properties"]["data"]["anyOf"][1]["contentSchema"]
    assert {"$ref": f"#/components/schemas/{chunk}"} in data_schema["oneOf"]
    root = {"components": schema["components"]}
    event_validator = jsonschema_rs.validator_for({**event_schema, **root})
    chunk_validator = jsonschema_rs.validator_for({"$ref": f"#/components/schemas/{chunk}", **root})
    request = {"model": "smollm2-135m-instruct", "max_tokens": 4, "stream": True, **body}
    request["stream_options"] = {"include_usage": True}
    response = httpx.post(f"{base_url}{path}", json=request, timeout=60)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]" and len(events) >= 3
    for data in events:
        event_validator.validate({"event": "message", "data": data})
    for data in events[:-1]:
        chunk_validator.validate(json.loads(data))
