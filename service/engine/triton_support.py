"""Triton, where it is installed: CUDA builds of PyTorch ship it, CPU-only installs may lack it.

Kernel modules import `triton` and `tl` from here and ask `available()` before launching; where
Triton is absent both names are None and no kernel is defined.
"""

from __future__ import annotations

__all__ = ["available", "tl", "triton"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


def available() -> bool:
    return triton is not None
