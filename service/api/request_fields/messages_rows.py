"""The rows of Anthropic's Messages request body (POST /v1/messages, anthropic 2.14's
MessageCreateParams, with the sampling fields its SDK sends through extra_body) and of its
count_tokens body, and the types of its content blocks (service.api.request_fields' rule)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.api.request_fields.rule import (
    ANTHROPIC,
    CACHE,
    GENERATION,
    GUIDED,
    MESSAGES,
    NO_EFFECT,
    TEMPLATE,
    TOOLS,
    ItemType,
    RequestField,
    honoured,
    only,
    partly,
    refused,
)

MESSAGES_SERVING = "service.api.messages.serving"
CONVERT = "service.api.messages.convert"
_M, _A = MESSAGES, ANTHROPIC
_SERVER_TOOL = (
    "only custom tools: Anthropic's server tools (bash, code execution, web search, text editor, ...) "
    "do not run on this server"
)


def _cache_control(value: Any, body: Mapping[str, Any]) -> bool:
    return isinstance(value, Mapping) and value.get("type") == "ephemeral"


def _custom_tool(value: Any, body: Mapping[str, Any]) -> bool:
    return value == "custom"


MESSAGES_FIELDS: tuple[RequestField, ...] = (
    honoured(
        "model", _A, "Anthropic", MESSAGES_SERVING, "embedded", "the served model's name or a LoRA adapter's"
    ),
    honoured(
        "messages",
        _A,
        "Anthropic",
        CONVERT,
        [{"role": "user", "content": "Hi"}],
        "content blocks by type (below); consecutive turns of one role are one turn; a final assistant "
        "turn is refused (no prefill)",
    ),
    honoured(
        "system", _A, "Anthropic", TEMPLATE, "Be brief.", "the first system message (text blocks joined)"
    ),
    honoured("max_tokens", _M, "Anthropic", GENERATION, 2, "required"),
    honoured("temperature", _M, "Anthropic", GENERATION, 0.0, "0 is greedy"),
    honoured("top_p", _M, "Anthropic", GENERATION, 0.9),
    honoured("top_k", _M, "Anthropic", GENERATION, 1),
    honoured(
        "stop_sequences",
        _M,
        "Anthropic",
        MESSAGES_SERVING,
        ["###"],
        "up to 4; stop_reason stop_sequence names the one that ended the answer",
    ),
    honoured("stream", _M, "Anthropic", MESSAGES_SERVING, True),
    honoured("metadata", _M, "Anthropic", NO_EFFECT, {"user_id": "user-1"}, "user_id: an end-user id"),
    honoured(
        "metadata.user_id",
        _M,
        "Anthropic",
        NO_EFFECT,
        "user-1",
        "an end-user id for abuse monitoring, of which this server keeps no record",
    ),
    honoured("tools", _A, "Anthropic", TOOLS, [{"name": "get_time", "input_schema": {"type": "object"}}]),
    partly(
        "tools.N.type",
        _A,
        "Anthropic",
        TOOLS,
        _custom_tool,
        '`"custom"`',
        _SERVER_TOOL,
        "custom",
        "web_search_20250305",
    ),
    honoured("tools.N.name", _A, "Anthropic", TOOLS, "get_time"),
    honoured("tools.N.description", _A, "Anthropic", TOOLS, "The time now", "rendered by the chat template"),
    honoured(
        "tools.N.input_schema", _A, "Anthropic", TOOLS, {"type": "object"}, "a JSON schema of type object"
    ),
    honoured(
        "tools.N.strict",
        _A,
        "Anthropic",
        TOOLS,
        True,
        "a grammar makes the input where tool_choice forces the call; under auto a call whose input "
        "does not meet the schema is not returned as a call",
    ),
    partly(
        "tools.N.cache_control",
        _A,
        "Anthropic",
        CACHE,
        _cache_control,
        '`{"type": "ephemeral"}`',
        "the prefix cache is automatic: shared prefixes are reused without breakpoints",
        {"type": "ephemeral"},
        {"type": "persistent"},
    ),
    honoured("tool_choice", _A, "Anthropic", TOOLS, {"type": "auto"}),
    partly(
        "tool_choice.type",
        _A,
        "Anthropic",
        TOOLS,
        only("auto", "any", "tool", "none"),
        '`"auto"`, `"any"`, `"tool"`, `"none"`',
        "there is no other kind of tool choice",
        "any",
        "server",
    ),
    honoured("tool_choice.name", _A, "Anthropic", TOOLS, "get_time"),
    honoured(
        "tool_choice.disable_parallel_tool_use",
        _A,
        "Anthropic",
        TOOLS,
        True,
        "true: at most one tool_use block",
    ),
    honoured(
        "thinking",
        _A,
        "Anthropic",
        TEMPLATE,
        {"type": "disabled"},
        "with a reasoning parser: enabled or adaptive thinks, disabled closes the thinking; without "
        "one, only disabled",
    ),
    honoured("thinking.type", _A, "Anthropic", TEMPLATE, "disabled"),
    refused(
        "thinking.budget_tokens",
        _A,
        "Anthropic",
        "the thinking cannot be cut at a budget here: bound the whole answer with max_tokens",
        1024,
    ),
    refused(
        "thinking.display", _A, "Anthropic", "the thinking is shown as the model writes it", "summarized"
    ),
    honoured("output_config", _A, "Anthropic", GUIDED, {"format": {"type": "json_schema", "schema": {}}}),
    honoured("output_config.format", _A, "Anthropic", GUIDED, {"type": "json_schema", "schema": {}}),
    partly(
        "output_config.format.type",
        _A,
        "Anthropic",
        GUIDED,
        only("json_schema"),
        '`"json_schema"`',
        "the answer is text or JSON of a schema",
        "json_schema",
        "grammar",
    ),
    honoured("output_config.format.schema", _A, "Anthropic", GUIDED, {"type": "object"}),
    refused("output_config.effort", _A, "Anthropic", "the model has no effort control", "low"),
    partly(
        "service_tier",
        _M,
        "Anthropic",
        NO_EFFECT,
        only("auto", "standard_only"),
        '`"auto"`, `"standard_only"`',
        "there is one service tier",
        "auto",
        "priority",
    ),
    partly(
        "cache_control",
        _A,
        "Anthropic",
        CACHE,
        _cache_control,
        '`{"type": "ephemeral"}`',
        "the prefix cache is automatic: shared prefixes are reused without breakpoints",
        {"type": "ephemeral"},
        {"type": "persistent"},
    ),
    refused("container", _A, "Anthropic", "there are no code execution containers here", "container_1"),
    refused("mcp_servers", _M, "Anthropic", "MCP servers are not called by this server", []),
    refused("inference_geo", _A, "Anthropic", "the model runs where this server runs", "us"),
    refused("speed", _A, "Anthropic", "there is one speed", "fast"),
    refused("context_management", _A, "Anthropic", "the context is never edited here", {"edits": []}),
)

_TEXT_ONLY = "this model takes text only"
# The types of a message's content blocks (a string content is one text block).
CONTENT_BLOCKS: tuple[ItemType, ...] = (
    ItemType("text", CONVERT, "text (its citations are not read)", ("text", "cache_control", "citations")),
    ItemType(
        "tool_use",
        CONVERT,
        "in an assistant turn: a call, as the assistant's tool_calls",
        ("id", "name", "input", "cache_control"),
    ),
    ItemType(
        "tool_result",
        CONVERT,
        "in a user turn: a tool message answering tool_use_id; is_error prefixes its text with 'Error: '",
        ("tool_use_id", "content", "is_error", "cache_control"),
    ),
    ItemType(
        "thinking",
        CONVERT,
        "in an assistant turn: earlier thinking, as reasoning_content (the signature is not checked)",
        ("thinking", "signature"),
    ),
    ItemType("redacted_thinking", None, "redacted thinking cannot be read back here"),
    ItemType("image", None, f"images are not supported: {_TEXT_ONLY}"),
    ItemType("document", None, f"documents are not supported: {_TEXT_ONLY}"),
    ItemType("search_result", None, "search results are not supported: send the text"),
    ItemType("container_upload", None, "there are no code execution containers here"),
    ItemType("server_tool_use", None, _SERVER_TOOL),
    ItemType("web_search_tool_result", None, _SERVER_TOOL),
)
