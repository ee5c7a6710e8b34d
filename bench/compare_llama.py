"""This server against llama.cpp's llama-server: same GGUF file, same machine, same client, one run.

Starts both servers (or attaches to running ones with --ours-url / --llama-url), then for each
concurrency sends the same load to each of them alternately (ours, llama, ours, llama, ... for
--rounds rounds) and reports the medians over rounds and the ratio ours / llama.

    bench/build_llama_server.sh            # once: builds llama-server (prints its path)
    .venv/bin/python bench/compare_llama.py --concurrency 1 8 32 --rounds 2 --out /tmp/compare.json

Servers, both on 127.0.0.1 with the same per-request context and the same number of parallel slots:

- ours:  NIM_NUM_THREADS=T NIM_MAX_NUM_SEQS=P NIM_MAX_MODEL_LEN=C NIM_KV_CACHE_MAX_TOKENS=C*P
         .venv/bin/python entrypoint.py serve --host 127.0.0.1 --port 8101
         (the embedded model unless --gguf names a file; a NIM_KV_CACHE_MAX_TOKENS already in the
         environment is kept)
- llama: llama-server -m FILE -c C*P -np P -t T -tb T --host 127.0.0.1 --port 8102
         llama-server splits -c across its -np slots (without --kv-unified each slot gets c / np),
         so -c C*P gives every slot the C tokens of context ours gives every request, and both hold
         the same C*P tokens of KV cache. The JSON records the n_ctx_slot llama-server reports.

The load is streaming chat completions: a user message of --input-words random common English
words, different every round, the same for both servers within a round, so neither reuses the
other's prompt cache (--workload random; --workload repeat instead asks for a passage of about as
many words of plain sentences, in an order of the round's, to be rewritten word for word, so the
answer repeats its input, as rewriting, extracting and editing do; --speculative-config serves
ours with NIM_SPECULATIVE_CONFIG), max_tokens --output-len, temperature 0, ignore_eos
(llama-server takes llama.cpp's own sampling fields in the OpenAI body, ignore_eos among them), and
stream_options.include_usage. Output tokens are counted from the usage chunk (both servers send
one), else from content deltas. TTFT is the time to the first non-empty content delta; ITL the
gaps between later content deltas. output tok/s is all output tokens over the wall time of the run.
At high concurrency the load is split across client processes (--client-processes; by default
one per 32 streams, at most half the cores), which start together: one Python client spends ~0.12 ms
of CPU per streamed token and would saturate near 8,000 tokens/s, its lag counted as the server's.
llama-server answers "Keep-Alive" yet closes the connection after each streamed response: a request
that meets such a closed connection is resent at once on a new one, timed from the resend and
counted in `reconnects`.

Prints a JSON document (config, machine, both servers' versions and commands, every round,
medians, ratios, the exact command) to stdout, a short table to stderr; --out also writes it to a
file, rewritten after every run (a run cut short by a deadline leaves what it measured). A run whose
requests failed records `errors` and its first error instead of stopping the others; the exit
status is then 1. Machines here are shared and noisy: compare ratios measured in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from http_load import Result, percentile  # bench/http_load.py (this script's directory is on sys.path)

REPO = Path(__file__).resolve().parent.parent
METRICS = ("output_tok_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")

# Common English words: a prompt of N of them is a few more than N tokens for most BPE vocabularies.
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this have had not are but "
    "one all were when which their said there can an she been has more will would who out so what up "
    "about into than them some could then time only other new these two may first also after any like "
    "our over such where most very well much through back years just made before people here between "
    "many under never long same while last might great old year off come since against around house "
    "world school still every small found state high during place again water might city river light "
    "music garden window paper story market summer winter morning evening bridge forest island road "
    "table letter color number family friend travel simple strong quiet green yellow north south"
)
WORDS = sorted(set(_WORDS.split()))


@dataclass
class ChatResult(Result):
    prompt_tokens: int = 0
    content_chunks: int = 0
    usage_seen: bool = False
    responded: bool = False
    reconnects: int = 0


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


REPEAT_ASK = "Rewrite the following text exactly, word for word:\n\n"
# Plain sentences for --workload repeat: a passage of them in a seeded order is text a small model
# copies (random words it does not), and differs every round.
SENTENCES = (
    "The river runs past the old mill and under the stone bridge before it reaches the sea.",
    "Every morning the baker opens her shop at six and sells bread until the shelves are empty.",
    "The children walked to school along the forest road, talking about the summer holidays.",
    "A small green boat was tied to the post at the end of the wooden pier.",
    "In the evening the family sat around the table and shared stories about their day.",
    "The market in the centre of the city is busy on Saturdays, when farmers bring their fruit.",
    "She wrote a long letter to her friend who had moved to a house near the island.",
    "The winter was cold and quiet, and snow covered the fields north of the village.",
    "He keeps a notebook of every bird he sees on his walks through the hills.",
    "The museum opened a new room for old maps, paintings of ships and letters from travellers.",
    "After the rain stopped, the streets were bright and the air smelled of wet leaves.",
    "The train to the south leaves at noon and arrives in the harbour town before dark.",
    "Our neighbours planted yellow flowers along the fence and a small tree by the gate.",
    "The teacher asked the class to read the first chapter and write down three questions.",
    "On the top shelf of the kitchen there is a blue jar full of buttons and string.",
    "The lighthouse keeper climbs the stairs each night to check the lamp and the clock.",
)


def make_prompts(seed: int, count: int, words: int, workload: str = "random") -> list[str]:
    """`count` user messages: `words` random common words; with workload "repeat" a passage of about
    `words` words of plain sentences in a seeded order that the message asks to have rewritten word
    for word, so the answer repeats the prompt (prompt lookup has runs to accept)."""
    rng = random.Random(seed)
    if workload != "repeat":
        return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]
    prompts = []
    for _ in range(count):
        order = rng.sample(SENTENCES, len(SENTENCES))
        passage: list[str] = []
        while sum(len(s.split()) for s in passage) < words:
            passage.append(order[len(passage) % len(order)])
        prompts.append(REPEAT_ASK + " ".join(passage))
    return prompts


async def chat_request(
    client: httpx.AsyncClient, url: str, model: str, text: str, output_len: int, sampling: dict | None = None
) -> ChatResult:
    """One streaming chat completion, timed from sending it to its last chunk.

    A request sent on a kept-alive connection the server has just closed fails before any response
    arrives; it is sent again at once on a fresh connection (as curl does), timed from the resend, and
    counted in `reconnects`. llama-server does that: it answers "Keep-Alive" but closes the
    connection after every streamed response.
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(sampling or {}),  # --temperature / --top-p: a sampled load instead of greedy
    }
    for attempt in range(2):
        result = ChatResult(reconnects=attempt)
        try:
            return await _stream_chat(client, url, body, result)
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            if result.responded or attempt == 1:
                result.error = f"{type(exc).__name__}: {exc}"
                return result
    raise AssertionError("unreachable")


