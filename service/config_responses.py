"""Settings of the Responses API's store (POST /v1/responses with `store: true`): a base of
`service.config.Settings`, declared here to keep config.py one screenful of topics per module."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings


class ResponsesStoreFields(BaseSettings):
    """NIM_RESPONSES_STORE_*: how many responses, and how many bytes of them, stay in memory."""

    responses_store_max_count: int = Field(
        0,
        ge=0,
        validation_alias=AliasChoices("NIM_RESPONSES_STORE_MAX_COUNT"),
        description="POST /v1/responses with store: true keeps up to this many responses in memory (oldest "
        "dropped first) for GET/DELETE /v1/responses/{id} and previous_response_id; 0 = no store.",
    )
    responses_store_max_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1,
        validation_alias=AliasChoices("NIM_RESPONSES_STORE_MAX_BYTES"),
        description="Memory bound of the Responses store (the JSON size of the responses and their "
        "conversations); past it the oldest are dropped first.",
    )
