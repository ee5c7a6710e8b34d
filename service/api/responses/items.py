"""A Responses request as the chat completion it runs as, and a chat answer as Responses output items.

`input` is a string (one user message) or items: messages (`input_text` parts; earlier assistant
answers as `output_text` / `refusal` parts), `function_call` items (an assistant's tool calls:
consecutive calls, and the assistant text or reasoning right before them, are one assistant turn,
as chat templates expect), `function_call_output` items (a tool message answering a call made
before it), and `reasoning` items (earlier thinking, passed to the assistant turn after it as
`reasoning_content`). `developer` messages are system messages. `instructions` is the first
system message; a system message that leads `input` joins it (many templates take one system
message only). Every other item type, part type or field is refused naming it (`input.3.type`,
`input.0.content.1`), by service.api.request_fields' tables.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from service.api.chat.protocol import ChatCompletionRequest, ResponseMessage, chat_body
from service.api.errors import invalid_request
from service.api.request_fields import INPUT_ITEMS, INPUT_PARTS, check_item
from service.api.responses.protocol import ResponsesRequest
from service.api.tools import ToolCall

ChatMessages = list[dict[str, Any]]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def conversation(body: ResponsesRequest, history: ChatMessages) -> ChatMessages:
    """The conversation without its instructions: a stored one's messages (`history`), then input."""
    messages: ChatMessages = [dict(m) for m in history]
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    calls: set[str] = {c["id"] for m in messages for c in m.get("tool_calls") or ()}
    for i, item in enumerate(items):
        _add_item(messages, item, i, calls)
    return messages


def with_instructions(messages: ChatMessages, instructions: str | None) -> ChatMessages:
    """`instructions` as the first system message (joined with one that leads the conversation)."""
    if instructions is None:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": instructions + "\n\n" + messages[0]["content"]}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def _add_item(messages: ChatMessages, item: Any, i: int, calls: set[str]) -> None:
    param = f"input.{i}"
    if not isinstance(item, dict):
        raise invalid_request("each input item must be an object", param)
    kind = item.get("type", "message" if "role" in item else None)
    check_item(INPUT_ITEMS, kind, item, param, "input item")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise invalid_request(
                f"{param}.role must be user, system, developer or assistant", f"{param}.role"
            )
        text = _content_text(item.get("content"), f"{param}.content")
        if role == "assistant":
            last = _assistant(messages, fresh=True)
            last["content"] = (last["content"] or "") + text
        else:
            messages.append({"role": "system" if role == "developer" else role, "content": text})
    elif kind == "function_call":
        call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
        for key, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
            if not isinstance(value, str):
                raise invalid_request(f"{param}.{key} is required (a string)", f"{param}.{key}")
        calls.add(str(call_id))
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = _assistant(messages, fresh=False)
        last.setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or call_id not in calls:
            raise invalid_request(
                f"{param}.call_id must name a function_call earlier in the conversation", f"{param}.call_id"
            )
        output = _content_text(item.get("output"), f"{param}.output")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind == "reasoning":
        if item.get("encrypted_content") is not None:
            raise invalid_request(
                f"{param}.encrypted_content cannot be read here: send the reasoning item's content",
                f"{param}.encrypted_content",
            )
        parts = item.get("content") or item.get("summary") or []
        if not isinstance(parts, list):
            raise invalid_request(
                f"{param}.content must be a list of reasoning_text parts", f"{param}.content"
            )
        text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        messages.append({"role": "assistant", "content": "", "reasoning_content": text})


def _assistant(messages: ChatMessages, fresh: bool) -> dict[str, Any]:
    """The assistant turn an item adds to: the last message when it is an assistant's that can take
    it (text: one with no text or calls yet, only thinking; a call: any), else a new one."""
    last = messages[-1] if messages else None
    takes = last is not None and (not fresh or (not last["content"] and not last.get("tool_calls")))
    if last is not None and last["role"] == "assistant" and takes:
        return last
    messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def _content_text(content: Any, param: str) -> str:
    """A message's (or a tool output's) text: a string, or parts of text only."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"{param} must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}.{j}"
        if not isinstance(part, dict):
            raise invalid_request("each content part must be an object", where)
        kind = check_item(INPUT_PARTS, part.get("type"), part, where, "content part")
        value = part.get("refusal" if kind.type == "refusal" else "text")
        if not isinstance(value, str):
            raise invalid_request(f"a {kind.type} part needs its text", where)
        texts.append(value)
    return "".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools as chat takes them ({type, function: {name, description, parameters, strict}})."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
        }
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format (service.api.guided reads it)."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt if isinstance(fmt, dict) else None
    if not isinstance(fmt.get("schema"), dict):
        raise invalid_request("text.format.schema is required (a JSON schema)", "text.format.schema")
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": {"name": "response", **spec}}


# Chat field names (as prepare's 400s name them) -> this body's.
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^messages(\..*)?$", "input"),
    (r"^(max_completion_tokens|max_tokens)$", "max_output_tokens"),
    (r"^response_format(\..*)?$", "text.format"),
    (r"^reasoning_effort$", "reasoning.effort"),
    (r"^tools\.(\d+)\.function(\..*)?$", r"tools.\1\2"),
)


def responses_param(param: str) -> str:
    for pattern, replacement in _RENAMES:
        if re.match(pattern, param):
            return re.sub(pattern, replacement, param)
    return param


def chat_request(body: ResponsesRequest, messages: ChatMessages) -> ChatCompletionRequest:
    """The chat completion `body` runs as (n is 1)."""
    reasoning = body.reasoning or {}
    # A forced call is the whole answer: text.format shapes a message, and there is none
    forced = bool(body.tools) and body.tool_choice not in (None, "auto", "none")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": None if forced else response_format(body.text),
        "reasoning_effort": reasoning.get("effort"),
        "user": body.user,
        "stream": bool(body.stream),
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
    }
    return chat_body(fields, responses_param)


# --- The answer as output items ----------------------------------------------------------------


def reasoning_item(item_id_: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id_,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id_: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [output_text(text)]
    return {"id": item_id_, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(call: ToolCall | dict[str, Any], status: str = "completed") -> dict[str, Any]:
    if isinstance(call, ToolCall):
        call = call.to_openai()
    function = call["function"]
    return {
        "id": item_id("fc"),
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": status,
    }


def output_items(message: ResponseMessage, cut: bool, reasoning: bool) -> list[dict[str, Any]]:
    """A finished answer's items: its thinking (a reasoning parser's), its text, its calls."""
    items = []
    if reasoning and message.reasoning_content:
        items.append(reasoning_item(item_id("rs"), message.reasoning_content))
    calls = message.tool_calls or []
    if message.content or not calls:
        items.append(
            message_item(item_id("msg"), message.content or "", "incomplete" if cut else "completed")
        )
    items += [call_item(c) for c in calls]
    return items


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the assistant message a later turn (previous_response_id) reads."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            turn["reasoning_content"] = "".join(p["text"] for p in item.get("content") or ())
        elif item["type"] == "message":
            turn["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": function}
            )
    return turn


def echoed_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools as a response shows them (parameters and strict always present)."""
    return [
        {"type": "function", "parameters": None, "strict": None, **t, "description": t.get("description")}
        for t in tools or ()
    ]


def dumped(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
