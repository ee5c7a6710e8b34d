"""The rows of OpenAI's chat and completions request bodies, of vLLM's extensions to them and of
NIM's `nvext` object; chat messages' content parts and fields (service.api.request_fields' rule)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.api.request_fields.rule import (
    BOTH,
    CHAT,
    CHAT_SERVING,
    COMPLETIONS,
    COMPLETIONS_SERVING,
    GENERATION,
    GUIDED,
    LOGPROBS,
    NO_EFFECT,
    SERVING,
    TEMPLATE,
    TOOLS,
    ContentPart,
    MessageField,
    RequestField,
    honoured,
    only,
    partly,
    refused,
    same,
)


def _best_of_is_n(value: Any, body: Mapping[str, Any]) -> bool:
    return same(value, body.get("n") if body.get("n") is not None else 1)


def _special_tokens_skipped(value: Any, body: Mapping[str, Any]) -> bool:
    return body.get("skip_special_tokens") is not False


def _implicit_cache(value: Any, body: Mapping[str, Any]) -> bool:
    return isinstance(value, dict) and value.get("mode", "implicit") == "implicit" and set(value) <= {"mode"}


def _strict_is_enforced(value: Any, body: Mapping[str, Any]) -> bool:
    """A function's `strict: true` is kept where a grammar makes the call (tool_choice required or
    named) or no call is made (none); under auto the model's own calls are only parsed."""
    return value is not True or body.get("tool_choice") not in (None, "auto")


_NO_MULTIMODAL = "this model takes text only (no image, audio or video input)"
_BACKEND = "the server chooses the grammar backend (xgrammar); leave it out"
_NOT_STORED = "nothing is stored here (store: true is refused)"

