"""The compiled grammars kept for reuse: by spec, least recently used out past a byte budget, an
entry pinned while a request checked with it lives (the step finds it then)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from service.engine.protocol import GuidedDecoding


@dataclass
class _Entry:
    compiled: Any
    nbytes: int
    pins: int = 0  # requests checked with it that still live


class GrammarCache:
    """Compiled grammars by spec, least recently used out past `budget` bytes; a pinned entry stays
    (it may take the total over the budget: by at most what the requests in flight use)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.total = 0
        self._entries: OrderedDict[GuidedDecoding, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: GuidedDecoding, pin_for: object | None = None) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            if pin_for is not None:
                self._pin(key, entry, pin_for)
            return entry.compiled

    def put(self, key: GuidedDecoding, compiled: Any, nbytes: int, pin_for: object | None = None) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(compiled, nbytes)
                self.total += nbytes
            self._entries.move_to_end(key)
            if pin_for is not None:
                self._pin(key, entry, pin_for)
            self._evict()

    def _pin(self, key: GuidedDecoding, entry: _Entry, owner: object) -> None:
        entry.pins += 1
        weakref.finalize(owner, self._unpin, key)

    def _unpin(self, key: GuidedDecoding) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.pins -= 1
                self._evict()

    def _evict(self) -> None:
        if self.total <= self.budget:
            return
        for key in [key for key, entry in self._entries.items() if not entry.pins]:
            self.total -= self._entries.pop(key).nbytes
            if self.total <= self.budget:
                return
