"""The NIM-named commands, run as real processes: detect, list-model-profiles, download-to-cache,
create-model-store (and serving what it creates with networking disabled)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from service.host import cpu_has_fast_bf16
from service.selection.manifests import find_manifest, load_manifests
from service.selection.system_info import SystemInfo
from tests.conftest import (
    EMBEDDED_NAME,
    REPO,
    embedded_default_precision,
    free_port,
    start_server,
    wait_ready,
)

SYSTEMS = Path(__file__).parent / "systems"


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("NIM_")}
    full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    return subprocess.run(
        [sys.executable, str(REPO / "entrypoint.py"), *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def embedded_profile(name: str | None = None):
    """The embedded model's profile by name; by default the one this machine selects."""
    name = name or f"torch-generic-{embedded_default_precision()}-tp1-pp1-throughput"
    manifest = find_manifest("embedded", load_manifests())
    assert manifest is not None
    return next(p for p in manifest.profiles if p.name == name)


def test_detect_prints_the_system_as_json() -> None:
    done = run_cli("detect")
    assert done.returncode == 0, done.stderr
    system = SystemInfo.from_dict(json.loads(done.stdout))
    assert system.cpu.cores >= 1
    assert system.gpus == () and system.nvml_status != "ok"  # no GPU on the test machines


def test_list_model_profiles_for_the_embedded_model() -> None:
    done = run_cli("list-model-profiles", "--explain")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "SYSTEM INFO" in out and "MODEL PROFILES (smollm2-135m-instruct)" in out
    assert "Compatible with system and runnable:" in out
    selected = [line for line in out.splitlines() if "(selected)" in line]
    precision = embedded_default_precision()
    assert len(selected) == 1 and f"torch-generic-{precision}-tp1-pp1-throughput" in selected[0]
    assert embedded_profile().id in selected[0]
    assert "tensorrt_llm is not installed" in out
    explanation = out.split("SELECTION")[1]
    assert (
        f"selected torch-generic-{precision}-tp1-pp1-throughput" in explanation
        and f"lowest runnable precision ({precision}, native" in explanation
    )
    # Without bf16 instructions: bf16 and aten's int kernels ranked last, int4_wo too where its
    # W4A8 kernel cannot run (conftest.embedded_default_precision).
    slow = "int8_wo ranked last: this CPU has no avx512_bf16 or amx_bf16"
    assert (slow in explanation) == (not cpu_has_fast_bf16())
    assert ("bf16, int4_wo, int8_wo ranked last" in explanation) == (precision == "fp32")
    assert "tensor parallelism on the CPU runs only when NIM_TENSOR_PARALLEL_SIZE=N" in explanation
    runnable = out.split("Compatible with system and runnable:")[1].split("Compatible with system but")[0]
    fp8 = next(line for line in runnable.splitlines() if "torch-generic-fp8-" in line)
    assert "[emulated:" in fp8 and "dequantized per layer" in fp8


