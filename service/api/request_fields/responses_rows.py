"""The rows of OpenAI's Responses request body (POST /v1/responses, openai 3.57's
ResponseCreateParams, with vLLM's sampling extras), and the types of its input items and of their
content parts (service.api.request_fields' rule)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.api.request_fields.rule import (
    CACHE,
    GENERATION,
    GUIDED,
    NO_EFFECT,
    RESPONSES,
    TEMPLATE,
    TOOLS,
    ItemType,
    RequestField,
    honoured,
    only,
    partly,
    refused,
)

RESPONSES_SERVING = "service.api.responses.serving"
ITEMS = "service.api.responses.items"
STORE = "service.api.responses.store"
_R = RESPONSES
_BUILT_IN = (
    "only function tools: built-in tools (web_search, file_search, code_interpreter, computer use, mcp, "
    "image_generation, shell, apply_patch, custom) do not run on this server"
)


def _nothing_included(value: Any, body: Mapping[str, Any]) -> bool:
    return value == []


RESPONSES_FIELDS: tuple[RequestField, ...] = (
    honoured(
        "model", _R, "OpenAI", RESPONSES_SERVING, "embedded", "the served model's name or a LoRA adapter's"
    ),
    honoured("input", _R, "OpenAI", ITEMS, "Hi", "a string (one user message), or items by type (below)"),
    honoured(
        "instructions",
        _R,
        "OpenAI",
        TEMPLATE,
        "Be brief.",
        "the first system message (a system or developer message leading input joins it)",
    ),
    honoured("max_output_tokens", _R, "OpenAI", GENERATION, 2, "reasoning tokens count in it"),
    honoured("temperature", _R, "OpenAI", GENERATION, 0.0, "0 is greedy"),
    honoured("top_p", _R, "OpenAI", GENERATION, 0.9),
    partly(
        "top_logprobs",
        _R,
        "OpenAI",
        GENERATION,
        only(0),
        "`0`",
        "log probabilities are not returned by this endpoint (chat completions return them)",
        0,
        2,
    ),
    partly(
        "include",
        _R,
        "OpenAI",
        RESPONSES_SERVING,
        _nothing_included,
        "`[]`",
        "nothing extra is returned: no logprobs, no encrypted reasoning, no built-in tool results",
        [],
        ["message.output_text.logprobs"],
    ),
    honoured(
        "metadata",
        _R,
        "OpenAI",
        RESPONSES_SERVING,
        {"team": "a"},
        "echoed, and kept with a stored response; at most 16 pairs",
    ),
    honoured("parallel_tool_calls", _R, "OpenAI", TOOLS, True),
    honoured("tools", _R, "OpenAI", TOOLS, [{"type": "function", "name": "get_time"}]),
    partly(
        "tools.N.type",
        _R,
        "OpenAI",
        TOOLS,
        only("function"),
        '`"function"`',
        _BUILT_IN,
        "function",
        "web_search",
    ),
    honoured("tools.N.name", _R, "OpenAI", TOOLS, "get_time"),
    honoured("tools.N.description", _R, "OpenAI", TOOLS, "The time now", "rendered by the chat template"),
    honoured(
        "tools.N.parameters",
        _R,
        "OpenAI",
        TOOLS,
        {"type": "object"},
        "a JSON schema of type object; null is no parameters",
    ),
    honoured(
        "tools.N.strict",
        _R,
        "OpenAI",
        TOOLS,
        True,
        "a grammar makes the arguments where tool_choice forces the call; under auto a call whose "
        "arguments do not meet the schema is not returned as a call",
    ),
    honoured("tool_choice", _R, "OpenAI", TOOLS, "auto", "none, auto, required, or a named function"),
    partly(
        "tool_choice.type",
        _R,
        "OpenAI",
        TOOLS,
        only("function"),
        '`"function"`',
        "only a function can be chosen (no allowed_tools, built-in or custom tools)",
        "function",
        "web_search_preview",
    ),
    honoured("tool_choice.name", _R, "OpenAI", TOOLS, "get_time"),
    honoured("text", _R, "OpenAI", GUIDED, {"format": {"type": "text"}}),
    honoured(
        "text.format",
        _R,
        "OpenAI",
        GUIDED,
        {"type": "json_object"},
        "the answer's message; where tool_choice forces a call, the call is the whole answer",
    ),
    partly(
        "text.format.type",
        _R,
        "OpenAI",
        GUIDED,
        only("text", "json_object", "json_schema"),
        '`"text"`, `"json_object"`, `"json_schema"`',
        "the answer is text, a JSON object or JSON of a schema",
        "json_schema",
        "grammar",
    ),
    honoured("text.format.name", _R, "OpenAI", NO_EFFECT, "answer", "names the schema"),
    honoured("text.format.schema", _R, "OpenAI", GUIDED, {"type": "object"}),
    honoured(
        "text.format.strict", _R, "OpenAI", GUIDED, True, "the schema is enforced whether or not strict"
    ),
    refused(
        "text.format.description",
        _R,
        "OpenAI",
        "the model is not shown a format's description: say what is wanted in the instructions",
        "A person",
    ),
    refused("text.verbosity", _R, "OpenAI", "the model has no verbosity control", "low"),
    honoured("reasoning", _R, "OpenAI", TEMPLATE, {"effort": None}),
    honoured(
        "reasoning.effort",
        _R,
        "OpenAI",
        TEMPLATE,
        "low",
        "passed to a chat template that reads it (reasoning_effort); refused where the template does not",
    ),
    refused(
        "reasoning.summary",
        _R,
        "OpenAI",
        "no summary is written: a reasoning model's thinking is the reasoning item's content",
        "auto",
    ),
    refused(
        "reasoning.generate_summary",
        _R,
        "OpenAI",
        "no summary is written: a reasoning model's thinking is the reasoning item's content",
        "auto",
    ),
    honoured(
        "store",
        _R,
        "OpenAI",
        STORE,
        False,
        "true keeps the response in the bounded store when NIM_RESPONSES_STORE_MAX_COUNT is set, "
        "and is a 400 otherwise",
    ),
    honoured(
        "previous_response_id",
        _R,
        "OpenAI",
        STORE,
        "resp_1",
        "continues a stored response (its input and output come first); a 400 with the store off, a "
        "404 for an id not (or no longer) stored",
    ),
    honoured("stream", _R, "OpenAI", RESPONSES_SERVING, True),
    honoured("stream_options", _R, "OpenAI", RESPONSES_SERVING, {}),
    partly(
        "stream_options.include_obfuscation",
        _R,
        "OpenAI",
        RESPONSES_SERVING,
        only(False),
        "`false`",
        "stream events carry no obfuscation padding here",
        False,
        True,
    ),
    partly(
        "truncation",
        _R,
        "OpenAI",
        RESPONSES_SERVING,
        only("disabled"),
        '`"disabled"`',
        "the input is never truncated: one too long for the context is a 400",
        "disabled",
        "auto",
    ),
    partly(
        "background",
        _R,
        "OpenAI",
        RESPONSES_SERVING,
        only(False),
        "`false`",
        "responses run while the request waits; there is no background queue",
        False,
        True,
    ),
    partly(
        "service_tier",
        _R,
        "OpenAI",
        NO_EFFECT,
        only("auto", "default"),
        '`"auto"`, `"default"`',
        "there is one service tier: flex, scale, priority and fast processing are not offered",
        "default",
        "flex",
    ),
    honoured(
        "user",
        _R,
        "OpenAI",
        NO_EFFECT,
        "user-1",
        "echoed; an end-user id for abuse monitoring, of which this server keeps no record",
    ),
    honoured(
        "safety_identifier",
        _R,
        "OpenAI",
        NO_EFFECT,
        "user-1-hash",
        "echoed; an end-user id for abuse monitoring, of which this server keeps no record",
    ),
    honoured(
        "prompt_cache_key",
        _R,
        "OpenAI",
        CACHE,
        "conversation-1",
        "echoed; the prefix cache finds shared prefixes by their tokens without one",
    ),
    partly(
        "prompt_cache_retention",
        _R,
        "OpenAI",
        CACHE,
        only("in_memory"),
        '`"in_memory"`',
        "cached prefixes live in memory, evicted least recently used: no 24h retention",
        "in_memory",
        "24h",
    ),
    refused("max_tool_calls", _R, "OpenAI", "it bounds built-in tool calls, which do not run here", 3),
    refused(
        "prompt",
        _R,
        "OpenAI",
        "stored prompt templates are not supported: send input and instructions",
        {"id": "pmpt_1"},
    ),
    refused(
        "conversation",
        _R,
        "OpenAI",
        "conversations are not kept here: send the history as input (or previous_response_id with the "
        "store on)",
        "conv_1",
    ),
    refused(
        "context_management", _R, "OpenAI", "the context is never compacted here", [{"type": "compaction"}]
    ),
    refused("verbosity", _R, "OpenAI", "the model has no verbosity control", "low"),
    # --- vLLM's sampling extras, as on chat ---------------------------------------------------------
    honoured("top_k", _R, "vLLM", GENERATION, 1),
    honoured("min_p", _R, "vLLM", GENERATION, 0.05),
    honoured("repetition_penalty", _R, "vLLM", GENERATION, 1.1),
    honoured("seed", _R, "vLLM", GENERATION, 7),
)

_NO_IMAGES = "this model takes text only"
# The types of `input` items (an item with a role and no type is a message).
INPUT_ITEMS: tuple[ItemType, ...] = (
    ItemType(
        "message",
        ITEMS,
        "a turn: user, system, developer (as system) or assistant",
        ("role", "content", "id", "status"),
    ),
    ItemType(
        "function_call",
        ITEMS,
        "an earlier call: the assistant's tool_calls (consecutive ones are one turn)",
        ("call_id", "name", "arguments", "id", "status"),
    ),
    ItemType(
        "function_call_output",
        ITEMS,
        "a tool message answering the call it names",
        ("call_id", "output", "id", "status"),
    ),
    ItemType(
        "reasoning",
        ITEMS,
        "earlier thinking, passed to the next assistant turn as reasoning_content",
        ("id", "summary", "content", "status", "encrypted_content"),
    ),
    ItemType("item_reference", None, "items are not stored one by one: send the item itself"),
    ItemType("computer_call", None, _BUILT_IN),
    ItemType("computer_call_output", None, _BUILT_IN),
    ItemType("web_search_call", None, _BUILT_IN),
    ItemType("file_search_call", None, _BUILT_IN),
    ItemType("code_interpreter_call", None, _BUILT_IN),
    ItemType("image_generation_call", None, _BUILT_IN),
    ItemType("local_shell_call", None, _BUILT_IN),
    ItemType("local_shell_call_output", None, _BUILT_IN),
    ItemType("mcp_call", None, _BUILT_IN),
    ItemType("mcp_list_tools", None, _BUILT_IN),
    ItemType("mcp_approval_request", None, _BUILT_IN),
    ItemType("mcp_approval_response", None, _BUILT_IN),
    ItemType("custom_tool_call", None, _BUILT_IN),
    ItemType("custom_tool_call_output", None, _BUILT_IN),
)
# The types of a message item's content parts.
INPUT_PARTS: tuple[ItemType, ...] = (
    ItemType("input_text", ITEMS, "text", ("text",)),
    ItemType(
        "output_text",
        ITEMS,
        "an earlier answer's text (its annotations and logprobs are not read)",
        ("text", "annotations", "logprobs"),
    ),
    ItemType("refusal", ITEMS, "an earlier refusal, read as its text", ("refusal",)),
    ItemType("input_image", None, f"images are not supported: {_NO_IMAGES}"),
    ItemType("input_file", None, f"files are not supported: {_NO_IMAGES}"),
    ItemType("input_audio", None, f"audio is not supported: {_NO_IMAGES}"),
)
