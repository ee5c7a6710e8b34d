"""Where a streamed token's CPU time goes: each thread of a server, and the client.

    NIM_PROFILE_TYPE=latency .venv/bin/python bench/thread_cpu.py --requests 4 --output-len 128 \
        [--concurrency N] [--llama-url http://127.0.0.1:8102 --llama-pid PID] [--out FILE]

Starts this repository's server (embedded model; the caller's NIM_* variables pass through), sends
--warmup requests, then --requests streaming chat requests, --concurrency at a time (one by
default; bench/compare_llama.py's client and prompts, in this process), and reads every
thread's CPU time (utime + stime in /proc/<pid>/task/<tid>/stat) of the server and of its child
processes before and after. Reports, per output token: the interval between tokens the client
saw, the CPU of each server thread (named by Python's threading where py-spy can name it; the rest
are native threads: OpenMP workers, the tokenizers' pool) and of each process, and the client's
own CPU. On a 2-core host every millisecond of CPU beside the model's threads is taken
from them, so this is where the interval beyond the step goes.

With --llama-url and --llama-pid, the same load is measured on a running llama-server as well.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nim_server  # bench/ is on sys.path when this file runs
from compare_llama import first_model, make_prompts, run_load
from http_load import write_report

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (started by any of its threads)."""
    found = [pid]
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            listed = children.read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        for child in listed:
            found += _descendants(int(child))
    return found


def thread_cpu_ms(pid: int) -> dict[tuple[int, int], float]:
    """(pid, tid) -> CPU ms so far, over `pid` and its descendants."""
    cpu = {}
    for proc in _descendants(pid):
        try:
            tasks = list(Path(f"/proc/{proc}/task").iterdir())
        except OSError:  # the process ended meanwhile
            continue
        for task in tasks:
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            cpu[(proc, int(task.name))] = (int(fields[11]) + int(fields[12])) * TICK_MS
    return cpu


def thread_names(pid: int) -> dict[int, str]:
    """tid -> Python thread name, from py-spy's dump of each process (empty without py-spy)."""
    names: dict[int, str] = {}
    for proc in _descendants(pid):
        try:
            dump = subprocess.run([PY_SPY, "dump", "--pid", str(proc)], capture_output=True, text=True,
                                  timeout=30).stdout  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        for tid, name in re.findall(r'^Thread (\d+)(?: \([^)]*\))?: "([^"]*)"', dump, re.M):
            names[int(tid)] = name
    return names


def client_cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return 1000 * (usage.ru_utime + usage.ru_stime)


def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, object]:
    model = first_model(url)
    prompts = make_prompts(args.seed, args.warmup + args.requests, args.input_words)
    asyncio.run(run_load(url, model, prompts[: args.warmup], 1, args.output_len))
    names = thread_names(pid)
    before, client_before = thread_cpu_ms(pid), client_cpu_ms()
    load = asyncio.run(run_load(url, model, prompts[args.warmup :], args.concurrency, args.output_len))
    after, client_after = thread_cpu_ms(pid), client_cpu_ms()
    tokens = load["output_tok_per_s"] * load["elapsed_s"]
    per_thread: dict[str, float] = {}
    per_process: dict[str, float] = {}
    for key, ms in after.items():
        used = ms - before.get(key, 0.0)
        if used <= 0:
            continue
        proc, tid = key
        process = "server" if proc == pid else f"child {proc}"
        label = f"{process}: {names.get(tid, 'native')}"
        per_thread[label] = per_thread.get(label, 0.0) + used / tokens
        per_process[process] = per_process.get(process, 0.0) + used / tokens
    return {
        "concurrency": args.concurrency,
        "interval_p50_ms": round(load["itl_p50_ms"], 3),
        "ttft_p50_ms": round(load["ttft_p50_ms"], 1),
        "output_tok_per_s": round(load["output_tok_per_s"], 2),
        "server_cpu_ms_per_token_by_process": {k: round(v, 4) for k, v in per_process.items()},
        "server_cpu_ms_per_token": {
            k: round(v, 3) for k, v in sorted(per_thread.items(), key=lambda kv: -kv[1])
        },
        "server_cpu_ms_per_token_total": round(sum(per_thread.values()), 3),
        "client_cpu_ms_per_token": round((client_after - client_before) / tokens, 3),
        "errors": load["errors"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--input-words", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8793)
    parser.add_argument("--llama-url", help="also measure this running llama-server")
    parser.add_argument("--llama-pid", type=int, help="its process id")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k.startswith("NIM_")}
    report: dict[str, object] = {"settings": vars(args) | {"env": env}}  # write_report adds the command
    with tempfile.TemporaryDirectory(prefix="thread-cpu-") as tmp:
        log = Path(tmp) / "server.log"
        process = nim_server.start(env, args.port, log)
        url = f"http://127.0.0.1:{args.port}"
        try:
            nim_server.wait_ready(url, process, log)
            report["ours"] = measure(url, process.pid, args)
        finally:
            process.terminate()
            process.wait(60)
    if args.llama_url and args.llama_pid:
        report["llama_server"] = measure(args.llama_url, args.llama_pid, args)
    report["settings"]["out"] = str(args.out) if args.out else None  # type: ignore[index]
    write_report(report, args.out)


if __name__ == "__main__":
    main()
