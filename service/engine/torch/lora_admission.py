"""LoRA device slots as a scheduler resource: a request of an adapter runs only while it holds a
slot holding that adapter, as vLLM's scheduler counts max_loras.

The scheduler asks `admit` for each waiting request of an adapter it is about to admit. The
request holds a slot when its adapter is in one already (shared with that adapter's other
requests) or a slot no request holds can take it; it waits (skipped, keeping its place in the
queue, while requests behind it are admitted) when every slot is held by requests of other
adapters, or while its adapter is read into host memory. It keeps its slot until it ends, across
preemptions; the scheduler releases it with the request's blocks.

Reading an adapter into host memory has one owner: this module's reader thread, which calls
`LoraStore.load` when a waiting request's adapter could take a slot but is not in host memory
(evicted, or never read). One adapter is read at a time, so reads cannot push each other out of
a host memory that holds as few adapters as there are slots. When the read ends, `wake` is
called (the engine's step loop, idle or not, schedules again); when it fails, the reason is
kept until the scheduler takes it (`take_failures`) and fails the requests waiting on that
adapter with it, in bounded time.

A slot filled with an adapter's weights for the first time is handed to the next step plan
(`take_fills`), so every tensor-parallel rank fills its slot from the same bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from service.engine.lora import LoraAdapter
from service.engine.lora_store import LoraStore, NoFreeSlotError, NotPreparedError
from service.engine.models.lora_ops import NO_ADAPTER
from service.engine.protocol import UnknownAdapterError
from service.engine.torch.request import Request
from service.util import one_line

log = logging.getLogger(__name__)


class AdapterUnavailableError(RuntimeError):
    """The request's adapter cannot run: no longer served, or its files could not be read."""


class LoraAdmission:
    def __init__(self, store: LoraStore, wake: Callable[[], None]) -> None:
        self.store = store
        self._wake = wake  # called from the reader thread when a read ends
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self._lock = threading.Lock()  # the reader thread's results, read by the step thread
        self._reading: str | None = None  # the adapter being read into host memory
        self._failures: dict[str, str] = {}  # adapter -> why it could not be read (not yet taken)
        self._fills: list[tuple[int, LoraAdapter]] = []  # slots the next plan fills

    def admit(self, request: Request) -> bool:
        """Give `request` a slot holding its adapter: True when it holds one now, False when it
        must wait. Raises AdapterUnavailableError when its adapter is no longer served."""
        name = request.adapter
        assert name is not None and request.lora_slot == NO_ADAPTER
        try:
            placement = self.store.acquire(name)
        except NoFreeSlotError:
            return False
        except NotPreparedError:
            self._read(name)
            return False
        except UnknownAdapterError:  # removed from the source, or its read just failed
            with self._lock:
                why = self._failures.get(name, f"LoRA adapter {name} is no longer served")
            raise AdapterUnavailableError(why) from None
        if placement.fill is not None:
            self._fills.append((placement.slot, placement.fill))
            log.info("LoRA adapter %s loaded into device slot %d", name, placement.slot)
        request.lora_slot = placement.slot
        request.cache_salt = f"lora:{name}:{placement.version}"
        return True

    def release(self, request: Request) -> None:
        """`request` ended: its slot is free for other adapters once no request of its adapter holds it."""
        if request.lora_slot != NO_ADAPTER:
            self.store.release(request.lora_slot)
            request.lora_slot = NO_ADAPTER

    def take_fills(self) -> tuple[tuple[int, LoraAdapter], ...]:
        fills, self._fills = tuple(self._fills), []
        return fills

    def take_failures(self) -> dict[str, str]:
        """Adapters whose read failed since the last call, with why (each reported once)."""
        with self._lock:
            failures, self._failures = self._failures, {}
        return failures

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _read(self, name: str) -> None:
        """Read `name` into host memory on the reader thread, unless a read is under way."""
        with self._lock:
            if self._reading is not None:
                return  # one at a time: the requests of `name` ask again after it
            self._reading = name
        try:
            self._reader.submit(self.store.load, name).add_done_callback(
                lambda reading: self._read_done(name, reading)
            )
        except RuntimeError:  # shut down: the engine is stopping
            with self._lock:
                self._reading = None

    def _read_done(self, name: str, reading: Future[None]) -> None:
        error = None if reading.cancelled() else reading.exception()
        with self._lock:
            self._reading = None
            if error is not None:
                self._failures[name] = f"LoRA adapter {name} cannot be loaded: {one_line(error)}"
        self._wake()
