"""Linear layers over quantized weights (service.engine.models.quant), native or emulated.

A layer runs *natively* where a kernel consumes its format directly, and is *emulated* elsewhere:
the weight stays quantized in memory and is dequantized into the activation dtype for each call.

| format   | CPU                                    | CUDA                                         |
|----------|----------------------------------------|----------------------------------------------|
| int4_wo  | native: aten._weight_int4pack_mm_for_cpu | emulated                                   |
| int8_wo  | native: aten._weight_int8pack_mm       | emulated                                     |
| fp8      | emulated                               | native from compute capability 8.9: _scaled_mm |
| nvfp4    | emulated                               | emulated                                     |

Emulation computes weight-only: activations are not quantized, so an emulated fp8 layer is the
dequantized weight applied in the activation dtype (as vLLM's weight-only FP8 fallback). The
native fp8 layer quantizes activations to e4m3 too: with the checkpoint's static input scale
where it has one, else with one scale per token computed at run time.

The precision specs (service.engine.precision) state this table, which layer serves which format
and which kernel is native where; selection and these layers both read them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.engine.models import prompt_rows, triton_fp8
from service.engine.models.quant import (
    E2M1_VALUES,
    FORMATS,
    FP8_MAX,
    FP8Weight,
    Int4Weight,
    Int8Weight,
    NVFP4Weight,
    QuantizedWeight,
)
from service.engine.native import quantize, w4a8
from service.engine.precision import SPECS
from service.engine.precision import precision_mode as _precision_mode
from service.model.quantization import QuantizationError


def precision_mode(precision: str, device: torch.device) -> str:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return _precision_mode(precision, device.type, capability)


# What the native CPU int4/int8 kernels compute in under float32 activations, where the engine
# asks (BuildOptions.int_kernels_in_bf16): their float32 path is a scalar loop, 10-40x slower than
# their bf16 one, which is vectorised on every x86 host, AVX2 or AVX-512, bf16 instructions or not
# (bench/README.md "CPU precisions by measurement"). Only each int layer's input and output then
# round through bf16 (far finer than its int4/int8 weights); the attention, norms and residual
# stream stay float32, which a CPU without bf16 instructions runs faster than bf16.
CPU_INT_KERNEL_DTYPE = torch.bfloat16

# The CPU int4 packing needs the output rows in multiples of this; other layers are padded.
INT4_CPU_ROW_MULTIPLE = 16

# The native CPU kernels, resolved once (an op packet resolves its overload in Python per call).
_INT4_MM_CPU = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default


class QuantLinear(nn.Module):
    """y = x @ W.T + b for a quantized W; subclasses hold the format's tensors as buffers."""

    precision: str
    native: bool

    def __init__(self, shape: tuple[int, int], bias: nn.Parameter | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.dtype = dtype
        self.bias = bias

    def weight_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        mode = "native" if self.native else "emulated"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.precision} {mode}"


# The kernel native int4 layers are built for while it is set (`int4_layers_on`): "aten" (the
# default) or "w4a8". loader.build_model sets it around a model's load (BuildOptions.int4_kernel).
_INT4_KERNEL: ContextVar[str] = ContextVar("int4_kernel", default="aten")


@contextmanager
def int4_layers_on(kernel: str) -> Iterator[None]:
    """Native int4 layers made inside run `kernel` ("aten" or "w4a8": the W4A8 kernel must be
    loaded, native/w4a8.py's problem() None)."""
    token = _INT4_KERNEL.set(kernel)
    try:
        yield
    finally:
        _INT4_KERNEL.reset(token)


