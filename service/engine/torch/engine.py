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

LoRA: a request naming an adapter takes a device slot at admission (shared with the other
requests of that adapter; the adapter's weights are copied in when the slot held another) and
keeps it until it ends; while every slot is held by running requests of other adapters it waits,
in arrival order, without holding KV blocks. Its prefix-cache hash chain is salted with the
adapter and its version, so it never shares KV blocks with the base model or another adapter.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from service.engine.config import GuidedLimits
from service.engine.lora import LoraAdapter
from service.engine.lora_store import LoraStore, NoFreeSlotError, NotPreparedError, UnknownAdapterError
from service.engine.models.base import CausalLM
from service.engine.models.config import ModelConfig
from service.engine.models.lora_ops import NO_ADAPTER
from service.engine.output import OutputProcessor
from service.engine.protocol import (
    EngineDeadError,
    EngineInfo,
    EngineStats,
    ErrorCause,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    RequestRefusedError,
    SamplingParams,
    TokenLogprob,
)
from service.engine.torch.block_pool import BlockPool
from service.engine.torch.cuda_graphs import CudaGraphDecoder
from service.engine.torch.guided import GrammarCompiler, GrammarError
from service.engine.torch.kv_cache_manager import KVCacheManager
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.lora_slots import LoraSlots
from service.engine.torch.model_runner import ModelRunner, StepResult
from service.engine.torch.request import Request
from service.engine.torch.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from service.engine.torch.scripted_decode import ScriptedDecoder
from service.engine.torch.step_plan import NewRequest, ScheduledSequence, StepPlan, build_plan
from service.engine.torch.tp_group import TensorParallelError, TPGroup
from service.text.tokenizer import Tokenizer
from service.util import one_line

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]
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
    decode_kernel: bool = False  # decodes attend through the Triton paged kernel (CUDA)
    cuda_graphs: bool = False  # decode steps replay CUDA graphs captured at start-up
    scripted_decode: bool = False  # CPU decode-only steps run as one TorchScript call, where they can
    guided: GuidedLimits = field(default_factory=GuidedLimits)  # structured output: compile limits


@dataclass
class _Live:
    """Engine-thread state of one request beside its scheduler state."""

    request: Request
    sink: Sink
    output: OutputProcessor
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    introduced: bool = False  # the runner has been sent its NewRequest
    adapter: str | None = None  # the LoRA adapter it runs
    slot: int = NO_ADAPTER  # the device slot it holds (while it holds one)


