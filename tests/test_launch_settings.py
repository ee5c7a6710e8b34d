"""Launching as NIM and vLLM users launch, checked in process at the settings layer: every NIM_*
variable NIM documents is read or refused in one line, an unknown one names the closest known one,
Kubernetes service links pass, NIM_MODEL_PATH's forms, vLLM's serve flags (accepted, refused,
unknown), and a flag that disagrees with its variable. tests/test_launch.py starts real processes
for what a user sees (the line on stderr, the exit code, what is served)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from service.config import Settings
from service.config_loading import ConfigError, load_settings, read_variables
from service.nim_variables import BY_NAME, NIM_VARIABLES
from service.selection.manifests import ProfileError
from service.selection.planning import make_plan
from service.serve_flags import FLAGS, FlagError, parse_serve_flags
from service.serve_flags_refused import REFUSED
from service.store.model_uri import ModelRef

REFUSED_VARIABLES = [v for v in NIM_VARIABLES if v.refusal is not None]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NIM_*, VLLM_* or HF offline switch from the machine running the tests."""
    for name in list(os.environ):
        if name.upper().startswith(("NIM_", "VLLM_")):
            monkeypatch.delenv(name)


def _refusal(**env: str) -> str:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(ConfigError) as caught:
            load_settings()
    message = str(caught.value)
    assert "\n" not in message
    return message


