"""Tensor-parallel ranks of the torch engine: one process per rank, the scheduler on rank 0.

Rank 0 is the engine's own process: it schedules, runs its shard of every step and samples. It
starts ranks 1..N-1 as child processes (service.engine.child: fresh interpreters that inherit
none of the server's threads or sockets),
which each load their shard of the weights (service.engine.models.tensor_parallel) and a KV pool
for their share of the kv heads, then run whatever step plan rank 0 sends them; the model's
collectives (all-reduce after row-parallel layers, all-gather of the logits) join the ranks
inside each forward pass. Only rank 0 samples: the others drop their copy of the logits.

    rank 0 (engine thread)                       rank r (worker process)
    schedule -> plan --- pipe (pickled plan) ---> forward(plan)
    forward(plan)  <====== gloo / NCCL =========> (all-reduce, all-gather)
    sample, detokenize, stream

Control travels over each worker's socket, tensors over torch.distributed: gloo on the CPU, NCCL
on CUDA (rank r on GPU r of the process's visible GPUs). The KV pools are sized alike: every
rank proposes a block count from its own free memory and rank 0 hands out the smallest.

Failure (the engine's dead-engine path does the rest: requests end with an error, readiness
fails, the process exits non-zero):
- a worker that exits is seen at once by a watchdog thread on its process sentinel, which fails
  the engine (`on_death`); a step already inside a collective with it fails too (gloo sees the
  closed connection);
- a collective that does not complete within NIM_COLLECTIVE_TIMEOUT_SECONDS (a hung rank) raises;
- shutdown (normal or after a failure) ends every worker in order (asked, terminated, killed), so
  no rank outlives the engine; a worker whose rank 0 vanishes sees its socket close (or its
  collective fail, or its parent change) and exits.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing.connection
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from service.engine.child import Child
from service.engine.config import EngineConfig
from service.engine.torch.decode_path import DecodePath
from service.engine.torch.kv_pool import KVPool
from service.engine.torch.model_runner import ModelRunner
from service.engine.torch.rank_loading import load_rank, resolve_device
from service.engine.torch.step_plan import StepPlan
from service.logs import configure_logging
from service.util import freeze_startup_heap, one_line

log = logging.getLogger(__name__)

# How long a collective waits for the other ranks where NIM_COLLECTIVE_TIMEOUT_SECONDS is unset.
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
RENDEZVOUS_TIMEOUT_S = 120.0  # how long the ranks' processes have to start and meet
# How long a stopping worker gets to leave on its own, then after terminate, before it is killed.
STOP_GRACE_S = 5.0
# How long the watchdog lets the other ranks show their exit after the first it sees.
DEATH_SETTLE_S = 0.2


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed: it died, could not load, or stopped answering."""


@dataclass(frozen=True)
class RankSetup:
    """What a worker needs to build its rank; pickled into the spawned process."""

    config: EngineConfig
    size: int
    rendezvous_port: int  # the ranks meet at 127.0.0.1:port (rank 0 serves the store)
    threads: int  # CPU threads of this rank's PyTorch ops
    log_level: int
    jsonl_logs: bool


@dataclass(frozen=True)
class RankStart:
    """A worker's setup: which rank it is, and what every rank shares."""

    rank: int
    setup: RankSetup


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r computes on GPU r (of those visible to the process), or on the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def join_group(device: torch.device, setup: RankSetup, rank: int) -> None:
    """Join the process group: the rendezvous waits up to RENDEZVOUS_TIMEOUT_S (or the collective
    timeout, if longer) for the other ranks, whose processes are still starting (importing torch,
    initialising CUDA: seconds, under load more); the group's collectives then wait at most the
    config's collective timeout. (One timeout for both failed starts whenever a rank took longer to
    start than NIM_COLLECTIVE_TIMEOUT_SECONDS.)"""
    collective = setup.config.collective_timeout_s or DEFAULT_COLLECTIVE_TIMEOUT_S
    store = dist.TCPStore(
        "127.0.0.1",
        setup.rendezvous_port,
        setup.size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=max(collective, RENDEZVOUS_TIMEOUT_S)),
        wait_for_workers=True,
    )
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=setup.size,
        timeout=datetime.timedelta(seconds=collective),
    )