def test_list_model_profiles_on_an_injected_gpu_system() -> None:
    env = {
        "NIM_SYSTEM_INFO": str(SYSTEMS / "rtx4090_x1.json"),
        "NIM_MODEL_NAME": "meta-llama/Llama-3.1-8B-Instruct",
    }
    done = run_cli("list-model-profiles", env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "RTX 4090" in out
    low = out.split("Compatible with system but low memory:")[1].split("Incompatible with system:")[0]
    assert "torch-generic-bf16-tp1-pp1-throughput" in low and "--max-model-len=" in low
    incompatible = out.split("Incompatible with system:")[1]
    assert "built for H100" in incompatible and "With LoRA support:" in out


def test_an_explicit_profile_that_cannot_run_stops_start_up() -> None:
    nvfp4 = "tensorrt_llm-b200-nvfp4-tp1-pp1-throughput-kvfp8"
    env = {"NIM_MODEL_NAME": "meta-llama/Llama-3.1-8B-Instruct", "NIM_MODEL_PROFILE": nvfp4}
    done = run_cli("download-to-cache", "--profiles", "no-such-profile", env=env)
    assert done.returncode == 1 and "names no profile" in done.stderr
    done = run_cli("serve", "--port", str(free_port()), env=env)
    assert done.returncode == 1
    assert "cannot run here" in done.stderr and nvfp4 in done.stderr


def test_download_to_cache_resolves_the_selected_profile(tmp_path: Path) -> None:
    done = run_cli("download-to-cache", env={"NIM_CACHE_PATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert embedded_profile().id in done.stdout and ".gguf" in done.stdout


def test_download_to_cache_all_offline_fetches_what_it_can_and_names_the_rest(tmp_path: Path) -> None:
    """Issue 44: offline, the tensorrt_llm profile's Hugging Face checkpoint is not in an empty cache;
    every other profile is still fetched, and the exit status and last line say which one was not."""
    done = run_cli("download-to-cache", "--all", env={"NIM_CACHE_PATH": str(tmp_path)})
    assert done.returncode == 1
    profiles = find_manifest("embedded", load_manifests()).profiles  # type: ignore[union-attr]
    local = [p for p in profiles if p.llm_engine == "torch"]
    assert local and all(p.id in done.stdout for p in local)
    last = done.stderr.strip().splitlines()[-1]
    trtllm = "tensorrt_llm-generic-bf16-tp1-pp1-throughput"
    assert last == f"error: 1 profile(s) not downloaded: {trtllm} (the reasons are above)"


def test_create_model_store_serves_offline(tmp_path: Path) -> None:
    store = tmp_path / "store"
    profile = embedded_profile()
    done = run_cli("create-model-store", "--profile", profile.id, "--model-store", str(store))
    assert done.returncode == 0, done.stderr
    descriptor = json.loads((store / "nim_model_store.json").read_text())
    assert descriptor["profile_id"] == profile.id
    assert (store / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size > 90_000_000

    again = run_cli("create-model-store", "--profile", profile.id, "--model-store", str(store))
    assert again.returncode == 1 and "not empty" in again.stderr

    # No network and an empty cache: everything comes from the store.
    env = {
        "NIM_MODEL_NAME": str(store),
        "HF_HUB_OFFLINE": "1",
        "NIM_CACHE_PATH": str(tmp_path / "empty-cache"),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
    }
    server = start_server(tmp_path / "log", env=env)
    try:
        wait_ready(server)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model=EMBEDDED_NAME,
            messages=[{"role": "user", "content": "Name the capital of France."}],
            temperature=0,
            max_tokens=16,
        )
        assert "Paris" in out.choices[0].message.content
        meta = httpx.get(f"{server.base_url}/v1/metadata").json()
        assert meta["selectedProfile"]["id"] == profile.id
    finally:
        assert server.stop() == 0


def test_nims_short_flags_parse_as_the_long_ones() -> None:
    from service.cli import build_parser

    parser = build_parser()
    download = parser.parse_args(["download-to-cache", "-p", "a", "b"])
    assert download.profiles == ["a", "b"]
    store = parser.parse_args(["create-model-store", "-p", "x", "-m", "/tmp/store"])
    assert (store.profile, store.model_store) == ("x", Path("/tmp/store"))


def test_download_to_cache_takes_nims_short_profile_flag(tmp_path: Path) -> None:
    profile = embedded_profile()
    done = run_cli("download-to-cache", "-p", profile.id, env={"NIM_CACHE_PATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert f"{profile.id} ({profile.name})" in done.stdout and ".gguf" in done.stdout


def test_help_lists_the_commands(capsys) -> None:
    """`nim-torch --help` names every command (issue 44 found only serve's flags there once);
    `serve --help` lists serve's flags."""
    from service.cli import main

    main(["--help"])
    out = capsys.readouterr().out
    for command in (
        "serve",
        "list-model-profiles",
        "download-to-cache",
        "create-model-store",
        "detect",
        "health",
    ):
        assert command in out, out
    try:
        main(["serve", "--help"])
    except SystemExit as exc:
        assert not exc.code
    assert "--max-model-len" in capsys.readouterr().out


def test_a_served_process_exits_with_its_objects_frozen(monkeypatch, capsys) -> None:
    """A process that served (serve, or a Dynamo role) freezes its objects before it exits, so the
    interpreter's shutdown does not garbage-collect torch's millions of objects (~0.9 s of every
    stop here; bench/gc_pause.py --stops); the exit code is the server's. Help and flag errors
    exit without it (the suite calls them in its own process)."""
    import service.cli
    from service.cli import main

    frozen: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))
    monkeypatch.setattr(service.cli, "serve", lambda settings, bring_up=None: 3)
    monkeypatch.setattr(service.cli, "serve_dynamo", lambda role, settings: 4)
    for command, code in (("serve", 3), ("dynamo-worker", 4)):
        with pytest.raises(SystemExit) as exited:
            main([command])
        assert exited.value.code == code
    assert len(frozen) == 2
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--no-such-flag"])
    assert exited.value.code == 2 and "--no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert len(frozen) == 2


def test_serve_freezes_the_start_up_heap_once_the_model_is_up(monkeypatch) -> None:
    """`serve` hands the app service.util.freeze_startup_heap as its on_ready hook (called once
    the model is up, before the service reports ready: tests/test_engine_failure.py), and the hook
    leaves what survived a collection out of the collector's reach (in a fresh interpreter: it
    freezes for good)."""
    import service.api.app
    from service.cli import serve
    from service.config_loading import ConfigError, load_settings
    from service.util import freeze_startup_heap

    seen: dict[str, object] = {}

    def create_app(*args: object, **kwargs: object) -> None:
        seen.update(kwargs)
        raise ConfigError("stop here")

    monkeypatch.setattr(service.api.app, "create_app", create_app)
    assert serve(load_settings(), bring_up=lambda metrics, on_death: None) == 2  # type: ignore[arg-type,return-value]
    assert seen["on_ready"] is freeze_startup_heap
    probe = "import gc; from service.util import freeze_startup_heap as f; f(); print(gc.get_freeze_count())"
    frozen = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert int(frozen.stdout) > 1000
