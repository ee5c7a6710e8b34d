"""Every example in README.md and docs/ runs against a real server, so the docs cannot drift.

A fenced block is an example when the line before it is `<!-- example -->`: a ```bash block runs in
bash (with `set -eo pipefail`, and curl failing on an HTTP error status), a ```python block in this
Python. `http://127.0.0.1:8000` and `http://localhost:8000` in it are replaced by the test server's
address. Examples run in document order, in one scratch directory per page (so a block may use
files an earlier one made). A tag picks what the example needs:

- `<!-- example: api-key -->` runs against a second server started with NIM_API_KEY=my-secret-key;
- `<!-- example: lora -->` waits (up to 20 s) until the adapter an earlier block made is served;
- `<!-- example: skip REASON -->` marks a request block that is not run, and says why.

The main server is the embedded model with NIM_PEFT_SOURCE=<scratch>/adapters (rescanned every
second) and the test defaults. Every ```python block and every ```bash block whose first line is a curl
command must carry one of the tags above (`test_every_request_block_is_marked`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, ServerProcess, start_server, wait_ready

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
API_KEY = "my-secret-key"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
MARK = re.compile(r"<!-- example(?::\s*([\w-]+)[^>]*)? -->\s*$")
EXAMPLE_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str
    tag: str | None  # None: not marked; "" marked plainly; else the tag

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        tag = None if mark is None else (mark.group(1) or "")
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match.group(1), match.group(2), tag))
    return found


def _is_request(block: Block) -> bool:
    first = block.code.lstrip().split("\n", 1)[0]
    return block.language == "python" or (block.language == "bash" and first.startswith("curl "))


def test_every_request_block_is_marked() -> None:
    unmarked = [b.name for page in PAGES for b in blocks(page) if _is_request(b) and b.tag is None]
    assert not unmarked, f"mark these as <!-- example --> (or example: skip REASON): {unmarked}"
    examples = [b for page in PAGES for b in blocks(page) if b.tag not in (None, "skip")]
    assert {b.language for b in examples} <= {"bash", "python"}, [b.name for b in examples]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("docs-examples")
    (root / "adapters").mkdir()
    return root


@pytest.fixture(scope="module")
def servers(scratch: Path) -> Iterator[dict[str, ServerProcess]]:
    """Both servers, started together (the CPU loads them side by side)."""
    main = start_server(
        scratch / "main.log",
        env={
            "NIM_PEFT_SOURCE": str(scratch / "adapters"),
            "NIM_PEFT_REFRESH_INTERVAL": "1",
        },
    )
    keyed = start_server(scratch / "keyed.log", env={"NIM_API_KEY": API_KEY})
    try:
        wait_ready(main)
        wait_ready(keyed)
        yield {"main": main, "api-key": keyed}
    finally:
        main.stop()
        keyed.stop()


def _wait_for_adapter(server: ServerProcess, name: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
        if any(m["id"] == name for m in models):
            return
        time.sleep(0.5)
    raise AssertionError(f"adapter {name!r} not served within 20 s:\n{server.log()[-3000:]}")


def _run(block: Block, server: ServerProcess, cwd: Path) -> subprocess.CompletedProcess:
    code = block.code
    for url in ("http://127.0.0.1:8000", "http://localhost:8000"):
        code = code.replace(url, server.base_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "OPENAI_", "ANTHROPIC_"))}
    if block.language == "python":
        command = [sys.executable, "-c", code]
    else:
        prelude = 'set -eo pipefail\ncurl() { command curl --fail-with-body --max-time 110 "$@"; }\n'
        command = ["bash", "-c", prelude + code]
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_examples_run(page: Path, servers: dict[str, ServerProcess], scratch: Path) -> None:
    examples = [b for b in blocks(page) if b.tag not in (None, "skip")]
    if not examples:
        pytest.skip("no examples on this page")
    cwd = scratch if page.name == "README.md" else scratch / page.stem
    cwd.mkdir(exist_ok=True)
    for block in examples:
        server = servers["api-key" if block.tag == "api-key" else "main"]
        if block.tag == "lora":
            _wait_for_adapter(server, re.search(r'"model": "([^"]+)"', block.code).group(1))  # type: ignore[union-attr]
        done = _run(block, server, cwd)
        assert done.returncode == 0, (
            f"{block.name} failed ({done.returncode}):\n{block.code}\nstdout:\n{done.stdout[-2000:]}\n"
            f"stderr:\n{done.stderr[-3000:]}"
        )
