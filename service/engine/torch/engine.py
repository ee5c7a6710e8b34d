"""The PyTorch engine: one thread runs the step loop; the event loop never waits on it.

Step loop (all on the engine thread):
  1. apply new requests and aborts from the inbox (block only when there is nothing to do), so
     an abort frees its blocks before the next step is scheduled;
  2. the scheduler picks this step's work: decode tokens of running requests and chunks of
     waiting prompts, under one token budget, with blocks from the paged KV cache; that decision
     becomes a plain StepPlan;
  3. the model runner runs the plan: one forward pass over the mixed batch, then sampling;
  4. output processing detokenizes, checks stop conditions and posts each request's delta to
     its asyncio queue (the event loop is woken once, after the step's last delta); finished
     requests free their blocks at once; a stats snapshot is published for metering.

LoRA: device slots are a scheduler resource (service.engine.torch.lora_admission): a request
naming an adapter is admitted only with a slot holding it (shared with the other requests of
that adapter; the adapter's weights are copied in when the slot held another) and keeps it until
it ends; while every slot is held by requests of other adapters, or while its adapter is read
into host memory, it waits in the queue without holding KV blocks. Its prefix-cache hash chain
is salted with the adapter and its version, so it never shares KV blocks with the base model or
another adapter.

Beside this module: the step plan is built by service.engine.torch.planner, outputs by
service.engine.torch.outputs, stats snapshots by service.engine.torch.engine_stats, and how
decode steps run is decided once, at build, by service.engine.torch.decode_path.

Endings: every request ends with exactly one finished output: finish_reason stop or length, or
abort (the client left, or the server is stopping), or an `error` when the engine failed it.
If the step loop itself dies, the engine is dead: every request in flight and every request
still in the inbox ends with an error at once, `ready` turns False, `failure` says why, later
`generate` calls raise EngineDeadError, and `on_fatal` is called so the process can exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from service.engine.config import GuidedLimits
from service.engine.kv_events import KVEventLog
from service.engine.lora_store import LoraStore
from service.engine.models.base import CausalLM
from service.engine.models.config import ModelConfig
from service.engine.output import OutputProcessor
from service.engine.protocol import (
    EngineDeadError,
    EngineInfo,
    EngineStats,
    ErrorCause,
    GenerationRequest,
    KVEvent,
    RequestOutput,
    RequestRefusedError,
    SamplingParams,
    TokenLogprob,
)
from service.engine.torch.block_pool import BlockPool
from service.engine.torch.decode_path import DecodeOptions, choose_decode_path
from service.engine.torch.engine_stats import StatsPublisher
from service.engine.torch.guided import GrammarCompiler, GrammarError
from service.engine.torch.kv_cache_manager import KVCacheManager
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.lora_admission import LoraAdmission
from service.engine.torch.lora_slots import LoraSlots
from service.engine.torch.model_runner import ModelRunner, StepResult
from service.engine.torch.outputs import LiveRequest, Sink, refuse
from service.engine.torch.planner import StepPlanner
from service.engine.torch.request import Request
from service.engine.torch.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from service.engine.torch.step_plan import StepPlan
from service.engine.torch.tp_group import TensorParallelError, TPGroup
from service.text.tokenizer import Tokenizer
from service.util import one_line

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.5


class LoopOutbox:
    """Hands outputs from the engine thread to one event loop's queues, a batch at a time.

    The first output after a flush schedules the next flush (one wake-up of the event loop); the
    rest join the batch without another. While the engine holds the outbox (across one step's
    output processing) outputs only gather, and letting go schedules the flush: a step of 64
    sequences wakes the loop once, not 64 times, and never before its last output is in (a loop
    woken by the first output would take the interpreter lock from the step to flush a few).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]] = []
        self._flush_scheduled = False
        self._held = False

    def put(self, queue: asyncio.Queue[RequestOutput], out: RequestOutput) -> None:
        with self._lock:
            self._items.append((queue, out))
            if self._held or self._flush_scheduled:
                return
            self._flush_scheduled = True
        self._schedule_flush()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Gather outputs without waking the loop; the flush is scheduled on leaving."""
        with self._lock:
            self._held = True
        try:
            yield
        finally:
            with self._lock:
                self._held = False
                wake = bool(self._items) and not self._flush_scheduled
                self._flush_scheduled |= wake
            if wake:
                self._schedule_flush()

    def _schedule_flush(self) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._flush_scheduled = False
        for outputs, out in items:
            outputs.put_nowait(out)


@dataclass(frozen=True)
class TorchEngineConfig:
    """The torch engine's resolved settings: device, dtype and KV pool size are decided."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    kv_spec: KVCacheSpec
    enable_prefix_caching: bool
    device: torch.device
    dtype: torch.dtype
    # What the decode path (service.engine.torch.decode_path) is decided from, once, at build:
    decode_kernel: bool = False  # the Triton paged kernel runs here (CUDA)
    enforce_eager: bool = False  # NIM_ENFORCE_EAGER: no CUDA graphs, no TorchScript step
    unified_attention: bool = True  # NIM_UNIFIED_ATTENTION: the unified kernel may run (CUDA, checked)
    guided: GuidedLimits = field(default_factory=GuidedLimits)  # structured output: compile limits
    record_kv_events: bool = False  # the prefix cache logs its events for kv_events()


