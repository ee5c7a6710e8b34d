"""The request and response bodies every endpoint shares, validated strictly (each endpoint's own
are in its package: service.api.chat.protocol, ...).

Request models declare the fields this service reads, with their types and ranges; every other
field a client sends is kept (extra="allow") for service.api.request_fields, the one table that
says of each field whether it is honoured, honoured for some values, or refused with a 400 naming
it (an unknown one is refused as OpenAI refuses it). Nothing sent is dropped unseen.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.api.request_fields import Endpoint, check_content_part, sent_fields

MAX_STOP_SEQUENCES = 4
MAX_N = 16
MAX_TOKEN_ID_DIGITS = 18  # far beyond any vocabulary, and within what int() reads


class Request(BaseModel):
    model_config = ConfigDict(extra="allow")


def _null_is_not_sent(model: type[BaseModel], data: Any) -> Any:
    """A declared field sent as null is taken as not sent (its default applies), as OpenAI takes
    it: `"stream": null` is no stream, not a type error."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. include_obfuscation: see request_fields

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _null_is_not_sent(cls, data)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk, not only the last


class ContentPart(BaseModel):
    """A part of a message's content, of any type: which types are honoured is
    request_fields.CONTENT_PARTS' to say (the route refuses the others naming the part), so an
    image part is "images are not supported", not a type error."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's earlier refusal (type "refusal")

    @model_validator(mode="after")
    def _has_its_text(self) -> ContentPart:
        if self.type in ("text", "refusal") and getattr(self, self.type) is None:
            raise ValueError(f"a {self.type} part needs its {self.type} string")
        return self

    def as_text(self, param: str) -> str:
        check_content_part(self.type, sent_fields(self), param)
        return (self.text if self.type == "text" else self.refusal) or ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, param: str = "messages") -> str:
        """The content's text; 400 (naming `param`.content.M) for a part that is not text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.as_text(f"{param}.content.{j}") for j, part in enumerate(self.content))


class NVExt(BaseModel):
    """NIM's request extension object; the sampling knobs it carries mirror the top-level extras."""

    model_config = ConfigDict(extra="allow")

    top_k: Annotated[int, Field(ge=-1)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): one constraint of the five
    (service.api.guided); its other options are rows of request_fields."""

    model_config = ConfigDict(extra="allow")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(Request):
    """Fields shared by chat and completions requests (OpenAI's, then vLLM's extras)."""

    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    structured_outputs: StructuredOutputs | None = None
    nvext: NVExt | None = None

    endpoint: ClassVar[Endpoint]

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _null_is_not_sent(cls, data)

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids written in ASCII digits (str.isdigit also takes "²" and "٣", which
        int() refuses or reads as another id); 18 digits at most, so int() always reads them."""
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                shown = key if len(key) <= 24 else key[:24] + "..."
                raise ValueError(f"logit_bias keys must be token ids (digits 0-9), got {shown!r}")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# --- Responses ---------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # of completion_tokens, those the reasoning parser put in reasoning_content


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "system"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
