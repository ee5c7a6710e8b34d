"""One machine, one command: N Dynamo workers and this server's router as child processes.

    python -m service.dynamo local --workers 2 --port 8000      (or: make dynamo-local)

File discovery in a directory of the deployment's own (DYN_FILE_KV), requests over TCP and KV
events over ZMQ, every socket on loopback (Dynamo's DYN_*_HOST variables), no etcd and no NATS.
The children inherit the environment (NIM_* settings apply to every role); each worker runs its
engine on `threads` cores. The tests and bench/dynamo_routing.py start deployments through
`LocalDeployment`; `stop` ends every child by its process group, router first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# Dynamo's own variables for one machine: its sockets bind the host's address unless told.
LOOPBACK_ENV = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",  # a worker's request-plane server
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",  # the router's response-stream server
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",  # the address a worker's ZMQ publisher advertises
    "DYN_SYSTEM_HOST": "127.0.0.1",
    "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",  # else a worker waits 5 s after SIGTERM
    "DYN_SELF_HOST_METADATA": "0",
    "DYN_LOG": "warn",
}
SERVING_MARK = "Dynamo worker "  # a worker's start-up line, logged once its engine is up
STOP_TIMEOUT_S = 20.0


@dataclass
class LocalDeployment:
    """`workers` Dynamo workers and one router on 127.0.0.1:`port`, logging into `workdir`."""

    workers: int
    port: int
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)  # every role's, over the inherited environment
    workers_env: dict[str, str] = field(default_factory=dict)  # every worker's (engine settings)
    worker_env: list[dict[str, str]] = field(default_factory=list)  # per worker, over both
    router_env: dict[str, str] = field(default_factory=dict)  # the router's (API settings)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def base_env(self) -> dict[str, str]:
        env = {**os.environ, **LOOPBACK_ENV, "DYN_FILE_KV": str(self.workdir / "discovery")}
        env.update({"NIM_DYNAMO_DISCOVERY": "file", "PYTHONUNBUFFERED": "1", "HOME": str(self.workdir)})
        env.update(self.env)
        return env

    def start_worker(self, index: int) -> subprocess.Popen[bytes]:
        env = {**self.base_env(), **self.workers_env}
        if index < len(self.worker_env):
            env.update(self.worker_env[index])
        return self._spawn(f"worker{index}", ["worker"], env)

    def start(self, timeout: float = 300.0) -> None:
        """Start everything; return once every worker serves and the router is ready."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for i in range(self.workers):
            self.start_worker(i)
        router_env = {**self.base_env(), **self.router_env}
        args = ["router", "--host", "127.0.0.1", "--port", str(self.port)]
        self._spawn("router", args, router_env)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with (self.workdir / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "service.dynamo", *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # stopped by process group: an engine process goes with it
            )
        self.processes[name] = process
        return process

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = {f"worker{i}" for i in range(self.workers)} | {"router"}
        while waiting:
            for name in sorted(waiting):
                process = self.processes[name]
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log(name)[-4000:]}")
                up = _ready(self.url) if name == "router" else SERVING_MARK in self.log(name)
                if up:
                    waiting.discard(name)
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout:.0f} s: {sorted(waiting)}")
            time.sleep(0.2)
        time.sleep(1.0)  # registration follows a worker's start-up line (its endpoint serves next)

    def kill(self, name: str) -> None:
        """SIGKILL one child's process group (a crash, as tests simulate one)."""
        process = self.processes[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def stop(self) -> dict[str, int | None]:
        """SIGTERM the router, then the workers (each drains and unregisters); SIGKILL whatever
        is left after STOP_TIMEOUT_S. Returns the exit codes."""
        order = ["router", *(n for n in self.processes if n != "router")]
        for name in order:
            process = self.processes.get(name)
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
            if name == "router" and process is not None:
                _wait(process, STOP_TIMEOUT_S)
        codes: dict[str, int | None] = {}
        for name, process in self.processes.items():
            _wait(process, STOP_TIMEOUT_S)
            codes[name] = process.returncode
            # the group too: nothing a child started outlives the deployment
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        return codes


def _wait(process: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/health/ready", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.dynamo local", description="N workers + router")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--port", type=int, default=8000, help="the router's HTTP port (127.0.0.1)")
    parser.add_argument("--dir", type=Path, help="logs and discovery (default: a new temporary directory)")
    parser.add_argument("--threads", type=int, help="NIM_NUM_THREADS of each worker")
    args = parser.parse_args(argv)
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="nim-dynamo-"))
    engine = {"NIM_NUM_THREADS": str(args.threads)} if args.threads else {}
    deployment = LocalDeployment(args.workers, args.port, workdir, workers_env=engine)
    print(f"starting {args.workers} workers and the router; logs in {workdir}", flush=True)
    try:
        deployment.start()
        print(f"ready: {deployment.url}/v1 (Ctrl-C stops everything)", flush=True)
        while deployment.processes["router"].poll() is None:
            for i in range(deployment.workers):  # as an orchestrator would: a worker that died restarts
                process = deployment.processes[f"worker{i}"]
                if process.poll() is not None:
                    print(f"worker{i} exited with {process.returncode}; restarting it", flush=True)
                    deployment.start_worker(i)
            time.sleep(0.5)
        print(f"the router exited with {deployment.processes['router'].returncode}; stopping", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        deployment.stop()
    return 0
