"""Settings of speculative decoding (NIM_SPECULATIVE_CONFIG, NIM_DRAFT_MODEL_PATH): a base of
`service.config.Settings`; what they mean is service.engine.speculative_config."""

from __future__ import annotations

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings

from service.engine.speculative_config import (
    SpeculativeConfig,
    SpeculativeConfigError,
    parse_speculative_config,
)


class SpeculativeFields(BaseSettings):
    """vLLM's --speculative-config as NIM reads it, checked when Settings is built."""

    speculative_config: str | None = Field(
        None,
        validation_alias=AliasChoices("NIM_SPECULATIVE_CONFIG"),
        description="Speculative decoding, as the JSON of vLLM's --speculative-config: "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} (prompt lookup) or '
        '{"model": PATH, "num_speculative_tokens": N} (a draft model sharing the tokenizer); unset: off. '
        "Greedy output is unchanged, sampled output keeps its distribution; speculation backs off for "
        "requests whose proposals are rejected. The torch engine only.",
    )
    draft_model_path: str | None = Field(
        None,
        validation_alias=AliasChoices("NIM_DRAFT_MODEL_PATH"),
        description="A draft model's directory for speculative decoding (4 tokens a step unless "
        "NIM_SPECULATIVE_CONFIG says otherwise); it must share the served model's tokenizer.",
    )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """NIM_SPECULATIVE_CONFIG and NIM_DRAFT_MODEL_PATH, parsed (checked when Settings is built)."""
        return parse_speculative_config(self.speculative_config, self.draft_model_path)

    @model_validator(mode="after")
    def _speculative_settings(self) -> SpeculativeFields:
        try:
            parse_speculative_config(self.speculative_config, self.draft_model_path)
        except SpeculativeConfigError as exc:
            raise ValueError(str(exc)) from None
        return self
