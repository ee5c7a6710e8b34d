"""The hub download layer against a local fake Hub (tests/fake_hub.py): never contacts huggingface.co."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import numpy as np
import pytest
from huggingface_hub import constants, hf_hub_download, snapshot_download
from safetensors.numpy import load_file, save_file

from service.store.hub_cache import CacheLayout
from service.store.model_download import (
    DEFAULT_ALLOW_PATTERNS,
    AccessDeniedError,
    ArtifactSpec,
    DownloadError,
    InsufficientDiskError,
    OfflineError,
    download_artifact,
)
from tests.fake_hub import FakeHub

REPO_ROOT = Path(__file__).resolve().parent.parent
REPO_ID = "org/tiny"
# huggingface_hub writes what it receives in DOWNLOAD_CHUNK_SIZE pieces (10 MiB); the tests shrink it so a
# 512 KiB file spans several pieces, which is what makes "cut after N bytes" meaningful at this scale.
CHUNK = 64 * 1024
DEFAULT_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}

# Runs download_artifact in a separate process (lock contention, kill-and-resume).
CHILD = """
import json, logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from huggingface_hub import constants
from service.store.model_download import ArtifactSpec, download_artifact
args = json.loads(sys.argv[1])
constants.DOWNLOAD_CHUNK_SIZE = args["chunk"]
start = time.monotonic()
path = download_artifact(ArtifactSpec(args["repo"], args["revision"]), Path(args["cache"]),
                         endpoint=args["endpoint"], progress=False)
print(json.dumps({"path": str(path), "seconds": time.monotonic() - start}))
"""


@dataclass
class TinyRepo:
    main: str  # commit sha of branch main
    v1: str  # commit sha of tag v1
    files: dict[str, bytes]  # content at main


@pytest.fixture(autouse=True)
def _isolated_hf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No real token, no offline switch from the environment, small write chunks."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub() as fake:
        yield fake


def build_tiny_repo(root: Path, *, revision: int) -> Path:
    """A tiny model directory: config, safetensors weights, tokenizer files, a README and a pickle decoy."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "revision": revision}))
    rng = np.random.default_rng(0)
    save_file(
        {
            "embed.weight": rng.standard_normal((256, 512)).astype(np.float32),  # 512 KiB
            "norm.weight": np.ones(512, dtype=np.float16),
        },
        str(root / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (root / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "b"}))
    (root / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (root / "README.md").write_text("# tiny\n")
    (root / "pytorch_model.bin").write_bytes(b"\x80\x02decoy pickle" * 100)
    return root


@pytest.fixture
def tiny(hub: FakeHub, tmp_path: Path) -> TinyRepo:
    v1 = hub.add_commit_from_dir(REPO_ID, build_tiny_repo(tmp_path / "repo-v1", revision=1), refs=("v1",))
    main_dir = build_tiny_repo(tmp_path / "repo-main", revision=2)
    main = hub.add_commit_from_dir(REPO_ID, main_dir, refs=("main",))
    files = {p.name: p.read_bytes() for p in main_dir.iterdir()}
    return TinyRepo(main, v1, files)


def fetch(
    hub_or_endpoint: FakeHub | str,
    cache: Path,
    revision: str = "main",
    *,
    repo_id: str = REPO_ID,
    allow_patterns: tuple[str, ...] = DEFAULT_ALLOW_PATTERNS,
    progress: bool = False,
    **kwargs: Any,
) -> Path:
    endpoint = hub_or_endpoint if isinstance(hub_or_endpoint, str) else hub_or_endpoint.endpoint
    spec = ArtifactSpec(repo_id, revision, allow_patterns=allow_patterns)
    return download_artifact(spec, cache, endpoint=endpoint, progress=progress, **kwargs)


def listing(snapshot: Path) -> set[str]:
    return {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if not p.is_dir()}


def blobs(cache: Path, repo_id: str = REPO_ID) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}" / "blobs"


