"""The benchmark client (bench/compare_llama.py): a load split across client processes, so that at
high concurrency the client's own CPU (~0.12 ms a streamed token in one Python process) is not
counted as the server's latency."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from unittest import mock

import pytest

from tests.conftest import EMBEDDED_NAME

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import compare_llama  # bench/compare_llama.py


def test_a_load_split_across_client_processes_counts_every_request_once(base_url: str) -> None:
    prompts = compare_llama.make_prompts(seed=7, count=5, words=6)
    figures = asyncio.run(compare_llama.run_load(base_url, EMBEDDED_NAME, prompts, 3, 4, processes=2))
    assert figures["client_processes"] == 2 and figures["errors"] == 0, figures
    assert figures["requests"] == 5 and figures["output_tokens_min"] == figures["output_tokens_max"] == 4
    # the span runs from the first process's start to the last one's end: it holds every request
    assert figures["requests_per_s"] == pytest.approx(5 / figures["elapsed_s"])
    assert figures["elapsed_s"] >= figures["ttft_p99_ms"] / 1000


def test_one_request_or_one_stream_needs_no_second_process(base_url: str) -> None:
    prompts = compare_llama.make_prompts(seed=8, count=2, words=6)
    figures = asyncio.run(compare_llama.run_load(base_url, EMBEDDED_NAME, prompts, 1, 2, processes=4))
    assert figures["client_processes"] == 1 and figures["requests"] == 2 and figures["errors"] == 0


@pytest.mark.parametrize(
    ("cores", "concurrency", "expected"),
    [(16, 1, 1), (16, 32, 1), (16, 64, 2), (16, 256, 8), (16, 1024, 8), (2, 256, 1), (1, 64, 1)],
)
def test_client_processes_follow_the_streams_and_leave_the_server_half_the_cores(
    cores: int, concurrency: int, expected: int
) -> None:
    with mock.patch.object(compare_llama.os, "sched_getaffinity", return_value=set(range(cores))):
        assert compare_llama.client_processes_for(concurrency) == expected
