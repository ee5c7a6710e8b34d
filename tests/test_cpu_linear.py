"""oneDNN-prepacked linear layers: the same result for a row whatever the batch size."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.engine.models.cpu_linear import PackedLinear, prepacking_supported

REPO = Path(__file__).resolve().parent.parent


def _order_sensitive(rows: int, width: int) -> torch.Tensor:
    """Rows whose sum depends on the order of summation: +-2**25 terms that cancel among ones that
    float32 loses beside them (a different blocking or split gives a different result)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.ones(rows, width)
    for row in range(rows):
        order = torch.randperm(width, generator=generator)
        x[row, order[: width // 4]] = 2.0**25
        x[row, order[width // 4 : width // 2]] = -(2.0**25)
    return x.to(torch.bfloat16)


@pytest.mark.skipif(
    not prepacking_supported(torch.bfloat16, torch.device("cpu")), reason="needs oneDNN bf16 on this CPU"
)
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(960, 576), (49152, 576), (576, 1536), (576, 4096)]
)
def test_packed_linears_compute_a_row_alike_at_every_batch_size(out_features: int, in_features: int) -> None:
    """Batch invariance of the linear layers: padding small batches where the load-time probe says
    this CPU needs it, a row's result is bitwise the same alone or among up to 40 rows, for random
    weights and for inputs that expose any change in the order of summation.

    On CPUs with AMX, oneDNN's AMX bf16 kernels choose their blocking by the row count (rows 7-65
    of one shape differ from a 256-row batch, 1-32 of another), which no padding of small batches
    fixes: invariance holds there only with oneDNN held to AVX-512 (ONEDNN_MAX_CPU_ISA, read when
    oneDNN first runs), as docs/engine.md says, so that is what runs here, in a process of its own."""
    if _amx_in_use():
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
        code = "from tests.test_cpu_linear import _check_rows_alike as check; "
        code += f"check({out_features}, {in_features})"
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return
    _check_rows_alike(out_features, in_features)


def _amx_in_use() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return "amx_bf16" in flags and "ONEDNN_MAX_CPU_ISA" not in os.environ


def _check_rows_alike(out_features: int, in_features: int) -> None:
    torch.manual_seed(out_features)
    for weight in (torch.randn(out_features, in_features), torch.ones(out_features, in_features)):
        layer = PackedLinear(weight.to(torch.bfloat16), None)
        layer.pad_small = layer.needs_padding()
        for x in (torch.randn(40, in_features).to(torch.bfloat16), _order_sensitive(40, in_features)):
            with torch.inference_mode():
                batch = layer(x)
                for rows in (1, 2, 4, 7, 8, 9, 33):
                    assert torch.equal(layer(x[:rows]), batch[:rows]), rows