@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Wake:
    """An adapter finished reading into host memory: requests parked on it may take a slot.
    With `error`, it could not be read: requests parked on it fail with that reason."""

    adapter: str
    error: str | None = None


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
        self.pool = BlockPool(config.num_blocks, enable_caching=config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.kv_spec.block_size)
        self.kv_pool = KVPool(config.kv_spec, config.num_blocks, config.device)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv
        )
        graphs = None
        if config.cuda_graphs:
            graphs = CudaGraphDecoder(
                model, self.kv_pool, config.max_num_seqs, config.max_model_len, config.device
            )
        self.runner = ModelRunner(
            model,
            self.kv_pool,
            config.device,
            graphs,
            config.decode_kernel,
            followers=tp_group,
            lora=lora_slots,
            grammars=self._grammar_compiler if info.features.guided_decoding else None,
            scripted=ScriptedDecoder.build(model, self.kv_pool) if config.scripted_decode else None,
        )
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._slot_waiting: list[str] = []  # requests waiting for a LoRA slot, in arrival order
        # Reads adapters evicted from host memory since the API prepared them, off this thread.
        self._adapter_reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self._reading: set[str] = set()
        self._slot_freed = False  # a parked request may fit now
        self._lora_fills: list[tuple[int, LoraAdapter]] = []  # slots the next plan fills
        self._live: dict[str, _Live] = {}
        self._ended: list[str] = []  # requests whose runner state the next plan releases
        self._inbox: queue.Queue[_Submit | _Abort | _Fail | _Wake | None] = queue.Queue()
        self._inbox_lock = threading.Lock()  # orders submissions against the engine dying
        self._thread: threading.Thread | None = None
        self._ready = False
        self._stopping = False
        self._failure: str | None = None
        self._stats = EngineStats(kv_blocks_total=config.num_blocks)
        # One per event loop that submits requests (normally the server's one); weakly held, so a
        # loop that is closed and dropped (tests run many) takes its outbox with it.
        self._outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopOutbox] = (
            weakref.WeakKeyDictionary()
        )
        self._outboxes_lock = threading.Lock()  # event loops add outboxes; the engine holds them

    # --- Engine protocol (event-loop side) ------------------------------------------------------

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
            self._adapter_reader.shutdown(wait=False, cancel_futures=True)
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
        return self._stats

    # --- Engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            with torch.inference_mode():
                while not self._stopping:
                    parked_may_fit = bool(self._slot_waiting) and self._slot_freed
                    self._drain_inbox(block=not (self.scheduler.has_work() or parked_may_fit))
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
            self._refuse(item, f"engine failure: {message}")
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
            self._reading.discard(item.adapter)
            self._slot_freed = True
            if item.error is not None:
                waiting_on = [r for r in self._slot_waiting if self._live[r].adapter == item.adapter]
                for request_id in waiting_on:
                    self._fail(request_id, item.error, "request")
        elif isinstance(item, _Submit):
            try:
                self._admit(item)
            except Exception as exc:  # a bad request must fail alone, never the step loop
                log.warning("request %s refused at admission: %s", item.request.request_id, exc)
                self._live.pop(item.request.request_id, None)
                self._refuse(item, f"request could not be admitted: {one_line(exc)}")
        else:
            request = self.scheduler.abort(item.request_id)
            live = self._live.pop(item.request_id, None)
            if live is not None:
                self._ended.append(item.request_id)
                parked = item.request_id in self._slot_waiting
                if parked:
                    self._slot_waiting.remove(item.request_id)
                self._release_slot(live)
                if request is not None or parked:
                    self._emit(live, "", [], finish_reason="abort")
            self._publish_stats()

    def _refuse(self, item: _Submit, message: str) -> None:
        gen = item.request
        num_prompt = len(gen.prompt_token_ids)
        item.sink(
            RequestOutput(gen.request_id, "", [], num_prompt, 0, True, error=message, time=time.monotonic())
        )

    def _admit(self, item: _Submit) -> None:
        gen = item.request
        num_prompt = len(gen.prompt_token_ids)
        if not 0 < num_prompt < self.config.max_model_len:
            raise ValueError(
                f"a prompt of {num_prompt} tokens does not fit the context of {self.config.max_model_len}"
            )
        if gen.request_id in self._live:
            raise ValueError(f"duplicate request id {gen.request_id!r}")
        if gen.adapter is not None and self.adapters is None:
            raise ValueError(f"LoRA adapter {gen.adapter!r} requested, but this engine serves none")
        output = OutputProcessor(self.tokenizer, gen.sampling, num_prompt, self.config.max_model_len)
        request = Request.from_generation(gen)
        live = _Live(
            request=request,
            sink=item.sink,
            output=output,
            prompt_logprobs=[None] if gen.sampling.prompt_logprobs is not None else None,
            adapter=gen.adapter,
        )
        self._live[gen.request_id] = live
        if gen.adapter is not None and not self._take_slot(live):
            self._slot_waiting.append(gen.request_id)
            return
        self.scheduler.add(request)

    def _take_slot(self, live: _Live) -> bool:
        """Give `live` a device slot holding its adapter; False when it must wait (every slot is
        held, or the adapter is being read back into host memory). Raises UnknownAdapterError
        when the adapter is no longer served."""
        assert self.adapters is not None and self.runner.lora is not None and live.adapter is not None
        try:
            placement = self.adapters.acquire(live.adapter)
        except NoFreeSlotError:
            return False
        except NotPreparedError:
            self._read_adapter(live.adapter)
            return False
        if placement.fill is not None:  # copied in by the next plan's runner (every rank)
            self._lora_fills.append((placement.slot, placement.fill))
            log.info("LoRA adapter %s loaded into device slot %d", live.adapter, placement.slot)
        live.slot = placement.slot
        live.request.cache_salt = f"lora:{live.adapter}:{placement.version}"
        return True

    def _release_slot(self, live: _Live) -> None:
        if live.slot != NO_ADAPTER:
            assert self.adapters is not None
            self.adapters.release(live.slot)
            live.slot = NO_ADAPTER
            self._slot_freed = True

    def _read_adapter(self, name: str) -> None:
        """Read `name` back into host memory on the reader thread; wake the step loop when done."""
        if name in self._reading:
            return
        self._reading.add(name)
        assert self.adapters is not None

        def done(reading: Future[None]) -> None:
            error = None if reading.cancelled() else reading.exception()
            why = f"LoRA adapter {name} cannot be loaded: {one_line(error)}" if error is not None else None
            self._inbox.put(_Wake(name, why))

        self._adapter_reader.submit(self.adapters.prepare, name).add_done_callback(done)

    def _admit_parked(self) -> None:
        """Requests waiting for a LoRA slot take the slots freed (in arrival order); requests of
        an adapter already in a slot join it; requests of an adapter no longer served fail."""
        self._slot_freed = False
        for request_id in list(self._slot_waiting):
            live = self._live[request_id]
            try:
                placed = self._take_slot(live)
            except UnknownAdapterError:  # removed from the source (or found bad) while it waited
                self._fail(request_id, f"LoRA adapter {live.adapter} is no longer served", "request")
                continue
            if placed:
                self._slot_waiting.remove(request_id)
                self.scheduler.add(live.request)

    def _step(self) -> None:
        started = time.perf_counter()
        if self._slot_waiting:
            self._admit_parked()
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            self._publish_stats()
            return
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
        self._publish_stats(plan, time.perf_counter() - started)

    def _plan(self, scheduled: SchedulerOutput) -> StepPlan:
        sequences: list[ScheduledSequence] = []
        new_requests: list[NewRequest] = []
        for chunk in scheduled.chunks:
            request = chunk.request
            live = self._live[request.request_id]
            if not live.introduced:
                live.introduced = True
                new_requests.append(
                    NewRequest(
                        request_id=request.request_id,
                        prompt_token_ids=tuple(request.token_ids[: request.num_prompt_tokens]),
                        sampling=request.sampling,
                        end_token_ids=tuple(sorted(live.output.stop_token_ids)),
                    )
                )
            sequences.append(
                ScheduledSequence(
                    request_id=request.request_id,
                    token_ids=request.token_ids,
                    start=chunk.start,
                    num_tokens=chunk.num_tokens,
                    block_table=self.kv.block_table(request),
                    sample=chunk.completes,
                    prompt_logits=request.sampling.prompt_logprobs is not None
                    and chunk.start < request.num_prompt_tokens,
                    adapter_slot=live.slot,
                )
            )
        ended, self._ended = tuple(self._ended), []
        fills, self._lora_fills = tuple(self._lora_fills), []
        cleared, self.kv.to_clear = tuple(self.kv.to_clear), []
        return build_plan(sequences, self.kv.block_size, tuple(new_requests), ended, fills, cleared)

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
            request = live.request
            request.token_ids.append(token.token_id)
            try:
                text, reason = live.output.process(token.token_id)
            except Exception as exc:  # its detokenizer or stop strings: this request alone fails
                log.exception("request %s: output processing failed", request_id)
                self._fail(request_id, f"output processing failed: {one_line(exc)}", "engine")
                continue
            if reason is not None:
                self._end(live)
            logprobs = [token.logprob] if token.logprob else None
            self._emit(live, text, [token.token_id], reason, logprobs, now)

    def _end(self, live: _Live, discard: bool = False) -> None:
        """`live` is done: its blocks and slot are freed now (with `discard`, its blocks are also
        unpublished and zeroed before reuse); the runner forgets it next step."""
        request_id = live.request.request_id
        if self.scheduler.abort(request_id, discard) is None and request_id in self._slot_waiting:
            self._slot_waiting.remove(request_id)
        del self._live[request_id]
        self._release_slot(live)
        self._ended.append(request_id)

    def _fail(self, request_id: str, message: str, cause: ErrorCause, discard: bool = False) -> None:
        """End one request with an error; the step, the batch and the engine go on."""
        live = self._live.get(request_id)
        if live is None:
            return
        log.warning("request %s failed: %s", request_id, message)
        self._end(live, discard)
        request = live.request
        live.sink(
            RequestOutput(
                request_id=request_id,
                text="",
                token_ids=[],
                num_prompt_tokens=request.num_prompt_tokens,
                num_generated_tokens=request.num_generated,
                finished=True,
                error=message,
                error_cause=cause,
                num_cached_tokens=request.num_cached_tokens,
                time=time.monotonic(),
            )
        )

    def _emit(
        self,
        live: _Live,
        text: str,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprob] | None = None,
        now: float | None = None,
    ) -> None:
        request = live.request
        prompt_logprobs = None
        if live.prompt_logprobs is not None and not live.prompt_logprobs_sent:
            prompt_logprobs, live.prompt_logprobs_sent = live.prompt_logprobs, True
        live.sink(
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
                time=time.monotonic() if now is None else now,
            )
        )

    def _end_all(self, error: str | None = None) -> None:
        """End every request in flight: failed with `error`, else aborted (the server is stopping)."""
        now = time.monotonic()
        for live in list(self._live.values()):
            self.scheduler.abort(live.request.request_id)
            self._release_slot(live)
            request = live.request
            live.sink(
                RequestOutput(
                    request_id=request.request_id,
                    text="",
                    token_ids=[],
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_generated_tokens=request.num_generated,
                    finished=True,
                    finish_reason="abort" if error is None else None,
                    error=error,
                    num_cached_tokens=request.num_cached_tokens,
                    time=now,
                )
            )
        self._live.clear()
        self._slot_waiting.clear()
        self._publish_stats()

    def _publish_stats(self, plan: StepPlan | None = None, seconds: float = 0.0) -> None:
        """A new immutable snapshot for metering (readers on other threads see one or the other)."""
        stats = self._stats
        if plan is not None:
            stats = replace(
                stats,
                num_steps=stats.num_steps + 1,
                step_tokens=stats.step_tokens.observe(plan.num_tokens),
                step_sequences=stats.step_sequences.observe(plan.num_sequences),
                step_seconds=stats.step_seconds.observe(seconds),
            )
        lora_running: tuple[str, ...] = ()
        lora_waiting: tuple[str, ...] = ()
        if self.adapters is not None:
            running = set(self.scheduler.running)
            by_state: dict[bool, set[str]] = {True: set(), False: set()}
            for live in self._live.values():
                if live.adapter is not None:
                    by_state[live.request in running].add(live.adapter)
            lora_running, lora_waiting = tuple(sorted(by_state[True])), tuple(sorted(by_state[False]))
        self._stats = replace(
            stats,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._slot_waiting),
            lora_running=lora_running,
            lora_waiting=lora_waiting,
            kv_blocks_used=self.pool.num_blocks - self.pool.num_free,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

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
        self._stats = EngineStats(kv_blocks_total=self.config.num_blocks)
        self._publish_stats()
