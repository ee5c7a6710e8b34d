"""A chat request's prompt: its template (the model's, or the request's own where trusted), the
variables the request passes it, the messages as templates take them, rendered and tokenized."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from service.api.chat.protocol import ChatCompletionRequest
from service.api.errors import invalid_request
from service.api.schemas import ChatMessage
from service.api.state import ApiLimits
from service.text.chat_template import ChatTemplate
from service.text.reasoning import closed
from service.text.tokenizer import ChatTemplateError, Tokenizer


def template_for(
    tokenizer: Tokenizer, body: ChatCompletionRequest, limits: ApiLimits, tools: bool
) -> ChatTemplate | None:
    """The chat template the conversation is rendered with: the request's own `chat_template`
    where the operator trusts requests with one (NIM_TRUST_REQUEST_CHAT_TEMPLATE, as vLLM's
    --trust-request-chat-template), else a 400; the model's otherwise."""
    if body.chat_template is None:
        return tokenizer.chat_template_for(tools=tools)
    if not limits.trust_request_chat_template:
        raise invalid_request(
            "a request's own chat_template is refused by this server; its operator may allow it with "
            "NIM_TRUST_REQUEST_CHAT_TEMPLATE=1 (it then runs sandboxed, size- and time-limited)",
            "chat_template",
        )
    try:
        return tokenizer.chat_template_for(tools=tools, source=body.chat_template)
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "chat_template") from None


# Template variables the server sets itself: not to be replaced through chat_template_kwargs.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


@dataclass(frozen=True)
class TemplateInputs:
    """What a request adds to its chat template's rendering: variables the template reads, and
    whether the prompt must end with the thinking closed (`enable_thinking: false` with a reasoning
    parser: service.text.reasoning.closed)."""

    variables: dict[str, Any]
    close_thinking: bool = False


def template_inputs(
    body: ChatCompletionRequest, template: ChatTemplate | None, tokenizer: Tokenizer, reasoning: bool
) -> TemplateInputs:
    """The request's extra chat template variables (chat_template_kwargs, reasoning_effort), each
    one the template reads; a 400 naming the field for any other. `enable_thinking` is the
    exception where the model has a reasoning parser (`reasoning`): false closes the thinking
    whether or not the template reads it, true asks for what the model does anyway."""
    variables: dict[str, Any] = {}
    close_thinking = False
    reserved = RESERVED_VARIABLES | tokenizer.template_tokens.keys()
    for key, value in (body.chat_template_kwargs or {}).items():
        param = f"chat_template_kwargs.{key}"
        if key in reserved:
            raise invalid_request(f"{key} is set by the server and cannot be passed in chat_template_kwargs",
                                  param)  # fmt: skip
        if key == "reasoning_effort" and body.reasoning_effort is not None:
            raise invalid_request("reasoning_effort is given twice (also as the request field)", param)
        reads = template is not None and template.reads(key)
        if key == "enable_thinking" and reasoning:
            if not isinstance(value, bool):
                raise invalid_request(f"enable_thinking is true or false, not {json.dumps(value)}", param)
            close_thinking = not value
            if not reads:
                continue
        elif not reads:
            raise invalid_request(
                f"this model's chat template does not read {key}, so passing it would have no effect", param
            )
        variables[key] = value
    if body.reasoning_effort is not None:
        if template is None or not template.reads("reasoning_effort"):
            raise invalid_request(
                "this model's chat template does not read reasoning_effort, so it would have no effect",
                "reasoning_effort",
            )
        variables["reasoning_effort"] = body.reasoning_effort
    return TemplateInputs(variables, close_thinking)


def chat_prompt(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    inputs: TemplateInputs,
    source: str | None = None,
) -> tuple[str, list[int]]:
    """The conversation's prompt, as text and tokens: rendered by the chat template (the request's
    own `source`, when it sent one, else the model's; with the request's template `inputs`), its
    thinking closed where the request asked for that, then tokenized. Slow for long conversations
    (seconds for megabytes): run it off the event loop."""
    rendered = [template_message(m, i) for i, m in enumerate(messages)]
    try:
        extra = {**inputs.variables, "tools": tools} if tools is not None else dict(inputs.variables)
        text = tokenizer.apply_chat_template(
            rendered, add_generation_prompt=True, chat_template=source, **extra
        )
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages" if source is None else "chat_template") from None
    if inputs.close_thinking:
        text = closed(text)
    return text, tokenizer.encode(text, add_special_tokens=False)


def template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates take it: tool calls (arguments as objects) and tool results too."""
    extra = message.model_extra or {}
    content = message.text(f"messages.{index}")
    refusal = extra.get("refusal")
    if not content and message.role == "assistant" and isinstance(refusal, str):
        content = refusal  # an earlier refusal is what the assistant said
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.name:
        out["name"] = message.name
    reasoning = extra.get("reasoning_content", extra.get("reasoning"))
    if message.role == "assistant" and isinstance(reasoning, str):
        out["reasoning_content"] = reasoning  # templates that show earlier thinking read it
    if message.role == "tool" and extra.get("tool_call_id"):
        out["tool_call_id"] = extra["tool_call_id"]
    calls = extra.get("tool_calls")
    if message.role == "assistant" and isinstance(calls, list):
        out["tool_calls"] = [
            template_call(call, f"messages.{index}.tool_calls.{j}")
            for j, call in enumerate(calls)
            if isinstance(call, dict)
        ]
    return out


def template_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict):
        raise invalid_request(
            "a tool call's function must be an object {name, arguments}", f"{param}.function"
        )
    function = dict(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError, RecursionError):  # not JSON: the template gets the text
            function["arguments"] = json.loads(arguments)
    return {**call, "type": call.get("type", "function"), "function": function}
