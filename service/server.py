"""uvicorn, with a drain before it stops.

On SIGTERM (or SIGINT) readiness turns 503 at once and new generation requests get 503, so the
orchestrator and gateways stop sending traffic; requests already in flight run to completion
for up to the grace period; then uvicorn shuts down (closing what is left) and the process exits
0. A second signal skips the wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)

DRAIN_POLL_SECONDS = 0.1


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        begin_drain: Callable[[], None],
        busy: Callable[[], bool],
        grace_s: float,
    ) -> None:
        super().__init__(config)
        self.begin_drain, self.busy, self.grace_s = begin_drain, busy, grace_s
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Deliberately not recording the signal for uvicorn to re-raise after shutdown: that would
        # kill the process with -SIGTERM, which orchestrators read as a crash.
        if self._draining:
            log.info("second stop signal: shutting down without waiting")
            self.should_exit = True
            return
        self._draining = True
        log.info("stop signal: draining (up to %.0f s) before shutting down", self.grace_s)
        self.begin_drain()
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and self.busy():
            time.sleep(DRAIN_POLL_SECONDS)
        if self.busy():
            log.warning("grace period over with requests still in flight; shutting down anyway")
        self.should_exit = True
