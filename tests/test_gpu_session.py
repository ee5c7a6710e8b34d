"""The device's measurement command, rehearsed on the CPU: the exact script a lent GPU runs
(bench/gpu_session.sh -> bench/gpu/session.py), every phase end to end with a tiny model it writes,
so the device never meets a script that has not run. And a phase cut by its deadline keeps what it
measured."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import device_carry  # noqa: E402  (bench/gpu/device_carry.py)
import session  # noqa: E402  (bench/gpu/session.py)


def test_the_rehearsal_runs_every_phase_and_writes_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "NIM_SESSION_WORK": str(tmp_path / "work")}
    run = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_session.sh"), "--rehearse", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    plan = session.REHEARSAL_PLAN
    assert summary["errors"] == [] and summary["rehearsal"] is True
    assert set(summary["phases"]) == {"check", "checkpoint", "floor", "serve-bf16", "greedy", "sampled",
                                      "serve-fp8", "fp8", "serve-fused", "fused", "prefill"}  # fmt: skip
    assert all(phase["status"] == "ok" for phase in summary["phases"].values())
    assert summary["floor_8b_tok_s"] > 0
    for key in ("ours_8b_tok_s", "ours_8b_itl_p50_ms", "ours_8b_ttft_p50_ms"):
        assert set(summary[key]) == {str(c) for c in plan.greedy}
        assert all(v > 0 for v in summary[key].values())
    assert summary[f"ours_8b_sampled_c{plan.sampled}_tok_s"] > 0
    assert summary[f"ours_8b_fp8_c{plan.fp8}_tok_s"] > 0
    assert all(v > 0 for v in summary["ours_8b_fused_tok_s"].values())  # served unfused on the CPU
    # The server's own account of each load, from its /metrics before and after it.
    for c in plan.greedy:
        account = summary["server_metrics"]["greedy"][str(c)]
        assert account["steps"] > 0 and account["step_ms_mean"] > 0 and account["itl_ms_mean"] > 0
        assert 0 < account["engine_busy_share"] <= 1 and account["tokens_per_step"] >= 1
    # The prefill profile: every prompt token went through timed steps.
    prefill = summary["prefill_profile"]
    assert prefill["prompt_tokens"] == plan.prefill_prompts * plan.prefill_input_len
    assert sum(step["tokens"] for step in prefill["steps"]) >= prefill["prompt_tokens"]
    assert prefill["prefill_step_ms_median"] > 0 and 0 < prefill["forward_share_of_steps"] <= 1
    # What each server decided, from /v1/metadata and its log.
    bf16, fp8 = summary["decisions"]["bf16"], summary["decisions"]["fp8"]
    assert bf16["profile"] == session.BF16_PROFILE and fp8["profile"] == session.FP8_PROFILE
    assert fp8["runtime"]["weight_precision"] == "fp8" and fp8["runtime"]["precision_mode"] == "emulated"
    assert set(bf16["execution_paths"]) >= {"unified_attention", "cuda_graphs", "engine_process"}
    assert any("KV cache" in line for line in bf16["log"])
    servers = {f"server-{name}.log" for name in ("bf16", "fp8", "fused")}
    returned = {"summary.json", "session.log", "carry", *servers}
    assert {p.name for p in out.iterdir()} <= returned  # fewer than the 8 files a device call returns
    # Nothing it started is left running.
    assert not [line for line in _processes() if str(tmp_path) in line]


def _processes() -> list[str]:
    return subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]


class _Stub(BaseHTTPRequestHandler):
    """A server that streams chat answers one request at a time and never answers a second
    request while one is in flight (a load at concurrency 2 hangs)."""

    busy = threading.Semaphore(1)

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json({"data": [{"id": "stub", "max_model_len": 256}]})
        else:
            self._json({"ok": True})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if not self.busy.acquire(blocking=False):
            time.sleep(60)  # the second concurrent request: never answered in time
            return
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for text in ("a", "b", "c"):
                chunk = {"choices": [{"index": 0, "delta": {"content": text}}], "usage": None}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.01)
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        finally:
            self.busy.release()


def test_a_phase_cut_by_its_deadline_keeps_the_figures_it_measured(tmp_path: Path) -> None:
    """The load at concurrency 1 completes; at 2 it hangs until the phase's deadline ends it: the
    document and the summary keep concurrency 1's figures, the phase says it was cut, and the load
    generator's process tree is gone."""
    stub = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        plan = session.Plan(
            shape="tiny", ctx=256, input_words=5, output_len=3, greedy=(1, 2), sampled=2, fp8=1,
            deadline_s=120, max_num_seqs=2, prefill_prompts=1, prefill_input_len=5, fused=(1,),
            limits={"greedy": 12}, warmup=1,
        )  # fmt: skip
        out = tmp_path / "out"
        out.mkdir()
        run = session.Session(plan, tmp_path, out, "test", sys.executable, rehearsal=True)
        run.work = tmp_path / "work"
        run.work.mkdir()
        run.phases["serve-bf16"] = session.PhaseRecord("ok", 0)
        fake = subprocess.Popen(["sleep", "60"])
        port = stub.server_address[1]
        run.servers["bf16"] = session.Server("bf16", fake, f"http://127.0.0.1:{port}", port, out / "x.log")
        run.run_phase("greedy", ("serve-bf16",), lambda s: run.load("greedy", "bf16", plan.greedy, s))
        fake.kill()
    finally:
        stub.shutdown()
    record = run.phases["greedy"]
    assert record.status == "timeout" and "cut at 12 s" in record.detail
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ours_8b_tok_s"]["1"] > 0 and summary["ours_8b_tok_s"]["2"] is None
    assert any(error.startswith("greedy: timeout") for error in summary["errors"])
    assert run.loads["greedy"]["complete"] is False
    assert not [line for line in _processes() if "compare_llama.py" in line and str(port) in line]