class Int4Linear(QuantLinear):
    precision = "int4_wo"
    # native: "aten", aten's CPU int4 kernel (activations in bf16 or float32), or "w4a8": the W4A8
    # kernel (native/w4a8.py: activations rounded to int8 per block of 32, integer dot products),
    # where the layer was made under int4_layers_on("w4a8") and its weight suits it (else
    # `w4a8_problem` says why not)
    kernel = "aten"
    w4a8_problem: str | None = None
    packed: Tensor  # native: uint8, aten's CPU int4 layout, or W4A8's (w4a8.pack)
    scales_zeros: Tensor  # native: aten's [K / group, N, 2], or W4A8's float16 scales and mins
    nibbles: Tensor  # emulated: uint8 [N, K / 2], and the format's scales
    scale: Tensor
    zero: Tensor
    dense: prompt_rows.DenseWeight | None = None  # native, where prompt rows go dense (attach_dense)

    def __init__(
        self, weight: Int4Weight, bias: nn.Parameter | None, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(weight.shape, bias, dtype)
        self.group_size = weight.group_size
        self.native = precision_mode(self.precision, device) == "native"
        if self.native and _INT4_KERNEL.get() == "w4a8":
            self.w4a8_problem = self._w4a8_problem(weight)
            if self.w4a8_problem is None:  # the file's scales as they are (float32 -> float16)
                packed, sm = w4a8.pack(weight.q, weight.scale, weight.zero, self.group_size)
                self.register_buffer("packed", packed.to(device))
                self.register_buffer("scales_zeros", sm.to(device))
                self.kernel = "w4a8"
                return
        if self.native:
            n, k = weight.shape
            rows = -(-n // INT4_CPU_ROW_MULTIPLE) * INT4_CPU_ROW_MULTIPLE
            q, scale, zero = weight.q, weight.scale, weight.zero
            if rows != n:  # pad with zero rows; their outputs are sliced off
                q = torch.cat([q, q.new_full((rows - n, k), 8)])
                scale = torch.cat([scale, scale.new_zeros(rows - n, scale.shape[1])])
                zero = torch.cat([zero, zero.new_zeros(rows - n, zero.shape[1])])
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            # [K / group, N, 2]: (scale, zero) per group and row, in the kernel's dtype (compute_in).
            scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
            self.register_buffer("packed", packed.to(device))
            self.register_buffer("scales_zeros", scales_zeros.to(device))
        else:  # two values per byte, even inputs in the low nibble; unpacked for each call
            q = weight.q
            self.register_buffer("nibbles", (q[:, 0::2] | (q[:, 1::2] << 4)).to(device))
            self.register_buffer("scale", weight.scale.to(device))
            self.register_buffer("zero", weight.zero.to(device))

    def compute_in(self, dtype: torch.dtype) -> None:
        """Run aten's kernel in `dtype` (see CPU_INT_KERNEL_DTYPE), the input and output cast (the
        W4A8 kernel takes float32 and bf16 inputs as they come)."""
        if self.native and self.kernel == "aten":
            self.scales_zeros = self.scales_zeros.to(dtype)

    @staticmethod
    def _w4a8_problem(weight: Int4Weight) -> str | None:
        """Why `weight` cannot run on the W4A8 kernel, or None."""
        k, group = weight.shape[1], weight.group_size
        if k % quantize.BLOCK or group % quantize.BLOCK:
            return f"{k} inputs in groups of {group} are not whole blocks of {quantize.BLOCK}"
        return w4a8.scales_problem(weight.scale, weight.zero)

    def attach_dense(self) -> str | None:
        """Hold the weight dequantized to bf16 as well, for a step's prompt rows (prompt_rows);
        None, or why it cannot."""
        assert self.native and self.dtype == torch.bfloat16, "dense prompt rows: native int4, bf16"
        weight: Tensor | str
        if self.kernel == "w4a8":
            dense = w4a8.dequantize(self.packed, self.scales_zeros, self.out_features, self.group_size)
            weight = dense.to(torch.bfloat16)
        else:
            weight = prompt_rows.dense_int4(
                self.packed, self.scales_zeros, self.group_size, self.out_features, self.in_features
            )
        if isinstance(weight, str):
            return weight
        self.dense = prompt_rows.DenseWeight(weight)
        return None

    def dequantized(self) -> Tensor:
        if self.native:
            raise RuntimeError("packed int4 weights are not dequantized")
        n, k = self.out_features, self.in_features
        q = torch.stack([self.nibbles & 0x0F, self.nibbles >> 4], dim=-1).view(n, k)
        return Int4Weight(q, self.scale, self.zero, self.group_size).dequantize().to(self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if not self.native:
            return F.linear(x, self.dequantized(), self.bias)
        dense = self.dense
        split = prompt_rows.current(x.shape[0]) if dense is not None else None
        if dense is not None and split is not None:
            if split.all_dense:
                out = dense.matmul(x)
            else:
                out = x.new_empty(x.shape[0], self.out_features)
                out[split.dense] = dense.matmul(x[split.dense])
                out[split.rest] = self._kernel(x[split.rest])
            return out if self.bias is None else out + self.bias
        out = self._kernel(x)
        return out if self.bias is None else out + self.bias

    def _kernel(self, x: Tensor) -> Tensor:
        if self.kernel == "w4a8":
            return w4a8.linear(x, self.packed, self.scales_zeros, self.group_size, self.out_features)
        kernel = self.scales_zeros.dtype
        out = cast(Tensor, _INT4_MM_CPU(x.to(kernel), self.packed, self.group_size, self.scales_zeros))
        out = out.to(x.dtype)
        if out.shape[-1] != self.out_features:
            out = out[..., : self.out_features]
        return out


class Int8Linear(QuantLinear):
    precision = "int8_wo"
    q: Tensor
    scale: Tensor

    def __init__(
        self, weight: Int8Weight, bias: nn.Parameter | None, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(weight.shape, bias, dtype)
        self.native = precision_mode(self.precision, device) == "native"
        self.register_buffer("q", weight.q.to(device))
        # The CPU kernel takes the scales in its compute dtype (compute_in).
        self.register_buffer("scale", weight.scale.to(device, dtype if self.native else torch.float32))

    def compute_in(self, dtype: torch.dtype) -> None:
        """Run the native kernel in `dtype` (see CPU_INT_KERNEL_DTYPE), the input and output cast."""
        if self.native:
            self.scale = self.scale.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.native:
            out = cast(Tensor, _INT8_MM(x.to(self.scale.dtype), self.q, self.scale)).to(x.dtype)
            return out if self.bias is None else out + self.bias
        weight = (self.q.float() * self.scale[:, None]).to(self.dtype)
        return F.linear(x, weight, self.bias)


class FP8Linear(QuantLinear):
    precision = "fp8"
    q: Tensor
    scale: Tensor
    input_scale: Tensor

    def __init__(
        self, weight: FP8Weight, bias: nn.Parameter | None, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(weight.shape, bias, dtype)
        self.native = precision_mode(self.precision, device) == "native"
        if self.native and dtype != torch.bfloat16:
            raise QuantizationError(f"native fp8 matmuls here produce bf16 activations, not {dtype}")
        self.register_buffer("q", weight.q.to(device))
        self.register_buffer("scale", weight.scale.to(device))
        # Native steps of at most triton_fp8.ROWS_MAX rows through the Triton rows kernel (weight-only:
        # no activation quantization), once its start-up check has passed (use_fp8_rows_kernel).
        self.rows_kernel = False
        self.static_input = weight.input_scale is not None
        # One weight scale and a static input scale (ModelOpt FP8): tensor-wise scaling, which every
        # fp8 GPU's cuBLAS supports; otherwise row-wise (per-row weight scales, per-token inputs).
        self.tensorwise = self.static_input and bool((weight.scale == weight.scale[0]).all())
        if weight.input_scale is not None:
            self.register_buffer("input_scale", weight.input_scale.reshape(1, 1).float().to(device))

    def emulated(self, x: Tensor) -> Tensor:
        """The weight-only path: the weight dequantized into the activation dtype (what runs where
        fp8 is not native, and what the native path is checked against at start)."""
        weight = (self.q.float() * self.scale[:, None]).to(self.dtype)
        return F.linear(x, weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        if not self.native:
            return self.emulated(x)
        if self.rows_kernel and x.shape[0] <= triton_fp8.ROWS_MAX:
            return triton_fp8.fp8_rows_linear(x, self.q, self.scale, self.bias)
        if self.static_input:
            x_scale = self.input_scale.expand(x.shape[0], 1)
        else:  # one scale per token
            x_scale = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
        x_q = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if self.tensorwise:
            scale_a, scale_b = self.input_scale.reshape(()), self.scale[0]
        else:
            scale_a, scale_b = x_scale.contiguous(), self.scale.view(1, -1)
        out: Tensor = torch._scaled_mm(
            x_q,
            self.q.t(),  # column-major [K, N], as _scaled_mm requires of its second operand
            scale_a=scale_a,
            scale_b=scale_b,
            bias=None if self.bias is None else self.bias.to(self.dtype),
            out_dtype=self.dtype,
        )
        return out


class NVFP4Linear(QuantLinear):
    precision = "nvfp4"
    packed: Tensor
    block_scale: Tensor
    global_scale: Tensor
    e2m1: Tensor

    def __init__(
        self, weight: NVFP4Weight, bias: nn.Parameter | None, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(weight.shape, bias, dtype)
        self.native = precision_mode(self.precision, device) == "native"
        if self.native:  # precision_mode never says so in this release; kept honest here too
            raise QuantizationError("native nvfp4 matmuls are not built; nvfp4 runs emulated")
        self.register_buffer("packed", weight.packed.to(device))
        self.register_buffer("block_scale", weight.block_scale.to(device))
        self.register_buffer("global_scale", weight.global_scale.to(device))
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
        self.register_buffer("e2m1", table, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        packed = NVFP4Weight(self.packed, self.block_scale, self.global_scale)
        weight = packed.dequantize(self.e2m1).to(self.dtype)
        return F.linear(x, weight, self.bias)


# Each quantized format's layer (its precision's spec names both classes).
_LINEARS: dict[type, type[QuantLinear]] = {
    FORMATS[spec.name]: globals()[spec.layer] for spec in SPECS if spec.layer is not None
}


class Int8Embedding(nn.Module):
    """An embedding table held as int8 with one float32 scale per row (Int8Weight's format): a
    lookup dequantizes only the rows it reads, into the activation dtype. With tied embeddings it
    shares its int8 rows with an Int8Linear logits layer (`q`), so the float table is not kept."""

    q: Tensor
    scale: Tensor

    def __init__(
        self, weight: Int8Weight, dtype: torch.dtype, device: torch.device, q: Tensor | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.register_buffer("q", weight.q.to(device) if q is None else q)
        self.register_buffer("scale", weight.scale.to(device))

    def forward(self, input_ids: Tensor) -> Tensor:
        rows = self.q.index_select(0, input_ids).float() * self.scale.index_select(0, input_ids)[:, None]
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


def make_linear(
    weight: QuantizedWeight, bias: nn.Parameter | None, dtype: torch.dtype, device: torch.device
) -> QuantLinear:
    layer_type: Any = _LINEARS[type(weight)]  # each takes its own format
    layer: QuantLinear = layer_type(weight, bias, dtype, device)
    return layer
