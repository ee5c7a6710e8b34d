"""The one interface every engine implements, and the values that cross it.

The API layer turns an HTTP request into a `GenerationRequest` (token ids plus `SamplingParams`)
and consumes `RequestOutput` deltas; it knows nothing of blocks, batches or threads. Engines
know nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import anyio

from service.text.tokenizer import Tokenizer

FinishReason = Literal["stop", "length", "abort"]
ErrorCause = Literal["request", "engine"]  # whose fault a failed request was
GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class GuidedDecoding:
    """Output constrained to a language: a JSON schema, any JSON object, a regex, one of a list of
    strings, or an EBNF grammar (GBNF style, as xgrammar and llama.cpp read it)."""

    kind: GuidedKind
    spec: str = ""  # the schema as JSON, the regex, the grammar, or the choices as a JSON array
    # json_schema only: literal text around the JSON (a tool call's markers, e.g. "<tool_call>\n")
    prefix: str = ""
    suffix: str = ""
    # Constrain only the text after these token ids have been generated (a reasoning model's end of
    # thinking, e.g. `</think>`): the reasoning before them is free. Empty: from the first token.
    start_after: tuple[int, ...] = ()
    # With start_after, when the prompt left it open whether the model thinks: the thinking opens
    # with these token ids (`<think>`), which must then be the answer's first tokens; an answer
    # whose first token is another is constrained from that token on. Empty: the prompt opened the
    # thinking, so the answer begins in it.
    opens_with: tuple[int, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; n: the chosen token's plus n alternatives
    prompt_logprobs: int | None = None  # same, for every prompt token after the first
    skip_special_tokens: bool = True
    guided: GuidedDecoding | None = None  # structured output; None: unconstrained

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (no limit) or positive")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")

    @property
    def greedy(self) -> bool:
        # Below this, temperature scaling only overflows; the distribution is the argmax anyway.
        return self.temperature < 1e-5


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, its rank, and the most likely alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0  # time.monotonic() when the API accepted it
    # The LoRA adapter to run (a name the engine's AdapterCatalog knows, prepared by the API);
    # None: the base model.
    adapter: str | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What a request produced since its previous output (a delta), plus running totals.

    A finished output has exactly one of `finish_reason` (stop: a stop token or string; length:
    max_tokens or the context; abort: cancelled, by the client leaving or the server shutting
    down) and `error` (the engine failed the request; the message says why). `error_cause` says
    whose the failure was: "request" when the request itself could not be served (a constraint
    no text satisfies, sampling parameters the model's output defeats), "engine" otherwise.
    Either way only that request ended; the engine and every other request go on.
    """

    request_id: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_generated_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_cause: ErrorCause = "engine"
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only; None for token 0
    num_cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache
    time: float = 0.0  # time.monotonic() when the engine produced this delta
    # time.monotonic() when the engine first scheduled the request (its queue time ends there);
    # on every output, None where the engine cannot tell
    first_scheduled_time: float | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @classmethod
    def last(
        cls,
        request_id: str,
        num_prompt_tokens: int,
        *,
        finish_reason: FinishReason | None = None,
        error: str | None = None,
        error_cause: ErrorCause = "engine",
        text: str = "",
        token_ids: list[int] | None = None,
        num_generated_tokens: int = 0,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
        num_cached_tokens: int = 0,
        time: float,
    ) -> RequestOutput:
        """A request's finished output: the one constructor of every ending (stop, length,
        abort, error), which holds the invariant that exactly one of `finish_reason` and `error`
        is given."""
        if (finish_reason is None) == (error is None):
            raise ValueError(f"request {request_id}: a finished output needs one of finish_reason or error")
        return cls(
            request_id=request_id,
            text=text,
            token_ids=[] if token_ids is None else token_ids,
            num_prompt_tokens=num_prompt_tokens,
            num_generated_tokens=num_generated_tokens,
            finished=True,
            finish_reason=finish_reason,
            error=error,
            error_cause=error_cause,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=num_cached_tokens,
            time=time,
        )


