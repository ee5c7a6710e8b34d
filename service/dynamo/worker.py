"""The engine as a Dynamo worker (`nim-torch dynamo-worker`): tokens in, tokens out, KV events and
load out, through Dynamo 1.6's unified backend (`dynamo.common.backend.LLMEngine`).

Dynamo's Rust `Worker` owns the runtime, registration, the request endpoint, cancellation and
SIGTERM/SIGINT; this class is the engine it drives:

- `from_args`: the profile is selected as `serve` selects it (same explanation in the log) and
  its files fetched; the registration's model directory is prepared (service.dynamo.cards);
- `start`: the engine is loaded (in this process or its own, NIM_ENGINE_PROCESS) and warmed up,
  then registered with its context length, KV block size and block count, and a WorkerCard;
- `generate`: Dynamo's request dict becomes a GenerationRequest (service.dynamo.requests: every
  field honoured or refused with InvalidArgument naming it), the engine's outputs become chunks;
  a request the engine fails ends with InvalidArgument (its own fault) or Unknown (the engine's);
  EngineShutdown only once the engine is dead (Dynamo then stops routing here);
- `abort`: Dynamo's cancellation (client gone, stop string cut by its frontend) aborts the request;
- a relay task drains the engine's KV events to the router (service.dynamo.kv_publish) and
  publishes its KV usage and prefix hit rate as a ComponentSnapshot whenever the stats change.

If the engine dies the process stops itself (SIGTERM to the Rust Worker, which unregisters and
drains) and exits 1, so an orchestrator restarts it, as `serve` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from dynamo._core import Context
from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.publisher import ComponentSnapshot, KvEventSource, PushSource
from dynamo.common.backend.run import run
from dynamo.common.utils.token_ids import normalize_request_token_ids
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown

from service.config import Settings
from service.dynamo import unused_settings
from service.dynamo.cards import CARD_KEY, WorkerCard, card_directory
from service.dynamo.kv_publish import KvEventRelay
from service.dynamo.requests import ModelView, RefusedField, from_dynamo, to_chunk
from service.engine.config import EngineConfig as NimEngineConfig
from service.engine.protocol import EngineDeadError, EngineStats, LoadedEngine, RequestRefusedError
from service.logs import configure_logging
from service.selection.planning import Plan, make_plan, model_source
from service.serving import engine_config, load
from service.store.checkpoint import ModelSource
from service.util import freeze_startup_heap, one_line

log = logging.getLogger(__name__)

COMPONENT, ENDPOINT = "backend", "generate"
RELAY_INTERVAL_S = 0.005  # how often KV events and stats go out (the router routes on them)


def endpoint_path(settings: Settings) -> str:
    return f"{settings.dynamo_namespace}.{COMPONENT}.{ENDPOINT}"


class NimWorker(LLMEngine):
    """One replica: the profile's engine behind Dynamo's Worker (built by `prepare`)."""

    def __init__(self, settings: Settings, plan: Plan, source: ModelSource, config: NimEngineConfig) -> None:
        self.settings = settings
        self.plan = plan
        self.source = source
        self.config = config
        self.card_dir = card_directory(
            source,
            config.load_tokenizer(),
            config.max_model_len or source.checkpoint.config.max_position_embeddings,
            settings.cache_path / "dynamo-model-cards",
        )
        self.loaded: LoadedEngine | None = None
        self.died: str | None = None  # why the engine died (the process then exits 1)
        self.relay: KvEventRelay | None = None
        self.snapshots: Any = None  # Dynamo's SnapshotPublisher, once attached
        self._relay_task: asyncio.Task[None] | None = None
        self._view: ModelView | None = None
        self._token_text: dict[int, str] = {}

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[NimWorker, WorkerConfig]:
        """Dynamo's entry: settings from the environment (the CLI passes its own to `prepare`)."""
        from service.config_loading import load_settings

        return await prepare(load_settings())

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self, worker_id: int) -> EngineConfig:
        # Dynamo's Worker replaced the log handlers with its own bridge; ours again (one format).
        configure_logging(self.settings.python_log_level, self.settings.jsonl_logging)
        loop = asyncio.get_running_loop()

        def died(exc: BaseException) -> None:  # from the engine's thread
            self.died = one_line(exc, with_type=True)
            log.error("engine failed: %s; stopping the worker", self.died)
            loop.call_soon_threadsafe(os.kill, os.getpid(), signal.SIGTERM)

        loaded, process_path = await load(self.settings, self.config, died)
        self.loaded = loaded
        await loaded.engine.start()
        loaded.engine.kv_events()  # the warm-up's blocks, already forgotten by its reset
        info = loaded.engine.info
        tokenizer = loaded.tokenizer
        adapters = tuple(loaded.adapters.names()) if loaded.adapters is not None else ()
        self._view = ModelView(
            self.source.served_name, info.vocab_size, info.max_model_len, tokenizer.eos_token_ids, adapters
        )
        profile = self.plan.profile
        card = WorkerCard(
            served_name=self.source.served_name,
            info=replace(info, paths=(*info.paths, process_path)),
            profile_id=profile.id,
            profile_name=profile.name,
            profile_tags=profile.tags(),
            selection=tuple(self.plan.selection.explanation[:1]),
            adapters=adapters,
            vocab_size=tokenizer.vocab_size,
        )
        self._relay_task = loop.create_task(self._relay())
        events = "publishes KV events" if self.config.kv_cache.record_events else "publishes no KV events"
        discovery: str = self.settings.dynamo_discovery
        if discovery == "file":
            discovery += f", DYN_FILE_KV={self.settings.dynamo_file_kv or 'unset: Dynamo default'}"
        log.info("Dynamo worker %d: %s as %r (profile %s), %d KV blocks of %d tokens, context %d; %s; "
                 "namespace %s, discovery %s", worker_id, self.source.path, self.source.served_name,
                 profile.name, info.kv_num_blocks, info.kv_block_size, info.max_model_len, events,
                 self.settings.dynamo_namespace, discovery)  # fmt: skip
        return EngineConfig(
            model=str(self.card_dir),
            served_model_name=self.source.served_name,
            runtime_data={CARD_KEY: card.to_json()},
            llm=LlmRegistration(
                context_length=info.max_model_len,
                kv_cache_block_size=info.kv_block_size,
                total_kv_blocks=info.kv_num_blocks,
                max_num_seqs=info.max_num_seqs or None,
            ),
        )

    async def cleanup(self) -> None:
        """Null-safe and idempotent (Dynamo's contract): stop the relay, then the engine."""
        task, self._relay_task = self._relay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            await loaded.engine.stop()

    # --- requests ----------------------------------------------------------------------------------

    async def generate(  # type: ignore[override]  # Dynamo's GenerateChunk is a TypedDict of these dicts
        self, request: Any, context: Context
    ) -> AsyncGenerator[dict[str, Any], None]:
        loaded, view = self.loaded, self._view
        if loaded is None or view is None or self.died is not None:
            raise EngineShutdown(f"the engine is not serving: {self.died or 'not started'}")
        engine = loaded.engine
        if loaded.adapters is not None:
            view = replace(view, adapters=tuple(loaded.adapters.names()))
        try:
            normalize_request_token_ids(request)
            gen = from_dynamo(request, context.id(), view, time.monotonic())
            await engine.check(gen)
        except (RefusedField, RequestRefusedError) as exc:
            raise InvalidArgument(str(exc)) from None
        prompt = gen.prompt_token_ids
        stream = engine.generate(gen)
        try:
            async for out in stream:
                if out.error is not None:
                    if out.error_cause == "request":
                        raise InvalidArgument(out.error)
                    if engine.failure is not None:
                        raise EngineShutdown(out.error)
                    raise Unknown(out.error)
                yield to_chunk(out, self._text, prompt)
        except EngineDeadError as exc:
            raise EngineShutdown(str(exc)) from None
        finally:
            await stream.aclose()  # aborts the request if it had not finished

    async def abort(self, context: Context) -> None:
        if self.loaded is not None:
            self.loaded.engine.abort(context.id())

    def _text(self, token_id: int) -> str:
        """A token's text, as top_logprobs name it (Dynamo's frontend shows it verbatim)."""
        text = self._token_text.get(token_id)
        if text is None:
            assert self.loaded is not None
            text = self.loaded.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
            self._token_text[token_id] = text
        return text

    # --- KV events and load ------------------------------------------------------------------------

    async def kv_event_sources(self) -> list[KvEventSource]:
        if not self.config.kv_cache.record_events:
            return []
        return [PushSource(on_ready=self._on_kv_publisher, dp_rank=0)]

    def _on_kv_publisher(self, publisher: Any) -> None:
        assert self.loaded is not None
        self.relay = KvEventRelay(publisher, self.loaded.engine.info.kv_block_size)

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self.snapshots = publisher

    async def _relay(self) -> None:
        """KV events to the router as they happen; a load snapshot whenever the stats change."""
        assert self.loaded is not None
        engine = self.loaded.engine
        last: EngineStats | None = None
        while True:
            await asyncio.sleep(RELAY_INTERVAL_S)
            if self.relay is not None:  # until Dynamo hands over its publisher the log keeps them
                self.relay.apply(engine.kv_events())
            stats = engine.stats()
            if stats is not last and self.snapshots is not None:
                last = stats
                self.snapshots.publish(0, snapshot(stats))


