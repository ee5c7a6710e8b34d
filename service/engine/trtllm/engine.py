"""The TensorRT-LLM engine behind our Engine interface: one `tensorrt_llm.LLM` per process.

Requests go to `LLM.generate_async` as token ids (the API has applied the chat template with the
model's own tokenizer) with streaming on; each iteration's `text_diff` / `token_ids_diff` becomes
one RequestOutput delta, and TensorRT-LLM's finish reasons map to ours (stop, length; cancelled
-> abort; timeout -> an error naming it). A client that leaves closes the generator, which aborts
the request in TensorRT-LLM. A request TensorRT-LLM fails (`RequestError`) ends with an error and
the engine serves on; any other exception from the executor means the engine is dead: every
request in flight ends with an error, readiness turns false, `on_fatal` lets the process exit.
Iteration stats (`get_stats_async`, with enable_iter_perf_stats) feed the same EngineStats the
torch engine publishes, so /metrics carries the same names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import Any

from service.engine.lora_store import LoraStore
from service.engine.protocol import (
    EngineDeadError,
    EngineInfo,
    EngineStats,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    RequestRefusedError,
)
from service.engine.trtllm.api import TrtllmApi
from service.engine.trtllm.sampling import to_trtllm, token_logprob
from service.util import one_line

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 2.0
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "cancelled": "abort"}


class TrtllmEngine:
    def __init__(
        self,
        api: TrtllmApi,
        make_llm: Callable[[], Any],
        info: EngineInfo,
        adapters: LoraStore | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.api = api
        self._make_llm = make_llm  # blocking: loads (or builds) the model
        self._info = info
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
        self._stats_task = asyncio.create_task(self._collect_stats(), name="trtllm-stats")
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
        except (ValueError, TypeError, RequestRefusedError) as exc:  # refused before it started
            yield self._ended(request, f"tensorrt_llm refused the request: {one_line(exc)}")
            return
        except RuntimeError as exc:  # "LLM is shutting down", or an executor that is gone
            self._die(exc)
            raise EngineDeadError(self._failure or one_line(exc)) from exc
        self._handles[request.request_id] = handle
        finished = False
        try:
            async for out in handle:
                delta = self._delta(request, out)
                finished = delta.finished
                yield delta
                if finished:
                    return
        except self.api.RequestError as exc:
            finished = True
            yield self._ended(request, f"tensorrt_llm failed the request: {one_line(exc)}")
        except Exception as exc:
            finished = True
            self._die(exc)
            yield self._ended(request, f"engine failure: {self._failure}")
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

    # --- mapping ----------------------------------------------------------------------------------

    def _sampling(self, request: GenerationRequest) -> Any:
        try:
            return to_trtllm(self.api, request.sampling, self._info.vocab_size)
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

    def _delta(self, request: GenerationRequest, out: Any) -> RequestOutput:
        completion = out.outputs[0]
        token_ids = list(completion.token_ids_diff)
        logprobs = None
        if request.sampling.logprobs is not None:
            entries = list(completion.logprobs_diff)
            top_n = request.sampling.logprobs
            logprobs = [token_logprob(t, e, top_n) for t, e in zip(token_ids, entries, strict=True)]
        reason, error = None, None
        if out.finished:
            raw = completion.finish_reason
            reason = _FINISH.get(raw)
            if reason is None:
                error = f"tensorrt_llm ended the request with finish reason {raw!r}"
        return RequestOutput(
            request_id=request.request_id,
            text=completion.text_diff,
            token_ids=token_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=len(completion.token_ids),
            finished=bool(out.finished),
            finish_reason=reason,
            error=error,
            logprobs=logprobs,
            time=time.monotonic(),
        )

    def _ended(self, request: GenerationRequest, error: str) -> RequestOutput:
        """A final output: the request failed with `error`."""
        num_prompt, now = len(request.prompt_token_ids), time.monotonic()
        return RequestOutput(request.request_id, "", [], num_prompt, 0, True, error=error, time=now)

    # --- health and stats ---------------------------------------------------------------------------

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