@dataclass(frozen=True)
class Histogram:
    """Cumulative observations: counts[i] fell at or below bounds[i] (and above bounds[i-1]);
    the last count is everything above the last bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(bounds, (0,) * (len(bounds) + 1), 0.0)

    def observe(self, value: float) -> Histogram:
        """A new histogram with one more observation (snapshots stay immutable)."""
        index = bisect.bisect_left(self.bounds, value)
        counts = list(self.counts)
        counts[index] += 1
        return Histogram(self.bounds, tuple(counts), self.total + value)


# Bounds of the step histograms every engine reports (tokens as vLLM's vllm:iteration_tokens_total).
STEP_TOKEN_BOUNDS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_SEQUENCE_BOUNDS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_SECONDS_BOUNDS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
)  # fmt: skip


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine; counters are cumulative since start, so readers take deltas."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found
    num_preemptions: int = 0
    num_steps: int = 0
    step_tokens: Histogram = field(default_factory=lambda: Histogram.empty(STEP_TOKEN_BOUNDS))
    step_sequences: Histogram = field(default_factory=lambda: Histogram.empty(STEP_SEQUENCE_BOUNDS))
    step_seconds: Histogram = field(default_factory=lambda: Histogram.empty(STEP_SECONDS_BOUNDS))
    lora_running: tuple[str, ...] = ()  # adapters of running requests (each once)
    lora_waiting: tuple[str, ...] = ()  # adapters of waiting requests (each once)
    # Speculative decoding (vLLM's spec_decode counters); per position: accepted at proposal index j.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()  # empty: no speculation configured

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks in use, 0-1."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class KVBlockStored:
    """A full block entered the prefix cache: other requests may now reuse its keys and values.

    Ids are signed 64-bit integers (the first 8 bytes of the block's chained content hash), so a
    block's id also names the tokens before it; `parent_hash` is the id of the block before it in
    its sequence (None: the first block). The block's own tokens and the LoRA adapter it was
    computed with (None: the base model) say what it holds.
    """

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    lora_name: str | None = None


@dataclass(frozen=True)
class KVBlocksRemoved:
    """Blocks left the prefix cache (evicted for new contents, or discarded)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheCleared:
    """Every block left the prefix cache (a reset), or the events between were lost."""


# What an engine's prefix cache did, in the order it did it (Engine.kv_events), for a KV-aware
# router (service.dynamo): a block is always stored after its parent, and removed only after it
# was stored.
KVEvent = KVBlockStored | KVBlocksRemoved | KVCacheCleared


@dataclass(frozen=True)
class EngineFeatures:
    """Request features an engine implements; the API refuses the others with a 400."""

    logprobs: bool = True
    prompt_logprobs: bool = True
    prefix_caching: bool = True
    lora: bool = False
    guided_decoding: bool = False


@dataclass(frozen=True)
class PathChoice:
    """Whether one execution path that has a proven fallback runs, and why (/v1/metadata shows
    these): CUDA code that has not been measured on a GPU is checked at start against the path it
    replaces and falls back, with one log line, when the check fails."""

    name: str  # "unified_attention", "cuda_graphs", "fp8_scaled_mm", "compact_logits", "fused_kernels", ...
    used: bool
    reason: str  # one line: the check passed, what failed, the setting, or why it does not apply
    setting: str  # the variable that turns it off


@dataclass(frozen=True)
class EngineInfo:
    """What a loaded engine is and runs, as /v1/models, /v1/metadata and the logs report it."""

    engine: str  # the registry key, e.g. "torch"
    architecture: str
    max_model_len: int
    vocab_size: int
    weight_precision: str  # the profile precision tag the weights run in (bf16, fp8, ...)
    precision_mode: Literal["native", "emulated"]  # emulated: stored compactly, computed upcast
    kv_cache_dtype: str  # as reported in metrics (bfloat16, int8, fp8_e4m3, ...)
    kv_block_size: int
    kv_num_blocks: int
    device: str  # cpu, cuda:0, ...
    tensor_parallel_size: int
    features: EngineFeatures = EngineFeatures()
    max_loras: int = 0  # LoRA adapters resident at once (device slots); 0: no adapters served
    max_num_seqs: int = 0  # requests the engine runs at once (NIM's num_request_max); 0: not known
    activation_dtype: str = ""  # what activations compute in (float32, bfloat16, ...); "": not known
    paths: tuple[PathChoice, ...] = ()  # the execution paths with a fallback, as decided at start


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; requests cannot be served until the process restarts."""


class RequestRefusedError(ValueError):
    """The engine cannot run this request as asked (the message names the field and why); the API
    answers 400 before anything is sent."""


class ConstraintRefusedError(RequestRefusedError):
    """The request's structured-output constraint cannot be served (over a limit, not enforceable,
    unsatisfiable, does not compile); the API names the field that carried it."""


class Engine(Protocol):
    """An inference engine. `generate` may be called from the event loop thread only."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def ready(self) -> bool:
        """Started and serving: False before `start` returns, after `stop`, and once dead."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine died, or None while it lives."""
        ...

    async def start(self) -> None:
        """Warm up and begin serving; returns once ready."""

    async def stop(self) -> None:
        """Abort what is in flight and release resources."""

    async def check(self, request: GenerationRequest) -> None:
        """Raise RequestRefusedError for a request this engine would refuse (a parameter it cannot
        honour, an adapter it does not serve, a grammar that does not compile); called by the API
        before generate, and where it compiles a grammar it does so off the event loop."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request; iterate its outputs until one with `finished=True`.

        Raises EngineDeadError (on the first iteration) when the engine is dead. Closing the
        iterator early (client gone) aborts the request, and returns once the engine has taken the
        abort (or a few seconds have passed: `until_last`), so the stats read afterwards no longer
        count the request.
        """
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats:
        """The latest snapshot; cheap, callable from any thread."""
        ...

    def kv_events(self) -> list[KVEvent]:
        """The prefix cache's events since the last call, oldest first (drained: each is returned
        once). Empty unless the engine was loaded with `KVCacheConfig.record_events`, and always
        empty for an engine without a prefix cache of its own to report."""
        ...


