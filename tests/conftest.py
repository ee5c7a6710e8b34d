"""Shared fixtures: a real server process on 127.0.0.1 serving the embedded model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

# Without a GPU, Triton kernels can only run in Triton's interpreter; it is chosen when a kernel
# module is imported, so before any test imports the engine.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
# Intra-op threads for the engines the tests build and the servers they start: one under
# pytest-xdist (`make test` runs two workers, one per core: two workers' threads would contend
# for the 2 cores of the target machine), two in a single pytest process.
TEST_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
if TEST_THREADS == 1:
    os.environ["OMP_NUM_THREADS"] = "1"  # torch's default in this worker, read when torch loads
EMBEDDED_NAME = "smollm2-135m-instruct"
READY_TIMEOUT_S = 180


def embedded_default_precision() -> str:
    """The embedded model's default profile's precision on this machine: its Q4_1 blocks as int4
    where the CPU has bf16 instructions or the W4A8 kernel's (AVX2, FMA, F16C, and a compiler to
    build it), fp32 where it has neither (aten's int kernels are slower than fp32 there at batch
    32: service/selection/profiles.py ranks them last for throughput, the default profile type)."""
    from service.host import cpu_flags, cpu_has_fast_bf16, cxx_compiler_found

    w4a8 = {"avx2", "fma", "f16c"} <= cpu_flags() and cxx_compiler_found()
    return "int4_wo" if cpu_has_fast_bf16() or w4a8 else "fp32"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    log_path: Path,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    unset: tuple[str, ...] = (),
    command: str = "serve",
) -> ServerProcess:
    """The server on a free port with the test defaults, `env` over them, and `unset` removed;
    `command` is serve or NIM 2.x's nim-serve."""
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("NIM_")}
    full_env.update(
        {
            "NIM_NUM_THREADS": str(TEST_THREADS),
            "NIM_KV_CACHE_MAX_TOKENS": "32768",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    full_env.update(env or {})
    for name in unset:
        full_env.pop(name, None)
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "entrypoint.py"),
            command,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *(args or []),
        ],
        cwd=REPO,
        env=full_env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    log_file.close()
    return ServerProcess(process, f"http://127.0.0.1:{port}", log_path)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_ready(
    server: ServerProcess, timeout: float = READY_TIMEOUT_S, client: httpx.Client | None = None
) -> None:
    deadline = time.monotonic() + timeout
    get = client.get if client is not None else httpx.get
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if get(f"{server.base_url}/v1/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready after {timeout} s:\n{server.log()}")


@pytest.fixture(autouse=True)
def _intra_op_threads() -> Iterator[None]:
    """Each test leaves torch at TEST_THREADS: an engine built in process sets the process's thread
    count (its NIM_NUM_THREADS, or every core), which would otherwise hold for the worker's later
    modules."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("server") / "server.log")
    try:
        wait_ready(proc)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def base_url(server: ServerProcess) -> str:
    return server.base_url


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from service.store.model_store import embedded_model_path
    from service.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(embedded_model_path())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` and `trtllm` tests skip, saying why, where their hardware or package is absent."""
    import importlib.util

    import torch

    reasons = {
        "gpu": None if torch.cuda.is_available() else "needs a CUDA device (none visible to PyTorch)",
        "trtllm": None if importlib.util.find_spec("tensorrt_llm") else "needs tensorrt_llm (in the image)",
    }
    for item in items:
        for marker, reason in reasons.items():
            if reason and item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
