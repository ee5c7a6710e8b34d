"""The test double's implementation (see tests/fakes/README.md); the package's modules re-export
it under the real import paths.

It plays one release, `VERSION` ($TRTLLM_DOUBLE_VERSION, default tensorrt_llm/version.py's), and
behaves as that release's sources say where the adapter could tell the difference: the LLM
classes accept exactly the arguments of the field lists recorded in llm_args_fields.json for its
series; the sampler applies no penalties, min_p or seed (it echoes; 1.2 ignores them, and the
adapter refuses them there); logprobs are the top k of each position, which before 1.3.0rc26 may
lack the sampled token (the double's "model" ranks it below k at every odd position when
sampling); a stop-token finish trims token_ids but not logprobs; the 1.3 series has no
`_tensorrt_engine`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tensorrt_llm.version import __version__ as _INSTALLED

VERSION = os.environ.get("TRTLLM_DOUBLE_VERSION", _INSTALLED)


def _version_key(version: str) -> tuple[int, int, int, int]:
    found = re.match(r"(\d+)\.(\d+)\.(\d+)(?:rc(\d+))?", version)
    assert found is not None, f"TRTLLM_DOUBLE_VERSION={version!r} is not a tensorrt_llm version"
    major, minor, patch, rc = found.groups()
    return (int(major), int(minor), int(patch), int(rc) if rc is not None else 10**6)


SERIES = "1.3" if _version_key(VERSION) >= (1, 3, 0, 0) else "1.2"
# From 1.3.0rc26 TorchSampler always returns the sampled token's logprob (logprobs=0: it alone).
SAMPLED_LOGPROB = _version_key(VERSION) >= (1, 3, 0, 26)


def _fields() -> tuple[set[str], set[str], set[str] | None, dict[str, list[str]]]:
    """(BaseLlmArgs, TorchLlmArgs, TrtLlmArgs or None, removed arguments) of SERIES."""
    releases = json.loads((Path(__file__).parent / "llm_args_fields.json").read_text())["releases"]
    entry = releases[SERIES]
    base = releases.get(entry.get("inherits"), entry)
    trt = entry.get("TrtLlmArgs", base.get("TrtLlmArgs"))
    return (
        set(base["BaseLlmArgs"]),
        set(base["TorchLlmArgs"]),
        None if trt is None else set(trt),
        entry.get("removed_arguments", {}),
    )


BASE_ARGS, TORCH_ARGS, TRT_ARGS, REMOVED_ARGS = _fields()

# --- configuration objects -------------------------------------------------------------------


class KvCacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float | None = Field(0.9, ge=0, le=1)
    max_tokens: int | None = None
    host_cache_size: int | None = None
    tokens_per_block: int = 32
    dtype: str = "auto"


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_dir: list[str] = []
    lora_ckpt_source: Literal["hf", "nemo"] = "hf"
    max_lora_rank: int = 64
    lora_target_modules: list[str] = []
    max_loras: int | None = None
    max_cpu_loras: int | None = None


class BuildConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_input_len: int = 1024
    max_seq_len: int | None = None
    max_batch_size: int = 2048
    max_num_tokens: int = 8192


@dataclass(slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_ckpt_source: str = "hf"

    def __post_init__(self) -> None:
        if self.lora_path is not None and not os.path.exists(self.lora_path):
            raise ValueError(f"lora_path ({self.lora_path}) does not exist.")
        if self.lora_ckpt_source not in ("hf", "nemo"):
            raise ValueError(f"lora_ckpt_source must be 'hf' or 'nemo', got '{self.lora_ckpt_source}'")


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    embedding_bias: Any = None
    n: int = 1
    best_of: int | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        self.logprobs = self.logprobs and int(self.logprobs)
        self.prompt_logprobs = self.prompt_logprobs and int(self.prompt_logprobs)


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: str | dict | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"Only one guide can be used for a request, but got {given}.")


class RequestError(RuntimeError):
    """A request failed inside the executor."""


class CppExecutorError(RuntimeError):
    """The C++ executor failed as a whole (tensorrt_llm.executor.CppExecutorError)."""


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: Literal["stop", "length", "timeout", "cancelled"] | None = None
    stop_reason: int | str | None = None
    _last_text_len: int = 0
    _last_token_ids_len: int = 0
    _last_logprobs_len: int = 0

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> list[dict[int, Logprob]]:
        return self.logprobs[self._last_logprobs_len :]


# --- the LLM ---------------------------------------------------------------------------------


class _Tokenizer:
    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.eos_token_id = config.get("eos_token_id")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class RequestOutput:
    """What generate_async returns: awaitable, async-iterable (yielding itself), abortable."""

    def __init__(self, llm: LLM, request_id: int, prompt_ids: list[int], params: SamplingParams,
                 streaming: bool, lora: LoRARequest | None) -> None:  # fmt: skip
        self.request_id = request_id
        self.prompt: str | None = None
        self.prompt_token_ids = prompt_ids
        self.outputs = [CompletionOutput(0)]
        self.finished = False
        self._llm = llm
        self._params = params
        self._streaming = streaming
        self._lora = lora
        self._aborted = False
        self._done = False
        self._loop = asyncio.get_running_loop()  # as the real one: async use needs a running loop

    def abort(self) -> None:
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while True:
            await asyncio.sleep(self._llm.step_seconds)
            self._step()
            if self._done or self._streaming:
                return self

    async def aresult(self) -> RequestOutput:
        async for _ in self:
            pass
        return self

    def __await__(self):  # the real class is awaitable the same way
        return self.aresult().__await__()

    def _step(self) -> None:
        out = self.outputs[0]
        out._last_text_len, out._last_token_ids_len = len(out.text), len(out.token_ids)
        out._last_logprobs_len = len(out.logprobs)
        if self._aborted:
            out.finish_reason, self._done, self.finished = "cancelled", True, True
            return
        prompt_text = self._llm.tokenizer.decode(self.prompt_token_ids)
        if self._llm.fail_marker in prompt_text:
            raise RequestError(f"request {self.request_id}: simulated executor error")
        if self._llm.crash_marker in prompt_text:
            self._llm._executor.shut_down = True
            raise CppExecutorError("simulated C++ executor failure")
        params = self._params
        position = len(out.token_ids)
        token = self.prompt_token_ids[position % len(self.prompt_token_ids)]
        generated = position + 1
        end = params.end_id if params.end_id is not None else self._llm.tokenizer.eos_token_id
        if token == end and not params.ignore_eos and generated > (params.min_tokens or 0):
            out.finish_reason, out.stop_reason = "stop", token  # END_ID: the end token is not output
            self._finish()
            return
        out.token_ids.append(token)
        if params.logprobs is not None and (params.logprobs > 0 or SAMPLED_LOGPROB):
            out.logprobs.append(self._logprobs(token, position, params))
        if token in (params.stop_token_ids or []) and generated > (params.min_tokens or 0):
            # STOP_WORDS: the stop token is generated, then trimmed from token_ids (not logprobs)
            out.finish_reason, out.stop_reason = "stop", token
            if not params.include_stop_str_in_output:
                out.token_ids = out.token_ids[:-1]
            out.text = self._llm.tokenizer.decode(out.token_ids, params.skip_special_tokens)
            self._finish()
            return
        out.text = self._llm.tokenizer.decode(out.token_ids, params.skip_special_tokens)
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        for stop in stops:
            at = out.text.find(stop)
            if at >= 0:
                out.text = out.text[: at + len(stop)] if params.include_stop_str_in_output else out.text[:at]
                out.finish_reason, out.stop_reason = "stop", stop
                self._finish()
                return
        if len(out.token_ids) >= params.max_tokens:
            out.finish_reason = "length"
            self._finish()

    @staticmethod
    def _logprobs(token: int, position: int, params: SamplingParams) -> dict[int, Logprob]:
        """The top `params.logprobs` tokens of this position. Greedy, the sampled token is the
        most likely; sampling, the double ranks it below the top k at every odd position, where
        releases before 1.3.0rc26 leave it out and later ones add it."""
        k = params.logprobs or 0
        sampling = bool(params.temperature) and (params.top_k or 0) != 1
        if sampling and position % 2 == 1:
            top = {(token + r) % 256: Logprob(-0.5 * r, r) for r in range(1, k + 1)}
            if SAMPLED_LOGPROB:
                top[token] = Logprob(-0.5 * (k + 1), k + 1)
            return top
        top = {token: Logprob(-0.25, 1)} if k or SAMPLED_LOGPROB else {}
        for rank in range(2, k + 1):
            top[(token + rank) % 256] = Logprob(-1.0 * rank, rank)
        return top

    def _finish(self) -> None:
        self._done = self.finished = True
        self._llm._completed += 1


class _Executor:
    """What `LLM._executor` answers about itself."""

    def __init__(self) -> None:
        self.shut_down = False

    def is_shutdown(self) -> bool:
        return self.shut_down


class LLM:
    """The PyTorch-backend LLM's surface; `step_seconds` paces the simulated iterations."""

    step_seconds = 0.002
    fail_marker = "<<fail>>"  # a prompt containing it fails with RequestError (error mapping tests)
    crash_marker = "<<crash>>"  # ... with CppExecutorError: the executor is gone
    _tensorrt_backend = False
    _class_name = "LLM"  # both real classes are called LLM

    def __init__(self, model: str, tokenizer: Any = None, trust_remote_code: bool = False,
                 tensor_parallel_size: int = 1, dtype: str = "auto", revision: str | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        self._check_arguments(kwargs)
        self.args = {
            "model": model, "tensor_parallel_size": tensor_parallel_size, "dtype": dtype,
            "trust_remote_code": trust_remote_code, **kwargs,
        }  # fmt: skip
        self.model_dir = Path(model)
        if not (self.model_dir / "config.json").exists():
            raise ValueError(f"{model} is not a Hugging Face checkpoint directory")
        self.tokenizer = _Tokenizer(self.model_dir)
        kv = kwargs.get("kv_cache_config") or KvCacheConfig()
        if not isinstance(kv, KvCacheConfig):
            raise TypeError(f"kv_cache_config must be a KvCacheConfig, got {type(kv).__name__}")
        block = kv.tokens_per_block
        if block <= 0 or block & (block - 1):
            raise RuntimeError(f"tokens_per_block ({block}) must be a power of 2")
        lora = kwargs.get("lora_config")
        if lora is not None and not isinstance(lora, LoraConfig):
            raise TypeError(f"lora_config must be a LoraConfig, got {type(lora).__name__}")
        self._max_num_tokens = kwargs.get("max_num_tokens") or 8192
        self._chunked = bool(kwargs.get("enable_chunked_prefill"))
        # the TensorRT backend's executor keeps iteration stats without a switch
        self._stats = bool(kwargs.get("enable_iter_perf_stats")) or self._tensorrt_backend
        self._next_id = 0
        self._iter = 0
        self._completed = 0
        self._running: list[RequestOutput] = []
        self._executor = _Executor()
        self.stats_polls_before_first_request = 0
        _record({"constructed": type(self).__name__, **_loggable(self.args)})

    def _check_arguments(self, kwargs: dict[str, Any]) -> None:
        """As BaseLLM.__init__: every keyword must be a field of the backend's arguments class;
        the PyTorch LLM names TensorRT-only ones as such."""
        own = TRT_ARGS if self._tensorrt_backend else TORCH_ARGS
        assert own is not None, "no TensorRT backend in this release"
        valid = BASE_ARGS | own
        if not self._tensorrt_backend and TRT_ARGS is not None:
            trt_only = sorted((set(kwargs) & TRT_ARGS) - valid)
            if trt_only:
                raise ValueError(
                    "The following arguments are specific to TensorRT backend and cannot be used with "
                    f"PyTorch backend: {trt_only}.\nPlease use 'from tensorrt_llm._tensorrt_engine "
                    "import LLM' instead to use the TensorRT backend."
                )
        for key, value in kwargs.items():
            if key in REMOVED_ARGS and not self._tensorrt_backend:
                if value not in REMOVED_ARGS[key]:
                    raise ValueError(f"'{key}' was removed and {value!r} is no longer available")
                continue
            if key not in valid:
                raise ValueError(f"{self._class_name} got invalid argument: {key}")
        if kwargs.get("sampler_type") not in (None, "auto", "TorchSampler", "TRTLLMSampler"):
            raise ValueError(f"Invalid sampler_type: {kwargs['sampler_type']}")

    def generate_async(self, inputs: Any, sampling_params: SamplingParams | None = None,
                       lora_request: LoRARequest | None = None, streaming: bool = False,
                       **kwargs: Any) -> RequestOutput:  # fmt: skip
        if self._executor.is_shutdown():
            raise RuntimeError("LLM is shutting down")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"The sampling_params must be type SamplingParams or None, but got {type(params)}"
            )
        if isinstance(inputs, dict):
            ids = list(inputs["prompt_token_ids"])
        elif isinstance(inputs, list):
            assert isinstance(inputs[0], int)
            ids = list(inputs)
        else:
            raise TypeError(f"Invalid type of inputs for llm.generate: {type(inputs)}")
        if not self._chunked and len(ids) > self._max_num_tokens:
            raise ValueError(
                f"The sum of prompt length ({float(len(ids))}), query length (0) should not exceed "
                f"max_num_tokens ({self._max_num_tokens})"
            )
        if lora_request is not None and self.args.get("lora_config") is None:
            raise ValueError("LoRA request given, but the LLM was built without lora_config")
        self._next_id += 1
        output = RequestOutput(self, self._next_id, ids, params, streaming, lora_request)
        self._running.append(output)
        return output

    def get_stats_async(self, timeout: float = 2) -> Any:
        llm = self

        class _Stats:
            def __aiter__(self) -> _Stats:
                return self

            async def __anext__(self) -> dict[str, Any]:
                if llm._next_id == 0:  # the real executor warns on every poll until a request ran
                    llm.stats_polls_before_first_request += 1
                if not llm._stats:
                    await asyncio.sleep(timeout)
                    raise StopAsyncIteration
                await asyncio.sleep(min(timeout, 0.05))
                llm._iter += 1
                llm._running = [r for r in llm._running if not r.finished]
                active = len(llm._running)
                return {
                    "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
                    "iter": llm._iter,
                    "iterLatencyMS": 2.0,
                    "numActiveRequests": active,
                    "numQueuedRequests": 0,
                    "numCompletedRequests": llm._completed,
                    "maxNumActiveRequests": 2048,
                    "gpuMemUsage": 0,
                    "kvCacheStats": {
                        "maxNumBlocks": 1000,
                        "freeNumBlocks": 1000 - active,
                        "usedNumBlocks": active,
                        "tokensPerBlock": 32,
                        "allocTotalBlocks": active,
                        "allocNewBlocks": 0,
                        "reusedBlocks": 0,
                        "missedBlocks": 0,
                        "cacheHitRate": 0.0,
                    },
                    "inflightBatchingStats": {
                        "numScheduledRequests": active,
                        "numContextRequests": 0,
                        "numGenRequests": active,
                        "numPausedRequests": 0,
                        "numCtxTokens": 0,
                        "microBatchId": 0,
                        "avgNumDecodedTokensPerIter": 1.0,
                    },
                }

        return _Stats()

    def shutdown(self) -> None:
        self._executor.shut_down = True

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.shutdown()
        return False

    def __reduce__(self) -> Any:
        raise RuntimeError("LLM object can not be pickled.")


