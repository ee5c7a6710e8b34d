"""Launching as NIM 2.x and vLLM users launch, with real processes: the NIM variables this server
refuses and a misspelt one stop the start with one line and exit code 2 before any model loads; a
model named only by NIM_MODEL_PATH=hf://org/name@revision is downloaded from the local fake hub
(tests/fake_hub.py) and served, started as NIM 2.x documents it (`nim-serve` with vLLM's flags,
NIM_PASSTHROUGH_ARGS); vLLM's quickstart command line serves what it names behind its API key;
list-model-profiles lists no tensor-parallel profile the model cannot be sharded into. The
settings layer's cases, one by one, are tests/test_launch_settings.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from service.model.config import ModelConfig
from service.nim_variables import NIM_VARIABLES
from tests.conftest import REPO, start_server, wait_ready
from tests.fake_hub import FakeHub
from tests.test_cli import run_cli
from tests.test_lora_serving import write_adapter
from tests.test_tensor_parallel import _checkpoint
from tests.test_tensor_parallel_serving import _distinct_tokens

FP32 = {"NIM_MODEL_PROFILE": "torch-generic-fp32-tp1-pp1-throughput"}
REPO_ID = "acme/tiny-chat"


def _refused_start(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("NIM_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, str(REPO / "entrypoint.py"), *args],
        cwd=REPO,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_refused_variables_and_a_typo_stop_the_start_in_one_line() -> None:
    """Every documented variable this server refuses, set at once (a value none of them lets
    pass): one line naming each and what to use instead, exit code 2, nothing loaded. Then a typo,
    and a vLLM flag this server cannot honour."""
    refused = {v.name: v.refusal for v in NIM_VARIABLES if v.refusal is not None}
    done = _refused_start(dict.fromkeys(refused, "unsupported-value"), "serve")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("configuration error: "), done.stderr
    for name, refusal in refused.items():
        assert refusal is not None
        assert f"{name} is not supported here: {refusal.instead}" in lines[0], name
    typo = _refused_start({"NIM_MAX_MODEL_LENGTH": "8192"}, "serve")
    assert typo.returncode == 2
    assert typo.stderr.strip() == (
        "configuration error: NIM_MAX_MODEL_LENGTH is not a setting of this server: "
        "did you mean NIM_MAX_MODEL_LEN? (unset it)"
    )
    flag = _refused_start(
        {}, "serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'
    )
    assert flag.returncode == 2
    assert flag.stderr.strip().startswith(
        "configuration error: NIM_SPECULATIVE_CONFIG: method 'eagle' is not implemented here"
    ), flag.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Llama with a byte-level tokenizer and a chat template, as a hub repo holds it."""
    directory = _checkpoint(
        tmp_path_factory.mktemp("hub") / "tiny-chat", vocab_size=256, max_position_embeddings=512
    )
    _distinct_tokens(directory)
    (directory / "tokenizer_config.json").write_text(
        '{"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}'
    )
    return directory


@pytest.fixture(scope="module")
def hub(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeHub, str]]:
    """The fake hub with the tiny model at tag v1, and a broken config on main (serving main fails)."""
    with FakeHub() as fake:
        v1 = fake.add_commit_from_dir(REPO_ID, tiny, refs=("v1",))
        broken = tmp_path_factory.mktemp("broken")
        (broken / "config.json").write_text('{"model_type": "nothing-we-serve"}')
        fake.add_commit_from_dir(REPO_ID, broken, refs=("main",))
        yield fake, v1