def _error(**kwargs: object) -> str:
    """load_settings' refusal of these overrides, one line."""
    with pytest.raises(ConfigError) as caught:
        load_settings(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_every_documented_variable_is_read_by_settings_or_refused() -> None:
    read = read_variables()
    for variable in NIM_VARIABLES:
        if variable.refusal is None:
            assert variable.name in read, (
                f"{variable.name} is documented as honoured but Settings does not read it"
            )
        else:
            assert variable.name not in read, f"{variable.name} is refused but Settings reads it"
    assert len(BY_NAME) == len(NIM_VARIABLES), "a variable is listed twice"
    assert read["NIM_DISABLE_CUDA_GRAPH"] == "NIM_ENFORCE_EAGER"
    assert read["NIM_DISABLE_MODEL_DOWNLOAD"] == "HF_HUB_OFFLINE"
    assert read["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "NIM_ALLOW_RUNTIME_LORA_UPDATING"


@pytest.mark.parametrize("variable", REFUSED_VARIABLES, ids=lambda v: v.name)
def test_a_refused_variable_stops_the_start_in_one_line(variable, monkeypatch: pytest.MonkeyPatch) -> None:
    refusal = variable.refusal
    assert refusal is not None
    message = _refusal(**{variable.name: "something-else"})
    assert message == f"{variable.name} is not supported here: {refusal.instead}"
    for value in refusal.accepted:  # values asking for what happens anyway pass
        monkeypatch.setenv(variable.name, value.upper())
        load_settings()


def test_an_unknown_nim_variable_names_the_closest_known_one() -> None:
    assert _refusal(NIM_MAX_MODEL_LENGTH="8192") == (
        "NIM_MAX_MODEL_LENGTH is not a setting of this server: did you mean NIM_MAX_MODEL_LEN? (unset it)"
    )
    assert "did you mean NIM_SERVER_PORT?" in _refusal(NIM_SEVER_PORT="9000")
    assert "see the configuration table in docs/configuration.md" in _refusal(NIM_WHATEVER_THIS_IS="1")
    # several problems: one line, each named
    both = _refusal(NIM_MAX_MODEL_LENGTH="1", NIM_SPECDEC_ARGS="x")
    assert "NIM_MAX_MODEL_LENGTH" in both and "NIM_SPECDEC_ARGS" in both


def test_kubernetes_service_links_are_ignored_but_a_lone_port_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    links = {  # what Kubernetes injects for Services named "nim" and "nim-llm"
        "NIM_SERVICE_HOST": "10.0.0.7",
        "NIM_SERVICE_PORT": "8000",
        "NIM_SERVICE_PORT_HTTP_OPENAI": "8000",
        "NIM_PORT": "tcp://10.0.0.7:8000",
        "NIM_PORT_8000_TCP": "tcp://10.0.0.7:8000",
        "NIM_PORT_8000_TCP_PROTO": "tcp",
        "NIM_PORT_8000_TCP_PORT": "8000",
        "NIM_PORT_8000_TCP_ADDR": "10.0.0.7",
        "NIM_LLM_SERVICE_HOST": "10.0.0.8",
        "NIM_LLM_SERVICE_PORT": "8000",
        "NIM_LLM_PORT": "tcp://10.0.0.8:8000",
        "NIM_LLM_PORT_8000_TCP": "tcp://10.0.0.8:8000",
    }
    for name, value in links.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert sorted(settings.service_links) == sorted(links)
    assert settings.port == 8000  # NIM_SERVICE_PORT is not NIM_SERVER_PORT
    monkeypatch.delenv("NIM_SERVICE_HOST")  # NIM_* of service "nim" no longer a link group
    assert "NIM_PORT is not a setting of this server" in _refusal()
    for name in links:
        monkeypatch.delenv(name, raising=False)
    assert "NIM_PORT is not a setting" in _refusal(NIM_PORT="8000")  # not a link: no tcp:// and no host


def test_aliases_read_nims_names_and_refuse_a_disagreement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NIM_DISABLE_CUDA_GRAPH", "1")
    monkeypatch.setenv("NIM_DISABLE_MODEL_DOWNLOAD", "true")
    monkeypatch.setenv("NIM_KVCACHE_PERCENT", "50")
    settings = load_settings()
    assert settings.enforce_eager and settings.hf_hub_offline and settings.kv_cache_fraction == 0.5
    monkeypatch.setenv("NIM_ENFORCE_EAGER", "1")  # the same value under both names is one setting
    load_settings()
    assert "NIM_ENFORCE_EAGER='0' and NIM_DISABLE_CUDA_GRAPH='1' disagree" in _refusal(NIM_ENFORCE_EAGER="0")
    monkeypatch.setenv("NIM_PEFT_SOURCE", str(tmp_path))
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert load_settings().allow_runtime_lora_updating
    monkeypatch.delenv("NIM_PEFT_SOURCE")
    assert "NIM_ALLOW_RUNTIME_LORA_UPDATING=1 needs NIM_PEFT_SOURCE" in _refusal()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hf://Qwen/Qwen3-0.6B", ModelRef("Qwen/Qwen3-0.6B", None, hub=True)),
        ("hf://org/name@v1.0", ModelRef("org/name", "v1.0", hub=True)),
        (
            "hf://org/name@0123456789abcdef0123456789abcdef01234567",
            ModelRef("org/name", "0123456789abcdef0123456789abcdef01234567", hub=True),
        ),
        ("Qwen/Qwen3-0.6B", ModelRef("Qwen/Qwen3-0.6B")),
        ("file:///models/tiny", ModelRef("/models/tiny")),
        ("/models/tiny.gguf", ModelRef("/models/tiny.gguf")),
    ],
)
def test_nim_model_path_forms(value: str, expected: ModelRef, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIM_MODEL_PATH", value)
    assert load_settings().model == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("ngc://nim/meta/llama-3.1-8b-instruct", "NGC downloads need NVIDIA's NGC client and an NGC API key"),
        ("modelscope://qwen/Qwen3-0.6B", "ModelScope downloads are not supported"),
        ("s3://bucket/model", "s3:// is not supported"),
        ("hf://just-a-name", "hf://org/name or hf://org/name@revision"),
        ("hf://org/name@", "the revision after '@' is empty"),
        ("file://relative/x", "a file:// path is absolute"),
    ],
)
def test_model_sources_this_server_cannot_fetch_are_refused(value: str, why: str) -> None:
    message = _refusal(NIM_MODEL_PATH=value)
    assert message.startswith(f"NIM_MODEL_PATH={value!r}: ") and why in message


