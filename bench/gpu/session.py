"""One lent GPU's measurement in one command, phase by phase under one deadline, and its rehearsal
on the CPU (what CI runs, so the device never meets a script that has not run).

    python3 bench/gpu/session.py prepare --carry DIR      # here, with PyPI: what the device lacks
    python3 bench/gpu/session.py measure --carry DIR --out OUT --commit SHA [--deadline-s 540]
    python3 bench/gpu/session.py rehearse --out OUT       # every phase on the CPU, a tiny model
    python3 bench/gpu/session.py stage --carry DIR        # on the device, second call: the embedded model

bench/gpu_session.sh wraps these (and the separate second command, `extras`).

The carry folder (CARRY_FILES) holds what the device machine has not: the wheels of the service's
dependencies that its image lacks (whl/, bench/gpu/device_carry.py says which and checks that list
against every import), and the embedded model's tokenizer (tokenizer/), which the random checkpoint
is written with. `check` refuses to go on without them, naming what is missing. `prepare` also
splits the embedded model into model-a/ and model-b/ (one per call: a call carries at most 64 MiB):
`check` keeps model-a on the device, `stage` (the second call) adds model-b for `make test-gpu`.

Phases, in the order of their value; each gets the lesser of its own limit and the time left
before the deadline (less a reserve for the summary and the server's cleanup), and a phase that
needs an earlier one that failed is skipped:

  check        the carry folder, the wheels installed, then every module of the server imported
  checkpoint   a random Llama-3.1-8B-shape checkpoint (bf16) written with the carried tokenizer
  floor        its batch-1 weight-read floor (bench/gpu/floor.py)
  serve-bf16   our server on it, the bf16 profile pinned; its decisions read from /v1/metadata and
               its log (attention path and why, graphs captured, KV pool, step capacity, profile)
  greedy       streaming chat, greedy, ignore_eos, at each greedy concurrency (bench/compare_llama.py,
               one call per concurrency), with the server's account of each from its /metrics before
               and after (engine steps: count, mean time, tokens, busy share; mean queue, prefill,
               TTFT and ITL as the server saw them): a slow step and time lost on the way out differ
  sampled      the same at the sampled concurrency, temperature 0.8, top_p 0.95, same server
  serve-fp8    the fp8 profile (quantized at load), then its load at the fp8 concurrency (fp8)
  serve-fused  the bf16 profile again with NIM_FUSED_KERNELS=1 (the Triton norm/RoPE/SiLU kernels, off
               by default until a GPU run shows them faster; the CPU rehearsal cannot turn them on and
               serves without), then its load at the fused concurrencies (fused)
  prefill      in process, the bf16 engine: the steps that prefill `prefill_prompts` prompts at once,
               timed one by one and under torch.profiler, with the kernels that take the GPU's time
               (bench/gpu/prefill_profile.py)

A server is stopped by its whole process tree (the engine process has a session of its own):
SIGTERM to each, then SIGKILL after a grace; then the port must be free and, on a GPU, nvidia-smi
must show no compute process. summary.json is rewritten after every phase, so a call cut by its
time limit still returns what it measured; OUT keeps few files (the device returns at most 8).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from device_carry import OPTIONAL_IMPORTS, WHEELS, assemble_embedded, keep_first_half, split_embedded

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"

CARRY_FILES = ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json")
IMPORTS = ("torch", "fastapi", "uvicorn", "pydantic_settings", "gguf", "safetensors", "tokenizers", "httpx")
# What the server and tools import, and what the device is (run by the check phase, after the wheels):
# every module of the server, so that a module the device lacks stops the session here, in seconds,
# rather than when its first server exits.
PROBE = """
import importlib, json, pkgutil, platform
for name in {imports!r}:
    importlib.import_module(name)
