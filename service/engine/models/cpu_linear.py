"""Prepacked linear layers for CPU inference: oneDNN's (float weights) and fbgemm's (float16 weights).

`F.linear` on CPU reorders the weight into oneDNN's blocked layout on every call; packing it once
at load time makes the skinny matmuls of decoding 1.2x (batch 32) to 4x (batch 1) faster on an
AVX-512 bf16 machine, with bit-identical results (measured in bench/README.md). Only used where
PyTorch's oneDNN build supports it; everywhere else models keep plain `nn.Linear`.

Batch invariance: a row's result must not depend on how many rows share the call, which keeps
greedy and seeded outputs independent of what else the engine batches with a request. From 8 rows
up (checked to 2048) oneDNN computes every row the same way, except with its AMX bf16 kernels,
which block by row count at every size (docs/engine.md: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16).
Below 8 rows some oneDNN builds and CPUs pick a differently blocked kernel (another summation
order), others do not; padding a small batch to 8 rows costs batch 1 about three times the
linear time. So at load time each layer shape is probed once (`needs_padding`): small batches are
padded only where the probe sees them computed differently.

HalfPackedLinear holds a float32 model's logits projection as float16 in fbgemm's packed layout:
float32 inputs, arithmetic and outputs (fbgemm widens each weight as it reads it), half the bytes
per token. The head is the largest single read of a small model's decode step (the embedded
model's float32 table is 113 MB against 53 MB for all of its int4 layers): batch 1 2.7 ms against
6.0 ms, batch 8 4.0 ms against 11.6 ms, batch 32 even, 1.2x slower from 64 rows
(bench/README.md). Only the weights round: float16 keeps 11 bits where bf16 keeps 8, and nothing
rounds the output, so logits move by ~1e-3 (bf16 kernels round a logit of 20 to steps of 0.125).
`half_packing_problem` checks at start-up that the build has the kernel and that it computes
every row alike at every batch size; otherwise the head stays float32.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

log = logging.getLogger(__name__)

# The batch size oneDNN tunes the packed layout for; any batch size works with it.
BATCH_HINT = 32
# From this many rows up every row is computed alike; fewer may not be (see the module docstring).
MIN_ROWS = 8
# Batch sizes the probe compares against MIN_ROWS rows.
PROBED_ROWS = (1, 2, 3, 5, 7)
# Batch sizes (and row offsets) the float16 probe compares against one call over HALF_PROBE_ROWS rows.
HALF_PROBED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 31, 33, 64)
HALF_PROBE_ROWS = 96


def order_sensitive_rows(rows: int, width: int) -> torch.Tensor:
    """Probe inputs [rows, width] (float32) whose sum depends on the order of summation: ones
    among +-2**25 terms that cancel, at a seeded random place in each row. Against weights of ones,
    any difference in a kernel's blocking or split shows in its result, where random inputs hide
    most such differences (they flip a bf16 rounding once in thousands of values)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.ones(rows, width)
    quarter = width // 4
    for row in range(rows):
        order = torch.randperm(width, generator=generator)
        x[row, order[:quarter]] = 2.0**25
        x[row, order[quarter : 2 * quarter]] = -(2.0**25)
    return x