def test_model_name_and_model_path_must_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIM_MODEL_PATH", "hf://Org/Tiny@v1")
    monkeypatch.setenv("NIM_MODEL_NAME", "org/tiny")  # the same repository; the path pins the revision
    assert load_settings().model == ModelRef("Org/Tiny", "v1", hub=True)
    assert "name different models" in _refusal(NIM_MODEL_NAME="org/other")
    assert "name different models" in _refusal(NIM_MODEL_NAME="hf://org/tiny@v2")
    (tmp_path / "model").mkdir()
    monkeypatch.setenv("NIM_MODEL_PATH", str(tmp_path / "model"))
    monkeypatch.setenv("NIM_MODEL_NAME", f"file://{tmp_path}/./model")
    assert load_settings().model == ModelRef(str(tmp_path / "model"))
    assert "name different models" in _refusal(NIM_MODEL_NAME=str(tmp_path))


def test_vllm_flags_set_this_servers_settings() -> None:
    fields = Settings.model_fields
    for flag in FLAGS:
        assert flag.field is None or flag.field in fields, flag.name
        assert flag.name not in REFUSED
    parsed = parse_serve_flags(
        shlex.split(
            "Qwen/Qwen2.5-1.5B-Instruct --max-model-len 8k --tensor-parallel-size 2 "
            "--no-enable-prefix-caching "
            "--dtype half -q fp8 --kv-cache-dtype fp8_e4m3 --max-num-seqs 16 --max-num-batched-tokens 1K "
            "--gpu-memory-utilization 0.5 --seed 3 --api-key a b --lora-modules sql=/a/sql "
            '\'{"name":"chat","path":"/a/chat"}\' --max-loras 2 --max-lora-rank 16 --enforce-eager '
            "--pipeline-parallel-size 1 --disable-log-requests --port 9000"
        )
    )
    assert parsed.values == {
        "model_name": "Qwen/Qwen2.5-1.5B-Instruct",
        "max_model_len": 8000,
        "tensor_parallel_size": 2,
        "enable_kv_cache_reuse": False,
        "dtype": "float16",
        "quantization": "fp8",
        "kv_cache_dtype": "fp8",
        "max_num_seqs": 16,
        "max_num_batched_tokens": 1024,
        "kv_cache_percent": 0.5,
        "seed": 3,
        "api_key": "a,b",
        "lora_modules": "sql=/a/sql,chat=/a/chat",
        "max_gpu_loras": 2,
        "max_lora_rank": 16,
        "enforce_eager": True,
        "port": 9000,
    }
    assert parsed.sources["api_key"] == "--api-key <hidden>"
    assert parse_serve_flags(["org/x", "--revision", "v2"]).values["model_name"] == "hf://org/x@v2"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--speculative-config [4]", "--speculative-config [4]: '[4]' is not a JSON object"),
        ("--trust-remote-code", "vLLM's --trust-remote-code is not supported by this server: model code"),
        ("-O3", "vLLM's -O3 is not supported by this server: no torch.compile"),
        ("--data-parallel-size 2", "vLLM's --data-parallel-size is not supported by this server"),
        (
            "--pipeline-parallel-size 2",
            "--pipeline-parallel-size 2: not supported here: pipeline parallelism",
        ),
        ("--max-model-length 8192", "unknown flag --max-model-length: did you mean --max-model-len?"),
        ("--quantization awq", "--quantization awq: quantization 'awq' is not supported"),
        ("--served-model-name a b", "one served name only"),
        ("a b", "a second model 'b'"),
        ("--max-model-len 8k --max-model-len 4096", "--max-model-len 8k and --max-model-len 4096 disagree"),
        ("--enable-prefix-caching=1", "--enable-prefix-caching takes no value"),
    ],
)
def test_a_vllm_flag_this_server_cannot_honour_is_refused_by_name(line: str, message: str) -> None:
    with pytest.raises(FlagError) as caught:
        parse_serve_flags(line.split())
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_flag_and_its_variable_must_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIM_MAX_MODEL_LEN", "4096")
    sources = {"max_model_len": "--max-model-len 8k"}
    message = str(_error(sources=sources, max_model_len=8000))
    assert message == "--max-model-len 8k and NIM_MAX_MODEL_LEN='4096' disagree: give one of them"
    assert load_settings(max_model_len=4096).max_model_len == 4096  # the same value twice is one setting
    monkeypatch.setenv("NIM_API_KEY", "secret-env")
    hidden = str(_error(api_key="secret-flag"))
    assert "secret" not in hidden and "NIM_API_KEY=<hidden>" in hidden
    monkeypatch.delenv("NIM_API_KEY")
    # NIM_PASSTHROUGH_ARGS: its flags apply; against the command line they must agree too
    monkeypatch.setenv("NIM_PASSTHROUGH_ARGS", "--max-model-len 4096 --seed 5 --enable-prefix-caching")
    settings = load_settings()
    assert (settings.max_model_len, settings.seed, settings.enable_kv_cache_reuse) == (4096, 5, True)
    conflict = str(_error(sources={"seed": "--seed 6"}, seed=6))
    assert conflict == "--seed 6 and NIM_PASSTHROUGH_ARGS --seed 5 disagree: give it once"
    monkeypatch.setenv("NIM_PASSTHROUGH_ARGS", "--max-model-len 2048")  # against NIM_MAX_MODEL_LEN
    assert "NIM_PASSTHROUGH_ARGS --max-model-len 2048 and NIM_MAX_MODEL_LEN='4096' disagree" in _refusal()
    monkeypatch.setenv("NIM_PASSTHROUGH_ARGS", "--tokenizer x")
    assert (
        _refusal()
        == "NIM_PASSTHROUGH_ARGS: vLLM's --tokenizer is not supported by this server: "
        + REFUSED["--tokenizer"]
    )


