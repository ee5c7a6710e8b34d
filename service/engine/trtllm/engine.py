"""The TensorRT-LLM engine behind our Engine interface: one `tensorrt_llm.LLM` per process.

Requests go to `LLM.generate_async` as token ids (the API has applied the chat template with the
model's own tokenizer) with streaming on. Each iteration's output becomes one RequestOutput delta
(`_delta`), read from TensorRT-LLM's cumulative `token_ids` / `text` / `logprobs` by how much this
request has been handed so far, not from its `*_diff` views: on a stop-word finish TensorRT-LLM
trims the stop tokens from `token_ids` but not from `logprobs`, so positions, not list lengths,
pair a token with its logprob. Finish reasons map to ours (stop, length; cancelled -> abort;
timeout -> an error naming it). A client that leaves closes the generator, which aborts the
request in TensorRT-LLM.

Failure domains, as trtllm-serve draws them: only an executor-level failure (TensorRT-LLM's
`CppExecutorError`, or its executor shut down) kills the engine: every request in flight ends
with an error, readiness turns false, `on_fatal` lets the process exit. Anything else (a
`RequestError`, an output this adapter cannot map, any other exception while one request is
served) ends that request with an error frame and the engine serves on.

Iteration stats (`get_stats_async`, with enable_iter_perf_stats) feed the same EngineStats the
torch engine publishes, so /metrics carries the same names; they are polled from the first
request on (TensorRT-LLM warns on every poll until a request has run).

The LLM is built off the event loop on a worker thread (loading takes minutes and health probes
must answer meanwhile); trtllm-serve builds it on its main thread before serving. That a worker
thread is safe for tensor-parallel (MPI) starts is not verified here (no GPU); the real-library
test (tests/test_trtllm.py, marked gpu and trtllm) starts it this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any

from service.engine.lora_store import LoraStore
from service.engine.protocol import (
    EngineDeadError,
    EngineInfo,
    EngineStats,
    ErrorCause,
    FinishReason,
    GenerationRequest,
    KVEvent,
    RequestOutput,
    RequestRefusedError,
    TokenLogprob,
)
from service.engine.trtllm.api import TrtllmApi
from service.engine.trtllm.release import Release
from service.engine.trtllm.sampling import refusal, to_trtllm, token_logprob
from service.util import one_line

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 2.0
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "cancelled": "abort"}


class UnmappableOutputError(ValueError):
    """TensorRT-LLM returned an output for one request that this adapter cannot express."""


@dataclass
class _Handed:
    """How much of one request's cumulative output has been handed out as deltas."""

    tokens: int = 0
    text: int = 0