@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Wake:
    """A LoRA adapter's read into host memory ended: requests waiting on it may be admitted (or
    fail, when it could not be read)."""


@dataclass(frozen=True)
class _Fail:
    """Posted by another thread that saw the engine become unusable (a tensor-parallel rank died)."""

    error: BaseException


class TorchEngine:
    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        config: TorchEngineConfig,
        info: EngineInfo,
        on_fatal: Callable[[BaseException], None] | None = None,
        tp_group: TPGroup | None = None,
        adapters: LoraStore | None = None,
        lora_slots: LoraSlots | None = None,
    ) -> None:
        """The engine serves structured output when `info.features.guided_decoding` says so (its
        grammar compiler is made on first use)."""
        if (adapters is None) != (lora_slots is None):
            raise ValueError("LoRA needs both the adapter store and the model's slots")
        self.model = model
        self.adapters = adapters
        self.tp_group = tp_group  # tensor parallelism: the worker ranks (this process is rank 0)
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self._info = info
        self.on_fatal = on_fatal
        events = KVEventLog() if config.record_kv_events else None
        self.pool = BlockPool(config.num_blocks, enable_caching=config.enable_prefix_caching, events=events)
        self.kv = KVCacheManager(self.pool, config.kv_spec.block_size)
        self.kv_pool = KVPool(config.kv_spec, config.num_blocks, config.device)
        self._inbox: queue.Queue[_Submit | _Abort | _Fail | _Wake | None] = queue.Queue()
        self.lora = (
            LoraAdmission(adapters, lambda: self._inbox.put(_Wake())) if adapters is not None else None
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv, self.lora
        )
        self.planner = StepPlanner(self.kv, self.lora)
        self.stats_publisher = StatsPublisher(self.pool, self.kv, self.scheduler, lora=adapters is not None)
        options = DecodeOptions(
            kernel=config.decode_kernel,
            enforce_eager=config.enforce_eager,
            max_num_seqs=min(config.max_num_seqs, config.max_num_batched_tokens),  # decodes in a step
            max_model_len=config.max_model_len,
            tensor_parallel=tp_group is not None,
            unified=config.unified_attention,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.runner = ModelRunner(
            model,
            self.kv_pool,
            config.device,
            choose_decode_path(model, self.kv_pool, config.device, options),
            followers=tp_group,
            lora=lora_slots,
            grammars=self._grammar_compiler if info.features.guided_decoding else None,
        )
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._live: dict[str, LiveRequest] = {}
        self._inbox_lock = threading.Lock()  # orders submissions against the engine dying
        self._thread: threading.Thread | None = None
        self._ready = False
        self._stopping = False
        self._failure: str | None = None
        # One per event loop that submits requests (normally the server's one); weakly held, so a
        # loop that is closed and dropped (tests run many) takes its outbox with it.
        self._outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopOutbox] = (
            weakref.WeakKeyDictionary()
        )
        self._outboxes_lock = threading.Lock()  # event loops add outboxes; the engine holds them

    # --- Engine protocol (event-loop side) ------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        """What this engine is, with the decode path's decisions (the graphs' once captured)."""
        return replace(self._info, paths=self._info.paths + self.runner.path.choices())

    @property
    def ready(self) -> bool:
        return self._ready and self._failure is None

    @property
    def failure(self) -> str | None:
        return self._failure

    async def start(self) -> None:
        """Warm up and capture on the engine's own thread, which then runs the step loop.

        All of the engine's PyTorch work runs on that one thread: on CPUs every thread that runs
        parallel ops keeps an OpenMP pool of its own, and more pooled threads than cores make
        GNU OpenMP stop spinning between parallel regions (a decode step ~1.6x slower).
        """
        loop = asyncio.get_running_loop()
        warmed: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if warmed.done():
                return
            if error is None:
                warmed.set_result(None)
            else:
                warmed.set_exception(error)

        def run() -> None:
            try:
                self._warm_up()
            except BaseException as exc:
                loop.call_soon_threadsafe(settle, exc)
                return
            loop.call_soon_threadsafe(settle, None)
            self._run()

        if self.tp_group is not None:
            self.tp_group.watch(lambda exc: self._inbox.put(_Fail(exc)))
        self._thread = threading.Thread(target=run, name="torch-engine", daemon=True)
        self._thread.start()
        try:
            await warmed
        except BaseException:
            await self._stop_ranks()
            raise
        if self.adapters is not None:
            self.adapters.start_refreshing()
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        if self.adapters is not None:
            self.adapters.stop_refreshing()
        if self.lora is not None:
            self.lora.close()
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        await self._stop_ranks()

    async def _stop_ranks(self) -> None:
        if self.tp_group is not None:
            await asyncio.to_thread(self.tp_group.shutdown)

    async def check(self, request: GenerationRequest) -> None:
        """The API has validated the sampling fields; what is left is the adapter and the grammar,
        which is checked and compiled here under the NIM_*GUIDED* limits, in a worker process that
        is killed when this is cancelled (and cached for the step that needs it)."""
        if request.adapter is not None and self.adapters is None:
            raise RequestRefusedError(
                f"LoRA adapter {request.adapter!r} requested, but this engine serves none"
            )
        guided, sampling = request.sampling.guided, request.sampling
        if guided is None:
            return
        if not self._info.features.guided_decoding:
            raise RequestRefusedError(
                "structured output (response_format, guided_*) needs xgrammar, which this server lacks"
            )
        if sampling.ignore_eos or sampling.min_tokens:
            field = "ignore_eos" if sampling.ignore_eos else "min_tokens"
            raise RequestRefusedError(
                f"{field} cannot be combined with structured output: the grammar decides the end"
            )
        try:
            grammars = await asyncio.to_thread(self._grammar_compiler)  # made on first use
            await grammars.prepare(guided)
        except GrammarError as exc:
            raise RequestRefusedError(str(exc)) from None

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                vocab_size = self.model_config.vocab_size
                self._grammars = GrammarCompiler(self.tokenizer, vocab_size, self.config.guided)
            return self._grammars

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        loop = asyncio.get_running_loop()
        with self._outboxes_lock:
            outbox = self._outboxes.get(loop)
            if outbox is None:
                outbox = self._outboxes[loop] = LoopOutbox(loop)
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        sink = functools.partial(outbox.put, outputs)

        with self._inbox_lock:
            if self._failure is not None:
                raise EngineDeadError(self._failure)
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
        return self.stats_publisher.snapshot

    def kv_events(self) -> list[KVEvent]:
        return self.pool.events.drain() if self.pool.events is not None else []

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
            self._die(exc)
            return
        self._end_all()

    def _die(self, exc: BaseException) -> None:
        message = one_line(exc, with_type=True)
        if self.tp_group is not None:
            death = self.tp_group.wait_for_death(1.0)  # a collective may fail before the watchdog wakes
            if death is not None and death not in message:
                message = f"{death}; {message}"  # the cause beside what the step saw
                exc = TensorParallelError(message)
            self.tp_group.shutdown()  # no rank outlives the engine
        with self._inbox_lock:  # nothing is submitted after this, and nothing before is stranded
            self._failure = message  # readiness turns false first
            stranded: list[_Submit] = []
            with contextlib.suppress(queue.Empty):
                while True:
                    item = self._inbox.get_nowait()
                    if isinstance(item, _Submit):
                        stranded.append(item)
        self._end_all(error=f"engine failure: {message}")
        for item in stranded:
            refuse(item.request, item.sink, f"engine failure: {message}")
        if self.on_fatal is not None:
            self.on_fatal(exc)

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

    def _handle(self, item: _Submit | _Abort | _Fail | _Wake | None) -> None:
        if item is None:
            self._stopping = True
        elif isinstance(item, _Fail):
            raise item.error
        elif isinstance(item, _Wake):
            self.scheduler.wake()
        elif isinstance(item, _Submit):
            try:
                self._admit(item)
            except Exception as exc:  # a bad request must fail alone, never the step loop
                log.warning("request %s refused at admission: %s", item.request.request_id, exc)
                self._live.pop(item.request.request_id, None)
                refuse(item.request, item.sink, f"request could not be admitted: {one_line(exc)}")
        else:
            request = self.scheduler.abort(item.request_id)
            live = self._live.pop(item.request_id, None)
            if live is not None:
                self.planner.ended(item.request_id)
                if request is not None:
                    live.end()
            self.stats_publisher.publish()

    def _admit(self, item: _Submit) -> None:
        gen = item.request
        num_prompt = len(gen.prompt_token_ids)
        if not 0 < num_prompt < self.config.max_model_len:
            raise ValueError(
                f"a prompt of {num_prompt} tokens does not fit the context of {self.config.max_model_len}"
            )
        if gen.request_id in self._live:
            raise ValueError(f"duplicate request id {gen.request_id!r}")
        output = OutputProcessor(self.tokenizer, gen.sampling, num_prompt, self.config.max_model_len)
        request = Request.from_generation(gen, tuple(sorted(output.stop_token_ids)))
        self.scheduler.add(request)  # refuses an adapter where none is served
        prompt_logprobs: list[TokenLogprob | None] | None = None
        if gen.sampling.prompt_logprobs is not None:
            prompt_logprobs = [None]
        self._live[gen.request_id] = LiveRequest(request, item.sink, output, prompt_logprobs)

    def _step(self) -> None:
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        for request, why in scheduled.failed:  # their LoRA adapter cannot run
            self._fail(request.request_id, why, "request")
        if not scheduled.chunks:
            self.stats_publisher.publish()
            return
        self._mark_scheduled(scheduled)
        plan = self._plan(scheduled)
        result = self.runner.execute(plan)
        for request_id, failure in result.failed.items():  # before their blocks are published
            self._fail(request_id, failure.message, failure.cause, discard=failure.non_finite)
        self.scheduler.step_done(scheduled)
        with contextlib.ExitStack() as holding:
            with self._outboxes_lock:
                outboxes = list(self._outboxes.values())
            for outbox in outboxes:
                holding.enter_context(outbox.held())
            self._apply(plan, result)
        self.stats_publisher.publish(plan, time.perf_counter() - started)

    def _mark_scheduled(self, scheduled: SchedulerOutput) -> None:
        """The requests this step computes: a request's first such step ends its queue time."""
        now = time.monotonic()
        for chunk in scheduled.chunks:
            live = self._live.get(chunk.request.request_id)
            if live is not None:
                live.scheduled(now)

    def _plan(self, scheduled: SchedulerOutput) -> StepPlan:
        return self.planner.plan(scheduled)

    def _apply(self, plan: StepPlan, result: StepResult) -> None:
        for request_id, entries in result.prompt_logprobs.items():
            live = self._live.get(request_id)
            if live is not None and live.prompt_logprobs is not None:
                live.prompt_logprobs.extend(entries)
        sampling_ids = [rid for rid, samples in zip(plan.request_ids, plan.sample, strict=True) if samples]
        now = time.monotonic()
        for request_id, token in zip(sampling_ids, result.sampled, strict=True):
            live = self._live.get(request_id)
            if live is None:
                continue  # aborted while the step ran, or its row failed
            live.request.token_ids.append(token.token_id)
            try:
                text, reason = live.output.process(token.token_id)
            except Exception as exc:  # its detokenizer or stop strings: this request alone fails
                log.exception("request %s: output processing failed", request_id)
                self._fail(request_id, f"output processing failed: {one_line(exc)}", "engine")
                continue
            if reason is not None:
                self._end(live)
            live.send(text, [token.token_id], reason, [token.logprob] if token.logprob else None, now)

    def _end(self, live: LiveRequest, discard: bool = False) -> None:
        """`live` is done: its blocks and LoRA slot are freed now (with `discard`, its blocks are
        also unpublished and zeroed before reuse); the runner forgets it next step."""
        request_id = live.request.request_id
        self.scheduler.abort(request_id, discard)
        del self._live[request_id]
        self.planner.ended(request_id)

    def _fail(self, request_id: str, message: str, cause: ErrorCause, discard: bool = False) -> None:
        """End one request with an error; the step, the batch and the engine go on."""
        live = self._live.get(request_id)
        if live is None:
            return
        log.warning("request %s failed: %s", request_id, message)
        self._end(live, discard)
        live.end(message, cause)

    def _end_all(self, error: str | None = None) -> None:
        """End every request in flight: failed with `error`, else aborted (the server is stopping)."""
        now = time.monotonic()
        for live in list(self._live.values()):
            self.scheduler.abort(live.request.request_id)
            live.end(error, now=now)
        self._live.clear()
        self.stats_publisher.publish()

    # --- Start-up -----------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Run a prefill and decode steps through the real path and capture the decode graphs
        (before readiness); stats and the prefix cache forget it."""
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
            if self.runner.decode_graphs is not None:
                self.runner.decode_graphs.capture()
            self.pool.reset_cache()
            self.kv.prefix_queries = self.kv.prefix_hits = 0
            self.scheduler.num_preemptions = 0
        self.stats_publisher.reset()