class TPGroup:
    """Rank 0's handle on the worker ranks: start them, agree on the KV pool, send plans, stop."""

    def __init__(self, setup: RankSetup, device: torch.device) -> None:
        self.setup = setup
        self.size = setup.size
        self.device = device
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.death: str | None = None  # why a worker is gone, once one is
        self._died = threading.Event()
        self._on_death: Callable[[TensorParallelError], None] | None = None
        self._workers: list[Child] = []
        try:
            for rank in range(1, self.size):
                self._workers.append(
                    Child.start(
                        f"{__name__}:worker_main", RankStart(rank, setup), name=f"tensor-parallel rank {rank}"
                    )
                )
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "tensor parallelism %d: started ranks 1-%d (pids %s) on %s",
            self.size,
            self.size - 1,
            ", ".join(str(worker.pid) for worker in self._workers),
            f"GPUs 0-{self.size - 1} (NCCL)" if device.type == "cuda" else "the CPU (gloo)",
        )

    @property
    def pids(self) -> list[int]:
        return [worker.pid for worker in self._workers]

    def join(self) -> None:
        """Join the process group as rank 0 (blocks until every rank has joined, or times out)."""
        try:
            join_group(self.device, self.setup, 0)
        except Exception as exc:
            raise TensorParallelError(self._explain(f"the ranks did not meet: {one_line(exc)}")) from exc

    def agree_blocks(self, own: int) -> int:
        """The KV pool size every rank uses: the smallest any rank proposes; waits for every
        worker to have loaded its shard."""
        proposals = [own]
        for rank, worker in enumerate(self._workers, start=1):
            proposals.append(self._expect(rank, worker, "loaded")[0])
        blocks = min(proposals)
        for worker in self._workers:
            worker.send(blocks)
        for rank, worker in enumerate(self._workers, start=1):
            self._expect(rank, worker, "ready")
        return blocks

    def watch(self, on_death: Callable[[TensorParallelError], None]) -> None:
        """From now on, a worker that exits calls `on_death` (once), from a watchdog thread."""
        self._on_death = on_death
        threading.Thread(target=self._watchdog, name="tp-watchdog", daemon=True).start()

    def wait_for_death(self, timeout: float) -> str | None:
        """Why a worker is gone, waiting up to `timeout` seconds for the watchdog to see one exit
        (None: every worker is still running). Called after a collective failed: a killed rank's
        connections close while its process is still being torn down, before it shows as exited,
        so the wait does not first ask whether a worker is alive (that raced: the error then lacked
        the rank)."""
        self._died.wait(timeout)
        return self.death

    def send(self, plan: StepPlan) -> None:
        """Hand this step's plan to every worker (before rank 0 runs its own forward pass)."""
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, worker in enumerate(self._workers, start=1):
            try:
                worker.send_bytes(data)
            except OSError as exc:
                raise TensorParallelError(self._explain(f"rank {rank} is gone: {one_line(exc)}")) from exc

    def shutdown(self) -> None:
        """Stop every worker and leave the process group; idempotent, safe after a failure."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
        for worker in self._workers:  # asked together, then each ended in order
            worker.ask_to_stop()
        for worker in self._workers:
            worker.stop(STOP_GRACE_S)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _expect(self, rank: int, worker: Child, what: str) -> list[Any]:
        while not worker.poll(0.2):
            if not worker.alive():
                raise TensorParallelError(self._explain(f"rank {rank} exited while starting"))
        try:
            message = worker.recv()
        except EOFError as exc:
            raise TensorParallelError(self._explain(f"rank {rank} exited while starting")) from exc
        if message[0] == "error":
            raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {message[1]}")
        if message[0] != what:
            raise TensorParallelError(f"tensor-parallel rank {rank} sent {message[0]!r}, expected {what!r}")
        return list(message[1:])

    def _explain(self, what: str) -> str:
        """`what`, with the exit codes of workers that have exited."""
        gone = [f"rank {rank} (pid {w.pid}) exited with code {w.exit_code}"
                for rank, w in enumerate(self._workers, start=1) if not w.alive()]  # fmt: skip
        return "; ".join([f"tensor parallelism: {what}", *gone])

    def _watchdog(self) -> None:
        sentinels = {w.sentinel: (rank, w) for rank, w in enumerate(self._workers, start=1)}
        multiprocessing.connection.wait(list(sentinels))
        # A rank whose peer died fails its own collective and exits too, and may show first: after
        # a moment, every rank gone is named, the ones a signal ended first (the cause).
        time.sleep(DEATH_SETTLE_S)
        if self._stopping.is_set():
            return
        ready = multiprocessing.connection.wait(list(sentinels), timeout=0)
        exited = [sentinels[sentinel] for sentinel in ready]  # type: ignore[index]
        for _, worker in exited:
            worker.wait()
        exited.sort(key=lambda gone: ((gone[1].exit_code or 0) >= 0, gone[0]))
        rank, worker = exited[0]
        self.death = f"tensor-parallel rank {rank} (pid {worker.pid}) exited with code {worker.exit_code}"
        also = [f"rank {other} (pid {w.pid}) with code {w.exit_code}" for other, w in exited[1:]]
        if also:
            self.death += f" (also exited: {', '.join(also)})"
        self._died.set()
        log.error("%s: the engine cannot continue", self.death)
        if self._on_death is not None:
            self._on_death(TensorParallelError(self.death))


def worker_main(start: RankStart, conn: Connection) -> int:
    """A worker rank's whole life (a child process's target): its exit code. A failure to load is
    told to rank 0 in one line before the process exits."""
    rank, setup = start.rank, start.setup
    configure_logging(logging.getLevelName(setup.log_level), setup.jsonl_logs)
    try:
        _serve_rank(rank, setup, conn)
    except (EOFError, BrokenPipeError):
        log.error("tensor-parallel rank %d: rank 0 is gone; exiting", rank)
        return 1
    except BaseException as exc:
        log.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(OSError):
            conn.send(("error", one_line(exc, with_type=True)))
        return 1
    return 0


def _serve_rank(rank: int, setup: RankSetup, pipe: Connection) -> None:
    config = setup.config
    device, dtype = resolve_device(config)
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(setup.threads)
    join_group(device, setup, rank)
    loaded = load_rank(config, device, dtype, rank, setup.size)
    pipe.send(("loaded", loaded.propose_blocks(config, setup.size)))
    blocks = pipe.recv()
    pool = KVPool(loaded.kv_spec, blocks, device)
    native = any(choice.name == "cpu_fused_ops" and choice.used for choice in loaded.paths)  # as rank 0
    path = DecodePath.eager(pool, loaded.model, loaded.decode_kernel, "a tensor-parallel worker rank", native)
    runner = ModelRunner(loaded.model, pool, device, path, lora=loaded.lora)
    freeze_startup_heap()
    pipe.send(("ready",))
    torch.set_grad_enabled(False)
    with torch.inference_mode():
        while True:
            plan: StepPlan | None = pickle.loads(pipe.recv_bytes())
            if plan is None:
                break
            runner.prepare_step(plan)
            runner.forward(plan)
    dist.destroy_process_group()
