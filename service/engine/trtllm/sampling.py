"""Our SamplingParams to TensorRT-LLM's, field by field.

Every field of service.engine.protocol.SamplingParams maps to a TensorRT-LLM field; nothing is
dropped. Conventions differ and are converted here: greedy is temperature 0 with top_p / top_k
left unset (TensorRT-LLM treats unset knobs as greedy); "no limit" (top_k 0, min_p 0, penalties
at their neutral values) is unset; logit_bias becomes a dense `embedding_bias` over the vocabulary;
TensorRT-LLM's `logprobs=k` returns the k most likely tokens per position (with the sampled one),
so the sampled token's logprob alone still asks for 1. Each request is one sequence (the API fans
out `n` choices itself). Prompt logprobs are not offered by this engine (EngineFeatures), so the
API refuses them before they reach here. Structured output becomes GuidedDecodingParams (json,
json_object, regex, grammar; a choice list as a grammar of alternatives), run by the backend
the LLM was built with (guided_decoding_backend).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from service.engine.protocol import GuidedDecoding, SamplingParams, TokenLogprob
from service.engine.trtllm.api import TrtllmApi


def to_trtllm(api: TrtllmApi, params: SamplingParams, vocab_size: int) -> Any:
    if params.prompt_logprobs is not None:
        raise ValueError("prompt logprobs are not served by the tensorrt_llm engine")
    kwargs: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "n": 1,
        "seed": params.seed,
        "stop": list(params.stop) or None,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "ignore_eos": params.ignore_eos,
        "min_tokens": params.min_tokens or None,
        "repetition_penalty": None if params.repetition_penalty == 1.0 else params.repetition_penalty,
        "presence_penalty": params.presence_penalty or None,
        "frequency_penalty": params.frequency_penalty or None,
        "logprobs": None if params.logprobs is None else max(1, params.logprobs),
        "skip_special_tokens": params.skip_special_tokens,
        "detokenize": True,
    }
    if params.greedy:
        kwargs["temperature"] = 0.0
    else:
        kwargs["temperature"] = params.temperature
        kwargs["top_p"] = params.top_p
        kwargs["top_k"] = params.top_k if params.top_k > 0 else None
        kwargs["min_p"] = params.min_p or None
    if params.guided is not None:
        kwargs["guided_decoding"] = _guided(api, params.guided)
    if params.logit_bias:
        bias = torch.zeros(vocab_size, dtype=torch.float32)
        for token, value in params.logit_bias.items():
            bias[token] = value
        kwargs["embedding_bias"] = bias
    return api.SamplingParams(**kwargs)


def _guided(api: TrtllmApi, guided: GuidedDecoding) -> Any:
    if api.GuidedDecodingParams is None:
        raise ValueError("structured output: this tensorrt_llm has no GuidedDecodingParams")
    if guided.prefix or guided.suffix:
        raise ValueError("tool_choice required or a named function is not served by the tensorrt_llm adapter")
    if guided.kind == "json_schema":
        return api.GuidedDecodingParams(json=guided.spec)
    if guided.kind == "json_object":
        return api.GuidedDecodingParams(json_object=True)
    if guided.kind == "regex":
        return api.GuidedDecodingParams(regex=guided.spec)
    if guided.kind == "choice":
        alternatives = " | ".join(json.dumps(choice) for choice in json.loads(guided.spec))
        return api.GuidedDecodingParams(grammar=f"root ::= {alternatives}")
    return api.GuidedDecodingParams(grammar=guided.spec)


def token_logprob(token_id: int, entry: dict[int, Any], top_n: int) -> TokenLogprob:
    """One position of TensorRT-LLM's logprobs ({token id: Logprob(logprob, rank)}, the sampled
    token among them) as ours: the sampled token's logprob and rank, and the top_n alternatives."""
    chosen = entry.get(token_id)
    if chosen is None:
        raise ValueError(f"tensorrt_llm returned no logprob for the sampled token {token_id}")
    ranked = sorted(entry.items(), key=lambda item: item[1].logprob, reverse=True)
    top = tuple((token, float(value.logprob)) for token, value in ranked[:top_n])
    rank = (
        chosen.rank
        if chosen.rank is not None
        else 1 + sum(v.logprob > chosen.logprob for v in entry.values())
    )
    return TokenLogprob(token_id=token_id, logprob=float(chosen.logprob), rank=int(rank), top=top)
