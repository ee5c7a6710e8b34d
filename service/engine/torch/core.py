"""The PyTorch engine's core: a synchronous EngineCore (service.engine.core) over the scheduler, the
paged KV cache and the model runner.

One step (`step`):
  1. the scheduler picks this step's work: decode tokens of running requests and chunks of
     waiting prompts, under one token budget, with blocks from the paged KV cache; that decision
     becomes a plain StepPlan;
  2. the model runner runs the plan: one forward pass over the mixed batch, then sampling;
  3. output processing detokenizes, checks stop conditions and gathers each request's delta;
     finished requests free their blocks at once;
  4. a stats snapshot is published, and only then are the step's outputs returned.
`add_request` and `abort` (applied by the driver before the next step, so an abort frees its
blocks before that step is scheduled) gather outputs the same way: a refusal, an abort's ending.

LoRA: device slots are a scheduler resource (service.engine.torch.lora_admission): a request
naming an adapter is admitted only with a slot holding it (shared with the other requests of
that adapter; the adapter's weights are copied in when the slot held another) and keeps it until
it ends; while every slot is held by requests of other adapters, or while its adapter is read
into host memory (by the admission's reader thread, which then wakes the driver: Wake), it waits
in the queue without holding KV blocks. Its prefix-cache hash chain is salted with the adapter
and its version, so it never shares KV blocks with the base model or another adapter.

Beside this module: the step plan is built by service.engine.torch.planner, outputs by
service.engine.torch.outputs, stats snapshots by service.engine.torch.engine_stats, and how
decode steps run is decided once, at build, by service.engine.torch.decode_path.

Endings: every request ends with exactly one finished output: finish_reason stop or length, or
abort, or an `error` when the core failed it (its own fault, or the step's: `end_all`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from service.engine.config import GuidedLimits
from service.engine.guided.compiler import CompileJob, GrammarCompiler
from service.engine.guided.specs import GrammarError
from service.engine.kv_events import KVEventLog
from service.engine.lora_store import LoraStore
from service.engine.models.base import CausalLM
from service.engine.output import OutputProcessor
from service.engine.protocol import (
    ConstraintRefusedError,
    EngineInfo,
    EngineStats,
    ErrorCause,
    FinishReason,
    GenerationRequest,
    KVEvent,
    RequestOutput,
    RequestRefusedError,
    SamplingParams,
    TokenLogprob,
)
from service.engine.speculative_config import SpeculativeConfig
from service.engine.torch import cpu_fused_ops
from service.engine.torch.block_pool import BlockPool
from service.engine.torch.decode_path import DecodeAttention, DecodeOptions, choose_decode_path
from service.engine.torch.engine_stats import StatsPublisher
from service.engine.torch.kv_cache_manager import KVCacheManager
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.lora_admission import LoraAdmission
from service.engine.torch.lora_slots import LoraSlots
from service.engine.torch.model_runner import ModelRunner, StepResult
from service.engine.torch.outputs import LiveRequest, refuse
from service.engine.torch.planner import StepPlanner
from service.engine.torch.request import Request
from service.engine.torch.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from service.engine.torch.speculative.choice import speculation
from service.engine.torch.speculative.draft import DraftModel
from service.engine.torch.speculative.draft_length import DraftLength
from service.engine.torch.step_plan import StepPlan
from service.engine.torch.tp_group import TensorParallelError, TPGroup
from service.model.config import ModelConfig
from service.text.tokenizer import Tokenizer
from service.util import one_line

log = logging.getLogger(__name__)

WARM_UP_TEXT = "Warm-up: the quick brown fox jumps over the lazy dog"
ROW_TIMING_ROUNDS = 3  # each row count's step time is the median of this many, in alternating order


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
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)


class TorchEngineCore:
    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        config: TorchEngineConfig,
        info: EngineInfo,
        tp_group: TPGroup | None = None,
        adapters: LoraStore | None = None,
        lora_slots: LoraSlots | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        """The core serves structured output when `info.features.guided_decoding` says so (its
        grammar compiler is made on first use); it speculates as `config.speculative` says (a
        draft model's method with `draft`, the draft model)."""
        if (adapters is None) != (lora_slots is None):
            raise ValueError("LoRA needs both the adapter store and the model's slots")
        self.model = model
        self._adapters = adapters
        self.tp_group = tp_group  # tensor parallelism: the worker ranks (this process is rank 0)
        self.model_config = model_config
        self._tokenizer = tokenizer
        self.config = config
        self._info = info
        events = KVEventLog() if config.record_kv_events else None
        self.pool = BlockPool(config.num_blocks, enable_caching=config.enable_prefix_caching, events=events)
        self.kv = KVCacheManager(self.pool, config.kv_spec.block_size)
        self.kv_pool = KVPool(config.kv_spec, config.num_blocks, config.device)
        self._wake: Callable[[], None] = lambda: None  # the driver's, once started
        self.lora = LoraAdmission(adapters, lambda: self._wake()) if adapters is not None else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv, self.lora
        )
        self.planner = StepPlanner(self.kv, self.lora)
        self.speculator, self._speculation = speculation(config.speculative, config.max_model_len, draft)
        self.stats_publisher = StatsPublisher(
            self.pool, self.kv, self.scheduler, lora=adapters is not None, speculator=self.speculator
        )
        fused_cpu_ops = any(path.name == "cpu_fused_ops" and path.used for path in info.paths)
        options = DecodeOptions(
            kernel=config.decode_kernel,
            enforce_eager=config.enforce_eager,
            max_num_seqs=min(config.max_num_seqs, config.max_num_batched_tokens),  # decodes in a step
            max_model_len=config.max_model_len,
            tensor_parallel=tp_group is not None,
            unified=config.unified_attention,
            max_num_batched_tokens=config.max_num_batched_tokens,
            native_attention=fused_cpu_ops,
        )
        self.runner = ModelRunner(
            model,
            self.kv_pool,
            config.device,
            choose_decode_path(model, self.kv_pool, config.device, options),
            followers=tp_group,
            lora=lora_slots,
            grammars=self.grammar_compiler if info.features.guided_decoding else None,
            fused_sampling=fused_cpu_ops,
        )
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._live: dict[str, LiveRequest] = {}
        self._outputs: list[RequestOutput] = []  # gathered since the last call returned them

    # --- What any thread may read --------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        """What this engine is, with the decode path's decisions (the graphs' once captured)."""
        native = self.runner.path.attention is DecodeAttention.NATIVE
        loaded = (
            cpu_fused_ops.with_decode_attention(path, native) if path.name == cpu_fused_ops.NAME else path
            for path in self._info.paths
        )
        paths = (*loaded, *self.runner.path.choices(), self._speculation)
        return replace(self._info, paths=paths)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def adapters(self) -> LoraStore | None:
        return self._adapters

    def stats(self) -> EngineStats:
        return self.stats_publisher.snapshot

    def kv_events(self) -> list[KVEvent]:
        return self.pool.events.drain() if self.pool.events is not None else []

    def prepare(self, request: GenerationRequest) -> CompileJob | None:
        """The API has validated the sampling fields; what is left is the adapter and the grammar,
        which is checked here and compiled under the NIM_*GUIDED* limits, in a worker process that
        is killed when its job is cancelled (and cached for the step that needs it)."""
        if request.adapter is not None and self._adapters is None:
            raise RequestRefusedError(
                f"LoRA adapter {request.adapter!r} requested, but this engine serves none"
            )
        guided, sampling = request.sampling.guided, request.sampling
        if guided is None:
            return None
        if not self._info.features.guided_decoding:
            raise RequestRefusedError(
                "structured output (response_format, guided_*) needs xgrammar, which this server lacks"
            )
        if sampling.ignore_eos or sampling.min_tokens:
            field_name = "ignore_eos" if sampling.ignore_eos else "min_tokens"
            raise RequestRefusedError(
                f"{field_name} cannot be combined with structured output: the grammar decides the end"
            )
        try:
            return self.grammar_compiler().submit(guided)
        except GrammarError as exc:
            raise ConstraintRefusedError(str(exc)) from None

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler (made on first use: its workers start then)."""
        with self._grammars_lock:
            if self._grammars is None:
                vocab_size = self.model_config.vocab_size
                self._grammars = GrammarCompiler(self._tokenizer, vocab_size, self.config.guided)
            return self._grammars

    # --- The driving thread ------------------------------------------------------------------------

    def start(self, wake: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        """Warm up here (the driving thread: all of the core's PyTorch work runs on it, since on
        CPUs every thread that runs parallel ops keeps an OpenMP pool of its own, and more pooled
        threads than cores make GNU OpenMP stop spinning between parallel regions, a decode step
        ~1.6x slower), then start the adapter rescans and the tensor-parallel watchdog."""
        self._wake = wake
        self._warm_up()
        if self.tp_group is not None:
            self.tp_group.watch(fail)
        if self._adapters is not None:
            self._adapters.start_refreshing()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def wake(self) -> None:
        self.scheduler.wake()

    def add_request(self, request: GenerationRequest) -> list[RequestOutput]:
        try:
            self._admit(request)
        except Exception as exc:  # a bad request must fail alone, never the core
            log.warning("request %s refused at admission: %s", request.request_id, exc)
            self._live.pop(request.request_id, None)
            refuse(request, self._outputs.append, f"request could not be admitted: {one_line(exc)}")
        return self._take()

    def abort(self, request_id: str) -> list[RequestOutput]:
        request = self.scheduler.abort(request_id)
        live = self._live.pop(request_id, None)
        if live is not None:
            self.planner.ended(request_id)
            if self.speculator is not None:
                self.speculator.ended(request_id)
            if request is not None:
                live.end()
        return self._take()

    def step(self) -> list[RequestOutput]:
        """One step; its outputs (tokens, endings, failures), after the stats counting them."""
        started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        for request, why in scheduled.failed:  # their LoRA adapter cannot run
            self._fail(request.request_id, why, "request")
        if not scheduled.chunks:
            return self._take()
        self._mark_scheduled(scheduled)
        plan = self.planner.plan(scheduled)
        draft_probs = self.speculator.draft_probs if self.speculator is not None else None
        with torch.inference_mode():
            result = self.runner.execute(plan, draft_probs)
        for request_id, failure in result.failed.items():  # before their blocks are published
            self._fail(request_id, failure.message, failure.cause, discard=failure.non_finite)
        self.scheduler.step_done(scheduled)
        self._apply(plan, result)
        return self._take(plan, time.perf_counter() - started)

    def end_all(self, error: str | None) -> list[RequestOutput]:
        now = time.monotonic()
        for live in list(self._live.values()):
            self.scheduler.abort(live.request.request_id)
            live.end(error, now=now)
        self._live.clear()
        return self._take()

    def death(self, error: BaseException) -> tuple[str, BaseException]:
        message = one_line(error, with_type=True)
        if self.tp_group is not None:
            death = self.tp_group.wait_for_death(1.0)  # a collective may fail before the watchdog wakes
            if death is not None and death not in message:
                message = f"{death}; {message}"  # the cause beside what the step saw
                error = TensorParallelError(message)
            self.tp_group.shutdown()  # no rank outlives the engine
        return message, error

    def shutdown(self) -> None:
        if self._adapters is not None:
            self._adapters.stop_refreshing()
        if self.lora is not None:
            self.lora.close()
        if self.tp_group is not None:
            self.tp_group.shutdown()

    # --- Inside ------------------------------------------------------------------------------------

    def _take(self, plan: StepPlan | None = None, seconds: float = 0.0) -> list[RequestOutput]:
        """Publish the stats (with `plan`, one more step of `seconds`), then hand over what was
        gathered: in that order, so no reader holds an output its gauges do not count yet."""
        self.stats_publisher.publish(plan, seconds)
        outputs = list(self._outputs)
        self._outputs.clear()  # the same list: every request's sink appends to it
        return outputs

    def _admit(self, gen: GenerationRequest) -> None:
        num_prompt = len(gen.prompt_token_ids)
        if not 0 < num_prompt < self.config.max_model_len:
            raise ValueError(
                f"a prompt of {num_prompt} tokens does not fit the context of {self.config.max_model_len}"
            )
        if gen.request_id in self._live:
            raise ValueError(f"duplicate request id {gen.request_id!r}")
        output = OutputProcessor(self._tokenizer, gen.sampling, num_prompt, self.config.max_model_len)
        request = Request.from_generation(gen, tuple(sorted(output.stop_token_ids)))
        request.tag_outputs = self.runner.dense_prompts  # its outputs' blocks are hashed apart
        self.scheduler.add(request)  # refuses an adapter where none is served
        prompt_logprobs: list[TokenLogprob | None] | None = None
        if gen.sampling.prompt_logprobs is not None:
            prompt_logprobs = [None]
        self._live[gen.request_id] = LiveRequest(request, self._outputs.append, output, prompt_logprobs)

    def _mark_scheduled(self, scheduled: SchedulerOutput) -> None:
        """The requests this step computes: a request's first such step ends its queue time."""
        now = time.monotonic()
        for chunk in scheduled.chunks:
            live = self._live.get(chunk.request.request_id)
            if live is not None:
                live.scheduled(now)

    def _apply(self, plan: StepPlan, result: StepResult) -> None:
        for request_id, entries in result.prompt_logprobs.items():
            live = self._live.get(request_id)
            if live is not None and live.prompt_logprobs is not None:
                live.prompt_logprobs.extend(entries)
        sampling = [i for i, samples in enumerate(plan.sample) if samples]
        now = time.monotonic()
        for i, token in zip(sampling, result.sampled, strict=True):
            request_id = plan.request_ids[i]
            live = self._live.get(request_id)
            if live is None:
                continue  # aborted while the step ran, or its row failed
            accepted = result.accepted.get(request_id)
            tokens = [*accepted, token.token_id] if accepted is not None else [token.token_id]
            try:
                text, reason, emitted = self._emit(live, tokens)
            except Exception as exc:  # its detokenizer or stop strings: this request alone fails
                log.exception("request %s: output processing failed", request_id)
                self._fail(request_id, f"output processing failed: {one_line(exc)}", "engine")
                continue
            if accepted is not None and self.speculator is not None:
                self.speculator.verified(request_id, plan.drafts_of(i), len(accepted))
                if reason is None:
                    self.scheduler.accept_drafts(live.request, len(accepted))
            if reason is not None:
                self._end(live)
            live.send(text, emitted, reason, [token.logprob] if token.logprob else None, now)

    def _emit(self, live: LiveRequest, tokens: list[int]) -> tuple[str, FinishReason | None, list[int]]:
        """Append `tokens` (a speculating request's accepted drafts, then its sampled token) to the
        request through its output processing, up to the first that ends it: their text, the
        ending (if any) and the tokens taken."""
        texts: list[str] = []
        for n, token_id in enumerate(tokens, 1):
            live.request.token_ids.append(token_id)
            text, reason = live.output.process(token_id)
            texts.append(text)
            if reason is not None:
                return "".join(texts), reason, tokens[:n]
        return "".join(texts), None, tokens

    def _end(self, live: LiveRequest, discard: bool = False) -> None:
        """`live` is done: its blocks and LoRA slot are freed now (with `discard`, its blocks are
        also unpublished and zeroed before reuse); the runner forgets it next step."""
        request_id = live.request.request_id
        self.scheduler.abort(request_id, discard)
        del self._live[request_id]
        self.planner.ended(request_id)
        if self.speculator is not None:
            self.speculator.ended(request_id)

    def _fail(self, request_id: str, message: str, cause: ErrorCause, discard: bool = False) -> None:
        """End one request with an error; the step, the batch and the core go on."""
        live = self._live.get(request_id)
        if live is None:
            return
        log.warning("request %s failed: %s", request_id, message)
        self._end(live, discard)
        live.end(message, cause)

    def _warm_up(self) -> None:
        """Run a prefill and decode steps through the real path and capture the decode graphs
        (before readiness); stats and the prefix cache forget it."""
        prompt = self._tokenizer.encode(WARM_UP_TEXT, True)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        outputs = self.add_request(GenerationRequest("warm-up", prompt, params, time.monotonic()))
        while not any(out.finished for out in outputs):
            outputs = self.step()
        if self.speculator is not None and self.speculator.draft is None:
            self._time_steps_by_rows(prompt)
        with torch.inference_mode():
            if self.runner.decode_graphs is not None:
                self.runner.decode_graphs.capture()
        self.pool.reset_cache()
        self.kv.prefix_queries = self.kv.prefix_hits = 0
        self.scheduler.num_preemptions = 0
        if self.speculator is not None:
            self.speculator.reset_counts()
        self.stats_publisher.reset()

    def _time_steps_by_rows(self, prompt: list[int]) -> None:
        """Time a lone request's steps verifying 0..K drafts (its last token repeated, verified as
        any drafts are: the output stays exact), so prompt lookup chooses each step's draft count
        by what rows cost here (speculative.draft_length); /v1/metadata shows the costs."""
        speculator = self.speculator
        assert speculator is not None
        rows = speculator.config.num_speculative_tokens + 1
        room = self.config.max_model_len - len(prompt) - 1  # every draft accepted, at worst
        if room < ROW_TIMING_ROUNDS * rows:
            log.info("speculative decoding: %d drafts a step (too short a context to time steps)", rows - 1)
            return
        params = SamplingParams(
            max_tokens=min(room, ROW_TIMING_ROUNDS * rows * rows), temperature=0.0, ignore_eos=True
        )
        outputs = self.add_request(GenerationRequest("row-timing", prompt, params, time.monotonic()))
        seconds: list[list[float]] = [[] for _ in range(rows)]
        try:
            while not outputs and self.has_work():  # the prompt, to its first token
                outputs = self.step()
            for round_ in range(ROW_TIMING_ROUNDS):
                for drafts in range(rows) if round_ % 2 == 0 else reversed(range(rows)):
                    if any(out.finished for out in outputs):
                        break
                    speculator.calibrating = drafts
                    started = time.perf_counter()
                    outputs = self.step()
                    seconds[drafts].append(time.perf_counter() - started)
        finally:
            speculator.calibrating = None
            self.abort("row-timing")
        if any(len(times) < ROW_TIMING_ROUNDS for times in seconds):
            log.info("speculative decoding: %d drafts a step (too short a context to time steps)", rows - 1)
            return
        medians = [sorted(times)[len(times) // 2] for times in seconds]
        speculator.lengths = DraftLength.from_step_times(medians)
        reason = f"{self._speculation.reason}; {speculator.lengths.describe()}"
        self._speculation = replace(self._speculation, reason=reason)
        log.info("speculative decoding: %s", speculator.lengths.describe())