class AdapterError(ValueError):
    """An adapter this engine cannot serve; the message names it and says why."""


class AdapterNotFoundError(AdapterError):
    """`add` of a path that holds no adapter (vLLM answers 404 for it)."""


class AdapterExistsError(ValueError):
    """`add` of a name that is served already, without `replace`."""


class UnknownAdapterError(KeyError):
    """No adapter of that name is served (never was, or removed from the source)."""

    def __str__(self) -> str:  # KeyError's would be the quoted name alone
        return f"adapter {self.args[0] if self.args else ''} is not served (not in the source, or removed)"


class AdapterCatalog(Protocol):
    """The LoRA adapters an engine serves (service.engine.lora_store.LoraStore)."""

    def names(self) -> list[str]:
        """Adapters requests may name now."""
        ...

    def prepare(self, name: str) -> None:
        """Raise KeyError unless an adapter of that name is served now. It reads nothing: the
        engine reads an adapter into memory when a request of it can take a device slot (one
        owner of "this adapter is in memory")."""
        ...

    def add(self, name: str, path: Path, replace: bool = False) -> None:
        """Serve the adapter at `path` (inside the adapter source) as `name`, read and checked in
        full first; blocking (call it off the event loop). Raises AdapterExistsError (served
        already, `replace` unset), AdapterNotFoundError (no adapter there) or AdapterError (what
        is wrong with the name, the path or the adapter), in one line."""
        ...

    def remove(self, name: str) -> None:
        """Stop serving `name`: new requests are refused at once, those accepted finish with it;
        blocking. Raises UnknownAdapterError (a KeyError) when it is not served."""
        ...


@dataclass(frozen=True)
class LoadedEngine:
    """What the registry hands the entry point: the engine, what it is, its tokenizer, and the
    LoRA adapters it serves (None: none)."""

    engine: Engine
    info: EngineInfo
    tokenizer: Tokenizer
    adapters: AdapterCatalog | None = None


async def until_last(outputs: asyncio.Queue[RequestOutput], timeout_s: float) -> None:
    """Wait for a request's last output on its queue (an engine posts it once it has ended the
    request, its stats published first), for at most `timeout_s`: the wait of an iterator closed
    early, after it asked for the abort. Shielded: a request whose client left is cancelled by
    Starlette's cancel scope, which cancels again at every await until the request's task ends."""
    with anyio.move_on_after(timeout_s, shield=True):
        while not (await outputs.get()).finished:
            pass
