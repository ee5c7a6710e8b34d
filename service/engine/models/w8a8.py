"""The CPU logits projection with its input rows quantized too (W8A8): int8 weights with one
scale per vocabulary row (Int8Weight), each input row quantized to int8 with one scale of its
own, and the products summed in integers by oneDNN's int8 matmul (VNNI or AMX instructions).

Why: aten's weight-only int8 kernel (Int8Linear) widens every weight to bf16 and multiplies in
floating point, so its time grows with the rows: the embedded model's 49152 x 576 head took
about 1.0 / 3.9 / 13.8 / 53 ms at 1 / 8 / 32 / 128 rows on an AMX host, against 1.1 / 1.5 / 3.0 /
12 here (bench/README.md "Outliers as rows of their own"). llama.cpp's Q8_0 head quantizes its
input too (in blocks of 32 values where this takes one scale a row).

What rounds: each input row to int8 (its largest magnitude to 127, round to nearest), as the
weights are, but for its OUTLIERS largest values: the head's input carries a few huge channels
(the embedded model's: 26x the row's RMS, the same two channels in most rows), which would leave
the rest a handful of int8 steps. As LLM.int8() does, those few are taken out of the row before it
is quantized; here they become a second row of their own (zero elsewhere), quantized with its own
scale (its largest value to 127, the others to steps of 1/127 of it) and run through the same
kernel call as the rest; the two rows' logits are then summed. On the embedded model,
teacher-forced greedy over the 50 prompts against the bf16 head, bf16 activations: 8 near-ties
taken the other way (all within 0.125), the chosen token's logprob moved by 0.031 on average, as
with the outliers multiplied in float32 (8, 0.030) and closer than the bf16-input int8 kernel (9,
up to 0.375); per-row scales without the outliers apart took 13 (one at a margin of 0.81) under
float32 activations. One call over twice the rows costs less than multiplying the outliers by
their weight columns in float32 did (a gather and a multiply-add per row and outlier over the
vocabulary: about half the head's time at 32 rows), and no copy of the table by columns is held.

The kernel takes the rows as uint8, shifted by 128 (oneDNN's signed-input and zero-point paths
run a reference loop off AMX: 350 ms a call), so it sums (q + 128) * w exactly in int32 and
scales by the weight row's scale in float32; the shift's share, 128 * sum(w) * scale, precomputed
per vocabulary row, is subtracted from each row's sums before its own scale applies: float32
logits.

Batch invariance: a row's integer sums are exact and every later step elementwise, so a row's
logits cannot depend on the rows beside it, provided the kernel accumulates without overflow and
scales every row the same way at every batch size. `w8a8_problem` checks both at start-up: CPUs
without VNNI multiply int8 pairs into saturating 16-bit sums (x86's vpmaddubsw), which inputs at
the extremes expose; and a row's result must be bitwise the same at every probed batch size and
place.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from service.engine.models.cpu_linear import batch_dependence
from service.engine.models.quant import Int8Weight
from service.host import cpu_flags

# CPU features with which oneDNN multiplies int8 without saturating 16-bit intermediates.
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
AVX512_INT8_DOT_FLAGS = ("avx512_vnni", "amx_int8")  # only where torch runs its AVX-512 kernels
_LARGEST = 127.0
OUTLIERS = 4  # each input row's largest magnitudes, quantized apart from the rest (a row of their own)
SHIFT = 128  # int8 -> uint8: the kernel's fast path takes unsigned inputs with a zero point of 0
# Input rows per kernel call (each with its outliers' row): oneDNN's int8 matmul over this
# vocabulary slows sharply past ~128 rows a call (the embedded head: 2 ms at 128, 18 at 256), so
# larger batches go in chunks; a row's integer sums do not depend on the call it is in.
CHUNK_ROWS = 32
# Output rows of the exactness probe's layer: the kernel's integer sums do not depend on how many.
_PROBE_OUTPUTS = 256
# The batch-invariance probe: enough outputs that the elementwise steps of most chunks run on
# several threads, as every chunk's do at a vocabulary's size (they are plain IEEE operations,
# threaded or not), and batch sizes (with places) compared against one forward over
# _INVARIANCE_ROWS rows, across chunk boundaries, past the decode batches and verification steps
# a server runs.
_INVARIANCE_OUTPUTS = 4096
_INVARIANCE_ROWS = 300
_INVARIANCE_PROBED = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 31, 33, 64, 65, 128, 129, 256, 257)


def _ops_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        and hasattr(torch.ops.onednn, "qlinear_pointwise")
        and hasattr(torch.ops.onednn, "qlinear_prepack")
    )


def quantize_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """float32 [M, K] -> (uint8 [M, K]: the int8 value + SHIFT, float32 scales [M, 1]): each row's
    largest magnitude to 127."""
    scale = (rows.abs().amax(-1, keepdim=True) / _LARGEST).clamp_min(torch.finfo(torch.float32).tiny)
    q = rows.div(scale).round_().clamp_(-_LARGEST, _LARGEST).add_(SHIFT)
    return q.to(torch.uint8), scale


class W8A8Linear(nn.Module):
    """y = x @ W.T in float32 for W held as int8 rows (no bias: the logits projections it holds
    have none), x quantized per row at each call, its outliers in a row of their own. The weight
    is held in oneDNN's packed layout only (an opaque tensor); a tied embedding keeps its own int8
    rows for lookups."""

    scale: Tensor
    shifted: Tensor
    zero_points: Tensor

    def __init__(self, weight: Int8Weight, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.onednn.qlinear_prepack(weight.q.to(device), [1, self.in_features])
        self.register_buffer("scale", weight.scale.to(device, torch.float32))
        # What the shift adds to each output: SHIFT * sum(w) in the kernel's units (times the scale).
        sums = weight.q.to(device, torch.float64).sum(1)
        self.register_buffer("shifted", (SHIFT * sums * self.scale.double()).float())
        # Symmetric weights: every zero point is 0 (the kernel takes one per output row).
        self.register_buffer("zero_points", torch.zeros(self.out_features, dtype=torch.int64, device=device))
        self.nbytes = weight.q.numel()  # the packed weight's bytes (an opaque tensor has no storage)
        self.outliers = min(OUTLIERS, self.in_features - 1)
        self._linear = torch.ops.onednn.qlinear_pointwise.default  # the overload, resolved once

    def forward(self, x: Tensor) -> Tensor:
        rows = x.float()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=rows.device)
        for start in range(0, rows.shape[0], CHUNK_ROWS):
            self._logits_into(rows[start : start + CHUNK_ROWS], out[start : start + CHUNK_ROWS])
        return out

    def _logits_into(self, rows: Tensor, out: Tensor) -> None:
        """The logits of float32 `rows` [M, K] into `out` [M, N], in one kernel call."""
        count = rows.shape[0]
        where = rows.abs().topk(self.outliers, -1).indices  # [M, OUTLIERS]
        apart = torch.zeros_like(rows).scatter_(1, where, rows.gather(1, where))
        # The rows without their outliers, then the outliers' rows.
        q, row_scale = quantize_rows(torch.cat([rows.scatter(1, where, 0.0), apart]))
        sums = self.scaled_sums(q).sub_(self.shifted)  # each row's own sum of q * w, scaled by w's
        # Each output row from its own two rows only: plain elementwise steps, no row depends on another.
        torch.mul(sums[:count], row_scale[:count], out=out).add_(sums[count:].mul_(row_scale[count:]))

    def scaled_sums(self, q: Tensor) -> Tensor:
        """The kernel itself: uint8 rows [M, K] -> float32(sum of q * w, exact in int32) * scale."""
        out: Tensor = self._linear(
            q, 1.0, 0, self.packed, self.scale, self.zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights and inputs"


def w8a8_problem(in_features: int) -> str | None:
    """Why a logits projection of `in_features` inputs cannot run as W8A8Linear here, or None."""
    if not _ops_available():
        return "this PyTorch build has no oneDNN int8 matmul"
    if not set(INT8_DOT_FLAGS) & cpu_flags():
        return f"this CPU has none of {', '.join(INT8_DOT_FLAGS)} (int8 products without saturation)"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512") and not {"avx_vnni"} & cpu_flags():
        # ATEN_CPU_CAPABILITY lowers the head's instructions as it lowers the native kernels'
        # (isa.h): an AVX-512 host emulating an AVX2 one serves the head an AVX2 host serves.
        return (
            f"torch's CPU capability is {capability} (ATEN_CPU_CAPABILITY), below the AVX-512 this "
            f"CPU's int8 products ({', '.join(sorted(set(AVX512_INT8_DOT_FLAGS) & cpu_flags()))}) need"
        )
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (_PROBE_OUTPUTS, in_features), dtype=torch.int8, generator=generator)
    q[0], q[1] = 127, -127
    try:
        layer = W8A8Linear(Int8Weight(q, torch.ones(_PROBE_OUTPUTS)), torch.device("cpu"))
        with torch.inference_mode():
            # Exact integers: inputs at the extremes, whose pair sums overflow 16 bits.
            extremes = torch.full((4, in_features), 255, dtype=torch.uint8)
            extremes[1] = 1
            extremes[2, ::2] = 1
            extremes[3] = torch.randint(0, 256, (in_features,), dtype=torch.uint8, generator=generator)
            exact = (extremes.double() @ q.double().T).float()
            if not torch.equal(layer.scaled_sums(extremes), exact):
                return "oneDNN's int8 matmul does not sum int8 products exactly on this CPU"
            # Batch invariance, with real scales (and the shift's share made from them).
            shape = (_INVARIANCE_OUTPUTS, in_features)
            q = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
            scale = torch.rand(_INVARIANCE_OUTPUTS, generator=generator) / 64
            layer = W8A8Linear(Int8Weight(q, scale), torch.device("cpu"))
            x = torch.randn(_INVARIANCE_ROWS, in_features, generator=generator)
            x[:, :: max(1, in_features // 7)] *= 30  # a few large channels, as a head's input has
            rows = batch_dependence(layer, x, _INVARIANCE_PROBED)
        if rows is not None:
            return f"oneDNN's int8 matmul computes a row differently at batch {rows}"
    except RuntimeError as error:  # the op exists but this CPU or build cannot run it
        return f"oneDNN's int8 matmul failed its check ({error})"
    return None