def snapshot(stats: EngineStats) -> ComponentSnapshot:
    """The load Dynamo's router and planner read: KV blocks in use, and the prefix hit rate (None
    until a prompt was looked up)."""
    hit_rate = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else None
    return ComponentSnapshot(
        kv_used_blocks=stats.kv_blocks_used,
        kv_total_blocks=stats.kv_blocks_total,
        gpu_cache_usage=stats.kv_cache_usage,
        dp_rank=0,
        kv_cache_hit_rate=hit_rate,
    )


async def prepare(settings: Settings) -> tuple[NimWorker, WorkerConfig]:
    """Select the profile and fetch its files (as `serve` does), and say how to register."""
    unused = unused_settings(settings, "engine")
    if unused:
        log.warning("dynamo-worker: %s apply to the HTTP API (dynamo-router), not to a worker: not used here",
                    ", ".join(unused))  # fmt: skip
    plan = await asyncio.to_thread(make_plan, settings)
    for line in plan.selection.explanation:
        log.info("%s", line)
    source = await asyncio.to_thread(model_source, plan, settings)
    config = engine_config(settings, plan, source)
    if config.engine == "torch":
        config = replace(config, kv_cache=replace(config.kv_cache, record_events=True))
    else:
        log.info("the %s engine reports no KV cache events: Dynamo routes to this worker by load only",
                 config.engine)  # fmt: skip
    worker = await asyncio.to_thread(NimWorker, settings, plan, source, config)
    worker_config = WorkerConfig(
        namespace=settings.dynamo_namespace,
        component=COMPONENT,
        endpoint=ENDPOINT,
        model_name=str(worker.card_dir),
        served_model_name=source.served_name,
        discovery_backend=settings.dynamo_discovery,
        request_plane="tcp",
        event_plane="zmq",
        enable_kv_routing=True,
    )
    return worker, worker_config


def serve_worker(settings: Settings) -> int:
    """Run the worker until SIGTERM/SIGINT (Dynamo's Worker drains, unregisters, cleans up);
    returns the exit code: 1 when the engine died or the worker could not start."""
    holder: list[NimWorker] = []

    async def factory(argv: list[str] | None) -> tuple[NimWorker, WorkerConfig]:
        worker, worker_config = await prepare(settings)
        freeze_startup_heap()
        holder.append(worker)
        return worker, worker_config

    try:
        run(NimWorker, engine_factory=factory)
    except Exception as exc:
        configure_logging(settings.python_log_level, settings.jsonl_logging)
        log.error("the Dynamo worker failed: %s", one_line(exc, with_type=True))
        return 1
    finally:
        sys.stderr.flush()
    if holder and holder[0].died is not None:
        log.error("exiting: the engine failed: %s", holder[0].died)
        return 1
    return 0