CHAT_FIELDS: tuple[RequestField, ...] = (
    # --- OpenAI: both endpoints -----------------------------------------------------------------
    honoured("model", BOTH, "OpenAI", SERVING, "embedded", "the served model's name or a LoRA adapter's"),
    honoured("frequency_penalty", BOTH, "OpenAI", GENERATION, 0.5),
    honoured("presence_penalty", BOTH, "OpenAI", GENERATION, 0.5),
    honoured("logit_bias", BOTH, "OpenAI", GENERATION, {"42": -100}),
    honoured("logprobs", BOTH, "OpenAI", LOGPROBS, True,
             "chat: true/false; completions: how many alternatives"),
    honoured("max_tokens", BOTH, "OpenAI", GENERATION, 2),
    honoured("n", BOTH, "OpenAI", GENERATION, 2),
    honoured("seed", BOTH, "OpenAI", GENERATION, 7),
    honoured("stop", BOTH, "OpenAI", GENERATION, ["\n\n"], "up to 4 strings"),
    honoured("stream", BOTH, "OpenAI", SERVING, True),
    honoured("stream_options", BOTH, "OpenAI", SERVING, {"include_usage": True}),
    honoured("stream_options.include_usage", BOTH, "OpenAI", SERVING, True),
    honoured("stream_options.continuous_usage_stats", BOTH, "vLLM", SERVING, True),
    partly("stream_options.include_obfuscation", BOTH, "OpenAI", SERVING, only(False), "`false`",
           "stream chunks carry no obfuscation padding here", False, True),
    honoured("temperature", BOTH, "OpenAI", GENERATION, 0.0, "0 is greedy"),
    honoured("top_p", BOTH, "OpenAI", GENERATION, 0.9),
    honoured("user", BOTH, "OpenAI", NO_EFFECT, "user-1",
             "an end-user id for the provider's abuse monitoring; this server keeps no per-user record"),
    # --- OpenAI: chat ---------------------------------------------------------------------------
    honoured("messages", CHAT, "OpenAI", TEMPLATE, [{"role": "user", "content": "Hi"}]),
    honoured("max_completion_tokens", CHAT, "OpenAI", GENERATION, 2),
    honoured("top_logprobs", CHAT, "OpenAI", LOGPROBS, 2),
    honoured("response_format", BOTH, "OpenAI", GUIDED, {"type": "json_object"},
             "text, json_object, json_schema; on completions as vLLM takes it"),
    honoured("response_format.type", BOTH, "OpenAI", GUIDED, "json_schema"),
    honoured("response_format.json_schema", BOTH, "OpenAI", GUIDED, {"name": "answer", "schema": {}}),
    honoured("response_format.json_schema.name", BOTH, "OpenAI", NO_EFFECT, "answer", "names the schema"),
    honoured("response_format.json_schema.schema", BOTH, "OpenAI", GUIDED, {"type": "object"}),
    honoured("response_format.json_schema.strict", BOTH, "OpenAI", GUIDED, True,
             "the schema is enforced whether or not strict"),
    refused("response_format.json_schema.description", BOTH, "OpenAI",
            "the model is not shown a response format's description: say what is wanted in a message",
            "A person"),
    honoured("tools", CHAT, "OpenAI", TOOLS,
             [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]),
    partly("tools.N.type", CHAT, "OpenAI", TOOLS, only("function"), '`"function"`',
           "only function tools are supported (no custom tools)", "function", "custom"),
    honoured("tools.N.function", CHAT, "OpenAI", TOOLS, {"name": "get_time"}),
    honoured("tools.N.function.name", CHAT, "OpenAI", TOOLS, "get_time"),
    honoured("tools.N.function.description", CHAT, "OpenAI", TOOLS, "The time now",
             "rendered by the chat template with the tool"),
    honoured("tools.N.function.parameters", CHAT, "OpenAI", TOOLS, {"type": "object"},
             "a JSON schema of type object, as OpenAI requires"),
    partly("tools.N.function.strict", CHAT, "OpenAI", TOOLS, _strict_is_enforced,
           "`false`; `true` with tool_choice none, required or a named function",
           "the arguments are enforced by a grammar only where tool_choice forces the call (required or "
           "named); under auto the model's calls are parsed, not constrained", False, True),
    honoured("tool_choice", CHAT, "OpenAI", TOOLS, "none"),
    partly("tool_choice.type", CHAT, "OpenAI", TOOLS, only("function"), '`"function"`',
           "only a function can be chosen (no allowed_tools or custom tools)", "function", "allowed_tools"),
    honoured("tool_choice.function", CHAT, "OpenAI", TOOLS, {"name": "get_time"}),
    honoured("tool_choice.function.name", CHAT, "OpenAI", TOOLS, "get_time"),
    honoured("parallel_tool_calls", CHAT, "OpenAI", TOOLS, True),
    honoured("reasoning_effort", CHAT, "OpenAI", TEMPLATE, "low",
             "passed to a chat template that reads it; refused where the template does not"),
    refused("functions", CHAT, "OpenAI", "deprecated by OpenAI: send the functions as `tools`",
            [{"name": "get_time", "parameters": {"type": "object"}}]),
    refused("function_call", CHAT, "OpenAI", "deprecated by OpenAI: send `tool_choice`", "auto"),
    refused("audio", CHAT, "OpenAI", "this model does not produce audio",
            {"voice": "alloy", "format": "wav"}),
    partly("modalities", CHAT, "OpenAI", CHAT_SERVING, only(["text"]), '`["text"]`',
           "this model produces text only", ["text"], ["text", "audio"]),
    refused("prediction", CHAT, "OpenAI", "predicted outputs are not implemented",
            {"type": "content", "content": "Hello"}),
    honoured("metadata", CHAT, "OpenAI", NO_EFFECT, {"team": "a"},
             "tags for a stored completion; " + _NOT_STORED),
    partly("store", CHAT, "OpenAI", NO_EFFECT, only(False), "`false`", _NOT_STORED, False, True),
    partly("service_tier", CHAT, "OpenAI", NO_EFFECT, only("auto", "default"), '`"auto"`, `"default"`',
           "there is one service tier: flex, scale, priority and fast processing are not offered",
           "default", "flex"),
    honoured("prompt_cache_key", CHAT, "OpenAI", "service.engine.torch.block_pool", "conversation-1",
             "a cache-routing hint; the prefix cache finds shared prefixes by their tokens without one"),
    partly("prompt_cache_options", CHAT, "OpenAI", "service.engine.torch.block_pool", _implicit_cache,
           '`{}`, `{"mode": "implicit"}`',
           "the prefix cache is automatic (LRU): no explicit breakpoints, no minimum lifetime",
           {"mode": "implicit"}, {"mode": "explicit", "ttl": "30m"}),
    partly("prompt_cache_retention", CHAT, "OpenAI", "service.engine.torch.block_pool", only("in_memory"),
           '`"in_memory"`', "cached prefixes live in memory, evicted least recently used: no 24h retention",
           "in_memory", "24h"),
    refused("moderation", CHAT, "OpenAI", "no moderation model runs here",
            {"model": "omni-moderation-latest"}),
    honoured("safety_identifier", CHAT, "OpenAI", NO_EFFECT, "user-1-hash",
             "an end-user id for the provider's abuse monitoring; this server keeps no per-user record"),
    refused("verbosity", CHAT, "OpenAI", "the model has no verbosity control", "low"),
    refused("web_search_options", CHAT, "OpenAI", "there is no web search here", {}),
    # --- OpenAI: completions --------------------------------------------------------------------
    honoured("prompt", COMPLETIONS, "OpenAI", COMPLETIONS_SERVING, "Hello"),
    honoured("echo", COMPLETIONS, "OpenAI", COMPLETIONS_SERVING, True),
    partly("best_of", COMPLETIONS, "OpenAI", GENERATION, _best_of_is_n, "equal to `n`",
           "choosing the best of more generations than `n` is not implemented", 1, 3),
    partly("suffix", COMPLETIONS, "OpenAI", COMPLETIONS_SERVING, only(""), '`""`',
           "fill-in-the-middle is not supported by this model", "", "def"),
    # --- vLLM: both endpoints -------------------------------------------------------------------
    partly("use_beam_search", BOTH, "vLLM", GENERATION, only(False), "`false`",
           "beam search is not implemented", False, True),
    honoured("top_k", BOTH, "vLLM", GENERATION, 1),
    honoured("min_p", BOTH, "vLLM", GENERATION, 0.05),
    honoured("repetition_penalty", BOTH, "vLLM", GENERATION, 1.1),
    partly("watermarking", BOTH, "vLLM", GENERATION, only(False), "`false`",
           "watermarking is not implemented", False, True),
    partly("length_penalty", BOTH, "vLLM", GENERATION, only(1.0), "`1.0`",
           "it weighs beam search, which is not implemented", 1.0, 0.5),
    honoured("stop_token_ids", BOTH, "vLLM", GENERATION, [2]),
    honoured("include_stop_str_in_output", BOTH, "vLLM", GENERATION, True),
    honoured("ignore_eos", BOTH, "vLLM", GENERATION, True),
    honoured("min_tokens", BOTH, "vLLM", GENERATION, 1),
    honoured("skip_special_tokens", BOTH, "vLLM", GENERATION, False),
    partly("spaces_between_special_tokens", BOTH, "vLLM", GENERATION, _special_tokens_skipped,
           "while special tokens are skipped (the default)",
           "special tokens are decoded as the tokenizer writes them; leave it out", True, True),
    refused("truncate_prompt_tokens", BOTH, "vLLM",
            "prompts are never truncated: one too long for the context is a 400", 8),
    refused("truncation_side", BOTH, "vLLM", "prompts are never truncated", "left"),
    honoured("prompt_logprobs", BOTH, "vLLM", SERVING, 1),
    refused("logprob_token_ids", BOTH, "vLLM",
            "logprobs of chosen token ids are not implemented; use logprobs", [42]),
    refused("allowed_token_ids", BOTH, "vLLM", "restricting sampling to given token ids is not implemented",
            [42]),
    partly("bad_words", BOTH, "vLLM", GENERATION, only([]), "`[]`", "bad-word lists are not implemented",
           [], ["bad"]),
    honoured("structured_outputs", BOTH, "vLLM", GUIDED, {"choice": ["yes", "no"]},
             "exactly one of json, regex, choice, grammar, json_object"),
    honoured("structured_outputs.json", BOTH, "vLLM", GUIDED, {"type": "object"}),
    honoured("structured_outputs.regex", BOTH, "vLLM", GUIDED, "[0-9]{3}"),
    honoured("structured_outputs.choice", BOTH, "vLLM", GUIDED, ["yes", "no"]),
    honoured("structured_outputs.grammar", BOTH, "vLLM", GUIDED, 'root ::= "yes" | "no"'),
    partly("structured_outputs.json_object", BOTH, "vLLM", GUIDED, only(True), "`true`",
           "false asks for no constraint: leave structured_outputs out", True, False),
    partly("structured_outputs.disable_any_whitespace", BOTH, "vLLM", GUIDED, only(False), "`false`",
           "the JSON grammar's whitespace is fixed", False, True),
    partly("structured_outputs.disable_additional_properties", BOTH, "vLLM", GUIDED, only(False), "`false`",
           "schemas are enforced as written: set additionalProperties in the schema", False, True),
    refused("structured_outputs.whitespace_pattern", BOTH, "vLLM", "the JSON grammar's whitespace is fixed",
            "[ ]?"),
    refused("structured_outputs.structural_tag", BOTH, "vLLM", "structural tags are not implemented", "{}"),
    refused("structured_outputs.backend", BOTH, "vLLM", _BACKEND, "outlines"),
    honoured("structured_outputs.disable_fallback", BOTH, "vLLM", GUIDED, True,
             "xgrammar is the only backend: there is nothing to fall back to"),
    partly("priority", BOTH, "vLLM", SERVING, only(0), "`0`",
           "one queue, first come first served: priority scheduling is not offered", 0, 5),
    refused("request_id", BOTH, "vLLM",
            "send it as the x-request-id header, which names the response and the logs", "req-1"),
    honoured("session_id", BOTH, "vLLM", NO_EFFECT, "session-1",
             "a session identity for routing gateways; one server keeps no sessions"),
    partly("return_tokens_as_token_ids", BOTH, "vLLM", LOGPROBS, only(False), "`false`",
           "logprob tokens are always their text", False, True),
    partly("return_token_ids", BOTH, "vLLM", SERVING, only(False), "`false`",
           "responses carry no token ids", False, True),
    partly("return_token_offsets", BOTH, "vLLM", SERVING, only(False), "`false`",
           "responses carry no token offsets", False, True),
    partly("return_prompt_text", BOTH, "vLLM", SERVING, only(False), "`false`",
           "responses carry no prompt text", False, True),
    partly("return_mm_kwargs", BOTH, "vLLM", SERVING, only(True), "`true`", _NO_MULTIMODAL, True, False),
    partly("routed_experts_prompt_start", BOTH, "vLLM", SERVING, only(0), "`0`",
           "responses carry no routed-expert data", 0, 4),
    refused("cache_salt", BOTH, "vLLM",
            "per-request cache salts are not taken (the prefix cache is salted per LoRA adapter)", "s" * 43),
    refused("kv_transfer_params", BOTH, "vLLM", "disaggregated serving is not implemented", {}),
    refused("ec_transfer_params", BOTH, "vLLM", "disaggregated serving is not implemented", {}),
    refused("vllm_xargs", BOTH, "vLLM", "no extension here reads them", {"a": 1}),
    refused("repetition_detection", BOTH, "vLLM", "repetition detection is not implemented",
            {"max_pattern_size": 4, "min_count": 3}),
    partly("stream_interval", BOTH, "vLLM", SERVING, only(1), "`1`",
           "tokens are streamed as each step makes them", 1, 4),
    refused("thinking_token_budget", BOTH, "vLLM", "thinking budget control is not implemented", 64),
    refused("logits_processors", BOTH, "vLLM", "logits processors are never loaded from a request",
            ["my.module:Processor"]),
    honoured("guided_json", BOTH, "vLLM", GUIDED, {"type": "object"},
             "vLLM before 0.12; structured_outputs now"),
    honoured("guided_regex", BOTH, "vLLM", GUIDED, "[0-9]{3}"),
    honoured("guided_choice", BOTH, "vLLM", GUIDED, ["yes", "no"]),
    honoured("guided_grammar", BOTH, "vLLM", GUIDED, 'root ::= "yes" | "no"'),
    refused("guided_decoding_backend", BOTH, "vLLM", _BACKEND, "outlines"),
    refused("guided_whitespace_pattern", BOTH, "vLLM", "the JSON grammar's whitespace is fixed", "[ ]?"),
    # --- vLLM: chat -----------------------------------------------------------------------------
    partly("echo", CHAT, "vLLM", CHAT_SERVING, only(False), "`false`",
           "echoing the last message into the answer is not implemented", False, True),
    partly("add_generation_prompt", CHAT, "vLLM", TEMPLATE, only(True), "`true`",
           "the prompt always ends by opening the assistant's turn", True, False),
    partly("continue_final_message", CHAT, "vLLM", TEMPLATE, only(False), "`false`",
           "continuing the final message (prefill) is not implemented", False, True),
    partly("add_special_tokens", CHAT, "vLLM", TEMPLATE, only(False), "`false`",
           "the chat template writes the special tokens", False, True),
    refused("documents", CHAT, "vLLM", "the chat template gets no documents here",
            [{"title": "a", "text": "b"}]),
    honoured("chat_template", CHAT, "vLLM", TEMPLATE, "{% for m in messages %}{{ m.content }}{% endfor %}",
             "only with NIM_TRUST_REQUEST_CHAT_TEMPLATE=1"),
    honoured("chat_template_kwargs", CHAT, "vLLM", TEMPLATE, {"enable_thinking": False}),
    refused("media_io_kwargs", CHAT, "vLLM", _NO_MULTIMODAL, {"image": {}}),
    refused("mm_processor_kwargs", CHAT, "vLLM", _NO_MULTIMODAL, {"num_crops": 4}),
    partly("include_reasoning", CHAT, "vLLM", CHAT_SERVING, only(True), "`true`",
           "a reasoning model's reasoning is always returned", True, False),
    # --- vLLM: completions ----------------------------------------------------------------------
    partly("add_special_tokens", COMPLETIONS, "vLLM", COMPLETIONS_SERVING, only(True), "`true`",
           "a prompt is always tokenized with the tokenizer's special tokens", True, False),
    refused("prompt_embeds", COMPLETIONS, "vLLM",
            "prompt embeddings are not accepted: send text or token ids", "AAAA"),
    # --- NIM: nvext -----------------------------------------------------------------------------
    honoured("nvext", BOTH, "NIM", GENERATION, {"top_k": 1}),
    honoured("nvext.top_k", BOTH, "NIM", GENERATION, 1),
    honoured("nvext.repetition_penalty", BOTH, "NIM", GENERATION, 1.1),
    honoured("nvext.ignore_eos", BOTH, "NIM", GENERATION, True),
    honoured("nvext.min_tokens", BOTH, "NIM", GENERATION, 1),
    honoured("nvext.guided_json", BOTH, "NIM", GUIDED, {"type": "object"}),
    honoured("nvext.guided_regex", BOTH, "NIM", GUIDED, "[0-9]{3}"),
    honoured("nvext.guided_choice", BOTH, "NIM", GUIDED, ["yes", "no"]),
    honoured("nvext.guided_grammar", BOTH, "NIM", GUIDED, 'root ::= "yes" | "no"'),
    refused("nvext.guided_decoding_backend", BOTH, "NIM", _BACKEND, "outlines"),
    refused("nvext.guided_whitespace_pattern", BOTH, "NIM", "the JSON grammar's whitespace is fixed", "[ ]?"),
    refused("nvext.max_thinking_tokens", BOTH, "NIM", "thinking budget control is not implemented", 64),
)  # fmt: skip

