"""Settings of the CPU's compute paths (NIM_COMPACT_LOGITS, NIM_DENSE_PROMPT_ROWS): a base of
`service.config.Settings`; what they choose is service.engine.torch.rank_loading's and
service.engine.torch.dense_prompts' to decide, and /v1/metadata shows."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings


class CpuFields(BaseSettings):
    compact_logits: Literal["auto", "off"] = Field(
        "auto",
        validation_alias=AliasChoices("NIM_COMPACT_LOGITS"),
        description="int8_wo and int4_wo profiles on the CPU: auto holds the logits projection in half "
        "the bytes: with bf16 activations as int8 with one scale per row (the embedding too), with fp32 "
        "activations as float16 computed in float32 (fbgemm); off: in the activation dtype.",
    )
    dense_prompt_rows: Literal["auto", "off"] = Field(
        "auto",
        validation_alias=AliasChoices("NIM_DENSE_PROMPT_ROWS"),
        description="int4_wo on a CPU with bf16 activations: auto also holds each decoder layer's int4 "
        "weights as bf16 (2 bytes a weight, where that fits a quarter of the memory available) and runs "
        "the tokens of each request's prompt through them in 64-row oneDNN calls (prefill at bf16 "
        "speed), decode rows on the int4 kernel; off: every row on the int4 kernel.",
    )
