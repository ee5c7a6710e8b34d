"""Settings of the CPU's compute paths (NIM_COMPACT_LOGITS, NIM_CPU_INT4_KERNEL,
NIM_CPU_FUSED_OPS, NIM_DENSE_PROMPT_ROWS): a base of `service.config.Settings`; what they choose
is service.engine.torch.rank_loading's, int4_kernel's, cpu_fused_ops' and dense_prompts' to decide,
and /v1/metadata shows."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings


class CpuFields(BaseSettings):
    compact_logits: Literal["auto", "weight-only", "off"] = Field(
        "auto",
        validation_alias=AliasChoices("NIM_COMPACT_LOGITS"),
        description="int8_wo and int4_wo profiles on the CPU: auto holds the logits projection as int8 "
        "blocks of 32 with float16 scales, each input row rounded to int8 per block of 32, the products "
        "summed in integers (the native Q8 kernel, llama.cpp's Q8_0; where it builds and its check "
        "passes), the embedding as int8 rows under bf16 activations; where it cannot, with bf16 "
        "activations the projection and the embedding as int8 with one scale per row and each input "
        "row quantized to int8 too (oneDNN; where a start-up probe finds that exact and "
        "batch-invariant: VNNI or AMX), else as weight-only does; weight-only: with bf16 activations "
        "the same int8 tables, the input in bf16, with fp32 activations the projection as float16 "
        "computed in float32 (fbgemm); off: in the activation dtype.",
    )
    cpu_int4_kernel: Literal["auto", "weight-only"] = Field(
        "auto",
        validation_alias=AliasChoices("NIM_CPU_INT4_KERNEL"),
        description="int4_wo on the CPU: auto rounds each block of 32 activations to int8 and sums the "
        "products with the int4 weights in integer dot-product instructions (AVX-512 VNNI or AVX2; a "
        "kernel built on first use with g++, checked at start-up), as llama.cpp's Q4_1 x Q8_1; "
        "weight-only: aten's int4 kernel, activations unrounded (bf16).",
    )
    cpu_fused_ops: Literal["auto", "off"] = Field(
        "auto",
        validation_alias=AliasChoices("NIM_CPU_FUSED_OPS"),
        description="Models on the CPU: auto runs each RMSNorm (with the residual add before it) and "
        "each MoE layer's routing as one native op (built on first use with g++, checked against "
        "aten's ops at start-up; Llama-family models, Qwen3-MoE and Mixtral); off: aten's op sequences.",
    )
    dense_prompt_rows: Literal["auto", "off"] = Field(
        "auto",
        validation_alias=AliasChoices("NIM_DENSE_PROMPT_ROWS"),
        description="int4_wo on a CPU with bf16 activations: auto also holds each decoder layer's int4 "
        "weights as bf16 (2 bytes a weight, where that fits a quarter of the memory available) and runs "
        "the tokens of each request's prompt through them in 64-row oneDNN calls (prefill at bf16 "
        "speed), decode rows on the int4 kernel; off: every row on the int4 kernel.",
    )
