"""vLLM's POST /tokenize and /detokenize (at the root, as vLLM serves them: gateways count tokens
with them)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from service.api.common import ready_for, state_of
from service.api.errors import ERROR_RESPONSES, invalid_request
from service.api.tokens.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from service.text.tokenizer import ChatTemplateError, Tokenizer

router = APIRouter(responses=ERROR_RESPONSES)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    ready = ready_for(state_of(request), body.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("send exactly one of prompt or messages", "prompt")
    tokens = await asyncio.to_thread(_tokens, ready.tokenizer, body)
    return TokenizeResponse(count=len(tokens), max_model_len=ready.info.max_model_len, tokens=tokens)


def _tokens(tokenizer: Tokenizer, body: TokenizeRequest) -> list[int]:
    """What /tokenize counts (slow for long texts: run it off the event loop)."""
    if body.messages is None:
        return tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
    messages = [{"role": m.role, "content": m.text(f"messages.{i}")} for i, m in enumerate(body.messages)]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ready = ready_for(state_of(request), body.model)
    vocab = ready.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise invalid_request(f"token ids must be in [0, {vocab})", "tokens")
    return DetokenizeResponse(prompt=ready.tokenizer.decode(body.tokens, skip_special_tokens=False))
