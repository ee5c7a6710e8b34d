"""Tensor parallelism through the real server: ranks as processes joined by gloo on the CPU.

A tiny checkpoint (4 heads, 2 kv heads, a byte-level tokenizer) is served with
NIM_TENSOR_PARALLEL_SIZE=2 and without it; greedy completions of a fixed prompt set, fetched with
the official client, must be the same tokens, in bf16 and in int8 weights over an int8 KV cache.
Then a rank killed mid-stream must bring the server down cleanly: the stream ends with an error
naming the rank, the process exits non-zero and no other rank is left running; so must a rank that
hangs (stopped with SIGSTOP), once a collective waits past NIM_COLLECTIVE_TIMEOUT_SECONDS.

Where greedy is decided by rounding: two bf16 ranks round their partial sums before adding them,
so their logprobs differ from one rank's by up to ~0.1 nats on this random model (measured: 0.03
to 0.09), and a random model has near-ties (one of 0.06 here). Tokens are compared up to the
first step whose top two candidates, in the one-rank run, lie within MARGIN of each other; at
least half of all tokens must be compared, so the check cannot pass by comparing nothing.
(tests/test_tensor_parallel.py checks float32 ranks against the unsharded logits to 1e-5.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import EMBEDDED_NAME, TEST_THREADS, ServerProcess, process_alive, start_server, wait_ready
from tests.test_quantization import CAPITAL, serving
from tests.test_tensor_parallel import _checkpoint

PROMPTS = ["Once upon a time", "The capital of France is", "0123456789", "tensor parallel ranks"]
TOKENS = 12
NAME = "tiny-tp"
MARGIN = 0.3  # nats: about three times the largest bf16 difference between one rank and two


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = _checkpoint(tmp_path_factory.mktemp("tp") / NAME, vocab_size=256, max_position_embeddings=512)
    # A sharper next-token distribution than the random init's: fewer near-ties to skip.
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 4
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _distinct_tokens(directory)
    return directory


def _distinct_tokens(directory: Path) -> None:
    """A byte-level tokenizer (every text encodes) without a decoder: each of the 256 tokens reads
    as its own character, so logprobs name every candidate apart (decoded bytes would not)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.save(str(directory / "tokenizer.json"))


def _profile(precision: str, tp: int) -> dict[str, str]:
    env = {"NIM_MODEL_PROFILE": f"torch-generic-{precision}-tp{tp}-pp1-throughput"}
    if tp > 1:
        env["NIM_TENSOR_PARALLEL_SIZE"] = str(tp)
    return env


def _greedy(server: ServerProcess) -> list[list[tuple[str, float]]]:
    """Per prompt, each greedy token and its margin over the runner-up (logprob difference)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    answers = []
    for prompt in PROMPTS:
        out = client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=TOKENS,
            temperature=0,
            logprobs=2,
            extra_body={"ignore_eos": True},
        )
        choice = out.choices[0]
        assert out.usage.completion_tokens == TOKENS and choice.finish_reason == "length"
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert choice.logprobs.top_logprobs is not None
        steps = []
        for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs, strict=True):
            best, runner_up = sorted(top.values(), reverse=True)[:2]
            assert top[token] == best  # greedy
            steps.append((token, best - runner_up))
        answers.append(steps)
    return answers


def _clear_prefixes(reference: list[list[tuple[str, float]]]) -> list[list[str]]:
    """Each prompt's tokens up to its first step decided by less than MARGIN."""
    prefixes = []
    for steps in reference:
        clear = []
        for token, margin in steps:
            if margin < MARGIN:
                break
            clear.append(token)
        prefixes.append(clear)
    return prefixes