class TrtllmEngine:
    def __init__(
        self,
        api: TrtllmApi,
        make_llm: Callable[[], Any],
        info: EngineInfo,
        sampler: Release,
        adapters: LoraStore | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.api = api
        self._make_llm = make_llm  # blocking: loads (or builds) the model
        self._info = info
        self.sampler = sampler  # what the installed release's sampler applies
        self.adapters = adapters
        self.on_fatal = on_fatal
        self.llm: Any = None
        self._ready = False
        self._failure: str | None = None
        self._handles: dict[str, Any] = {}  # our request id -> TensorRT-LLM's RequestOutput
        self._stats = EngineStats()
        self._stats_task: asyncio.Task[None] | None = None
        self._lora_ids: dict[str, int] = {}  # adapter name -> the int id TensorRT-LLM caches it by

    # --- Engine protocol --------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def ready(self) -> bool:
        return self._ready and self._failure is None

    @property
    def failure(self) -> str | None:
        return self._failure

    async def start(self) -> None:
        self.llm = await asyncio.to_thread(self._make_llm)
        if self.adapters is not None:
            self.adapters.start_refreshing()
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        if self.adapters is not None:
            self.adapters.stop_refreshing()
        for handle in list(self._handles.values()):
            handle.abort()
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
        if self.llm is not None:
            await asyncio.to_thread(self.llm.shutdown)

    async def check(self, request: GenerationRequest) -> None:
        self._sampling(request)
        if request.adapter is not None:
            self._lora_request(request.adapter)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        try:
            handle = self.llm.generate_async(
                list(request.prompt_token_ids),
                sampling_params=self._sampling(request),
                lora_request=None if request.adapter is None else self._lora_request(request.adapter),
                streaming=True,
            )
        except (ValueError, TypeError, RequestRefusedError, self.api.RequestError) as exc:
            yield self._ended(request, f"tensorrt_llm refused the request: {one_line(exc)}", "request")
            return
        except Exception as exc:
            if self._executor_failed(exc):  # "LLM is shutting down", or its C++ executor failed
                self._die(exc)
                raise EngineDeadError(self._failure or one_line(exc)) from exc
            yield self._ended(request, f"tensorrt_llm could not take the request: {one_line(exc)}")
            return
        self._handles[request.request_id] = handle
        self._poll_stats()
        finished, handed = False, _Handed()
        try:
            async for out in handle:
                delta = self._delta(request, out, handed)
                finished = delta.finished
                yield delta
                if finished:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            finished = True
            if self._executor_failed(exc):
                self._die(exc)
                yield self._ended(request, f"engine failure: {self._failure}")
            else:
                why = one_line(exc, with_type=True)
                log.warning("tensorrt_llm request %s failed: %s", request.request_id, why)
                yield self._ended(request, f"tensorrt_llm failed the request: {one_line(exc)}")
        finally:
            self._handles.pop(request.request_id, None)
            if not finished:
                handle.abort()  # the client left: TensorRT-LLM stops computing it

    def abort(self, request_id: str) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.abort()

    def stats(self) -> EngineStats:
        """TensorRT-LLM's latest iteration stats, bounded by what is in flight here: it reports
        only when it iterates, so an idle engine's last report would otherwise linger."""
        stats, in_flight = self._stats, len(self._handles)
        running = min(stats.num_running, in_flight)
        return replace(
            stats,
            num_running=running,
            num_waiting=min(stats.num_waiting, in_flight - running),
            kv_blocks_used=stats.kv_blocks_used if in_flight else 0,
        )

    def kv_events(self) -> list[KVEvent]:
        """None: TensorRT-LLM's KV cache events are not read here (a Dynamo worker of this engine
        is routed by load only, as its start-up log says)."""
        return []

    # --- mapping ----------------------------------------------------------------------------------

    def _sampling(self, request: GenerationRequest) -> Any:
        guided = request.sampling.guided
        if guided is not None and guided.start_after:
            raise RequestRefusedError(
                "structured output (response_format, structured_outputs, guided_*, or a required or named "
                "tool_choice) on a reasoning model is not served by the tensorrt_llm engine: its grammar "
                "would constrain the thinking as well as the answer (NIM_REASONING_PARSER is in effect); "
                'send no constraint, turn the thinking off (chat_template_kwargs: {"enable_thinking": '
                "false}), or serve with the torch engine"
            )
        why = refusal(request.sampling, self.sampler)
        if why is not None:
            raise RequestRefusedError(why)
        try:
            return to_trtllm(self.api, request.sampling, self._info.vocab_size, self.sampler)
        except (ValueError, TypeError) as exc:
            raise RequestRefusedError(
                f"tensorrt_llm refuses these sampling parameters: {one_line(exc)}"
            ) from exc

    def _lora_request(self, name: str) -> Any:
        if self.adapters is None:
            raise RequestRefusedError(f"LoRA adapter {name!r} requested, but this engine serves none")
        path = self.adapters.path(name)
        if path is None:
            raise RequestRefusedError(f"LoRA adapter {name!r} is no longer served")
        adapter_id = self._lora_ids.setdefault(name, len(self._lora_ids) + 1)
        try:
            return self.api.LoRARequest(name, adapter_id, str(path))
        except ValueError as exc:  # the directory went away since it was listed
            raise RequestRefusedError(f"LoRA adapter {name!r}: {one_line(exc)}") from exc

    def _delta(self, request: GenerationRequest, out: Any, handed: _Handed) -> RequestOutput:
        """The part of TensorRT-LLM's cumulative output `out` not yet handed out. Total: an
        output it cannot express raises UnmappableOutputError (that request fails, alone)."""
        completion = out.outputs[0]
        token_ids = [int(t) for t in (completion.token_ids or [])]
        text = completion.text or ""
        new_ids = token_ids[handed.tokens :]  # empty when a stop-word trim shortened the list
        logprobs = None
        if request.sampling.logprobs is not None:
            entries, start = list(completion.logprobs or []), handed.tokens
            if len(entries) < start + len(new_ids):  # not cumulative: this step's only
                entries, start = list(getattr(completion, "logprobs_diff", None) or []), 0
            logprobs = self._logprobs(entries, new_ids, start, request.sampling.logprobs)
        new_text = text[handed.text :]
        handed.tokens, handed.text = max(handed.tokens, len(token_ids)), max(handed.text, len(text))
        reason, error = None, None
        if out.finished:
            raw = completion.finish_reason
            reason = _FINISH.get(raw)
            if reason is None:
                error = f"tensorrt_llm ended the request with finish reason {raw!r}"
        return RequestOutput(
            request_id=request.request_id,
            text=new_text,
            token_ids=new_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=len(token_ids),
            finished=bool(out.finished),
            finish_reason=reason,
            error=error,
            logprobs=logprobs,
            time=time.monotonic(),
        )

    def _logprobs(
        self, entries: list[Any], token_ids: list[int], start: int, top_n: int
    ) -> list[TokenLogprob]:
        """Our logprobs for `token_ids`, which sit at positions start, start + 1, ... of
        `entries`: TensorRT-LLM's cumulative `logprobs`, which may run longer than its token_ids
        (the stop tokens it trimmed from them), or, should a release hand only each step's, its
        `logprobs_diff` (start 0)."""
        mapped = []
        for position, token_id in enumerate(token_ids, start):
            entry = entries[position] if position < len(entries) else None
            logprob = token_logprob(token_id, entry, top_n)
            if logprob is None:
                raise UnmappableOutputError(
                    f"tensorrt_llm {self.sampler.version} returned no logprob for the sampled token "
                    f"{token_id} at position {position}"
                )
            mapped.append(logprob)
        return mapped

    def _ended(self, request: GenerationRequest, error: str, cause: ErrorCause = "engine") -> RequestOutput:
        """A final output: the request failed with `error` (`cause`: whose fault it was)."""
        num_prompt, now = len(request.prompt_token_ids), time.monotonic()
        return RequestOutput(
            request.request_id, "", [], num_prompt, 0, True, error=error, error_cause=cause, time=now
        )

    # --- health and stats ---------------------------------------------------------------------------

    def _executor_failed(self, exc: BaseException) -> bool:
        """Whether `exc` means TensorRT-LLM's executor as a whole is gone (its C++ executor
        failed, or it was shut down), rather than one request failing."""
        if isinstance(exc, self.api.CppExecutorError):
            return True
        executor = getattr(self.llm, "_executor", None)
        if executor is None:
            return isinstance(exc, RuntimeError) and "shutting down" in str(exc)
        is_shutdown = getattr(executor, "is_shutdown", None)
        if callable(is_shutdown):
            return bool(is_shutdown())
        return bool(getattr(executor, "doing_shutdown", False))

    def _die(self, exc: BaseException) -> None:
        if self._failure is not None:
            return
        self._failure = one_line(exc, with_type=True)
        log.error("tensorrt_llm engine failed: %s", self._failure)
        for handle in list(self._handles.values()):
            with contextlib.suppress(Exception):
                handle.abort()
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _poll_stats(self) -> None:
        """Start polling iteration stats, once: at the first request."""
        if self._stats_task is None and self._failure is None:
            self._stats_task = asyncio.create_task(self._collect_stats(), name="trtllm-stats")

    async def _collect_stats(self) -> None:
        """Fold TensorRT-LLM's iteration stats into EngineStats, forever (cancelled at stop)."""
        while True:
            try:
                async for stat in self.llm.get_stats_async(STATS_TIMEOUT_S):
                    self._stats = fold_stats(self._stats, stat)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # stats are best effort; serving goes on
                log.warning("tensorrt_llm stats: %s", one_line(exc))
            await asyncio.sleep(0.5)


def fold_stats(stats: EngineStats, stat: dict[str, Any]) -> EngineStats:
    """One iteration-stats record (camelCase keys, as TensorRT-LLM serializes them) into ours."""
    kv = stat.get("kvCacheStats") or {}
    batching = stat.get("inflightBatchingStats") or {}
    per_block = int(kv.get("tokensPerBlock") or 0)
    scheduled = int(batching.get("numScheduledRequests") or 0)
    tokens = int(batching.get("numCtxTokens") or 0) + int(batching.get("numGenRequests") or 0)
    updated = replace(
        stats,
        num_running=int(stat.get("numActiveRequests") or 0),
        num_waiting=int(stat.get("numQueuedRequests") or 0),
        kv_blocks_used=int(kv.get("usedNumBlocks") or 0),
        kv_blocks_total=int(kv.get("maxNumBlocks") or 0),
        # reusedBlocks / missedBlocks count since start (like our counters): taken as they are
        prefix_queries=per_block * (int(kv.get("reusedBlocks") or 0) + int(kv.get("missedBlocks") or 0)),
        prefix_hits=per_block * int(kv.get("reusedBlocks") or 0),
    )
    if scheduled:
        updated = replace(
            updated,
            num_steps=updated.num_steps + 1,
            step_tokens=updated.step_tokens.observe(tokens),
            step_sequences=updated.step_sequences.observe(scheduled),
            step_seconds=updated.step_seconds.observe(float(stat.get("iterLatencyMS") or 0) / 1000),
        )
    return updated