def test_a_model_named_only_by_nim_model_path_hf_is_downloaded_and_served(
    hub: tuple[FakeHub, str], tmp_path: Path
) -> None:
    """NIM 2.x's model-free launch: NIM_MODEL_PATH=hf://org/name@revision and `nim-serve` with
    vLLM's flags (the advanced-configuration page's example), NIM_PASSTHROUGH_ARGS beside them."""
    fake, v1 = hub
    env = {
        **FP32,
        "NIM_MODEL_PATH": f"hf://{REPO_ID}@v1",
        "NIM_PASSTHROUGH_ARGS": "--seed 7 --max-num-seqs 4",
        "NIM_CACHE_PATH": str(tmp_path / "cache"),
        "HF_ENDPOINT": fake.endpoint,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_OFFLINE": "0",
    }
    flags = ["--enable-prefix-caching", "--gpu-memory-utilization", "0.5", "--max-model-len", "256"]
    server = start_server(tmp_path / "server.log", env=env, args=flags, command="nim-serve")
    try:
        wait_ready(server)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        (card,) = client.models.list().data
        assert card.id == REPO_ID and getattr(card, "max_model_len", None) == 256
        out = client.completions.create(model=REPO_ID, prompt="hello", max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason == "length"
        metadata = httpx.get(f"{server.base_url}/v1/metadata", timeout=10).json()
        assert v1 in metadata["modelInfo"][0]["modelUrl"]  # the snapshot of the pinned revision
        assert metadata["selectedProfile"]["name"] == FP32["NIM_MODEL_PROFILE"]
    finally:
        assert server.stop() == 0, server.log()
    fetched = {r.file for r in fake.transfers() if r.file}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= fetched
    resolved = [r.path for r in fake.requests if "/resolve/" in r.path]
    assert resolved and all(f"/resolve/{v1}/" in path for path in resolved), resolved  # never main


def test_vllms_quickstart_command_line_serves_what_it_names(tiny: Path, tmp_path: Path) -> None:
    """vLLM's OpenAI-compatible server quickstart, `vllm serve MODEL --dtype auto --api-key
    token-abc123` (docs.vllm.ai, serving/openai_compatible_server), with MODEL a local directory,
    and the adapter flags of its LoRA page (`--enable-lora --lora-modules sql-lora=PATH`)."""
    config = ModelConfig.from_hf_config(json.loads((tiny / "config.json").read_text()))
    write_adapter(tmp_path / "adapters" / "sql", config, seed=5)
    args = [str(tiny), "--dtype", "auto", "--api-key", "token-abc123"]
    args += ["--enable-lora", "--lora-modules", f"sql-lora={tmp_path / 'adapters' / 'sql'}"]
    server = start_server(tmp_path / "server.log", env=FP32, args=args)
    try:
        wait_ready(server)
        assert httpx.get(f"{server.base_url}/v1/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="token-abc123", max_retries=0)
        cards = {m.id: getattr(m, "parent", None) for m in client.models.list().data}
        assert cards == {"tiny-chat": None, "sql-lora": "tiny-chat"}
        adapted = client.completions.create(model="sql-lora", prompt="SELECT", max_tokens=3, temperature=0)
        assert adapted.model == "sql-lora" and adapted.choices[0].text
        chat = client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "Hello!"}], max_tokens=3, temperature=0
        )
        assert chat.model == "tiny-chat" and chat.usage is not None and chat.usage.completion_tokens == 3
        headers = {"Authorization": "Bearer token-abc123"}
        metadata = httpx.get(f"{server.base_url}/v1/metadata", headers=headers, timeout=10).json()
        assert metadata["modelInfo"][0]["modelUrl"] == str(tiny)
        assert metadata["selectedProfile"]["runtime"]["weight_precision"] == "fp32"
    finally:
        assert server.stop() == 0, server.log()


def test_list_model_profiles_lists_no_tensor_parallel_profile_that_cannot_start() -> None:
    """The embedded model's 9 heads and 3 kv heads do not split over 2 ranks: its tp2 profiles are
    listed as incompatible, with the reason the start would give."""
    done = run_cli("list-model-profiles", env={"NIM_TENSOR_PARALLEL_SIZE": "2"})
    assert done.returncode == 0, done.stderr
    runnable, incompatible = done.stdout.split("- Incompatible with system:")
    assert "tp2" not in runnable
    line = next(ln for ln in incompatible.splitlines() if "(torch-generic-int4_wo-tp2-pp1-throughput)" in ln)
    assert "tensor parallelism 2 does not divide this model's 9 attention heads, 3 kv heads" in line


def test_a_lone_misspelt_flag_names_the_closest(tmp_path: Path) -> None:
    done = _refused_start({}, "nim-serve", "--max-model-length", "8192")
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "configuration error: unknown flag --max-model-length: did you mean --max-model-len?"
    )