class TrtLLM(LLM):
    """`tensorrt_llm._tensorrt_engine.LLM`: builds a TensorRT engine from a checkpoint, or loads a
    saved one (a directory whose config.json has pretrained_config and build_config: an engine, as
    llm_args.get_model_format tells one)."""

    _tensorrt_backend = True

    def __init__(self, model: str, **kwargs: Any) -> None:
        if kwargs.get("guided_decoding_backend") == "llguidance":
            raise ValueError("llguidance is supported in PyTorch backend only")
        kv = kwargs.get("kv_cache_config")
        if isinstance(kv, KvCacheConfig) and kv.dtype != "auto":
            raise AssertionError("KvCacheConfig.dtype is not supported by the TensorRT backend.")
        source = Path(model)
        self.engine_dir: Path | None = None
        config = json.loads((source / "config.json").read_text()) if (source / "config.json").exists() else {}
        if "pretrained_config" in config and "build_config" in config:  # a saved engine
            if not (source / "rank0.engine").is_file():
                raise RuntimeError(f"{model}: engine file rank0.engine is missing")
            self.engine_dir = source
            super().__init__(str(source / "checkpoint"), **kwargs)
            self.built = False
            return
        super().__init__(model, **kwargs)
        self.built = True
        _record({"built": str(source)})

    def save(self, engine_dir: str) -> None:
        if not self.built:
            raise RuntimeError("The engine is not built yet.")
        target = Path(engine_dir)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copytree(self.model_dir, target / "checkpoint", dirs_exist_ok=True)
        (target / "rank0.engine").write_bytes(b"double-engine")
        build = self.args.get("build_config")
        (target / "config.json").write_text(
            json.dumps({"pretrained_config": {}, "build_config": build.model_dump() if build else {}})
        )


def _record(event: dict[str, Any]) -> None:
    """Append `event` to $TRTLLM_DOUBLE_LOG (JSON lines), where tests read what the adapter asked for."""
    path = os.environ.get("TRTLLM_DOUBLE_LOG")
    if path:
        with Path(path).open("a") as handle:
            handle.write(json.dumps(event, default=str) + "\n")


def _loggable(args: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.model_dump() if isinstance(v, BaseModel) else v) for k, v in args.items()}
