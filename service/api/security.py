"""API keys: from NIM_API_KEY and/or a keys file that is re-read when it changes (no restart).

Keys are compared in constant time against every configured key, so response timing says
nothing about how much of a guess was right.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

RELOAD_CHECK_SECONDS = 1.0


class APIKeyStore:
    def __init__(self, static_keys: list[str], keys_file: Path | None) -> None:
        self._static = [k.encode() for k in static_keys if k]
        self._file = keys_file
        self._file_keys: list[bytes] = []
        self._file_mtime: float | None = None
        self._checked_at = 0.0
        self._lock = threading.Lock()
        self._reload(force=True)

    @property
    def enabled(self) -> bool:
        return bool(self._static) or self._file is not None

    def verify(self, presented: str) -> bool:
        self._reload()
        candidate = presented.encode()
        match = False
        for key in (*self._static, *self._file_keys):
            match |= hmac.compare_digest(candidate, key)  # no early exit
        return match

    def _reload(self, force: bool = False) -> None:
        if self._file is None:
            return
        now = time.monotonic()
        if not force and now - self._checked_at < RELOAD_CHECK_SECONDS:
            return
        with self._lock:
            self._checked_at = now
            try:
                mtime = self._file.stat().st_mtime
            except OSError:
                if self._file_keys:
                    log.warning("API keys file %s is gone; no file keys are accepted", self._file)
                self._file_keys, self._file_mtime = [], None
                return
            if mtime == self._file_mtime:
                return
            lines = self._file.read_text().splitlines()
            self._file_keys = [ln.strip().encode() for ln in lines if ln.strip() and not ln.startswith("#")]
            self._file_mtime = mtime
            log.info("loaded %d API key(s) from %s", len(self._file_keys), self._file)