async def _stream_chat(client: httpx.AsyncClient, url: str, body: dict, result: ChatResult) -> ChatResult:
    started = last = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        result.responded = True
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = str(chunk["error"].get("message", chunk["error"]))
                return result
            now = time.perf_counter()
            usage = chunk.get("usage")
            if usage:
                result.usage_seen = True
                result.output_tokens = usage.get("completion_tokens", 0)
                result.prompt_tokens = usage.get("prompt_tokens", 0)
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                result.content_chunks += 1
                if result.ttft == 0.0:
                    result.ttft = now - started
                else:
                    result.itls.append(now - last)
                last = now
    result.latency = time.perf_counter() - started
    if not result.usage_seen:
        result.output_tokens = result.content_chunks
    return result


def sampling_of(args: argparse.Namespace) -> dict:
    """The request's sampling fields beyond the greedy default."""
    sampling: dict = {"temperature": args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    return sampling


async def _drive(
    url: str, model: str, prompts: list[str], concurrency: int, output_len: int, sampling: dict | None
) -> tuple[list[ChatResult], float, float]:
    """`concurrency` workers send `prompts` one after another; the results and the wall-clock (time.time)
    start and end of the load."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[ChatResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                text = queue.get_nowait()
                results.append(await chat_request(client, url, model, text, output_len, sampling))

        started = time.time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        ended = time.time()
    return results, started, ended


def _client(
    conn: multiprocessing.connection.Connection, url: str, model: str, prompts: list[str], concurrency: int,
    output_len: int, sampling: dict | None,
) -> None:  # fmt: skip
    """One client process's share of a load: says it is ready, waits for the shared start time, sends
    its results back."""
    conn.send("ready")
    start_at = conn.recv()
    time.sleep(max(0.0, start_at - time.time()))
    conn.send(asyncio.run(_drive(url, model, prompts, concurrency, output_len, sampling)))


def _drive_in_processes(
    url: str, model: str, prompts: list[str], concurrency: int, output_len: int, sampling: dict | None,
    processes: int,
) -> tuple[list[ChatResult], float, float]:  # fmt: skip
    """`_drive` split across `processes` client processes (streams and prompts dealt round-robin),
    started together once every one has imported its modules."""
    context = multiprocessing.get_context("spawn")
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    conns, children = [], []
    for i, share in enumerate(shares):
        ours, theirs = context.Pipe()
        args = (theirs, url, model, prompts[i::processes], share, output_len, sampling)
        children.append(context.Process(target=_client, args=args, daemon=True))
        children[-1].start()
        conns.append(ours)
    try:
        for conn in conns:
            conn.recv()  # ready
        start_at = time.time() + 0.1
        for conn in conns:
            conn.send(start_at)
        parts = [conn.recv() for conn in conns]
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    return [r for part in parts for r in part[0]], min(p[1] for p in parts), max(p[2] for p in parts)


STREAMS_PER_CLIENT = 32


def client_processes_for(concurrency: int) -> int:
    """Client processes for a load at `concurrency`: one per STREAMS_PER_CLIENT streams, at most half
    the cores. One Python client spends ~0.12 ms of CPU on each streamed token (measured at c=64 and
    c=256, bench/README.md), so a single one saturates near 8,000 tokens/s and its lag would be
    counted as the server's."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(-(-concurrency // STREAMS_PER_CLIENT), cores // 2))


async def run_load(
    url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    output_len: int,
    sampling: dict | None = None,
    processes: int = 1,
) -> dict:
    """The load's figures; with `processes` > 1 its streams and prompts are split across that many
    client processes that start together, and the figures are those of all their requests over the
    span from the first start to the last end."""
    processes = max(1, min(processes, concurrency, len(prompts)))
    if processes == 1:
        results, started, ended = await _drive(url, model, prompts, concurrency, output_len, sampling)
    else:
        results, started, ended = await asyncio.to_thread(
            _drive_in_processes, url, model, prompts, concurrency, output_len, sampling, processes
        )
    figures = load_figures(results, ended - started)
    figures["client_processes"] = processes
    return figures


def load_figures(results: list[ChatResult], elapsed: float) -> dict:
    errors = [r.error for r in results if r.error]
    results = [r for r in results if not r.error] or results
    ttfts = [r.ttft for r in results]
    itls = [x for r in results for x in r.itls] or [0.0]
    outputs = [r.output_tokens for r in results]
    return {
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tok_per_s": sum(outputs) / elapsed,
        "requests_per_s": len(results) / elapsed,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "itl_p50_ms": 1000 * percentile(itls, 50),
        "itl_p99_ms": 1000 * percentile(itls, 99),
        "elapsed_s": elapsed,
        "requests": len(results),
        "output_tokens_min": min(outputs),
        "output_tokens_max": max(outputs),
        "prompt_tokens_median": statistics.median(r.prompt_tokens for r in results),
        "content_chunks_per_request": statistics.mean(r.content_chunks for r in results),
        "usage_chunk_share": sum(r.usage_seen for r in results) / len(results),
        "reconnects": sum(r.reconnects for r in results),
    }


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_ready(url: str, path: str, proc: subprocess.Popen | None, log: Path | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"server for {url} exited with {proc.returncode} before ready:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}{path}", timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{url}{path} not ready after {timeout:.0f} s")


class Servers:
    """Servers this script started: stopped (SIGTERM, then SIGKILL) when the block ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], env: dict[str, str], log: Path, port: int) -> subprocess.Popen:
        if port_in_use(port):
            raise RuntimeError(f"port {port} is already in use: stop what listens there or pick another")
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        print(f"started pid {proc.pid}: {shlex.join(cmd)} (log {log})", file=sys.stderr)
        return proc

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            print(f"stopped pid {proc.pid} (exit {proc.returncode})", file=sys.stderr)


def embedded_gguf(python: str) -> str:
    out = subprocess.run(
        [python, "-m", "service.store.model_store", "embedded-path"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def llama_binary(path: str | None) -> str:
    if path:
        return path
    script = REPO / "bench" / "build_llama_server.sh"
    print(f"llama-server: running {script} (returns at once when already built)", file=sys.stderr)
    out = subprocess.run([str(script)], check=True, stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


def get_json(url: str) -> Any:
    try:
        response = httpx.get(url, timeout=10)
        return response.json() if response.status_code == 200 else {"status": response.status_code}
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": str(exc)}


def first_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu,
        "load_average_at_start": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "commit": git("rev-parse", "HEAD"),
        "worktree_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def summarize(rounds: list[dict], concurrencies: list[int]) -> tuple[dict, dict]:
    medians: dict[str, dict] = {}
    ratios: dict[str, dict] = {}
    for c in concurrencies:
        per_server = {}
        for server in ("ours", "llama"):
            runs = [r for r in rounds if r["concurrency"] == c and r["server"] == server]
            if runs:
                per_server[server] = {key: statistics.median(r[key] for r in runs) for key in METRICS}
        medians[str(c)] = per_server
        if "llama" in per_server:
            ratios[str(c)] = {key: per_server["ours"][key] / per_server["llama"][key] for key in METRICS}
    return medians, ratios


def print_table(medians: dict, ratios: dict) -> None:
    print(
        f"\n{'conc':>4} | {'ours tok/s':>10} {'llama tok/s':>11} {'ratio':>6} | "
        f"{'TTFT p50/p99 ms (ours; llama)':>32} | {'ITL p50/p99 ms (ours; llama)':>30}",
        file=sys.stderr,
    )
    for c, m in medians.items():
        if "llama" not in m:
            o = m["ours"]
            print(f"{c:>4} | {o['output_tok_per_s']:>10.1f} (ours only) | TTFT p50 {o['ttft_p50_ms']:.0f} ms"
                  f" | ITL p50 {o['itl_p50_ms']:.1f} ms", file=sys.stderr)  # fmt: skip
            continue
        o, ll = m["ours"], m["llama"]
        print(
            f"{c:>4} | {o['output_tok_per_s']:>10.1f} {ll['output_tok_per_s']:>11.1f} "
            f"{ratios[c]['output_tok_per_s']:>5.2f}x | "
            f"{o['ttft_p50_ms']:>6.0f}/{o['ttft_p99_ms']:<6.0f}; "
            f"{ll['ttft_p50_ms']:>6.0f}/{ll['ttft_p99_ms']:<6.0f}"
            f"       | {o['itl_p50_ms']:>5.1f}/{o['itl_p99_ms']:<5.1f}; {ll['itl_p50_ms']:>5.1f}/"
            f"{ll['itl_p99_ms']:<5.1f}",
            file=sys.stderr,
        )


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ours-url", help="attach to this running server of ours instead of starting one")
    parser.add_argument("--llama-url", help="attach to this running llama-server instead of starting one")
    parser.add_argument("--gguf", help="model file for both servers (default: the embedded model)")
    parser.add_argument("--llama-server", help="binary (default: what bench/build_llama_server.sh prints)")
    parser.add_argument("--llama-args", default="", help='extra llama-server arguments, e.g. "-ngl 999"')
    parser.add_argument("--ours-only", action="store_true", help="measure only this server (no ratios)")
    parser.add_argument("--ours-model", help="NIM_MODEL_NAME for ours (default: --gguf, else embedded)")
    parser.add_argument("--ctx", type=int, default=2048, help="context per request / per slot (tokens)")
    parser.add_argument("--parallel", type=int, help="parallel slots (default: the largest concurrency)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--ours-port", type=int, default=8101)
    parser.add_argument("--llama-port", type=int, default=8102)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, help="requests per run (default: max(8, 2 x concurrency))")
    parser.add_argument(
        "--workload",
        choices=["random", "repeat"],
        default="random",
        help="random: messages of random words; repeat: each asks for its words rewritten word for word",
    )
    parser.add_argument(
        "--speculative-config",
        help='NIM_SPECULATIVE_CONFIG for ours, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    parser.add_argument("--input-words", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--client-processes",
        type=int,
        help="client processes sharing each load (default: one per 32 streams, at most half the cores)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="requests sent to each server before measuring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling (sent only when given)")
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a new temporary directory)")
    parser.add_argument("--out", type=Path, help="also write the JSON document here")
    args = parser.parse_args()
    args.parallel = args.parallel or max(args.concurrency)
    return args


def main() -> None:
    args = parse_args()
    command = shlex.join([sys.executable, *sys.argv])
    python = (
        str(REPO / ".venv" / "bin" / "python")
        if (REPO / ".venv" / "bin" / "python").exists()
        else sys.executable
    )
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="compare_llama_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # The file: for llama-server, and for ours when it starts with no other model named.
    need_file = (not args.ours_only and not args.llama_url) or not (args.ours_url or args.ours_model)
    gguf = args.gguf or (embedded_gguf(python) if need_file else None)
    servers_info: dict[str, dict[str, Any]] = {"ours": {}, "llama": {}}

    with Servers() as servers:
        # -- ours
        if args.ours_url:
            ours_url = args.ours_url.rstrip("/")
            servers_info["ours"]["attached"] = True
            wait_ready(ours_url, "/v1/health/ready", None, None, args.ready_timeout)
        else:
            ours_url = f"http://127.0.0.1:{args.ours_port}"
            env = {
                **os.environ,
                "NIM_NUM_THREADS": str(args.threads),
                "NIM_MAX_NUM_SEQS": str(args.parallel),
                "NIM_MAX_MODEL_LEN": str(args.ctx),
                "NIM_KV_CACHE_MAX_TOKENS": os.environ.get(
                    "NIM_KV_CACHE_MAX_TOKENS", str(args.ctx * args.parallel)
                ),
            }
            if args.speculative_config:
                env["NIM_SPECULATIVE_CONFIG"] = args.speculative_config
            if args.gguf or args.ours_model:
                env["NIM_MODEL_NAME"] = args.ours_model or args.gguf
            cmd = [python, "entrypoint.py", "serve", "--host", "127.0.0.1", "--port", str(args.ours_port)]
            log = log_dir / "ours.log"
            proc = servers.start(cmd, env, log, args.ours_port)
            wait_ready(ours_url, "/v1/health/ready", proc, log, args.ready_timeout)
            nim_env = {k: v for k, v in env.items() if k.startswith("NIM_")}
            servers_info["ours"].update(command=shlex.join(cmd), env=nim_env, log=str(log))
        # -- llama-server
        if args.ours_only:
            llama_url = ""
        elif args.llama_url:
            llama_url = args.llama_url.rstrip("/")
            servers_info["llama"]["attached"] = True
            wait_ready(llama_url, "/health", None, None, args.ready_timeout)
        else:
            llama_url = f"http://127.0.0.1:{args.llama_port}"
            binary = llama_binary(args.llama_server)
            version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
            servers_info["llama"]["binary_version"] = (version.stdout + version.stderr).strip()
            cmd = [
                binary,
                "-m",
                gguf,
                "-c",
                str(args.ctx * args.parallel),
                "-np",
                str(args.parallel),
                "-t",
                str(args.threads),
                "-tb",
                str(args.threads),
                "--host",
                "127.0.0.1",
                "--port",
                str(args.llama_port),
                "--no-webui",
                *shlex.split(args.llama_args),
            ]
            log = log_dir / "llama.log"
            proc = servers.start(cmd, dict(os.environ), log, args.llama_port)
            wait_ready(llama_url, "/health", proc, log, args.ready_timeout)
            found = re.search(r"n_ctx_slot = (\d+)", log.read_text(errors="replace"))
            servers_info["llama"].update(
                command=shlex.join(cmd), log=str(log), n_ctx_slot=int(found.group(1)) if found else None
            )

        urls = {"ours": ours_url} if args.ours_only else {"ours": ours_url, "llama": llama_url}
        models = {name: first_model(url) for name, url in urls.items()}
        servers_info["ours"].update(
            url=ours_url,
            model=models["ours"],
            version=get_json(f"{ours_url}/v1/version"),
            max_model_len=get_json(f"{ours_url}/v1/models").get("data", [{}])[0].get("max_model_len"),
        )
        props = get_json(f"{llama_url}/props") if llama_url else {}
        servers_info["llama"].update(
            url=llama_url,
            model=models.get("llama"),
            build_info=props.get("build_info"),
            total_slots=props.get("total_slots"),
            slot_n_ctx=(props.get("default_generation_settings") or {}).get("n_ctx"),
        )

        for name, url in urls.items():
            warm = make_prompts(args.seed - 1, args.warmup, args.input_words, args.workload)
            asyncio.run(run_load(url, models[name], warm, 1, 8))

        rounds: list[dict] = []

        def document() -> dict[str, Any]:
            medians, ratios = summarize(rounds, args.concurrency)
            return {
                "config": {
                    key: (str(value) if isinstance(value, Path) else value)
                    for key, value in vars(args).items()
                    if key not in ("out", "log_dir")
                }
                | {"gguf": gguf, "log_dir": str(log_dir)},
                "command": command,
                "machine": machine_info(),
                "servers": servers_info,
                "rounds": rounds,
                "median": medians,
                "ratio_ours_over_llama": ratios,
                "errors": sum(r["errors"] for r in rounds),
                "complete": len(rounds) == len(args.concurrency) * args.rounds * len(urls),
                "notes": "medians over rounds; ratios are ours / llama (above 1: ours higher, i.e. better "
                "for tok/s, worse for latencies)",
            }

        for c in args.concurrency:
            count = args.requests or max(8, 2 * c)
            for r in range(args.rounds):
                seed = args.seed * 1_000_003 + c * 1000 + r
                prompts = make_prompts(seed, count, args.input_words, args.workload)
                for name in urls:
                    clients = args.client_processes or client_processes_for(c)
                    sampling = sampling_of(args)
                    load = run_load(urls[name], models[name], prompts, c, args.output_len, sampling, clients)
                    figures = asyncio.run(load)
                    rounds.append({"concurrency": c, "round": r, "server": name, **figures})
                    if args.out:  # as it goes: a run cut short keeps what it measured
                        args.out.write_text(json.dumps(document(), indent=2) + "\n")
                    print(
                        f"c={c} round {r} {name}: {figures['output_tok_per_s']:.1f} tok/s, "
                        f"TTFT p50 {figures['ttft_p50_ms']:.0f} ms, ITL p50 {figures['itl_p50_ms']:.1f} ms",
                        file=sys.stderr,
                    )

    final = document()
    text = json.dumps(final, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print_table(final["median"], final["ratio_ours_over_llama"])
    if final["errors"]:
        print(f"{final['errors']} requests failed; first: {rounds[-1].get('first_error')}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
