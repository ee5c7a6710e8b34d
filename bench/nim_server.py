"""This repository's server as a benchmark subject: started from the checkout with a clean NIM_*
environment (only what the benchmark sets), and waited on until ready."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def start(env: dict[str, str], port: int, log: Path, repo: Path = REPO) -> subprocess.Popen:
    """`entrypoint.py serve` of the checkout `repo` (this one by default) on 127.0.0.1:`port` with
    `env` (over the caller's environment minus its NIM_* variables), output to `log`."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("NIM_")}
    full.update({"HF_HUB_OFFLINE": "1", **env})
    command = [
        sys.executable,
        str(repo / "entrypoint.py"),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return subprocess.Popen(command, cwd=repo, env=full, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/v1/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not ready after {timeout} s:\n{log.read_text()}")
