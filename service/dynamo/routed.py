"""This server's API in front of Dynamo workers (`nim-torch dynamo-router`).

The API process is the one of `serve` (auth, field rules, NIM routes, metrics, drain), but the
engine behind it is `RoutedEngine`: an Engine (service.engine.protocol) whose requests go as
token ids to the workers through Dynamo's KV router (`dynamo.llm.KvRouter`, in this process),
and whose outputs are detokenized and checked for stop strings here, by the same OutputProcessor
an engine runs (service.engine.output). So every API feature and its error contract holds
unchanged; only where tokens are computed differs.

Routing: in kv mode `KvRouter.best_worker` picks the worker whose prefix cache (as its KV events
told the router) overlaps the prompt most, weighed by load, with the adapter's name for LoRA
requests; round-robin mode takes turns. The request is then sent to that worker with
`KvRouter.generate(worker_id=...)`, which books it in the router's load tracking.

Failures: Dynamo's Python router has no request migration. A worker that cannot be reached or
vanishes before the request's first token (a killed worker stays in discovery for seconds) is
left out for `QUARANTINE_S` and the request goes to another worker; once tokens have been sent the
request ends with an error, as a stream does when a single server's engine dies. A request the
worker refuses (InvalidArgument) ends as the request's own fault; other worker errors as the
engine's. Dropping the response stream (the client left, a stop string was met here) cancels the
request on its worker.

Workers describe themselves in their registration (service.dynamo.cards.WorkerCard): the router
takes the engine's description and the profile from there, and reads the tokenizer of the same
profile from the model's files (NIM_MODEL_NAME as the workers have it; no weights are loaded).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dynamo.llm import FpmEventSubscriber, KvRouter, KvRouterConfig
from dynamo.llm.exceptions import (
    CannotConnect,
    ConnectionTimeout,
    Disconnected,
    EngineShutdown,
    InvalidArgument,
    StreamIncomplete,
    WorkerUnavailable,
)
from dynamo.runtime import DistributedRuntime

from service.api.state import ModelInfo, Ready
from service.config import Settings
from service.dynamo import unused_settings
from service.dynamo.cards import CARD_KEY, WorkerCard
from service.dynamo.requests import from_chunk, to_dynamo
from service.dynamo.worker import endpoint_path
from service.engine.output import OutputProcessor
from service.engine.protocol import (
    AdapterError,
    ConstraintRefusedError,
    EngineInfo,
    EngineStats,
    ErrorCause,
    GenerationRequest,
    KVEvent,
    PathChoice,
    RequestOutput,
    RequestRefusedError,
)
from service.selection.planning import fetch_profile, manifest_for
from service.serving import use_chat_templates
from service.store.model_download import ArtifactSpec, download_artifact
from service.telemetry.metering import MeteredEngine
from service.telemetry.metrics import Metrics
from service.text.tokenizer import Tokenizer
from service.util import one_line

log = logging.getLogger(__name__)

QUARANTINE_S = (
    15.0  # a worker that failed a request is left out this long (discovery drops a dead one in ~9 s)
)
CARD_POLL_S = 0.2
# Errors that mean the worker (not the request) failed: the request may go to another worker
# while nothing of it has been sent. Dynamo's Python router raises a worker lost mid-stream as
# ValueError("Unavailable: ...").
WORKER_LOST = (
    CannotConnect,
    ConnectionTimeout,
    Disconnected,
    EngineShutdown,
    StreamIncomplete,
    WorkerUnavailable,
)


def _worker_lost(exc: BaseException) -> bool:
    return isinstance(exc, WORKER_LOST) or (
        isinstance(exc, ValueError) and str(exc).startswith("Unavailable")
    )


class NoWorkerError(RuntimeError):
    """No live worker could take the request."""


class RoutedEngine:
    """An Engine whose steps run on Dynamo workers (see the module doc)."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        client: Any,
        router: KvRouter,
        cards: FpmEventSubscriber,
        card: WorkerCard,
        tokenizer: Tokenizer,
        mode: str,
        guided: Any,
    ) -> None:
        self.runtime = runtime
        self.client = client
        self.router = router
        self.cards = cards
        self.card = card
        self.tokenizer = tokenizer
        self.mode = mode
        self._grammars = guided  # () -> GrammarCompiler, made on first use; None: not served
        self._grammar_compiler: Any = None
        self._quarantine: dict[int, float] = {}  # worker id -> until (monotonic)
        self._turns = itertools.count()
        self._in_flight = 0
        self._stopping = False
        self._started = False

    # --- Engine protocol ---------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self.card.info

    @property
    def ready(self) -> bool:
        """Started, and some worker is registered (readiness is 503 while none is)."""
        return self._started and not self._stopping and bool(self.client.instance_ids())

    @property
    def failure(self) -> str | None:
        return None  # the router itself cannot die of an engine failure; workers come and go

    async def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        """New requests are refused as aborted; the runtime leaves discovery."""
        self._stopping = True
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()  # its compile workers are child processes
        self.cards.shutdown()
        self.runtime.shutdown()

    async def check(self, request: GenerationRequest) -> None:
        """What the workers would refuse before starting, refused here first (a 400 before any
        stream starts): an adapter they do not serve, a constraint that does not compile (compiled
        here with the same limits, and again on the worker)."""
        if request.adapter is not None and request.adapter not in self.adapter_names():
            raise RequestRefusedError(f"LoRA adapter {request.adapter!r} is not served by the workers")
        guided, sampling = request.sampling.guided, request.sampling
        if guided is None:
            return
        if self._grammars is None:
            raise RequestRefusedError(
                "structured output (response_format, guided_*) is not served by the workers' engine"
            )
        if sampling.ignore_eos or sampling.min_tokens:
            field = "ignore_eos" if sampling.ignore_eos else "min_tokens"
            raise RequestRefusedError(
                f"{field} cannot be combined with structured output: the grammar decides the end"
            )
        from service.engine.guided.specs import GrammarError

        try:
            if self._grammar_compiler is None:
                self._grammar_compiler = await asyncio.to_thread(self._grammars)
            await self._grammar_compiler.prepare(guided)
        except GrammarError as exc:
            raise ConstraintRefusedError(str(exc)) from None

    def abort(self, request_id: str) -> None:
        """Nothing to do: a request is cancelled on its worker when its stream is closed."""

    def stats(self) -> EngineStats:
        """What this router knows: the requests it has in flight (KV use is each worker's own,
        in Dynamo's dynamo_component_* series on the workers)."""
        return EngineStats(num_running=self._in_flight)

    def kv_events(self) -> list[KVEvent]:
        return []

    def adapter_names(self) -> list[str]:
        names: set[str] = set()
        for card in self._cards().values():
            names.update(card.adapters)
        return sorted(names)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        num_prompt = len(request.prompt_token_ids)
        if self._stopping:
            yield RequestOutput.last(
                request.request_id, num_prompt, finish_reason="abort", time=time.monotonic()
            )
            return
        self._in_flight += 1
        try:
            async for out in self._routed(request):
                yield out
        finally:
            self._in_flight -= 1

    # --- routing -----------------------------------------------------------------------------------

    async def _routed(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        payload = to_dynamo(request)
        tried: set[int] = set()
        while True:
            try:
                worker = await self._pick(request, tried)
            except NoWorkerError as exc:
                yield self._failed(request, f"no Dynamo worker can take the request: {exc}", "engine")
                return
            tried.add(worker)
            relay = _Relay(request, self.tokenizer, self.info.max_model_len)
            stream: Any = None
            try:
                stream = await self.router.generate(
                    payload["token_ids"],
                    self.card.served_name if request.adapter is None else request.adapter,
                    stop_conditions=payload["stop_conditions"],
                    sampling_options=payload["sampling_options"],
                    output_options=payload["output_options"],
                    extra_args=payload["extra_args"],
                    worker_id=worker,
                )
                async for chunk in stream:
                    for out in relay.feed(chunk):
                        yield out
                    if relay.finished:
                        return  # dropping the stream cancels what the worker still runs
                yield self._failed(
                    request, f"worker {worker} ended the stream without finishing it", "engine"
                )
                return
            except InvalidArgument as exc:
                yield self._failed(request, str(exc), "request", relay.num_generated)
                return
            except Exception as exc:
                if not _worker_lost(exc):
                    yield self._failed(
                        request, f"worker {worker}: {one_line(exc)}", "engine", relay.num_generated
                    )
                    return
                self._quarantine[worker] = time.monotonic() + QUARANTINE_S
                log.warning("worker %d lost (%s); left out for %.0f s", worker, one_line(exc), QUARANTINE_S)
                if relay.started:
                    yield self._failed(request, f"worker {worker} was lost mid-generation: {one_line(exc)}",
                                       "engine", relay.num_generated)  # fmt: skip
                    return
            finally:
                del stream  # the last reference: the worker's request is cancelled if still running
            log.info("request %s: retrying on another worker", request.request_id)

    async def _pick(self, request: GenerationRequest, tried: set[int]) -> int:
        now = time.monotonic()
        self._quarantine = {w: until for w, until in self._quarantine.items() if until > now}
        live = sorted(set(self.client.instance_ids()) - set(self._quarantine) - tried)
        if not live:
            raise NoWorkerError(
                "none registered" if not self.client.instance_ids() else "every worker failed"
            )
        if self.mode == "kv":
            best, _, _ = await self.router.best_worker(request.prompt_token_ids, lora_name=request.adapter)
            if best in live:
                return int(best)
        return live[next(self._turns) % len(live)]

    def _failed(
        self, request: GenerationRequest, why: str, cause: ErrorCause, generated: int = 0
    ) -> RequestOutput:
        return RequestOutput.last(
            request.request_id,
            len(request.prompt_token_ids),
            error=why,
            error_cause=cause,
            num_generated_tokens=generated,
            time=time.monotonic(),
        )

    def _cards(self) -> dict[int, WorkerCard]:
        return read_cards(self.cards)


class _Relay:
    """One attempt's chunks -> RequestOutputs: detokenized and stop-checked here, as in an engine."""

    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.request = request
        self.sampling = request.sampling
        self.output = OutputProcessor(
            tokenizer, request.sampling, len(request.prompt_token_ids), max_model_len
        )
        self.started = False  # an output was handed on (no retry elsewhere after that)
        self.finished = False
        self.num_generated = 0

    def feed(self, raw: Any) -> list[RequestOutput]:
        chunk = from_chunk(
            raw, self.request.prompt_token_ids, self.sampling.logprobs, self.sampling.prompt_logprobs
        )
        texts: list[str] = []
        tokens: list[int] = []
        reason = None
        for token in chunk.token_ids:
            text, reason = self.output.process(token)
            texts.append(text)
            tokens.append(token)
            if reason is not None:
                break  # a stop string or token met here ends it (the worker stops there too)
        if reason is None and chunk.finish_reason is not None:
            if chunk.finish_reason == "abort":
                reason = "abort"
            else:
                tail, reason = self.output.finish(chunk.finish_reason)
                texts.append(tail)
        self.num_generated = self.output.num_generated
        logprobs = chunk.logprobs[: len(tokens)] if chunk.logprobs is not None else None
        if reason is None and not tokens and chunk.prompt_logprobs is None:
            return []
        self.started = True
        self.finished = reason is not None
        out = RequestOutput(
            request_id=self.request.request_id,
            text="".join(texts),
            token_ids=tokens,
            num_prompt_tokens=len(self.request.prompt_token_ids),
            num_generated_tokens=self.num_generated,
            finished=self.finished,
            finish_reason=reason,
            logprobs=logprobs,
            prompt_logprobs=chunk.prompt_logprobs,
            num_cached_tokens=chunk.num_cached_tokens or 0,
            time=time.monotonic(),
        )
        return [out]


def read_cards(subscriber: FpmEventSubscriber) -> dict[int, WorkerCard]:
    """The live workers' WorkerCards, by worker id."""
    cards: dict[int, WorkerCard] = {}
    for worker, raw in subscriber.get_model_cards().items():
        data = json.loads(raw)
        runtime = (data.get("runtime_config") or {}).get("runtime_data") or {}
        if CARD_KEY in runtime:
            cards[int(worker)] = WorkerCard.from_json(runtime[CARD_KEY])
    return cards


# What the router fetches of a hub checkpoint: its configuration and tokenizer, never its weights.
TOKENIZER_FILES = ("*.json", "*.jinja", "tokenizer.model")


def router_tokenizer(settings: Settings, card: WorkerCard) -> Tokenizer:
    """The tokenizer of the workers' profile, from the model's files as this router resolves
    NIM_MODEL_NAME (a hub checkpoint's tokenizer files only; a GGUF holds its own, so it is read
    whole)."""
    manifest = manifest_for(settings)
    profile = next((p for p in manifest.profiles if p.id == card.profile_id), None)
    if profile is None:
        raise RuntimeError(
            f"the workers serve profile {card.profile_name} ({card.profile_id}), which is not a profile of "
            f"{settings.model_name or 'the embedded model'}: give the router the workers' NIM_MODEL_NAME"
        )
    source = profile.source
    local = source.repo == "embedded" or Path(source.repo).expanduser().exists()
    if local or any(f.endswith(".gguf") for f in source.files) or _is_store(settings):
        path = fetch_profile(profile, settings, progress=False)
    else:
        token = settings.hf_token.get_secret_value() if settings.hf_token is not None else None
        spec = ArtifactSpec(source.repo, source.revision, TOKENIZER_FILES)
        path = download_artifact(
            spec, settings.cache_path / "hub", token=token, offline=settings.hf_hub_offline, progress=False
        )
    tokenizer = _read_tokenizer(path)
    if tokenizer.vocab_size != card.vocab_size:
        raise RuntimeError(
            f"the router's tokenizer ({path}) has {tokenizer.vocab_size} tokens, the workers' "
            f"{card.vocab_size}: give the router the workers' NIM_MODEL_NAME"
        )
    return tokenizer


def _is_store(settings: Settings) -> bool:
    name = settings.model_name
    return name is not None and Path(name).expanduser().is_dir()


def _read_tokenizer(path: Path) -> Tokenizer:
    if path.is_file():
        return Tokenizer.from_gguf(path)
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_directory(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) != 1:
        raise RuntimeError(f"{path}: no tokenizer.json, and not one .gguf file to read a tokenizer from")
    return Tokenizer.from_gguf(ggufs[0])


def bring_up_router(settings: Settings) -> Callable[[Metrics, Callable[[str], None]], Awaitable[Ready]]:
    """The API's BringUp for the router role: join Dynamo, wait for a worker's registration,
    describe the model from it, and route (readiness stays 503 until then)."""

    async def bring_up(metrics: Metrics, on_engine_death: Callable[[str], None]) -> Ready:
        unused = unused_settings(settings, "api")
        if unused:
            log.warning("dynamo-router: %s apply to the workers' engine (dynamo-worker), not to the router: "
                        "not used here", ", ".join(unused))  # fmt: skip
        loop = asyncio.get_running_loop()
        runtime = DistributedRuntime(loop, settings.dynamo_discovery, "tcp", event_plane="zmq")
        try:
            endpoint = runtime.endpoint(endpoint_path(settings))
            client = await endpoint.client()
            cards = FpmEventSubscriber(endpoint)
            cards.start_tracking()
            log.info("Dynamo router: waiting for workers at %s (discovery %s), routing %s",
                     endpoint_path(settings), _discovery(settings), _routing(settings))  # fmt: skip
            found: dict[int, WorkerCard] = {}
            while not found:
                found = read_cards(cards)
                if not found:
                    await asyncio.sleep(CARD_POLL_S)
            card = found[min(found)]
            sizes = {c.info.kv_block_size for c in found.values()}
            names = {c.served_name for c in found.values()}
            if len(sizes) > 1 or len(names) > 1:
                raise RuntimeError(
                    f"the workers disagree: models {sorted(names)}, KV block sizes {sorted(sizes)}"
                )
            tokenizer = await asyncio.to_thread(router_tokenizer, settings, card)
            use_chat_templates(settings, tokenizer)
            config = KvRouterConfig(router_track_active_blocks=settings.dynamo_router_track_active_blocks)
            router = KvRouter(endpoint, card.info.kv_block_size, config)
            guided = None
            if card.info.features.guided_decoding:

                def guided() -> Any:
                    from service.engine.guided.compiler import GrammarCompiler

                    return GrammarCompiler(tokenizer, card.info.vocab_size, settings.guided_limits)

            engine = RoutedEngine(
                runtime, client, router, cards, card, tokenizer, settings.dynamo_router_mode, guided
            )
        except BaseException:
            runtime.shutdown()
            raise
        metered = MeteredEngine(engine, metrics)
        await metered.start()
        where = f"{_routing(settings)} over Dynamo workers at {endpoint_path(settings)}"
        routing = PathChoice("dynamo_router", True, where, "NIM_DYNAMO_ROUTER_MODE")
        info = ModelInfo(
            served_name=card.served_name,
            source=f"dynamo://{endpoint_path(settings)}",
            engine=replace_paths(card.info, routing),
            profile_id=card.profile_id,
            profile_name=card.profile_name,
            profile_tags=card.profile_tags,
            selection=card.selection,
        )
        log.info(
            "Dynamo router: %d worker(s) serve %r (profile %s)",
            len(found),
            card.served_name,
            card.profile_name,
        )
        return Ready(engine=metered, tokenizer=tokenizer, info=info, adapters=_Adapters(engine))

    return bring_up


def _discovery(settings: Settings) -> str:
    if settings.dynamo_discovery == "file":
        return f"file, DYN_FILE_KV={settings.dynamo_file_kv or 'unset: Dynamo default'}"
    return settings.dynamo_discovery


def _routing(settings: Settings) -> str:
    if settings.dynamo_router_mode != "kv":
        return "round-robin"
    tracked = "tracked" if settings.dynamo_router_track_active_blocks else "not tracked"
    return f"kv (active blocks {tracked})"


def replace_paths(info: EngineInfo, extra: PathChoice) -> EngineInfo:
    return replace(info, paths=(*info.paths, extra))


class _Adapters:
    """The router's AdapterCatalog: the adapters the workers registered with."""

    def __init__(self, engine: RoutedEngine) -> None:
        self.engine = engine

    def names(self) -> list[str]:
        return self.engine.adapter_names()

    def prepare(self, name: str) -> None:
        if name not in self.engine.adapter_names():
            raise KeyError(name)

    def add(self, name: str, path: Path, replace: bool = False) -> None:
        raise AdapterError(
            "the router serves the adapters its workers registered; load adapters on the workers"
        )

    def remove(self, name: str) -> None:
        raise AdapterError(
            "the router serves the adapters its workers registered; unload adapters on the workers"
        )
