"""The Responses store: responses a client asked to keep (`store: true`), in memory, bounded.

Off unless NIM_RESPONSES_STORE_MAX_COUNT is above 0. Each entry is a finished response and the
conversation that led to it (the chat messages it was built from, its instructions left out as
OpenAI leaves them out, then its output as an assistant turn), which `previous_response_id`
continues. Bounded by count and by bytes (the JSON size of the response and of the conversation):
past either bound the oldest entries are dropped first; a single entry larger than the byte bound
is not kept (the response itself is still answered). Nothing survives a restart, and each server
process has its own store.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from service.api.errors import APIError, invalid_request

log = logging.getLogger(__name__)

STORE_OFF = (
    "responses are not stored on this server (its operator may keep them with NIM_RESPONSES_STORE_MAX_COUNT)"
)


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    size: int


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.max_bytes > 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep a response (dropping the oldest past the bounds); False when it alone is too large."""
        size = len(json.dumps(response, default=str)) + len(json.dumps(conversation, default=str))
        if size > self.max_bytes:
            log.warning("response %s (%d bytes) is larger than NIM_RESPONSES_STORE_MAX_BYTES: not stored",
                        response["id"], size)  # fmt: skip
            return False
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = Stored(response, conversation, size)
            self._bytes += size
            while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        """The stored response; 400 with the store off, 404 for an id not (or no longer) kept."""
        if not self.enabled:
            raise invalid_request(STORE_OFF, param)
        with self._lock:
            found = self._entries.get(response_id)
        if found is None:
            message = f"Response with id '{response_id}' not found."
            raise APIError(404, message, "invalid_request_error", param, "not_found")
        return found

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._drop(response_id)

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, response_id: str) -> None:
        gone = self._entries.pop(response_id, None)
        if gone is not None:
            self._bytes -= gone.size
