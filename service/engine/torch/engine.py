"""The PyTorch engine: one thread runs the model step by step; the event loop never waits on it.

Step loop (all on the engine thread):
  1. take new requests and aborts from the inbox (block only when there is nothing to do);
  2. prefill at most one waiting request (first come, first served) if fewer than
     `max_num_seqs` are running, sampling its first token;
  3. decode one token for every running request in a single batched forward pass;
  4. detokenize, check stop conditions, and post each request's delta to its asyncio queue.

Requests join and leave the running batch between steps (inflight batching). A request owns a
dense KV cache that is dropped the moment it finishes or is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

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
)
from service.engine.torch.kv_cache import DecodeAttention, PrefillAttention, SequenceKVCache
from service.engine.torch.sampler import make_generator, sample
from service.metrics import Metrics
from service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]
IDLE_POLL_SECONDS = 0.5


@dataclass
class EngineConfig:
    max_model_len: int
    max_num_seqs: int
    device: torch.device
    dtype: torch.dtype


@dataclass
class Sequence:
    request: GenerationRequest
    sink: Sink
    output: OutputProcessor
    generator: torch.Generator
    cache: SequenceKVCache | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_generated: int = 0
    last_token_time: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id


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
        self._inbox: queue.Queue[_Submit | _Abort | None] = queue.Queue()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._thread: threading.Thread | None = None
        self._ready = False
        self._stopping = False
        self._fatal: BaseException | None = None

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
        self._stopping = True
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
        return EngineStats(num_running=len(self._running), num_waiting=len(self._waiting))

    # --- Engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            with torch.inference_mode():
                while not self._stopping:
                    self._drain_inbox(block=not (self._running or self._waiting))
                    if self._stopping:
                        break
                    self._prefill_one()
                    self._decode_running()
                    self._publish_queue_sizes()
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine step loop failed")
            self._fatal = exc
            self._fail_all(f"engine failure: {exc.__class__.__name__}: {exc}")
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        self._fail_all("server shutting down", reason="abort")

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
            num_prompt = len(item.request.prompt_token_ids)
            if not 0 < num_prompt < self.config.max_model_len:
                error = (
                    f"prompt of {num_prompt} tokens does not fit the context of {self.config.max_model_len}"
                )
                item.sink(RequestOutput(item.request.request_id, "", [], num_prompt, 0, True, "abort", error))
                return
            self._waiting.append(self._new_sequence(item))
        else:
            self._drop(item.request_id)

    def _new_sequence(self, item: _Submit) -> Sequence:
        request = item.request
        return Sequence(
            request=request,
            sink=item.sink,
            output=OutputProcessor(
                self.tokenizer, request.sampling, len(request.prompt_token_ids), self.config.max_model_len
            ),
            generator=make_generator(request.sampling, self.config.device),
            token_ids=list(request.prompt_token_ids),
        )

    def _drop(self, request_id: str) -> None:
        """Abort: forget the request and free its cache at once."""
        for seqs in (self._waiting, self._running):
            for seq in list(seqs):
                if seq.request_id == request_id:
                    seqs.remove(seq)
                    seq.cache = None
                    self._emit(seq, "", [], finish_reason="abort")

    def _prefill_one(self) -> None:
        if not self._waiting or len(self._running) >= self.config.max_num_seqs:
            return
        seq = self._waiting.popleft()
        prompt = seq.token_ids
        seq.cache = self._new_cache()
        logits = self._forward_prefill(seq.cache, prompt)
        if self.metrics is not None:
            self.metrics.observe_prefill(len(prompt))
        self._running.append(seq)
        self._append_tokens([seq], logits)

    def _decode_running(self) -> None:
        # Invariant: a running sequence's cache holds all its tokens but the last sampled one.
        batch = list(self._running)
        if not batch:
            return
        caches = [seq.cache for seq in batch if seq.cache is not None]
        logits = self._forward_decode(caches, [seq.token_ids[-1] for seq in batch])
        self._append_tokens(batch, logits)

    def _append_tokens(self, batch: list[Sequence], logits: torch.Tensor) -> None:
        # logits: [B, V]
        token_ids = sample(logits, [s.request.sampling for s in batch], [s.generator for s in batch])
        now = time.monotonic()
        for seq, token_id in zip(batch, token_ids, strict=True):
            seq.token_ids.append(token_id)
            seq.num_generated += 1
            first = seq.num_generated == 1
            if self.metrics is not None:
                previous = seq.request.arrival_time if first else seq.last_token_time
                self.metrics.observe_token(first, now - previous)
            seq.last_token_time = now
            text, reason = seq.output.process(token_id)
            if reason is not None:
                self._running.remove(seq)
                seq.cache = None
            self._emit(seq, text, [token_id], finish_reason=reason)

    def _emit(
        self, seq: Sequence, text: str, token_ids: list[int], finish_reason: FinishReason | None
    ) -> None:
        num_prompt = len(seq.request.prompt_token_ids)
        if finish_reason is not None and self.metrics is not None:
            self.metrics.observe_finished(
                finish_reason, time.monotonic() - seq.request.arrival_time, num_prompt, seq.num_generated
            )
        seq.sink(
            RequestOutput(
                request_id=seq.request_id,
                text=text,
                token_ids=token_ids,
                num_prompt_tokens=num_prompt,
                num_generated_tokens=seq.num_generated,
                finished=finish_reason is not None,
                finish_reason=finish_reason,
            )
        )

    def _fail_all(self, message: str, reason: FinishReason = "abort") -> None:
        for seq in [*self._waiting, *self._running]:
            seq.cache = None
            seq.sink(
                RequestOutput(
                    request_id=seq.request_id,
                    text="",
                    token_ids=[],
                    num_prompt_tokens=len(seq.request.prompt_token_ids),
                    num_generated_tokens=seq.num_generated,
                    finished=True,
                    finish_reason=reason,
                    error=message,
                )
            )
        self._waiting.clear()
        self._running.clear()
        self._publish_queue_sizes()

    def _publish_queue_sizes(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue_sizes(len(self._running), len(self._waiting))

    # --- Model execution --------------------------------------------------------------------------

    def _new_cache(self) -> SequenceKVCache:
        c = self.model_config
        return SequenceKVCache(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            self.config.max_model_len,
            self.config.dtype,
            self.config.device,
        )

    def _forward_prefill(self, cache: SequenceKVCache, token_ids: list[int]) -> torch.Tensor:
        device = self.config.device
        input_ids = torch.tensor(token_ids[cache.length :], dtype=torch.long, device=device)  # [T]
        positions = torch.arange(cache.length, len(token_ids), dtype=torch.long, device=device)  # [T]
        attention = PrefillAttention(cache, len(input_ids))
        hidden = self.model(input_ids, positions, attention)  # [T, H]
        attention.commit()
        return self.model.compute_logits(hidden[-1:])  # [1, V]

    def _forward_decode(self, caches: list[SequenceKVCache], last_tokens: list[int]) -> torch.Tensor:
        device = self.config.device
        input_ids = torch.tensor(last_tokens, dtype=torch.long, device=device)  # [B]
        positions = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)  # [B]
        attention = DecodeAttention(caches)
        hidden = self.model(input_ids, positions, attention)  # [B, H]
        attention.commit()
        return self.model.compute_logits(hidden)  # [B, V]

    def _warm_up(self) -> None:
        """One prefill and a few decode steps so the first real request pays no one-time costs."""
        with torch.inference_mode():
            cache = self._new_cache()
            prompt = self.tokenizer.encode("Warm-up: the quick brown fox", add_special_tokens=True)
            logits = self._forward_prefill(cache, prompt)
            for _ in range(4):
                token = int(torch.argmax(logits[0]))
                logits = self._forward_decode([cache], [token])
