"""The project's native CPU ops, one extension built from this directory's C++ sources.

- w4a8.cpp: the W4A8 int4 linear and MoE ops (w4a8.py);
- q8.cpp: the Q8 linear, int8 weights with a scale per block of 32 (q8.py);
- fused_ops.cpp: RMSNorm (with its residual add) and MoE routing, each one op (fused_ops.py);
- decode_attention.cpp: decode rows' attention over the paged cache, read in place (fused_ops.py).

w4a8.cpp and q8.cpp quantize their activations alike (quantize.h); isa.h chooses the instructions.

They are compiled together on first use by torch.utils.cpp_extension (g++ and ninja; cached under
TORCH_EXTENSIONS_DIR, which the container image fills at build time), into the `nim_cpu` op
namespace. Where the extension cannot be built or loaded, `problem()` says why, and every user
keeps aten's ops. The ops' schemas are declared in Python (`define`), whether or not the extension
builds: TorchScript resolves them when it compiles a decode stack that may call them.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("w4a8.cpp", "q8.cpp", "fused_ops.cpp", "decode_attention.cpp")
)
NAME = "nim_cpu"  # the extension's name (its build directory under TORCH_EXTENSIONS_DIR)
# A build lock older than this was left by a build that died (a build takes well under a minute);
# torch.utils.cpp_extension would wait on it forever.
STALE_LOCK_S = 600.0
ISA_NAMES = ("portable", "avx2", "avx512_vnni")
# A fragment, each op declared once: a second import of a module that declares ops must not fail.
_LIBRARY = torch.library.Library("nim_cpu", "FRAGMENT")  # type: ignore[no-untyped-call]  # torch leaves it unannotated


def define(schemas: dict[str, str]) -> None:
    """Declare ops of the nim_cpu namespace by schema (op name -> schema), each once a process."""
    for op, schema in schemas.items():
        if not hasattr(torch.ops.nim_cpu, op):
            _LIBRARY.define(schema)  # type: ignore[no-untyped-call]


def isa() -> str:
    """The instructions the loaded ops run here (isa.h: torch's CPU capability, which
    ATEN_CPU_CAPABILITY lowers, and the CPU's flags)."""
    return ISA_NAMES[int(torch.ops.nim_cpu.w4a8_isa())]


def _gomp_flags() -> list[str]:
    """Link the OpenMP runtime torch itself loaded (its bundled libgomp where it ships one), so
    at::parallel_for's threads are torch's own and no second runtime starts."""
    lib = Path(torch.__file__).parent / "lib"
    bundled = sorted(lib.glob("libgomp*.so*"))
    if bundled:
        return [f"-L{lib}", f"-l:{bundled[0].name}", f"-Wl,-rpath,{lib}"]
    return ["-lgomp"]


def _ninja_on_path() -> None:
    """torch.utils.cpp_extension runs `ninja` from PATH; the `ninja` package (a dependency) puts it
    beside the interpreter, which PATH lacks when a virtual environment's python is run directly."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _clear_stale_lock(build_dir: Path) -> None:
    """Remove the build lock a build that died left behind (see STALE_LOCK_S), saying so."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing %s, a build lock %.0f s old (a build that did not finish left it)", lock, age)
        lock.unlink(missing_ok=True)


@functools.cache
def problem() -> str | None:
    """None once the extension is loaded (built on first use), else why it cannot be."""
    if os.name != "posix":
        return "the native CPU ops are built for Linux only"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the native CPU ops are x86-64 code (AVX2 / AVX-512); this CPU is {platform.machine()}"
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        _clear_stale_lock(Path(cpp_extension._get_build_directory(NAME, verbose=False)))
        cpp_extension.load(
            name=NAME,
            sources=[str(source) for source in SOURCES],
            # No contraction of a * b + c into an fma the source does not write: every path
            # (portable, AVX2, AVX-512) must round alike.
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"],
            extra_ldflags=_gomp_flags(),
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # a missing compiler, ninja, or headers: say which, keep aten's ops
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"the native CPU ops could not be built ({first})"
    log.info("native CPU ops loaded (%s)", isa())
    return None
