"""The PyTorch engine: one thread runs the step loop; the event loop never waits on it.

Step loop (all on the engine thread):
  1. apply new requests and aborts from the inbox (block only when there is nothing to do), so
     an abort frees its blocks before the next step is scheduled;
  2. the scheduler picks this step's work: decode tokens of running requests and chunks of
     waiting prompts, under one token budget, with blocks from the paged KV cache;
  3. the model runs once over the whole mixed batch;
  4. requests whose chunk completed sample a token; output processing detokenizes, checks stop
     conditions and posts each request's delta to its asyncio queue; finished requests free
     their blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import torch

from service.engine.models.config import ModelConfig
from service.engine.models.llama import LlamaForCausalLM
from service.engine.output import OutputProcessor
from service.engine.protocol import (
    EngineDeadError,
    EngineStats,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from service.engine.torch.block_pool import BlockPool
from service.engine.torch.kv_cache_manager import KVCacheManager
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.model_runner import ModelRunner, StepLogits
from service.engine.torch.request import Request
from service.engine.torch.sampler import SamplingRow, make_generator, sample, token_logprob
from service.engine.torch.scheduler import Scheduler, SchedulerConfig
from service.metrics import Metrics
from service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]
IDLE_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    kv_spec: KVCacheSpec
    enable_prefix_caching: bool
    device: torch.device
    dtype: torch.dtype


@dataclass
class _Live:
    """Engine-thread state of one request beside its scheduler state."""

    request: Request
    output: OutputProcessor
    generator: torch.Generator
    end_token_ids: frozenset[int]
    last_token_time: float = 0.0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False


@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


class TorchEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        config: EngineConfig,
        metrics: Metrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.pool = BlockPool(config.num_blocks, enable_caching=config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.kv_spec.block_size)
        self.kv_pool = KVPool(config.kv_spec, config.num_blocks, config.device)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv
        )
        self.runner = ModelRunner(model, self.kv_pool, self.kv, config.device)
        self._live: dict[str, _Live] = {}
        self._inbox: queue.Queue[_Submit | _Abort | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ready = False
        self._stopping = False
        self._fatal: BaseException | None = None
        if metrics is not None:
            metrics.set_cache_config(config.kv_spec.block_size, config.num_blocks, config.kv_spec.name)

    # --- Engine protocol (event-loop side) ------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready and self._fatal is None

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    async def start(self) -> None:
        await asyncio.to_thread(self._warm_up)
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        if self._fatal is not None:
            raise EngineDeadError(f"engine failed: {self._fatal}")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            # A closed event loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(outputs.put_nowait, out)

        self._inbox.put(_Submit(request, sink))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            extra={"kv_cache_usage": self.pool.usage, "num_free_blocks": float(self.pool.num_free)},
        )

    # --- Engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            with torch.inference_mode():
                while not self._stopping:
                    self._drain_inbox(block=not self.scheduler.has_work())
                    if self._stopping:
                        break
                    self._step()
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine step loop failed")
            self._fatal = exc  # readiness turns false first
            if self.on_fatal is not None:
                self.on_fatal(exc)
            self._fail_all(f"engine failure: {exc.__class__.__name__}: {exc}")
            return
        self._fail_all("server shutting down")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_POLL_SECONDS) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: _Submit | _Abort | None) -> None:
        if item is None:
            self._stopping = True
        elif isinstance(item, _Submit):
            try:
                self._admit(item)
            except Exception as exc:  # a bad request must fail alone, never the step loop
                log.warning("request %s refused at admission: %s", item.request.request_id, exc)
                self._live.pop(item.request.request_id, None)
                gen = item.request
                message = f"request could not be admitted: {exc}"
                item.sink(
                    RequestOutput(
                        gen.request_id, "", [], len(gen.prompt_token_ids), 0, True, "abort", message
                    )
                )
        else:
            request = self.scheduler.abort(item.request_id)
            live = self._live.pop(item.request_id, None)
            if request is not None and live is not None:
                self._emit(live, "", [], finish_reason="abort")
            self._publish_stats()

    def _admit(self, item: _Submit) -> None:
        gen = item.request
        num_prompt = len(gen.prompt_token_ids)
        if not 0 < num_prompt < self.config.max_model_len:
            error = f"prompt of {num_prompt} tokens does not fit the context of {self.config.max_model_len}"
            item.sink(RequestOutput(gen.request_id, "", [], num_prompt, 0, True, "abort", error))
            return
        if gen.request_id in self._live:
            item.sink(
                RequestOutput(gen.request_id, "", [], num_prompt, 0, True, "abort", "duplicate request id")
            )
            return
        params = gen.sampling
        output = OutputProcessor(self.tokenizer, params, num_prompt, self.config.max_model_len)
        request = Request.from_generation(gen, item.sink)
        self._live[gen.request_id] = _Live(
            request=request,
            output=output,
            generator=make_generator(params, self.config.device),
            end_token_ids=output.stop_token_ids,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        self.scheduler.add(request)

    def _step(self) -> None:
        scheduled = self.scheduler.schedule()
        if scheduled.preempted and self.metrics is not None:
            self.metrics.observe_preemptions(len(scheduled.preempted))
        if not scheduled.chunks:
            return
        step = self.runner.execute(scheduled.chunks)
        self._collect_prompt_logprobs(step)
        self.scheduler.step_done(scheduled)
        self._sample_and_emit(step)
        self._publish_stats()

    def _collect_prompt_logprobs(self, step: StepLogits) -> None:
        for chunk, (first, _) in zip(step.chunks, step.rows, strict=True):
            live = self._live[chunk.request.request_id]
            if live.prompt_logprobs is None:
                continue
            request = chunk.request
            start = chunk.start
            # Row j predicts token start + j + 1; keep those still inside the prompt.
            for j in range(chunk.num_tokens):
                target = start + j + 1
                if target >= request.num_prompt_tokens or target < len(live.prompt_logprobs):
                    continue
                logprobs = torch.log_softmax(step.logits[first + j], dim=-1)
                top_n = request.sampling.prompt_logprobs or 0
                live.prompt_logprobs.append(token_logprob(logprobs, request.token_ids[target], top_n))

    def _sample_and_emit(self, step: StepLogits) -> None:
        completing = [(c, end - 1) for c, (_, end) in zip(step.chunks, step.rows, strict=True) if c.completes]
        if not completing:
            return
        lives = [self._live[c.request.request_id] for c, _ in completing]
        index = torch.tensor([row for _, row in completing], dtype=torch.long, device=step.logits.device)
        logits = step.logits.index_select(0, index)  # [B, V]
        rows = [
            SamplingRow(
                params=live.request.sampling,
                generator=live.generator,
                token_ids=live.request.token_ids,
                num_prompt_tokens=live.request.num_prompt_tokens,
                end_token_ids=live.end_token_ids,
            )
            for live in lives
        ]
        sampled = sample(logits, rows)
        now = time.monotonic()
        for live, token in zip(lives, sampled, strict=True):
            request = live.request
            request.token_ids.append(token.token_id)
            first = request.num_generated == 1
            if self.metrics is not None:
                if first:
                    self.metrics.observe_prefill(request.num_prompt_tokens)
                previous = request.arrival_time if first else live.last_token_time
                self.metrics.observe_token(first, now - previous)
            live.last_token_time = now
            text, reason = live.output.process(token.token_id)
            if reason is not None:
                self.scheduler.finish(request)
                del self._live[request.request_id]
            self._emit(live, text, [token.token_id], reason, [token.logprob] if token.logprob else None)

    def _emit(
        self,
        live: _Live,
        text: str,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        request = live.request
        prompt_logprobs = None
        if live.prompt_logprobs is not None and not live.prompt_logprobs_sent:
            prompt_logprobs, live.prompt_logprobs_sent = live.prompt_logprobs, True
        if finish_reason is not None and self.metrics is not None:
            self.metrics.observe_finished(
                finish_reason,
                time.monotonic() - request.arrival_time,
                request.num_prompt_tokens,
                request.num_generated,
            )
        request.sink(
            RequestOutput(
                request_id=request.request_id,
                text=text,
                token_ids=token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                num_generated_tokens=request.num_generated,
                finished=finish_reason is not None,
                finish_reason=finish_reason,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                num_cached_tokens=request.num_cached_tokens,
            )
        )

    def _fail_all(self, message: str) -> None:
        for live in list(self._live.values()):
            self.scheduler.abort(live.request.request_id)
            request = live.request
            request.sink(
                RequestOutput(
                    request_id=request.request_id,
                    text="",
                    token_ids=[],
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_generated_tokens=request.num_generated,
                    finished=True,
                    finish_reason="abort",
                    error=message,
                )
            )
        self._live.clear()
        self._publish_stats()

    def _publish_stats(self) -> None:
        if self.metrics is None:
            return
        self.metrics.set_engine_state(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_usage=self.pool.usage,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
        )

    # --- Start-up -----------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Run a prefill and decode steps through the real path; metrics and the cache forget it."""
        metrics, self.metrics = self.metrics, None
        try:
            with torch.inference_mode():
                prompt = self.tokenizer.encode("Warm-up: the quick brown fox jumps over the lazy dog", True)
                params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
                done = threading.Event()

                def sink(out: RequestOutput) -> None:
                    if out.finished:
                        done.set()

                self._admit(_Submit(GenerationRequest("warm-up", prompt, params, time.monotonic()), sink))
                while not done.is_set():
                    self._step()
                self.pool.reset_cache()
                self.kv.prefix_queries = self.kv.prefix_hits = 0
        finally:
            self.metrics = metrics
        self._publish_stats()