import service
unimportable = {{}}
for module in pkgutil.walk_packages(service.__path__, "service."):
    if module.name.startswith("service.dynamo"):  # the Dynamo worker: ai-dynamo, optional
        continue
    try:
        importlib.import_module(module.name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in {optional!r}:
            unimportable[module.name] = exc.name
import torch
cuda = torch.cuda.is_available()
info = {{"torch": torch.__version__, "cuda": cuda, "python": platform.python_version()}}
info["unimportable"] = unimportable
if cuda:
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, capability=[props.major, props.minor])
    info["memory_gib"] = round(props.total_memory / 2**30, 1)
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
print(json.dumps(info))
"""
SITE = Path("/tmp/site")  # where the device's wheels are installed
RESERVE_S = 25  # kept back from every phase for the summary and a server's cleanup
STOP_GRACE_S = 20  # a server's drain after SIGTERM, before SIGKILL
FP8_PROFILE = "torch-generic-fp8-tp1-pp1-throughput"
BF16_PROFILE = "torch-generic-bf16-tp1-pp1-throughput"
# Lines of the server's log that say what it decided (kept in the summary).
DECISIONS = re.compile(
    r"step capacity|KV cache|captured \d+ CUDA graphs|decode steps|CUDA graph .* dropped|start-up check|"
    r"engine core runs|engine process|profile|loaded .* in [\d.]+ s|unified|fp8|fused kernels|decode"
)


@dataclass(frozen=True)
class Plan:
    """What one session measures: the device's, or the CPU rehearsal's smaller copy of it."""

    shape: str  # bench/gpu/checkpoint.py's
    ctx: int  # context per request (NIM_MAX_MODEL_LEN)
    input_words: int
    output_len: int
    greedy: tuple[int, ...]  # greedy concurrencies, in order
    sampled: int  # the sampled load's concurrency (same server)
    fp8: int  # the fp8 profile's concurrency
    deadline_s: float
    limits: dict[str, float]  # per phase
    max_num_seqs: int
    prefill_prompts: int  # the prefill profile's prompts (of about the loads' prompt length)
    prefill_input_len: int
    fused: tuple[int, ...]  # the fused-kernels server's concurrencies
    prefill_batched_tokens: int | None = None  # None: the server's default for the device
    fused_env: bool = True  # NIM_FUSED_KERNELS=1 on the fused server (CUDA only: the rehearsal cannot)
    rounds: int = 1
    warmup: int = 2


DEVICE_PLAN = Plan(
    shape="8b", ctx=1024, input_words=200, output_len=256, greedy=(1, 64, 256), sampled=256, fp8=1,
    deadline_s=540, max_num_seqs=256, prefill_prompts=64, prefill_input_len=256, fused=(1, 64),
    limits={"check": 90, "checkpoint": 90, "floor": 60, "serve-bf16": 180, "greedy": 240, "sampled": 90,
            "serve-fp8": 180, "fp8": 60, "serve-fused": 120, "fused": 60, "prefill": 90},
)  # fmt: skip
REHEARSAL_PLAN = Plan(
    shape="tiny", ctx=256, input_words=40, output_len=24, greedy=(1, 4), sampled=4, fp8=1,
    deadline_s=170, max_num_seqs=8, prefill_prompts=4, prefill_input_len=40, prefill_batched_tokens=64,
    fused=(1,), fused_env=False,
    # sampled and fp8 at their slowest on a bf16 CPU (a flat nucleus sorted in bf16; fp8 emulated)
    limits={"check": 30, "checkpoint": 30, "floor": 30, "serve-bf16": 60, "greedy": 40, "sampled": 45,
            "serve-fp8": 60, "fp8": 40, "serve-fused": 60, "fused": 20, "prefill": 30},
)  # fmt: skip


@dataclass
class PhaseRecord:
    status: str  # ok, failed, timeout, skipped
    seconds: float
    detail: str = ""


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    port: int
    log: Path
    decisions: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False


class PhaseFailed(Exception):
    """A phase could not do its job; the message says why (one line)."""


class Session:
    def __init__(self, plan: Plan, carry: Path, out: Path, commit: str, python: str, rehearsal: bool) -> None:
        self.plan, self.carry, self.out, self.commit = plan, carry, out, commit
        self.python, self.rehearsal = python, rehearsal
        self.work = Path(os.environ.get("NIM_SESSION_WORK", "/tmp/nim-session")) / (
            "rehearsal" if rehearsal else "device"
        )
        self.started = time.monotonic()
        self.deadline = self.started + plan.deadline_s
        self.phases: dict[str, PhaseRecord] = {}
        self.loads: dict[str, dict[str, Any]] = {}  # compare_llama documents by phase
        self.floor: dict[str, Any] | None = None
        self.prefill: dict[str, Any] | None = None
        self.server_metrics: dict[str, dict[str, dict[str, float | None]]] = {}  # load -> c -> figures
        self.device: dict[str, Any] = {}
        self.servers: dict[str, Server] = {}
        self.log_file = (out / "session.log").open("a")

    # --- Plumbing ---------------------------------------------------------------------------------

    def say(self, message: str) -> None:
        line = f"== {time.strftime('%H:%M:%S')} +{time.monotonic() - self.started:.0f}s {message}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NIM_")}
        paths = [str(REPO)] if self.rehearsal else [str(SITE), str(REPO)]
        env.update(
            PYTHONPATH=":".join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
            PYTHONUNBUFFERED="1",
            PYTHONFAULTHANDLER="1",
            HF_HUB_OFFLINE="1",
            NIM_CACHE_PATH=str(self.work / "cache"),
        )
        env.update(extra)
        return env

    def time_left(self) -> float:
        return self.deadline - time.monotonic() - RESERVE_S

    def run_phase(self, name: str, needs: tuple[str, ...], body: Callable[[float], str]) -> None:
        """Run `body(seconds)` with the lesser of the phase's limit and the time left; record it."""
        missing = [n for n in needs if self.phases.get(n, PhaseRecord("skipped", 0)).status != "ok"]
        budget = min(self.plan.limits[name], self.time_left())
        started = time.monotonic()
        if missing:
            self.phases[name] = PhaseRecord("skipped", 0, f"needs {', '.join(missing)}")
        elif budget < 5:
            self.phases[name] = PhaseRecord("skipped", 0, "no time left before the deadline")
        else:
            self.say(f"{name} (up to {budget:.0f} s)")
            try:
                detail = body(budget)
                self.phases[name] = PhaseRecord("ok", time.monotonic() - started, detail)
            except subprocess.TimeoutExpired:
                self.phases[name] = PhaseRecord(
                    "timeout", time.monotonic() - started, f"cut at {budget:.0f} s, the phase's time"
                )
            except PhaseFailed as exc:
                self.phases[name] = PhaseRecord("failed", time.monotonic() - started, str(exc))
            except Exception as exc:  # the script's own fault: recorded, the session goes on
                why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
                self.phases[name] = PhaseRecord("failed", time.monotonic() - started, why)
        record = self.phases[name]
        self.say(f"{name}: {record.status} ({record.seconds:.0f} s) {record.detail}")
        self.write_summary()

    def command(self, args: list[str], seconds: float, log: Path | None = None, **env: str) -> str:
        """Run `args` in a session of its own for at most `seconds`: on the deadline its stacks are
        dumped (SIGABRT, with PYTHONFAULTHANDLER) and its whole tree is ended; TimeoutExpired."""
        output = log.open("ab") if log is not None else subprocess.PIPE
        process = subprocess.Popen(
            args,
            cwd=REPO,
            env=self.env(**env),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = process.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            end_tree(process, grace=5, first=signal.SIGABRT)
            raise
        finally:
            if log is not None:
                output.close()  # type: ignore[union-attr]
        text = (
            (out or b"").decode(errors="replace") if log is None else log.read_text(errors="replace")[-4000:]
        )
        if process.returncode != 0:
            tool = Path(args[1]).name if len(args) > 1 else args[0]
            tail = " ".join(text.split())[-600:]
            raise PhaseFailed(f"{tool} exited {process.returncode}: {tail}")
        return text

    # --- Phases ------------------------------------------------------------------------------------

    def check(self, seconds: float) -> str:
        missing = [name for name in CARRY_FILES if not (self.carry / name).is_file()]
        wheels = sorted((self.carry / "whl").glob("*.whl")) if (self.carry / "whl").is_dir() else []
        if not self.rehearsal and not wheels:
            missing.append("whl/*.whl")
        if missing:
            lacks = ", ".join(missing)
            raise PhaseFailed(f"the carry folder {self.carry} lacks {lacks} (`prepare --carry DIR` makes it)")
        if wheels:
            pip = [self.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            self.command(
                [*pip, "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)], seconds
            )
        probe = PROBE.format(imports=IMPORTS, optional=sorted(OPTIONAL_IMPORTS))
        self.device = json.loads(self.command([self.python, "-c", probe], seconds).strip().splitlines()[-1])
        if unimportable := self.device.pop("unimportable"):
            lacking = ", ".join(sorted({f"{name} (by {module})" for module, name in unimportable.items()}))
            raise PhaseFailed(f"the server cannot import {lacking}: add its wheel to device_carry.WHEELS")
        if not self.rehearsal:
            self.say(keep_first_half(self.carry))
        if not self.rehearsal and not self.device["cuda"]:
            raise PhaseFailed(f"no CUDA device visible to torch {self.device['torch']}")
        return json.dumps(self.device)

    @property
    def checkpoint_dir(self) -> Path:
        return self.work / f"ckpt-{self.plan.shape}"

    def checkpoint(self, seconds: float) -> str:
        shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
        args = [self.python, str(BENCH / "gpu" / "checkpoint.py"), self.plan.shape, str(self.checkpoint_dir),
                str(self.carry / "tokenizer")]  # fmt: skip
        return self.command(args, seconds).strip().splitlines()[-1]

    def floor_phase(self, seconds: float) -> str:
        figures = self.work / "floor.json"
        args = [
            self.python,
            str(BENCH / "gpu" / "floor.py"),
            str(self.checkpoint_dir),
            "--json",
            str(figures),
        ]
        line = self.command(args, seconds).strip().splitlines()[-1]
        self.floor = json.loads(figures.read_text())
        return line

    def prefill_phase(self, seconds: float) -> str:
        figures = self.work / "prefill.json"
        plan = self.plan
        args = [self.python, str(BENCH / "gpu" / "prefill_profile.py"), str(self.checkpoint_dir),
                "--profile", BF16_PROFILE, "--prompts", str(plan.prefill_prompts),
                "--input-len", str(plan.prefill_input_len), "--max-model-len", str(plan.ctx),
                "--json", str(figures)]  # fmt: skip
        if plan.prefill_batched_tokens:
            args += ["--max-batched-tokens", str(plan.prefill_batched_tokens)]
        line = self.command(args, seconds, log=self.work / "prefill.log").strip().splitlines()[-1]
        self.prefill = json.loads(figures.read_text())
        return line

    def serve(self, name: str, profile: str, seconds: float, **settings: str) -> str:
        port = free_port()
        log = self.out / f"server-{name}.log"
        env = self.env(
            NIM_MODEL_NAME=str(self.checkpoint_dir),
            NIM_MODEL_PROFILE=profile,
            NIM_MAX_MODEL_LEN=str(self.plan.ctx),
            NIM_MAX_NUM_SEQS=str(self.plan.max_num_seqs),
            NIM_LOG_LEVEL="INFO",
            **settings,
        )
        with log.open("wb") as output:
            process = subprocess.Popen(
                [self.python, "entrypoint.py", "serve", "--host", "127.0.0.1", "--port", str(port)],
                cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        server = Server(name, process, f"http://127.0.0.1:{port}", port, log)
        self.servers[name] = server
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise PhaseFailed(f"the server exited {process.returncode} before ready: "
                                  f"{last_lines(log, 3)}")  # fmt: skip
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/v1/health/ready", timeout=5).status_code == 200:
                    break
            time.sleep(1)
        else:
            end_tree(process, grace=5, first=signal.SIGABRT)  # its stacks into its log
            raise subprocess.TimeoutExpired("serve", seconds)
        meta = httpx.get(f"{server.url}/v1/metadata", timeout=30).json()
        server.decisions = {
            "profile": (meta.get("selectedProfile") or {}).get("name"),
            "runtime": (meta.get("selectedProfile") or {}).get("runtime"),
            "execution_paths": meta.get("executionPaths"),
            "log": [line for line in log.read_text(errors="replace").splitlines() if DECISIONS.search(line)][
                :60
            ],
            "ready_after_s": round(seconds - (deadline - time.monotonic()), 1),
        }
        return f"ready in {server.decisions['ready_after_s']} s, profile {server.decisions['profile']}"

    def load(
        self, name: str, server: str, concurrency: tuple[int, ...], seconds: float, **sampling: float
    ) -> str:
        """compare_llama at each concurrency in turn (one call each, within `seconds` in all), with the
        server's own account of each (`server_metrics`: /metrics before and after)."""
        url = self.servers[server].url
        deadline = time.monotonic() + seconds
        merged: dict[str, Any] = {"median": {}, "errors": 0, "complete": False, "commands": []}
        self.loads[name] = merged
        for c in concurrency:
            document = self.work / f"load-{name}-c{c}.json"
            document.unlink(missing_ok=True)
            args = [
                self.python, str(BENCH / "compare_llama.py"), "--ours-only", "--ours-url", url,
                "--ours-model", str(self.checkpoint_dir), "--ctx", str(self.plan.ctx),
                "--input-words", str(self.plan.input_words), "--output-len", str(self.plan.output_len),
                "--rounds", str(self.plan.rounds), "--warmup", str(self.plan.warmup),
                "--concurrency", str(c), "--out", str(document),
            ]  # fmt: skip
            for key, value in sampling.items():
                args += [f"--{key.replace('_', '-')}", str(value)]
            before, started = scrape(url), time.monotonic()
            try:
                self.command(args, deadline - time.monotonic(), log=self.work / f"load-{name}.log")
            finally:  # whatever it wrote before a failure or the deadline
                if document.is_file():
                    figures = json.loads(document.read_text())
                    merged["median"].update(figures.get("median", {}))
                    merged["errors"] += figures.get("errors", 0)
                    merged["commands"].append(figures.get("command"))
                after = scrape(url)
                self.server_metrics.setdefault(name, {})[str(c)] = engine_account(
                    before, after, time.monotonic() - started
                )
        merged["complete"] = True
        medians = merged["median"]
        return "; ".join(f"c={c}: {m['ours']['output_tok_per_s']:.0f} tok/s" for c, m in medians.items())

    def stop(self, name: str) -> None:
        server = self.servers.get(name)
        if server is None or server.stopped:
            return
        server.stopped = True
        self.say(f"stopping the {name} server (pid {server.process.pid}) and its processes")
        end_tree(server.process, grace=STOP_GRACE_S)
        wait_port_free(server.port, 30)
        if self.device.get("cuda"):
            busy = wait_gpu_idle(60)
            if busy:
                self.say(f"GPU still busy after the server stopped: {busy}")

    # --- Summary -----------------------------------------------------------------------------------

    def write_summary(self) -> dict[str, Any]:
        plan = self.plan
        bf16 = self.loads.get("greedy", {})
        sampled = self.loads.get("sampled", {})
        fp8 = self.loads.get("fp8", {})
        fused = self.loads.get("fused", {})

        def ours(document: dict[str, Any], c: int, metric: str) -> float | None:
            value = document.get("median", {}).get(str(c), {}).get("ours", {}).get(metric)
            return None if value is None else round(float(value), 2)

        errors = [
            f"{name}: {r.status}: {r.detail}" for name, r in self.phases.items() if r.status not in ("ok",)
        ]
        for name, document in self.loads.items():
            if document.get("errors"):
                errors.append(f"{name}: {document['errors']} requests failed")
        floor = round(self.floor["floor_tok_s"], 1) if self.floor else None
        tok = {str(c): ours(bf16, c, "output_tok_per_s") for c in plan.greedy}
        summary: dict[str, Any] = {
            "commit": self.commit,
            "rehearsal": self.rehearsal,
            "model": f"random Llama, {plan.shape} shape, bf16 safetensors, the embedded tokenizer",
            "device": self.device,
            "floor": self.floor,
            "floor_8b_tok_s": floor,
            "ours_8b_tok_s": tok,
            "ours_8b_itl_p50_ms": {str(c): ours(bf16, c, "itl_p50_ms") for c in plan.greedy},
            "ours_8b_ttft_p50_ms": {str(c): ours(bf16, c, "ttft_p50_ms") for c in plan.greedy},
            f"ours_8b_sampled_c{plan.sampled}_tok_s": ours(sampled, plan.sampled, "output_tok_per_s"),
            f"ours_8b_fp8_c{plan.fp8}_tok_s": ours(fp8, plan.fp8, "output_tok_per_s"),
            "ours_8b_fused_tok_s": {str(c): ours(fused, c, "output_tok_per_s") for c in plan.fused},
            "ours_8b_fused_itl_p50_ms": {str(c): ours(fused, c, "itl_p50_ms") for c in plan.fused},
            "errors": errors,
            "phases": {name: asdict(record) for name, record in self.phases.items()},
            "decisions": {name: server.decisions for name, server in self.servers.items()},
            "plan": asdict(plan),
            "server_metrics": self.server_metrics,
            "prefill_profile": self.prefill,
            "commands": {name: document.get("commands") for name, document in self.loads.items()},
            "elapsed_s": round(time.monotonic() - self.started, 1),
        }
        if not self.rehearsal:
            summary["targets_met"] = targets(summary, plan)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary


def targets(summary: dict[str, Any], plan: Plan) -> dict[str, bool]:
    """The GPU issue's targets, met or not (False where a figure is missing)."""
    tok, itl, ttft = summary["ours_8b_tok_s"], summary["ours_8b_itl_p50_ms"], summary["ours_8b_ttft_p50_ms"]
    floor = summary["floor_8b_tok_s"]
    sampled = summary[f"ours_8b_sampled_c{plan.sampled}_tok_s"]
    fp8 = summary[f"ours_8b_fp8_c{plan.fp8}_tok_s"]
    return {
        "batch 1 >= 0.80 x floor": bool(floor and tok.get("1") and tok["1"] >= 0.8 * floor),
        "c64 >= 5000 tok/s, ITL p50 <= 15 ms": (tok.get("64") or 0) >= 5000 and (itl.get("64") or 1e9) <= 15,
        "c256 >= 10000 tok/s, TTFT p50 <= 1 s": (tok.get("256") or 0) >= 10000
        and (ttft.get("256") or 1e9) <= 1000,
        "sampled c256 within 10% of greedy": bool(sampled and tok.get("256") and sampled >= 0.9 * tok["256"]),
        "fp8 batch 1 >= 1.5 x bf16": bool(fp8 and tok.get("1") and fp8 >= 1.5 * tok["1"]),
    }


# --- Processes -----------------------------------------------------------------------------------------


# The server's histograms read around each load (sums and counts summed over their label sets).
ACCOUNT = {
    "step": "nim_engine_step_duration_seconds",
    "step_tokens": "vllm:iteration_tokens_total",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as {sample name: value summed over labels} ({} if it cannot be read)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        with contextlib.suppress(ValueError):
            values[name] = values.get(name, 0.0) + float(value)
    return values


def engine_account(
    before: dict[str, float], after: dict[str, float], wall_s: float
) -> dict[str, float | None]:
    """What the server says of one load: its engine's steps (how many, mean time, tokens each, the
    share of the wall time spent stepping), and its requests' mean queue, prefill, TTFT and ITL, as
    the server measured them. Beside the client's figures this tells a slow engine step from time
    lost between the engine and the socket."""

    def delta(metric: str, part: str) -> float:
        return after.get(f"{metric}_{part}", 0.0) - before.get(f"{metric}_{part}", 0.0)

    def mean(key: str, scale: float = 1000.0) -> float | None:
        count = delta(ACCOUNT[key], "count")
        return round(delta(ACCOUNT[key], "sum") / count * scale, 3) if count else None

    steps = delta(ACCOUNT["step"], "count")
    return {
        "wall_s": round(wall_s, 2),
        "steps": steps,
        "step_ms_mean": mean("step"),
        "tokens_per_step": mean("step_tokens", scale=1.0),
        "engine_busy_share": round(delta(ACCOUNT["step"], "sum") / wall_s, 3) if wall_s else None,
        "queue_ms_mean": mean("queue"),
        "prefill_ms_mean": mean("prefill"),
        "ttft_ms_mean": mean("ttft"),
        "itl_ms_mean": mean("itl"),
    }


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first found), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def end_tree(process: subprocess.Popen[bytes], grace: float, first: int = signal.SIGTERM) -> None:
    """Signal `process` and every process below it (found before signalling: the engine process
    has a session of its own), wait up to `grace` seconds, then SIGKILL whatever is left."""
    pids = [process.pid, *descendants(process.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, first)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (process.poll() is None or any(alive(p) for p in pids[1:])):
        time.sleep(0.2)
    for pid in [*pids, *descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_port_free(port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return True
        time.sleep(0.5)
    return False


def wait_gpu_idle(seconds: float) -> str:
    """'' once nvidia-smi lists no compute process (or cannot be asked), else what it lists."""
    if shutil.which("nvidia-smi") is None:
        return ""
    deadline = time.monotonic() + seconds
    busy = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        busy = " ".join(out.stdout.split())
        if out.returncode != 0 or not busy:
            return ""
        time.sleep(1)
    return busy


def last_lines(path: Path, count: int) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-count:])


# --- Entry points -------------------------------------------------------------------------------------


def measure(plan: Plan, carry: Path, out: Path, commit: str, python: str, rehearsal: bool) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    session = Session(plan, carry, out, commit, python, rehearsal)
    session.work.mkdir(parents=True, exist_ok=True)
    kind = "rehearsal" if rehearsal else "device"
    session.say(f"{kind} session at commit {commit}; deadline {plan.deadline_s:.0f} s")
    try:
        session.run_phase("check", (), session.check)
        session.run_phase("checkpoint", ("check",), session.checkpoint)
        session.run_phase("floor", ("checkpoint",), session.floor_phase)
        session.run_phase("serve-bf16", ("checkpoint",), lambda s: session.serve("bf16", BF16_PROFILE, s))
        session.run_phase("greedy", ("serve-bf16",), lambda s: session.load("greedy", "bf16", plan.greedy, s))
        session.run_phase(
            "sampled",
            ("serve-bf16",),
            lambda s: session.load("sampled", "bf16", (plan.sampled,), s, temperature=0.8, top_p=0.95),
        )
        session.stop("bf16")
        session.run_phase("serve-fp8", ("checkpoint",), lambda s: session.serve("fp8", FP8_PROFILE, s))
        session.run_phase("fp8", ("serve-fp8",), lambda s: session.load("fp8", "fp8", (plan.fp8,), s))
        session.stop("fp8")
        fused = {"NIM_FUSED_KERNELS": "1"} if plan.fused_env else {}
        session.run_phase(
            "serve-fused", ("checkpoint",), lambda s: session.serve("fused", BF16_PROFILE, s, **fused)
        )
        session.run_phase("fused", ("serve-fused",), lambda s: session.load("fused", "fused", plan.fused, s))
        session.stop("fused")
        session.run_phase("prefill", ("checkpoint",), session.prefill_phase)
    finally:
        for name in list(session.servers):
            session.stop(name)
    summary = session.write_summary()
    session.say(f"done in {summary['elapsed_s']} s; errors: {summary['errors'] or 'none'}")
    for name, met in summary.get("targets_met", {}).items():
        session.say(f"{'met' if met else 'NOT met'}: {name}")
    return summary


def prepare(carry: Path, python: str) -> None:
    """The carry folder, here: the embedded tokenizer, the embedded model in two halves, and (for
    the device, Python 3.12) the wheels, at the versions installed here where they are."""
    from importlib.metadata import PackageNotFoundError, version

    export_tokenizer(carry / "tokenizer")
    split_embedded(embedded_model(), carry)
    wheels = carry / "whl"
    wheels.mkdir(parents=True, exist_ok=True)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28, 34)] + [
        "--platform=manylinux2014_x86_64"
    ]
    download = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels)]
    download += ["--python-version", "3.12", "--implementation", "cp", *platforms]
    for name in WHEELS:
        try:
            pinned = f"{name}=={version(name)}"
        except PackageNotFoundError:
            pinned = name
        subprocess.run([*download, pinned], check=True)
    first = sum(f.stat().st_size for d in ("whl", "tokenizer", "model-a") for f in (carry / d).rglob("*"))
    second = sum(f.stat().st_size for f in (carry / "model-b").rglob("*"))
    print(f"carry folder {carry}: {len(list(wheels.glob('*.whl')))} wheels, the tokenizer, the embedded "
          f"model in two parts; the first call carries {first / 2**20:.1f} MiB (whl, tokenizer, "
          f"model-a), the second {second / 2**20:.1f} MiB (model-b), each beside the repository "
          "(64 MiB a call)")  # fmt: skip


def embedded_model() -> Path:
    sys.path.insert(0, str(REPO))
    from service.store.model_store import embedded_model_path

    return embedded_model_path()


def stage(carry: Path) -> None:
    """On the device, the second call: the embedded model where the tests look for it, from the half
    the first call kept and the half this one carries."""
    sys.path.insert(0, str(REPO))
    from service.store.model_store import EMBEDDED_GGUF_FILE, EMBEDDED_MODEL_NAME, REPO_MODEL_STORE

    try:
        print(assemble_embedded(carry, REPO_MODEL_STORE / EMBEDDED_MODEL_NAME / EMBEDDED_GGUF_FILE))
    except ValueError as exc:
        print(f"the embedded model is not staged: {exc}; the tests that load it will fail")
        sys.exit(1)


def export_tokenizer(out: Path) -> None:
    """The embedded model's tokenizer (tokenizer.json, tokenizer_config.json with its template)."""
    from service.text.tokenizer import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_gguf(embedded_model())
    tokenizer.backend.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    config.update(tokenizer.template_tokens)
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def host_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=("prepare", "measure", "rehearse", "stage"))
    parser.add_argument("--carry", type=Path, help="the carry folder (rehearse: made under OUT)")
    parser.add_argument("--out", type=Path, help="where summary.json, session.log and the server logs go")
    parser.add_argument("--commit", help="the commit measured (the device's .git is not reliable)")
    parser.add_argument("--deadline-s", type=float, help="override the plan's deadline")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the server and tools")
    args = parser.parse_args()
    if args.mode == "prepare":
        prepare(args.carry, args.python)
        return
    if args.mode == "stage":
        stage(args.carry)
        return
    if args.out is None:
        parser.error("--out is required")
    rehearsal = args.mode == "rehearse"
    plan = REHEARSAL_PLAN if rehearsal else DEVICE_PLAN
    if args.deadline_s:
        plan = Plan(**{**asdict(plan), "deadline_s": args.deadline_s})
    carry = args.carry
    if rehearsal and carry is None:
        carry = args.out / "carry"
        export_tokenizer(
            carry / "tokenizer"
        )  # from the embedded model, as prepare does: nothing from a network
    if carry is None:
        parser.error("--carry is required")
    summary = measure(plan, carry, args.out, args.commit or host_commit(), args.python, rehearsal)
    sys.exit(1 if summary["errors"] else 0)


if __name__ == "__main__":
    main()