@pytest.mark.parametrize("missing", ["tokenizer/tokenizer.json", "whl"])
def test_the_device_run_refuses_a_carry_folder_without_what_it_needs(tmp_path: Path, missing: str) -> None:
    carry = tmp_path / "carry"
    (carry / "tokenizer").mkdir(parents=True)
    for name in session.CARRY_FILES:
        (carry / name).write_text("{}")
    (carry / "whl").mkdir()
    (carry / "whl" / "x-1-py3-none-any.whl").write_text("")
    target = carry / missing
    if target.is_dir():
        (target / "x-1-py3-none-any.whl").unlink()
    else:
        target.unlink()
    out = tmp_path / "out"
    out.mkdir()
    run = session.Session(session.DEVICE_PLAN, carry, out, "test", sys.executable, rehearsal=False)
    run.run_phase("check", (), run.check)
    record = run.phases["check"]
    assert record.status == "failed" and "lacks" in record.detail
    assert ("whl/*.whl" if missing == "whl" else missing) in record.detail
    run.run_phase("checkpoint", ("check",), run.checkpoint)
    assert run.phases["checkpoint"].status == "skipped"


def test_every_module_the_device_imports_is_on_its_image_or_carried() -> None:
    """The server, the measuring tools and `make test-gpu`'s modules import nothing that the device's
    image lacks and no wheel carries (2026-11-28: `httpx2` stopped both servers of a lent session,
    `openai` every API test). Without a wheel on the list, the check names it."""
    imports = device_carry.third_party_imports(device_carry.device_files())
    distributions = importlib.metadata.packages_distributions()
    assert {"torch", "fastapi", "httpx2", "openai"} <= set(imports)
    assert device_carry.uncovered(imports, distributions) == {}
    without = [w for w in device_carry.WHEELS if w != "httpx2"]
    missing = device_carry.uncovered(imports, distributions, wheels=without)
    assert set(missing) == {"httpx2"} and "service/store/" in missing["httpx2"]


def test_the_embedded_model_travels_in_two_parts_and_is_checked(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(100_000))
    carry, staged, target = tmp_path / "carry", tmp_path / "staged", tmp_path / "store" / "m" / "model.gguf"
    device_carry.split_embedded(model, carry)
    sizes = [(carry / part / "part").stat().st_size for part in device_carry.EMBEDDED_HALVES]
    assert sum(sizes) == 100_000 and sizes[0] < sizes[1]
    with pytest.raises(ValueError, match="first call"):  # the second call without the first
        device_carry.assemble_embedded(carry, target, staged)
    assert "kept" in device_carry.keep_first_half(carry, staged)
    (carry / "model-b" / "part").write_bytes(b"x" + (carry / "model-b" / "part").read_bytes()[1:])
    with pytest.raises(ValueError, match="does not match its sha256"):
        device_carry.assemble_embedded(carry, target, staged)
    assert not target.exists()  # a mismatch writes nothing
    device_carry.split_embedded(model, carry)
    assert "assembled model.gguf" in device_carry.assemble_embedded(carry, target, staged)
    assert target.read_bytes() == model.read_bytes()
