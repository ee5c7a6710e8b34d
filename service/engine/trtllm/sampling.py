"""Our SamplingParams to TensorRT-LLM's, field by field, and its logprobs back to ours.

Every field of service.engine.protocol.SamplingParams maps to a TensorRT-LLM field, or is refused
(`refusal`) where the installed release's sampler would accept it and apply nothing (see
`release.py`): nothing is silently dropped. Conventions differ and are converted here: greedy is
temperature 0 with top_p / top_k left unset (TensorRT-LLM treats unset knobs as greedy); "no
limit" (top_k 0, min_p 0, penalties at their neutral values) is unset; logit_bias becomes a dense
`embedding_bias` over the vocabulary. Each request is one sequence (the API fans out `n` choices
itself). Prompt logprobs are not offered by this engine (EngineFeatures), so the API refuses them
before they reach here. Structured output becomes GuidedDecodingParams (json, json_object, regex,
grammar; a choice list as a grammar of alternatives), run by the backend the LLM was started with.

Logprobs: `logprobs=k` asks for the k most likely tokens of each position. Where the release
always adds the sampled token, the sampled token alone is `logprobs=0`; before that it is the
top 1, so at least 1 is asked for, and sampling (temperature > 0) is refused with logprobs, since
the sampled token may be missing from the top k. What comes back is read by `token_logprob`,
which takes every shape TensorRT-LLM returns (a {token id: Logprob} dict from the PyTorch
backend, a bare float from the C++ executor) and reports a position it cannot read as None.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from service.engine.protocol import GuidedDecoding, SamplingParams, TokenLogprob
from service.engine.trtllm.api import TrtllmApi
from service.engine.trtllm.release import Release

# trtllm-serve's floor for a logprob (a -inf is not JSON); ours too.
LOGPROB_FLOOR = -9999.0


def refusal(params: SamplingParams, release: Release) -> str | None:
    """Why the installed release cannot honour `params` (one line naming the field), or None."""
    asked = {
        "repetition_penalty": params.repetition_penalty != 1.0,
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        # min_p and a seed act only when sampling; greedy decoding needs neither
        "min_p": params.min_p != 0.0 and not params.greedy,
        "seed": params.seed is not None and not params.greedy,
    }
    for name in release.ignored:
        if asked.get(name):
            return (
                f"{name} is not applied by tensorrt_llm {release.version}'s sampler (it would be accepted "
                f"and ignored); leave {name} out"
            )
    if params.logprobs is not None and not params.greedy and not release.sampled_logprob:
        return (
            f"logprobs with temperature > 0: tensorrt_llm {release.version}'s sampler returns the top-k "
            "tokens only, which need not include the sampled one; use temperature 0 or leave logprobs out"
        )
    return None


def to_trtllm(api: TrtllmApi, params: SamplingParams, vocab_size: int, release: Release) -> Any:
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
        "logprobs": None if params.logprobs is None else max(params.logprobs, _min_logprobs(release)),
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


def _min_logprobs(release: Release) -> int:
    """The fewest `logprobs` that return the sampled token's (0 where it is always added)."""
    return 0 if release.sampled_logprob else 1


def token_logprob(token_id: int, entry: object, top_n: int) -> TokenLogprob | None:
    """One position of TensorRT-LLM's logprobs as ours (the sampled token's logprob and rank, and
    the top_n alternatives), or None when `entry` holds no finite logprob for `token_id`.

    `entry` is a {token id: Logprob(logprob, rank)} dict (the PyTorch backend: the top k, with
    the sampled token only where the release adds it), a float (the C++ executor: the sampled
    token's alone, rank unknown, reported as 0), or missing (None)."""
    if isinstance(entry, dict):
        values = {t: _value(v) for t, v in entry.items() if isinstance(t, int)}
        chosen = values.get(token_id)
        if chosen is None or math.isnan(chosen):
            return None
        rank = getattr(entry[token_id], "rank", None)
        if not isinstance(rank, int):
            rank = 1 + sum(v > chosen for v in values.values())
        ranked = sorted(((t, v) for t, v in values.items() if not math.isnan(v)), key=lambda tv: -tv[1])
        top = tuple((t, max(v, LOGPROB_FLOOR)) for t, v in ranked[:top_n])
        return TokenLogprob(token_id=token_id, logprob=max(chosen, LOGPROB_FLOOR), rank=rank, top=top)
    if isinstance(entry, int | float) and not isinstance(entry, bool) and not math.isnan(entry):
        return TokenLogprob(token_id=token_id, logprob=max(float(entry), LOGPROB_FLOOR), rank=0)
    return None


def _value(logprob: object) -> float:
    """A Logprob's (or a bare number's) value; NaN for anything else."""
    value = getattr(logprob, "logprob", logprob)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return math.nan