@pytest.mark.parametrize(("precision", "kv_cache"), [("bf16", "auto"), ("int8_wo", "int8")])
def test_two_ranks_answer_as_one(checkpoint: Path, tmp_path: Path, precision: str, kv_cache: str) -> None:
    threads = str(TEST_THREADS)
    base = {"NIM_MODEL_NAME": str(checkpoint), "NIM_NUM_THREADS": threads, "NIM_KV_CACHE_DTYPE": kv_cache}
    with serving(tmp_path / "tp1.log", {**base, **_profile(precision, 1)}) as server:
        alone = _greedy(server)
    with serving(tmp_path / "tp2.log", {**base, **_profile(precision, 2)}) as server:
        meta = httpx.get(f"{server.base_url}/v1/metadata", timeout=10).json()
        selected = meta["selectedProfile"]
        assert selected["name"] == f"torch-generic-{precision}-tp2-pp1-throughput"
        assert selected["runtime"]["tensor_parallel_size"] == 2
        assert selected["runtime"]["weight_precision"] == precision
        sharded = _greedy(server)
        log = server.log()
    assert "rank 1 of 2" in log  # the worker loaded its own shard
    expected = _clear_prefixes(alone)
    compared = sum(len(prefix) for prefix in expected)
    print(f"{precision}: {compared} of {len(PROMPTS) * TOKENS} tokens compared")
    assert compared >= len(PROMPTS) * TOKENS // 2, f"only {compared} tokens are clear of near-ties"
    pairs = zip(sharded, expected, strict=True)
    got = [[token for token, _ in steps[: len(prefix)]] for steps, prefix in pairs]
    assert got == expected


def test_the_embedded_int4_model_answers_alike_over_three_ranks(tmp_path: Path) -> None:
    """The default profile (the GGUF's Q4_1 blocks as int4, groups of 32) sharded over 3 ranks (its
    9 heads and 3 kv heads, int4 columns split at whole groups): one rank's greedy answer."""

    def answer(url: str) -> str:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.chat.completions.create(
            model=EMBEDDED_NAME, messages=CAPITAL, temperature=0, max_tokens=12
        )
        return str(out.choices[0].message.content)

    # The embedded default is int4_wo only on CPUs with fast bf16 (fp32 elsewhere): ask for it.
    int4 = {"NIM_MODEL_PROFILE": "torch-generic-int4_wo-tp1-pp1-throughput"}
    with serving(tmp_path / "tp1.log", int4) as one:
        alone = answer(one.base_url)
    env = {"NIM_TENSOR_PARALLEL_SIZE": "3", "NIM_MODEL_PROFILE": "torch-generic-int4_wo-tp3-pp1-throughput"}
    with serving(tmp_path / "tp3.log", env) as sharded:
        meta = httpx.get(f"{sharded.base_url}/v1/metadata", timeout=10).json()
        assert meta["selectedProfile"]["name"] == "torch-generic-int4_wo-tp3-pp1-throughput"
        assert answer(sharded.base_url) == alone
    assert "Paris" in alone


def _ranks(log: str) -> list[int]:
    found = re.search(r"started ranks 1-\d+ \(pids ([\d, ]+)\)", log)
    assert found, log
    return [int(pid) for pid in found.group(1).split(", ")]


@contextlib.contextmanager
def _ranked_server(log: Path, env: dict[str, str]) -> Iterator[tuple[ServerProcess, list[int]]]:
    """A ready tensor-parallel server and its worker ranks' pids; afterwards the server is stopped
    and any rank a failed test left behind is killed."""
    server = start_server(log, env=env)
    ranks: list[int] = []
    try:
        wait_ready(server)
        ranks = _ranks(server.log())
        yield server, ranks
    finally:
        server.stop()
        for pid in ranks:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _stream_in_background(server: ServerProcess) -> tuple[threading.Thread, list[str], threading.Event]:
    frames: list[str] = []
    streaming = threading.Event()

    def stream() -> None:
        body = {"model": NAME, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=90) as response:
                for line in response.iter_lines():
                    if line:
                        frames.append(line)
                        streaming.set()
        except httpx.HTTPError as exc:  # recorded: the test requires a clean error frame instead
            frames.append(f"transport error: {exc}")

    reader = threading.Thread(target=stream)
    reader.start()
    return reader, frames, streaming