def test_lora_flags_need_adapters_and_modules_are_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = str(_error(needs_lora="--enable-lora"))
    assert message == "--enable-lora: name the adapters to serve (NIM_PEFT_SOURCE or --lora-modules)"
    lora = load_settings(lora_modules=f"sql={tmp_path}/sql", needs_lora="--enable-lora").lora
    assert lora is not None and lora.source is None and lora.modules == (("sql", tmp_path / "sql"),)
    assert "is not name=path" in str(_error(lora_modules="sql"))
    assert "NIM_QUANTIZATION=fp8 and NIM_DTYPE=bfloat16" in _refusal(
        NIM_QUANTIZATION="fp8", NIM_DTYPE="bfloat16"
    )


def test_a_tensor_parallel_size_the_model_cannot_shard_is_not_selected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The embedded model's 9 heads and 3 kv heads do not split over 2 ranks: every tp2 profile is
    incompatible with the reason the engine would give, so nothing listed as runnable fails to load."""
    monkeypatch.setenv("NIM_TENSOR_PARALLEL_SIZE", "2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ProfileError) as caught:
        make_plan(load_settings())
    assert "tensor parallelism 2 does not divide this model's 9 attention heads, 3 kv heads" in str(
        caught.value
    )
    monkeypatch.setenv("NIM_TENSOR_PARALLEL_SIZE", "3")  # 9 and 3 heads split over 3 ranks
    assert make_plan(load_settings()).profile.tp == 3


def test_a_server_seed_gives_unseeded_requests_a_reproducible_sequence() -> None:
    """NIM_SEED (vLLM's --seed): a request that sends no seed is sampled with the next seed of the
    server's own sequence, the same after a restart; a request's own seed is kept; unset, nothing
    is added (the engine draws at random)."""
    from service.api.completions.protocol import CompletionRequest
    from service.api.state import ApiLimits, ServiceState
    from service.telemetry.metrics import Metrics

    def seeds(seed: int | None, *bodies: CompletionRequest) -> list[int | None]:
        state = ServiceState(ApiLimits(max_pending_requests=1, seed=seed), Metrics("m"), "m")
        return [state.seeded(body).seed for body in bodies]

    unseeded = CompletionRequest(model="m", prompt="hi")
    own = CompletionRequest(model="m", prompt="hi", seed=11)
    first = seeds(7, unseeded, own, unseeded)
    assert first == seeds(7, unseeded, own, unseeded)  # a restart draws the same sequence
    assert first[1] == 11 and first[0] != first[2] and all(isinstance(s, int) for s in first)
    assert seeds(None, unseeded, own) == [None, 11]