CONTENT_PARTS: tuple[ContentPart, ...] = (
    ContentPart("text", TEMPLATE),
    ContentPart("refusal", TEMPLATE, "an earlier assistant refusal, read as its text"),
    ContentPart("image_url", None, "images are not supported by this model"),
    ContentPart("image_embeds", None, "images are not supported by this model"),
    ContentPart("input_audio", None, "audio is not supported by this model"),
    ContentPart("audio_url", None, "audio is not supported by this model"),
    ContentPart("video_url", None, "video is not supported by this model"),
    ContentPart("file", None, "files are not supported by this model"),
)

# The fields of a content part beyond `type`, by its (honoured) type.
CONTENT_PART_FIELDS: dict[str, tuple[str, ...]] = {"text": ("text",), "refusal": ("refusal",)}

ASSISTANT: frozenset[str] = frozenset({"assistant"})
ALL_ROLES: frozenset[str] = frozenset({"system", "developer", "user", "assistant", "tool"})


_MESSAGE_FIELDS = (
    MessageField("name", ALL_ROLES, "the participant's name"),
    MessageField("tool_calls", ASSISTANT, "an assistant's calls, arguments parsed to objects"),
    MessageField("tool_call_id", frozenset({"tool"}), "the call a tool result answers (required)"),
    MessageField("reasoning_content", ASSISTANT, "earlier thinking (vLLM), as reasoning templates read it"),
    MessageField("reasoning", ASSISTANT, "the same, under vLLM's newer name"),
    MessageField("refusal", ASSISTANT, "an earlier refusal, its text where the message has no content"),
    MessageField("function_call", frozenset(), "deprecated by OpenAI: send the call as tool_calls"),
    MessageField("audio", frozenset(), "audio is not supported by this model"),
)
MESSAGE_FIELDS: dict[str, MessageField] = {f.name: f for f in _MESSAGE_FIELDS}
# The fields of an assistant message's tool call, and of its function.
TOOL_CALL_FIELDS = ("id", "type", "function")
TOOL_CALL_FUNCTION_FIELDS = ("name", "arguments")