def _fail_mid_stream(server: ServerProcess, pid: int, sig: signal.Signals) -> dict:
    """Send `sig` to a rank while a completion streams; the stream's closing error object."""
    reader, frames, streaming = _stream_in_background(server)
    assert streaming.wait(60), server.log()
    os.kill(pid, sig)
    reader.join(90)
    assert not reader.is_alive()
    assert frames[-1] == "data: [DONE]", frames[-3:]
    error: dict = json.loads(frames[-2].removeprefix("data: "))["error"]
    return error


def _all_gone(pids: list[int], within: float = 15) -> bool:
    deadline = time.monotonic() + within
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(process_alive(pid) for pid in pids)


def test_a_killed_rank_ends_streams_with_an_error_and_the_process(checkpoint: Path, tmp_path: Path) -> None:
    env = {"NIM_MODEL_NAME": str(checkpoint), **_profile("bf16", 4)}
    with _ranked_server(tmp_path / "tp4.log", env) as (server, ranks):
        assert len(ranks) == 3 and all(process_alive(pid) for pid in ranks)
        victim = ranks[1]  # rank 2
        error = _fail_mid_stream(server, victim, signal.SIGKILL)
        assert "tensor-parallel rank 2" in error["message"], error
        assert server.process.wait(60) == 1, server.log()
        assert _all_gone(ranks), "a rank outlived the engine"
        assert f"tensor-parallel rank 2 (pid {victim}) exited with code -9" in server.log()


def test_a_hung_rank_times_out_and_ends_the_process(checkpoint: Path, tmp_path: Path) -> None:
    env = {"NIM_MODEL_NAME": str(checkpoint), **_profile("bf16", 2), "NIM_COLLECTIVE_TIMEOUT_SECONDS": "3"}
    with _ranked_server(tmp_path / "hang.log", env) as (server, ranks):
        # SIGSTOP: alive, but never reaches its next collective.
        error = _fail_mid_stream(server, ranks[0], signal.SIGSTOP)
        assert "engine failure" in error["message"], error
        assert server.process.wait(60) == 1, server.log()
        assert _all_gone(ranks[:1]), "the hung rank outlived the engine"


def test_a_size_the_model_does_not_divide_is_one_line_at_start(checkpoint: Path, tmp_path: Path) -> None:
    env = {"NIM_MODEL_NAME": str(checkpoint), **_profile("bf16", 3)}
    server = start_server(tmp_path / "tp3.log", env=env)
    try:
        code = server.process.wait(120)
    finally:
        server.stop()
    assert code != 0
    assert "tensor parallelism 3 does not divide this model's 4 attention heads" in server.log()


torch.set_num_threads(TEST_THREADS)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stream_outlasting_the_shutdown_grace_ends_with_an_error_frame(
    checkpoint: Path, tmp_path: Path, tp: int
) -> None:
    """SIGTERM with a stream that outlasts NIM_SHUTDOWN_GRACE_SECONDS: when the grace is over the
    stream gets an error frame saying the server is shutting down, then [DONE] (it used to be cut
    off with neither); the process exits 0 and no rank outlives it."""
    env = {"NIM_MODEL_NAME": str(checkpoint), **_profile("fp32", tp), "NIM_SHUTDOWN_GRACE_SECONDS": "0"}
    with _ranked_server(tmp_path / "server.log", env) if tp > 1 else contextlib.nullcontext() as ranked:
        if ranked is None:
            server = start_server(tmp_path / "server.log", env=env)
            wait_ready(server)
            ranks: list[int] = []
        else:
            server, ranks = ranked
        reader, frames, streaming = _stream_in_background(server)
        assert streaming.wait(60), server.log()
        server.process.send_signal(signal.SIGTERM)
        reader.join(90)
        assert not reader.is_alive()
        assert frames[-1] == "data: [DONE]", frames[-3:]
        error = json.loads(frames[-2].removeprefix("data: "))["error"]
        assert "shutting down" in error["message"], error
        assert sum('"text"' in frame for frame in frames) < 400  # cut short by the grace period
        assert server.process.wait(60) == 0, server.log()
        assert _all_gone(ranks), "a rank outlived the server"