def spawn(hub: FakeHub, cache: Path, tmp_path: Path, revision: str = "main") -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "HUGGING_FACE" not in k}
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env.update({"PYTHONPATH": path, "HF_HOME": str(tmp_path / "hf-home")})
    args = {
        "repo": REPO_ID,
        "revision": revision,
        "cache": str(cache),
        "endpoint": hub.endpoint,
        "chunk": CHUNK,
    }
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_full_download_is_complete_and_intact(hub: FakeHub, tiny: TinyRepo, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    snapshot = fetch(hub, cache, progress=True)

    assert snapshot == cache / "models--org--tiny" / "snapshots" / tiny.main
    assert listing(snapshot) == DEFAULT_FILES
    for name in DEFAULT_FILES:
        assert (snapshot / name).read_bytes() == tiny.files[name], name
    weights = load_file(str(snapshot / "model.safetensors"))
    assert weights["embed.weight"].shape == (256, 512)
    assert (cache / "models--org--tiny" / "refs" / "main").read_text() == tiny.main
    assert (snapshot / "model.safetensors").is_symlink()  # the Hub cache layout: snapshot -> blob
    assert not list(blobs(cache).glob("*.incomplete"))
    # Each file crossed the wire once, whole; the CDN never saw credentials.
    for name in DEFAULT_FILES:
        assert hub.bytes_served(name) == len(tiny.files[name]), name
    assert all(r.authorization is None for r in hub.requests if r.server == "cdn")

    # A second call with the cache complete only asks which commit main is (one API call, no transfer).
    hub.reset_stats()
    assert fetch(hub, cache) == snapshot
    assert [r.path for r in hub.requests] == [f"/api/models/{REPO_ID}/revision/main"]


def test_patterns_select_files_and_pickles_are_never_fetched(
    hub: FakeHub, tiny: TinyRepo, tmp_path: Path
) -> None:
    everything = fetch(hub, tmp_path / "all", allow_patterns=("*",))
    assert listing(everything) == DEFAULT_FILES | {"README.md"}  # "*" allows the .bin: still refused
    assert not hub.touched("pytorch_model.bin")  # not even a HEAD

    only_json = fetch(hub, tmp_path / "json", allow_patterns=("*.json",))
    assert listing(only_json) == {"config.json", "tokenizer.json", "tokenizer_config.json"}

    with pytest.raises(DownloadError, match=r"no file of org/tiny@main matches \['\*\.bin'\]"):
        fetch(hub, tmp_path / "bin", allow_patterns=("*.bin",))
    assert not hub.touched("pytorch_model.bin")


def test_pinned_revision_and_tags(hub: FakeHub, tiny: TinyRepo, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    pinned = fetch(hub, cache, revision=tiny.v1)
    assert pinned.name == tiny.v1
    assert json.loads((pinned / "config.json").read_text())["revision"] == 1
    assert not (cache / "models--org--tiny" / "refs" / tiny.v1).exists()  # a commit needs no ref

    latest = fetch(hub, cache, revision="main")
    assert latest.name == tiny.main
    assert json.loads((latest / "config.json").read_text())["revision"] == 2
    # Unchanged weights are one blob shared by both commits: fetched once.
    assert len(hub.transfers("model.safetensors")) == 1

    hub.reset_stats()
    assert fetch(hub, cache, revision="v1") == pinned
    assert (cache / "models--org--tiny" / "refs" / "v1").read_text() == tiny.v1
    assert not hub.transfers()

    hub.reset_stats()
    assert fetch(hub, cache, revision=tiny.v1) == pinned  # complete pinned commit: no request at all
    assert hub.requests == []

    with pytest.raises(DownloadError, match="revision 'nope' does not exist in org/tiny"):
        fetch(hub, cache, revision="nope")


def test_gated_repo_needs_a_token(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_commit_from_dir("org/gated", build_tiny_repo(tmp_path / "gated", revision=1))
    hub.gate("org/gated", "hf_good")

    with pytest.raises(AccessDeniedError) as denied:
        fetch(hub, tmp_path / "c1", repo_id="org/gated")
    message = str(denied.value)
    assert "org/gated is gated (401)" in message and "HF_TOKEN" in message and "\n" not in message

    with pytest.raises(AccessDeniedError, match=r"\(403\)"):
        fetch(hub, tmp_path / "c2", repo_id="org/gated", token="hf_wrong")

    snapshot = fetch(hub, tmp_path / "c3", repo_id="org/gated", token="hf_good")
    assert listing(snapshot) == DEFAULT_FILES
    resolves = [r for r in hub.requests if "/resolve/" in r.path and r.status in (200, 302)]
    assert resolves and all(r.authorization == "Bearer hf_good" for r in resolves)
    assert all(r.authorization is None for r in hub.requests if r.server == "cdn")

    monkeypatch.setenv("HF_TOKEN", "hf_good")  # the library's own lookup when no token is passed
    assert listing(fetch(hub, tmp_path / "c4", repo_id="org/gated")) == DEFAULT_FILES


def test_offline_and_unreachable_hub_use_the_cache_without_requests(
    hub: FakeHub, tiny: TinyRepo, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    snapshot = fetch(hub, cache)
    hub.reset_stats()

    assert fetch(hub, cache, offline=True) == snapshot
    assert fetch(hub, cache, revision=tiny.main, offline=True) == snapshot
    assert fetch("http://127.0.0.1:9", cache, offline=True) == snapshot  # endpoint never used
    assert hub.requests == []

    hub.stop()  # air-gapped: the endpoint refuses connections
    with caplog.at_level("WARNING", logger="service.store.model_download"):
        assert fetch(hub, cache) == snapshot  # a branch needs the hub; unreachable -> the cached commit
    assert "hub unavailable" in caplog.text
    assert fetch(hub, cache, revision=tiny.main) == snapshot


def test_offline_without_the_revision_cached_fails_clearly(
    hub: FakeHub, tiny: TinyRepo, tmp_path: Path
) -> None:
    with pytest.raises(OfflineError, match=r"org/tiny@main is not in the cache at .* and offline mode is on"):
        fetch(hub, tmp_path / "empty", offline=True)

    cache = tmp_path / "partial"
    fetch(hub, cache, allow_patterns=("*.json",))
    with pytest.raises(
        OfflineError, match=r"incomplete .*2 missing: chat_template\.jinja, model\.safetensors"
    ):
        fetch(hub, cache, offline=True)
    with pytest.raises(OfflineError, match=r"org/tiny@v1 is not in the cache"):
        fetch(hub, cache, revision="v1", offline=True)

    hub.stop()
    with pytest.raises(OfflineError, match=r"cannot reach http://127\.0\.0\.1:\d+ \(ConnectError\)"):
        fetch(hub, cache)


def test_dropped_connection_resumes_without_resending(hub: FakeHub, tiny: TinyRepo, tmp_path: Path) -> None:
    size = len(tiny.files["model.safetensors"])
    cut = 3 * CHUNK
    hub.cut_next("model.safetensors", cut)

    snapshot = fetch(hub, tmp_path / "cache")

    assert (snapshot / "model.safetensors").read_bytes() == tiny.files["model.safetensors"]
    first, second = hub.transfers("model.safetensors")
    assert (first.range, first.sent) == (None, cut)
    assert (second.range, second.status) == (f"bytes={cut}-", 206)
    assert hub.bytes_served("model.safetensors") == size  # nothing sent twice


def test_killed_download_resumes_from_the_incomplete_file(
    hub: FakeHub, tiny: TinyRepo, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    size = len(tiny.files["model.safetensors"])
    hub.chunk_delay = 0.02  # ~0.7 s for the weights: time to kill the process mid-file
    child = spawn(hub, cache, tmp_path)
    deadline = time.monotonic() + 20
    partial_size = 0
    while time.monotonic() < deadline and child.poll() is None:
        partial = list(blobs(cache).glob("*.incomplete"))
        partial_size = partial[0].stat().st_size if partial else 0
        if partial_size >= 2 * CHUNK:
            break
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL, "the child finished before it could be killed"

    (incomplete,) = blobs(cache).glob("*.incomplete")
    kept = incomplete.stat().st_size
    assert 2 * CHUNK <= kept < size
    hub.chunk_delay = 0
    hub.reset_stats()

    snapshot = fetch(hub, cache)

    assert (snapshot / "model.safetensors").read_bytes() == tiny.files["model.safetensors"]
    (resumed,) = hub.transfers("model.safetensors")
    assert (resumed.range, resumed.status, resumed.sent) == (f"bytes={kept}-", 206, size - kept)
    assert not list(blobs(cache).glob("*.incomplete"))


@pytest.mark.parametrize("damage", ["header", "truncate"])
def test_corrupt_cached_safetensors_is_detected_removed_and_refetched(
    hub: FakeHub, tiny: TinyRepo, tmp_path: Path, damage: str
) -> None:
    cache = tmp_path / "cache"
    snapshot = fetch(hub, cache)
    blob = (snapshot / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    if damage == "header":
        data[:8] = (2**40).to_bytes(8, "little")  # same size, impossible header length
    else:
        del data[-1000:]
    blob.write_bytes(bytes(data))

    with pytest.raises(
        OfflineError, match=r"cached model\.safetensors of org/tiny@main is corrupt \(.*removed"
    ):
        fetch(hub, cache, offline=True)
    assert not (snapshot / "model.safetensors").exists() and not blob.exists()

    hub.reset_stats()
    assert fetch(hub, cache) == snapshot  # online: fetched again
    assert (snapshot / "model.safetensors").read_bytes() == tiny.files["model.safetensors"]
    assert len(hub.transfers("model.safetensors")) == 1


def test_corrupt_download_raises_naming_the_file(hub: FakeHub, tmp_path: Path) -> None:
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [1_000_000], "data_offsets": [0, 4_000_000]}}
    ).encode()
    bad = len(header).to_bytes(8, "little") + header + b"\0" * 4096  # claims 4 MB, holds 4 KB
    root = build_tiny_repo(tmp_path / "broken", revision=1)
    (root / "model.safetensors").write_bytes(bad)
    hub.add_commit_from_dir("org/broken", root)
    cache = tmp_path / "cache"

    with pytest.raises(DownloadError) as err:
        fetch(hub, cache, repo_id="org/broken")
    message = str(err.value)
    assert message.startswith("downloaded model.safetensors of org/broken@main is corrupt (tensor 'w' spans")
    assert "; removed); retry" in message and "\n" not in message
    snapshot = next((cache / "models--org--broken" / "snapshots").iterdir())
    assert not (snapshot / "model.safetensors").exists()
    assert {p.name for p in blobs(cache, "org/broken").iterdir() if p.stat().st_size == len(bad)} == set()


def test_insufficient_disk_fails_before_any_byte(
    hub: FakeHub, tiny: TinyRepo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: real(path)._replace(free=100 * 1024**2)
    )  # 100 MiB free < 256 MiB margin
    cache = tmp_path / "cache"

    with pytest.raises(InsufficientDiskError) as err:
        fetch(hub, cache)
    message = str(err.value)
    assert "needs 0.00 GiB (+0.25 GiB margin) but only 0.10 GiB is free at" in message
    assert str(cache) in message
    assert hub.transfers() == [] and hub.bytes_served() == 0
    assert not blobs(cache).exists()


def test_concurrent_processes_share_one_download(hub: FakeHub, tiny: TinyRepo, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    hub.chunk_delay = 0.02  # the first holder is still downloading when the second asks
    children = [spawn(hub, cache, tmp_path) for _ in range(2)]
    results, logs = [], []
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
        logs.append(err)

    assert sum("another process is fetching org/tiny@main" in log for log in logs) == 1, logs  # one waited
    assert results[0]["path"] == results[1]["path"]
    snapshot = Path(results[0]["path"])
    for name in DEFAULT_FILES:
        assert (snapshot / name).read_bytes() == tiny.files[name]
        # Fetched once, and the waiter did not even ask about the file: it found the artifact complete.
        assert len(hub.transfers(name)) == 1, name
        assert sum(r.method == "HEAD" and r.file == name for r in hub.requests) == 1, name
    assert (cache / "locks" / "models--org--tiny@main.lock").exists()


def test_lock_timeout_is_reported(hub: FakeHub, tiny: TinyRepo, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    lock_path = cache / "locks" / "models--org--tiny@main.lock"
    lock_path.parent.mkdir(parents=True)
    with filelock.FileLock(lock_path):
        started = time.monotonic()
        with pytest.raises(DownloadError, match=r"timed out after 0\.3s waiting for lock .*org/tiny@main"):
            fetch(hub, cache, lock_timeout=0.3)
        assert time.monotonic() - started < 5
    assert hub.requests == []


def test_fake_hub_serves_the_stock_library(hub: FakeHub, tiny: TinyRepo, tmp_path: Path) -> None:
    """The fake answers huggingface_hub's own snapshot_download and hf_hub_download as the Hub does."""
    path = snapshot_download(
        REPO_ID, cache_dir=tmp_path / "a", endpoint=hub.endpoint, allow_patterns=["*.json", "*.safetensors"]
    )
    assert listing(Path(path)) == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    file = hf_hub_download(
        REPO_ID, "config.json", revision="v1", cache_dir=tmp_path / "b", endpoint=hub.endpoint
    )
    assert json.loads(Path(file).read_text())["revision"] == 1


def test_spec_validation() -> None:
    assert ArtifactSpec("org/x", "main", allow_patterns=["*.json"]).allow_patterns == ("*.json",)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a hub id"):
        ArtifactSpec("a/b/c", "main")
    with pytest.raises(ValueError, match="repo_type"):
        ArtifactSpec("org/x", "main", repo_type="space")


def test_unlockable_cache_is_fine_offline_only(
    hub: FakeHub, tiny: TinyRepo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only cache (air-gapped mounts) takes no lock: offline reads go ahead, downloads refuse."""
    cache = tmp_path / "cache"
    snapshot = fetch(hub, cache)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setattr(CacheLayout, "artifact_lock", property(lambda self: blocker / "x.lock"))

    assert fetch(hub, cache, offline=True) == snapshot
    with pytest.raises(DownloadError, match=r"cannot create lock file .*x\.lock .*make .* writable"):
        fetch(hub, cache)


def test_offline_uses_caches_filled_by_other_tools(hub: FakeHub, tmp_path: Path) -> None:
    """A cache pre-filled with huggingface_hub itself serves offline; a missing shard is still caught."""
    root = build_tiny_repo(tmp_path / "sharded", revision=1)
    (root / "model.safetensors").unlink()
    rng = np.random.default_rng(1)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for i, shard in enumerate(shards):
        save_file({f"layer{i}.weight": rng.standard_normal((64, 64)).astype(np.float32)}, str(root / shard))
    weight_map = {f"layer{i}.weight": shard for i, shard in enumerate(shards)}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    hub.add_commit_from_dir("org/sharded", root)
    cache = tmp_path / "cache"
    filled = Path(snapshot_download("org/sharded", cache_dir=cache, endpoint=hub.endpoint))  # stock library
    hub.reset_stats()

    snapshot = fetch(hub, cache, repo_id="org/sharded", offline=True)  # via the library's tree cache
    assert snapshot == filled and {*shards, "model.safetensors.index.json"} <= listing(snapshot)

    # Without any listing (older tools) the snapshot is taken as is, but the index still names its shards.
    shutil.rmtree(cache / "models--org--sharded" / "trees")
    (snapshot / shards[1]).unlink()
    with pytest.raises(OfflineError, match=r"1 missing: model-00002-of-00002\.safetensors"):
        fetch(hub, cache, repo_id="org/sharded", offline=True)
    assert hub.requests == []
