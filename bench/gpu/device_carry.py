"""What a lent GPU machine lacks, and how it gets there: the wheels its image does not hold, checked
against every import of the server and of the tests `make test-gpu` runs; and the embedded model,
which is larger than one call may carry, split in two halves carried by two calls made back to back.

The device's image is recorded here (DEVICE_IMAGE, from the device tool's KINDS.md, read 2026-11-17):
a session learns of a missing module only when the server it started exits, minutes into its
device time (2026-11-28: `httpx2`, then `openai`), so tests/test_gpu_session.py checks, on the CPU,
that every import is covered by the image, by WHEELS, or named optional (OPTIONAL_IMPORTS).
"""

from __future__ import annotations

import ast
import hashlib
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Distributions on the device's image ('cuda', nvidia-h200), canonical names.
_IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
DEVICE_IMAGE = frozenset(_IMAGE.split())

# What the device lacks, carried as wheels (at the versions this checkout's environment holds, so
# the device runs what CI tested). The server's own needs, then the tests' (`make test-gpu`).
WHEELS = (
    "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv",
    "annotated-types", "annotated-doc", "typing-inspection", "typing-extensions", "gguf", "opentelemetry-api",
    "httpx2", "httpcore2", "truststore",
    "openai", "jiter", "distro", "sniffio", "jsonschema-rs",
)  # fmt: skip

# Imports the server makes only where a feature is configured, each with why it may be missing.
OPTIONAL_IMPORTS = {
    "dynamo": "only the Dynamo worker (`serve --dynamo`) imports it",
    "xgrammar": "guided decoding reports itself unavailable without it",
    "opentelemetry": "the SDK and exporters only where NIM_OTEL tracing is configured (the API is carried)",
}

# The files whose imports must resolve on the device: the server, the measuring tools, and the test
# modules `make test-gpu` runs (read from the Makefile) with the test helpers they import.
SERVED = ("service", "entrypoint.py", "bench/compare_llama.py", "bench/http_load.py", "bench/gpu")

EMBEDDED_HALVES = ("model-a", "model-b")  # carry subfolders, one per device call
FIRST_PART = 0.42  # ~41 MB of 98: each call then carries ~61 MB with the repository's ~4 MB
STAGED = Path("/tmp/nim-embedded")  # where the first half waits on the device for the second


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_test_modules(makefile: Path = REPO / "Makefile") -> list[Path]:
    """The test files of the Makefile's test-gpu recipe."""
    recipe = re.search(r"^test-gpu:\n((?:\t.*\n)+)", makefile.read_text(), re.MULTILINE)
    if recipe is None:
        raise ValueError(f"{makefile} has no test-gpu recipe")
    return [REPO / name for name in re.findall(r"tests/\w+\.py", recipe.group(1))]


def device_files() -> list[Path]:
    files: list[Path] = []
    for entry in SERVED:
        path = REPO / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [*files, REPO / "tests" / "conftest.py", *gpu_test_modules()]


def third_party_imports(files: Iterable[Path]) -> dict[str, set[str]]:
    """Top-level module -> the files importing it, for every import that is neither the standard
    library nor this repository's (local test helpers imported as `tests.x` are followed)."""
    local = {"service", "tests", "bench", *(p.stem for p in (REPO / "bench").rglob("*.py"))}
    found: dict[str, set[str]] = {}
    todo, seen = list(files), set()
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "tests":
                names = [f"tests.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "tests":
                    todo.append(REPO / (name.replace(".", "/") + ".py"))
                elif top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def uncovered(
    imports: dict[str, set[str]], distributions: dict[str, list[str]], wheels: Iterable[str] = WHEELS
) -> dict[str, str]:
    """Imports that neither the device's image nor `wheels` provides and that are not optional, each
    with what provides it here (`distributions`: importlib.metadata.packages_distributions())."""
    have = DEVICE_IMAGE | {canonical(w) for w in wheels}
    missing: dict[str, str] = {}
    for module, users in sorted(imports.items()):
        if module in OPTIONAL_IMPORTS:
            continue
        provided_by = {canonical(d) for d in distributions.get(module, [module])}
        if not provided_by & have:
            missing[module] = f"{'/'.join(sorted(provided_by))} (imported by {', '.join(sorted(users)[:3])})"
    return missing


# --- The embedded model, in two halves ------------------------------------------------------------


def split_embedded(model: Path, carry: Path) -> None:
    """CARRY/model-a and CARRY/model-b: the two parts of `model`, each with the whole file's name
    and sha256 (a call carries at most 64 MiB; the model is ~98 MB). The first part is the smaller
    (FIRST_PART of it): the first call carries the wheels and the tokenizer beside it (~16 MB)."""
    data = model.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    half = int(len(data) * FIRST_PART)
    for name, part in zip(EMBEDDED_HALVES, (data[:half], data[half:]), strict=True):
        folder = carry / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / "part").write_bytes(part)
        (folder / "sha256").write_text(f"{digest}  {model.name}\n")


def keep_first_half(carry: Path, staged: Path = STAGED) -> str:
    """On the device, in the first call: put CARRY/model-a where the second call finds it."""
    source = carry / EMBEDDED_HALVES[0]
    if not (source / "part").is_file():
        return f"no {source.name} carried: the embedded model is not staged"
    staged.mkdir(parents=True, exist_ok=True)
    for name in ("part", "sha256"):
        shutil.copyfile(source / name, staged / f"{EMBEDDED_HALVES[0]}.{name}")
    return f"kept the first half of the embedded model in {staged}"


def assemble_embedded(carry: Path, target: Path, staged: Path = STAGED) -> str:
    """On the device, in the second call: the first half kept by the first call plus CARRY/model-b,
    checked against the sha256 both carry, written to `target`. Raises ValueError saying what is
    missing or wrong."""
    first, second = staged / f"{EMBEDDED_HALVES[0]}.part", carry / EMBEDDED_HALVES[1] / "part"
    if target.is_file():
        return f"the embedded model is already at {target}"
    for path, how in ((first, "the first call (measure) with model-a carried, on this warm machine"),
                      (second, "this call with model-b carried")):  # fmt: skip
        if not path.is_file():
            raise ValueError(f"{path} is missing: it comes from {how}")
    expected = {(staged / f"{EMBEDDED_HALVES[0]}.sha256").read_text(),
                (carry / EMBEDDED_HALVES[1] / "sha256").read_text()}  # fmt: skip
    if len(expected) != 1:
        raise ValueError("the two halves come from different models (their sha256 files differ)")
    digest, name = expected.pop().split()
    data = first.read_bytes() + second.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"the assembled {name} does not match its sha256 {digest[:12]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(target)
    return f"assembled {name} ({len(data) / 1e6:.0f} MB, sha256 checked) at {target}"
