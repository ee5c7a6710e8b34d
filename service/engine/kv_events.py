"""A bounded, ordered buffer of prefix-cache events (service.engine.protocol.KVEvent) between
the thread that records them and the one that drains them: the torch engine's block pool records,
and an engine process forwards what it drained to the API process's copy."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from service.engine.protocol import KVCacheCleared, KVEvent

log = logging.getLogger(__name__)

# Events kept for a consumer that stopped draining (a Dynamo worker drains every few ms); past
# this the log starts over with a "cleared", so it never grows without bound.
EVENT_LOG_CAPACITY = 1 << 16


class KVEventLog:
    """The prefix cache's events in the order they happened, until drained (from any thread)."""

    def __init__(self, capacity: int = EVENT_LOG_CAPACITY) -> None:
        self.capacity = capacity
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()
        self.overflows = 0

    def record(self, event: KVEvent) -> None:
        self.extend((event,))

    def extend(self, events: Iterable[KVEvent]) -> None:
        with self._lock:
            for event in events:
                if len(self._events) >= self.capacity:
                    # The consumer lost track: tell it to forget everything rather than drop
                    # events out of order (a child without its parent is useless to a router).
                    self._events = [KVCacheCleared()]
                    self.overflows += 1
                    log.warning("KV event log full (%d undrained): recorded a cache clear", self.capacity)
                self._events.append(event)

    def drain(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events