def prepacking_supported(dtype: torch.dtype, device: torch.device) -> bool:
    # torch leaves mkldnn.is_available unannotated.
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's packed layout (an opaque mkldnn tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.bias = None if bias is None else bias.detach()
        self.pad_small = True  # pad batches under MIN_ROWS rows, unless needs_padding() says not
        # The overload itself: an op packet resolves it in Python on every call.
        self._linear = torch.ops.mkldnn._linear_pointwise.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features]
        rows = x.shape[0]
        if rows < MIN_ROWS and self.pad_small:
            return self.matmul(torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])]))[:rows]
        return self.matmul(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The packed matmul itself, for any number of rows."""
        out: torch.Tensor = self._linear(x, self.packed, self.bias, "none", [], "")
        return out

    def needs_padding(self) -> bool:
        """Whether this build and CPU compute a row of a small batch (under MIN_ROWS rows)
        differently from the same row in a larger batch.

        Kernel choice depends on the shapes, not the values, so the probe uses a layer of this
        shape with weights of ones and `order_sensitive_rows` inputs.
        """
        rows = 4 * MIN_ROWS
        x = order_sensitive_rows(rows, self.in_features).to(self.dtype)
        ones = torch.ops.mkldnn._reorder_linear_weight(
            torch.ones(self.out_features, self.in_features, dtype=self.dtype), BATCH_HINT
        )
        with torch.inference_mode():

            def matmul(m: int) -> torch.Tensor:
                out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x[:m], ones, None, "none", [], "")
                return out

            reference = matmul(rows)
            return not all(torch.equal(matmul(m), reference[:m]) for m in (*PROBED_ROWS, MIN_ROWS + 1))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=True"


def prepack_linears(model: nn.Module, keep: Iterable[nn.Module] = ()) -> int:
    """Replace every nn.Linear in `model` but those in `keep` with a PackedLinear, probing each
    distinct shape once for whether small batches need padding; returns how many were replaced."""
    replaced = 0
    padding: dict[tuple[int, int, torch.dtype], bool] = {}
    kept = {id(module) for module in keep}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and id(child) not in kept:
                packed = PackedLinear(child.weight, child.bias)
                key = (packed.out_features, packed.in_features, packed.dtype)
                if key not in padding:
                    padding[key] = packed.needs_padding()
                packed.pad_small = padding[key]
                setattr(parent, name, packed)
                replaced += 1
    padded = sorted(f"{out}x{inp}" for (out, inp, _), pad in padding.items() if pad)
    alike = "no shape: this CPU computes every row alike at any batch size"
    log.info("prepacked %d linear layers; batches under %d rows are padded for %s", replaced, MIN_ROWS,
             ", ".join(padded) or alike)  # fmt: skip
    return replaced


class HalfPackedLinear(nn.Module):
    """y = x @ W.T, x and y float32, W held as float16 in fbgemm's packed layout (no bias: the
    logits projections it holds have none). See the module docstring for where it is used."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), None)
        self.nbytes = weight.numel() * 2  # what one call reads (the opaque packed object has no size)
        self._linear = torch.ops.quantized.linear_dynamic_fp16.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._linear(x, self.packed)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 packed"


def batch_dependence(
    layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, probed: Iterable[int]
) -> int | None:
    """The first of the `probed` batch sizes at which `layer` computes a row of `x` differently
    from one call over all of `x` (each size tried at offsets 0, 1 and the end), or None."""
    reference = layer(x)
    for rows in probed:
        for offset in (0, 1, x.shape[0] - rows):
            if not torch.equal(layer(x[offset : offset + rows]), reference[offset : offset + rows]):
                return rows
    return None


def half_packing_problem(in_features: int) -> str | None:
    """Why a float32 logits projection of `in_features` inputs cannot be held as HalfPackedLinear
    here, or None: the build must have fbgemm's float16 kernel, and a row's result must be bitwise
    the same whatever the batch size and the row's place in it (probed on random weights of this
    width, with inputs whose sum depends on the order of summation, as `needs_padding` does)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this PyTorch build has no fbgemm (its float16 matmul)"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, in_features, generator=generator)
    x = torch.randn(HALF_PROBE_ROWS, in_features, generator=generator)
    quarter = in_features // 4
    for row in range(0, HALF_PROBE_ROWS, 3):
        order = torch.randperm(in_features, generator=generator)
        x[row, order[:quarter]] = 2.0**25
        x[row, order[quarter : 2 * quarter]] = -(2.0**25)
    try:
        layer = HalfPackedLinear(weight)
        with torch.inference_mode():
            rows = batch_dependence(layer, x, HALF_PROBED_ROWS)
        if rows is not None:
            return f"fbgemm's float16 matmul computes a row differently at batch {rows}"
    except RuntimeError as error:  # the op exists but this CPU or build cannot run it
        return f"fbgemm's float16 matmul failed its check ({error})"
    return None
