"""A Messages request as the chat completion it runs as.

`system` (a string, or text blocks joined) is the first system message. Each turn's content is a
string or blocks: `text`; in an assistant turn `tool_use` (the assistant's tool_calls, its input
as the arguments) and `thinking` (earlier thinking, as reasoning_content); in a user turn
`tool_result` (a tool message answering the tool_use it names; text only; `is_error` puts
"Error: " before its text), sent before the turn's text as chat templates expect. Consecutive
turns of one role are one turn, as Anthropic combines them. A conversation that ends with an
assistant turn asks to continue it (a prefill), which is refused. Any other block type, or a field
a block's type does not have, is refused naming it (`messages.0.content.1`), by
service.api.request_fields' tables.
"""

from __future__ import annotations

import json
import re
from typing import Any

from service.api.chat.protocol import ChatCompletionRequest, chat_body
from service.api.errors import invalid_request
from service.api.messages.protocol import CountTokensRequest, MessagesRequest
from service.api.request_fields import CONTENT_BLOCKS, check_item, unrecognized

ChatMessages = list[dict[str, Any]]


def chat_messages(body: CountTokensRequest) -> ChatMessages:
    messages: ChatMessages = []
    system = _system(body.system)
    if system is not None:
        messages.append({"role": "system", "content": system})
    calls: set[str] = set()
    last = len(body.messages) - 1
    for i, turn in enumerate(body.messages):
        param = f"messages.{i}"
        if not isinstance(turn, dict):
            raise invalid_request("each message must be an object {role, content}", param)
        for key in turn:
            if key not in ("role", "content"):
                raise unrecognized(f"{param}.{key}")
        role = turn.get("role")
        if role not in ("user", "assistant", "system"):
            raise invalid_request(f"{param}.role must be user or assistant", f"{param}.role")
        if role == "assistant" and i == last:
            raise invalid_request(
                f"{param}: a conversation that ends with an assistant turn asks to continue it (prefill), "
                "which this server does not do; end with a user turn",
                param,
            )
        blocks = _blocks(turn.get("content"), f"{param}.content")
        if role == "assistant":
            _assistant(messages, blocks, param, calls)
        else:
            _user(messages, blocks, param, calls, role)
    return messages


def _system(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    texts = []
    for j, block in enumerate(system):
        param = f"system.{j}"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise invalid_request("system blocks are text blocks", param)
        check_item(CONTENT_BLOCKS, "text", block, param, "content block")
        texts.append(str(block.get("text", "")))
    return "\n\n".join(texts)


def _blocks(content: Any, param: str) -> list[tuple[str, dict[str, Any]]]:
    """A turn's content as (param, block) pairs, each block's type and fields checked."""
    if isinstance(content, str):
        return [(param, {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise invalid_request(f"{param} must be a string or a list of content blocks", param)
    out = []
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        if not isinstance(block, dict):
            raise invalid_request("each content block must be an object", where)
        check_item(CONTENT_BLOCKS, block.get("type"), block, where, "content block")
        out.append((where, block))
    return out


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid_request(f"{where}.text is required (a string)", f"{where}.text")
    return text


def _assistant(messages: ChatMessages, blocks: list[tuple[str, dict[str, Any]]], param: str,
               calls: set[str]) -> None:  # fmt: skip
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if last is None:
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    for where, block in blocks:
        kind = block["type"]
        if kind == "text":
            last["content"] += _text_of(block, where)
        elif kind == "thinking":
            last["reasoning_content"] = last.get("reasoning_content", "") + str(block.get("thinking", ""))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
                raise invalid_request("a tool_use block is {id, name, input: an object}", where)
            calls.add(call_id)
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            last.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": function}
            )
        else:
            raise invalid_request(f"a {kind} block is read in a user turn only", where)


def _user(messages: ChatMessages, blocks: list[tuple[str, dict[str, Any]]], param: str, calls: set[str],
          role: str) -> None:  # fmt: skip
    texts: list[str] = []
    for where, block in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(_text_of(block, where))
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise invalid_request(
                    f"{where}.tool_use_id must name a tool_use block earlier in the conversation",
                    f"{where}.tool_use_id",
                )
            text = _result_text(block.get("content"), f"{where}.content")
            if block.get("is_error") is True:
                text = "Error: " + text
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise invalid_request(f"a {kind} block is read in an assistant turn only", where)
    if not texts:
        return
    text = "".join(texts)
    last = messages[-1] if messages else None
    if last is not None and last["role"] == role:  # one turn, as Anthropic combines them
        last["content"] += ("\n\n" if role == "system" else "") + text
    else:
        messages.append({"role": role, "content": text})


def _result_text(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid_request(f"{param} must be a string or a list of text blocks", param)
    texts = []
    for k, block in enumerate(content):
        where = f"{param}.{k}"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise invalid_request(f"a tool result holds text blocks only, not {json.dumps(kind)}", where)
        check_item(CONTENT_BLOCKS, "text", block, where, "content block")
        texts.append(_text_of(block, where))
    return "".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """Anthropic's tool_choice as chat's, and parallel_tool_calls (False where it disables them)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid_request("tool_choice of type tool names the tool", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}.get(str(kind), "auto"), parallel


# Chat field names (as prepare's 400s name them) -> this body's.
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^(max_completion_tokens|max_tokens)$", "max_tokens"),
    (r"^response_format(\..*)?$", "output_config.format"),
    (r"^stop$", "stop_sequences"),
    (r"^tools\.(\d+)\.function\.parameters(\..*)?$", r"tools.\1.input_schema\2"),
    (r"^tools\.(\d+)\.function(\..*)?$", r"tools.\1\2"),
    (r"^parallel_tool_calls$", "tool_choice.disable_parallel_tool_use"),
    (r"^chat_template_kwargs(\..*)?$", "thinking"),
)


def messages_param(param: str) -> str:
    for pattern, replacement in _RENAMES:
        if re.match(pattern, param):
            return re.sub(pattern, replacement, param)
    return param


def chat_request(body: CountTokensRequest, reasoning: bool) -> ChatCompletionRequest:
    """The chat completion `body` runs as; `reasoning`: the model has a reasoning parser."""
    thinking = (body.thinking or {}).get("type")
    if thinking in ("enabled", "adaptive") and not reasoning:
        raise invalid_request(
            f"thinking {thinking} needs a reasoning model: this one does not think apart from its answer",
            "thinking.type",
        )
    fmt = (body.output_config or {}).get("format")
    tool_choice, parallel = chat_tool_choice(body.tool_choice)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "tools": chat_tools(body.tools),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.get("schema")},
        }
        if isinstance(fmt, dict)
        else None,
        "chat_template_kwargs": {"enable_thinking": False} if thinking == "disabled" and reasoning else None,
    }
    if isinstance(body, MessagesRequest):
        metadata = body.metadata or {}
        fields |= {
            "max_completion_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences,
            "include_stop_str_in_output": True if body.stop_sequences else None,
            "user": metadata.get("user_id"),
            "stream": bool(body.stream),
        }
    return chat_body(fields, messages_param)
