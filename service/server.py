"""uvicorn, with a drain before it stops.

On SIGTERM (or SIGINT) readiness turns 503 at once and new generation requests get 503, so the
orchestrator and gateways stop sending traffic; requests already in flight run to completion
for up to the grace period. Then what still runs is ended (the engine stops: each stream gets
an error frame saying the server is shutting down, then [DONE], each other request a 503), and
uvicorn shuts down and the process exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

DRAIN_POLL_SECONDS = 0.1
END_IN_FLIGHT_TIMEOUT_S = 40.0  # the engine's stop joins its thread (30 s) and its ranks


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        begin_drain: Callable[[], None],
        busy: Callable[[], bool],
        grace_s: float,
        end_in_flight: Callable[[], Coroutine[Any, Any, None]],
    ) -> None:
        super().__init__(config)
        self.begin_drain, self.busy, self.grace_s = begin_drain, busy, grace_s
        self.end_in_flight = end_in_flight  # ends what still runs when the grace period is over
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Deliberately not recording the signal for uvicorn to re-raise after shutdown: that would
        # kill the process with -SIGTERM, which orchestrators read as a crash.
        if self._draining:
            log.info("second stop signal: shutting down without waiting")
            self.should_exit = True
            return
        self._draining = True
        self._loop = asyncio.get_event_loop()  # signals are handled on the event loop's thread
        log.info("stop signal: draining (up to %.0f s) before shutting down", self.grace_s)
        self.begin_drain()
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and self.busy():
            time.sleep(DRAIN_POLL_SECONDS)
        if self.busy() and self._loop is not None:
            log.warning("grace period over with requests still in flight; ending them")
            ending = asyncio.run_coroutine_threadsafe(self.end_in_flight(), self._loop)
            with contextlib.suppress(Exception):  # stopping regardless; the app logs its own errors
                ending.result(END_IN_FLIGHT_TIMEOUT_S)
        self.should_exit = True
