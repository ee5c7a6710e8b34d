"""Tensor-parallel ranks of the torch engine: one process per rank, the scheduler on rank 0.

Rank 0 is the engine's own process: it schedules, runs its shard of every step and samples. It
starts ranks 1..N-1 as processes (spawned, so none inherits the server's threads or sockets),
which each load their shard of the weights (service.engine.models.tensor_parallel) and a KV pool
for their share of the kv heads, then run whatever step plan rank 0 sends them; the model's
collectives (all-reduce after row-parallel layers, all-gather of the logits) join the ranks
inside each forward pass. Only rank 0 samples: the others drop their copy of the logits.

    rank 0 (engine thread)                       rank r (worker process)
    schedule -> plan --- pipe (pickled plan) ---> forward(plan)
    forward(plan)  <====== gloo / NCCL =========> (all-reduce, all-gather)
    sample, detokenize, stream

Control travels over one pipe per worker, tensors over torch.distributed: gloo on the CPU, NCCL
on CUDA (rank r on GPU r of the process's visible GPUs). The KV pools are sized alike: every
rank proposes a block count from its own free memory and rank 0 hands out the smallest.

Failure (the engine's dead-engine path does the rest: requests end with an error, readiness
fails, the process exits non-zero):
- a worker that exits is seen at once by a watchdog thread on its process sentinel, which fails
  the engine (`on_death`); a step already inside a collective with it fails too (gloo sees the
  closed connection);
- a collective that does not complete within NIM_COLLECTIVE_TIMEOUT_SECONDS (a hung rank) raises;
- shutdown (normal or after a failure) asks every worker to stop, then terminates and finally
  kills what is left, so no rank outlives the engine; a worker whose rank 0 vanishes sees its
  pipe close (or its collective fail) and exits.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from service.engine.config import EngineConfig
from service.engine.torch.decode_path import DecodePath
from service.engine.torch.kv_pool import KVPool
from service.engine.torch.model_runner import ModelRunner
from service.engine.torch.rank_loading import load_rank, resolve_device
from service.engine.torch.step_plan import StepPlan
from service.logs import configure_logging
from service.util import one_line

log = logging.getLogger(__name__)

# How long a collective waits for the other ranks where NIM_COLLECTIVE_TIMEOUT_SECONDS is unset.
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
# How long a stopping worker gets to leave on its own, then after terminate, before it is killed.
STOP_GRACE_S = 5.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed: it died, could not load, or stopped answering."""


@dataclass(frozen=True)
class RankSetup:
    """What a worker needs to build its rank; pickled into the spawned process."""

    config: EngineConfig
    size: int
    init_method: str  # torch.distributed rendezvous (tcp://127.0.0.1:port)
    threads: int  # CPU threads of this rank's PyTorch ops
    log_level: int
    jsonl_logs: bool


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r computes on GPU r (of those visible to the process), or on the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def join_group(device: torch.device, setup: RankSetup, rank: int) -> None:
    """Join the process group; its collectives (and this rendezvous) wait at most the config's
    collective timeout for the other ranks."""
    dist.init_process_group(
        backend_for(device),
        init_method=setup.init_method,
        rank=rank,
        world_size=setup.size,
        timeout=datetime.timedelta(seconds=setup.config.collective_timeout_s or DEFAULT_COLLECTIVE_TIMEOUT_S),
    )


