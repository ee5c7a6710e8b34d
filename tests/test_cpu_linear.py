"""oneDNN-prepacked linear layers: the same result for a row whatever the batch size."""

from __future__ import annotations

import pytest
import torch

from service.engine.models.cpu_linear import PackedLinear, prepacking_supported


@pytest.mark.skipif(
    not prepacking_supported(torch.bfloat16, torch.device("cpu")), reason="needs oneDNN bf16 on this CPU"
)
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (49152, 576), (576, 1536)])
def test_packed_linears_compute_a_row_alike_at_every_batch_size(out_features: int, in_features: int) -> None:
    """Batch invariance of the linear layers: padding small batches where the probe says this CPU
    needs it, a row's result is bitwise the same alone or among up to 40 rows."""
    torch.manual_seed(out_features)
    layer = PackedLinear(torch.randn(out_features, in_features).to(torch.bfloat16), None)
    layer.pad_small = layer.needs_padding()
    x = torch.randn(40, in_features).to(torch.bfloat16)
    with torch.inference_mode():
        batch = layer(x)
        for rows in (1, 2, 4, 7, 8, 9, 33):
            assert torch.equal(layer(x[:rows]), batch[:rows]), rows