class TPGroup:
    """Rank 0's handle on the worker ranks: start them, agree on the KV pool, send plans, stop."""

    def __init__(self, setup: RankSetup, device: torch.device) -> None:
        self.setup = setup
        self.size = setup.size
        self.device = device
        context = multiprocessing.get_context("spawn")
        self._processes: list[BaseProcess] = []
        self._pipes: list[multiprocessing.connection.Connection] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.death: str | None = None  # why a worker is gone, once one is
        self._died = threading.Event()
        self._on_death: Callable[[TensorParallelError], None] | None = None
        for rank in range(1, self.size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=worker_main, args=(rank, setup, theirs), name=f"tp-rank-{rank}", daemon=True
            )
            process.start()
            theirs.close()  # the worker holds the only other end: its exit closes the pipe
            self._processes.append(process)
            self._pipes.append(ours)
        log.info(
            "tensor parallelism %d: started ranks 1-%d (pids %s) on %s",
            self.size,
            self.size - 1,
            ", ".join(str(p.pid) for p in self._processes),
            f"GPUs 0-{self.size - 1} (NCCL)" if device.type == "cuda" else "the CPU (gloo)",
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None]

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
        for rank, pipe in enumerate(self._pipes, start=1):
            proposals.append(self._expect(rank, pipe, "loaded")[0])
        blocks = min(proposals)
        for pipe in self._pipes:
            pipe.send(blocks)
        for rank, pipe in enumerate(self._pipes, start=1):
            self._expect(rank, pipe, "ready")
        return blocks

    def watch(self, on_death: Callable[[TensorParallelError], None]) -> None:
        """From now on, a worker that exits calls `on_death` (once), from a watchdog thread."""
        self._on_death = on_death
        threading.Thread(target=self._watchdog, name="tp-watchdog", daemon=True).start()

    def wait_for_death(self, timeout: float) -> str | None:
        """Why a worker is gone, waiting up to `timeout` seconds for the watchdog to see one exit
        (None: every worker is still running)."""
        if any(p.exitcode is not None for p in self._processes):
            self._died.wait(timeout)
        return self.death

    def send(self, plan: StepPlan) -> None:
        """Hand this step's plan to every worker (before rank 0 runs its own forward pass)."""
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                pipe.send_bytes(data)
            except OSError as exc:
                raise TensorParallelError(self._explain(f"rank {rank} is gone: {one_line(exc)}")) from exc

    def shutdown(self) -> None:
        """Stop every worker and leave the process group; idempotent, safe after a failure."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
        for pipe in self._pipes:
            with contextlib.suppress(OSError):  # that worker is gone already
                pipe.send_bytes(pickle.dumps(None))
        for process in self._processes:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.terminate()
                process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self._pipes:
            pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _expect(self, rank: int, pipe: multiprocessing.connection.Connection, what: str) -> list[Any]:
        process = self._processes[rank - 1]
        while not pipe.poll(0.2):
            if not process.is_alive():
                raise TensorParallelError(self._explain(f"rank {rank} exited while starting"))
        try:
            message = pipe.recv()
        except EOFError as exc:
            raise TensorParallelError(self._explain(f"rank {rank} exited while starting")) from exc
        if message[0] == "error":
            raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {message[1]}")
        if message[0] != what:
            raise TensorParallelError(f"tensor-parallel rank {rank} sent {message[0]!r}, expected {what!r}")
        return list(message[1:])

    def _explain(self, what: str) -> str:
        """`what`, with the exit codes of workers that have exited."""
        gone = [
            f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
            for rank, p in enumerate(self._processes, start=1)
            if p.exitcode is not None
        ]
        return "; ".join([f"tensor parallelism: {what}", *gone])

    def _watchdog(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping.is_set():
            return
        rank, process = sentinels[ready[0]]  # type: ignore[index]
        process.join()
        self.death = f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        self._died.set()
        log.error("%s: the engine cannot continue", self.death)
        if self._on_death is not None:
            self._on_death(TensorParallelError(self.death))


def worker_main(rank: int, setup: RankSetup, pipe: multiprocessing.connection.Connection) -> None:
    """A worker rank's whole life (the spawned process's target)."""
    configure_logging(logging.getLevelName(setup.log_level), setup.jsonl_logs)
    try:
        _serve_rank(rank, setup, pipe)
    except (EOFError, BrokenPipeError):
        log.error("tensor-parallel rank %d: rank 0 is gone; exiting", rank)
        os._exit(1)
    except BaseException as exc:
        log.error("tensor-parallel rank %d failed: %s\n%s", rank, one_line(exc), traceback.format_exc())
        with contextlib.suppress(OSError):
            pipe.send(("error", one_line(exc, with_type=True)))
        os._exit(1)  # no atexit or process-group teardown that could wait on the other ranks
    os._exit(0)


def _serve_rank(rank: int, setup: RankSetup, pipe: multiprocessing.connection.Connection) -> None:
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
    path = DecodePath.eager(pool, loaded.model, loaded.decode_kernel, "a tensor-parallel worker rank")
    runner = ModelRunner(loaded.model, pool, device, path, lora=loaded.lora)
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
