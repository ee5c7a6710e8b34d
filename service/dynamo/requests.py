"""Dynamo's token request and response dicts <-> this engine's GenerationRequest and RequestOutput.

A worker receives the dict Dynamo's preprocessor (its frontend, or a `KvRouter` client such as
this server's router role) builds: `token_ids`, `stop_conditions`, `sampling_options` (with
`guided_decoding`), `output_options`, `eos_token_ids`, `model`, routing fields, and `extra_args`
passed through verbatim. Every field is honoured or refused, as the HTTP API treats its own
fields: `FIELDS` below is the one table of what happens to each (docs/dynamo.md renders it), and
a field it does not list is refused when it carries a value. `null` always means "not sent".

Dynamo's request structs drop keys they do not know and keep floats as float32, so this server's
router sends the exact SamplingParams in `extra_args["nim"]["sampling"]` (logit_bias, a
constraint's tool-call markers and reasoning start included); `to_dynamo` and `from_dynamo` are
inverses on every GenerationRequest (a test round-trips them).

No Dynamo import here: refusals are `RefusedField`, which the worker raises as Dynamo's
`InvalidArgument`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from service.engine.protocol import (
    FinishReason,
    GenerationRequest,
    GuidedDecoding,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from service.util import one_line

Handling = Literal["honoured", "only", "nothing to do", "refused"]


@dataclass(frozen=True)
class Field:
    """One request field and what happens to it (`only`: honoured for the values `why` names)."""

    name: str  # dotted path in the request dict
    handling: Handling
    why: str


FIELDS: tuple[Field, ...] = (
    Field("token_ids", "honoured", "the prompt; a packed int32 buffer is unpacked first"),
    Field("model", "honoured", "the served model's name (or empty) runs the base model; an adapter's "
          "name runs that LoRA adapter; any other name is refused"),
    Field("stop_conditions", "honoured", "checked field by field"),
    Field("stop_conditions.max_tokens", "honoured", "unset: up to the context length"),
    Field("stop_conditions.stop", "honoured", "stop strings, matched on the detokenized text by the "
          "engine; Dynamo's frontend also cuts the text itself"),
    Field("stop_conditions.stop_token_ids", "honoured", "the generation ends at any of them"),
    Field("stop_conditions.stop_token_ids_hidden", "honoured", "as stop_token_ids (whoever renders "
          "the text hides them); the end-of-sequence ids among them are dropped under ignore_eos"),
    Field("stop_conditions.stop_token_ids_visible", "honoured", "as stop_token_ids"),
    Field("stop_conditions.min_tokens", "honoured", "stop tokens are masked until then"),
    Field("stop_conditions.ignore_eos", "honoured", "the model's end-of-sequence tokens do not end it"),
    Field("stop_conditions.max_thinking_tokens", "refused", "thinking budget control is not "
          "implemented"),
    Field("sampling_options", "honoured", "checked field by field"),
    Field("sampling_options.n", "only", "1: each choice is a request of its own (Dynamo's frontend "
          "fans n out)"),
    Field("sampling_options.best_of", "only", "1: choosing the best of several is not implemented"),
    Field("sampling_options.temperature", "honoured", "0 is greedy"),
    Field("sampling_options.top_p", "honoured", ""),
    Field("sampling_options.top_k", "honoured", "0 or -1: no limit"),
    Field("sampling_options.min_p", "honoured", ""),
    Field("sampling_options.repetition_penalty", "honoured", ""),
    Field("sampling_options.presence_penalty", "honoured", ""),
    Field("sampling_options.frequency_penalty", "honoured", ""),
    Field("sampling_options.seed", "honoured", ""),
    Field("sampling_options.include_stop_str_in_output", "honoured", ""),
    Field("sampling_options.use_beam_search", "only", "false: beam search is not implemented"),
    Field("sampling_options.length_penalty", "only", "1.0: it weighs beam search"),
    Field("sampling_options.guided_decoding", "honoured", "exactly one of json, regex, choice, "
          "grammar (xgrammar, compiled and checked by the engine before the request starts)"),
    Field("sampling_options.guided_decoding.json", "honoured", "a JSON schema (object or text)"),
    Field("sampling_options.guided_decoding.regex", "honoured", ""),
    Field("sampling_options.guided_decoding.choice", "honoured", "a list of strings"),
    Field("sampling_options.guided_decoding.grammar", "honoured", "EBNF as xgrammar reads it"),
    Field("sampling_options.guided_decoding.backend", "only", '"xgrammar": the engine\'s only one'),
    Field("sampling_options.guided_decoding.whitespace_pattern", "refused", "the JSON grammar's "
          "whitespace is fixed"),
    Field("sampling_options.guided_decoding.structural_tag", "refused", "structural tags are not "
          "implemented"),
    Field("output_options", "honoured", "checked field by field"),
    Field("output_options.logprobs", "honoured", "k: each token's logprob and the k most likely "
          "(`log_probs`, `top_logprobs`)"),
    Field("output_options.prompt_logprobs", "honoured", "k: on the last chunk's "
          "`engine_data.prompt_logprobs`, vLLM's shape"),
    Field("output_options.skip_special_tokens", "honoured", "what stop strings are matched against"),
    Field("output_options.formatted_prompt", "only", "false: the worker takes tokens, not text"),
    Field("output_options.return_tokens_as_token_ids", "nothing to do", "a rendering choice of the "
          "frontend; top_logprobs always carry token_id"),
    Field("eos_token_ids", "honoured", "stop tokens besides the model's own (none under ignore_eos)"),
    Field("mdc_sum", "nothing to do", "the model card's checksum, for the frontend"),
    Field("annotations", "nothing to do", "requests to the frontend's preprocessor"),
    Field("routing", "only", "dp_rank 0 or unset: one data-parallel rank per worker; the rest "
          "(worker ids, hints) were the router's to use"),
    Field("router_config_override", "nothing to do", "the router's, already applied"),
    Field("extra_args", "honoured", 'only its "nim" object (this server\'s router), else refused'),
    Field("extra_args.nim", "honoured", "checked field by field"),
    Field("extra_args.nim.sampling", "honoured", "this server's router: the request's sampling "
          "parameters exactly as the engine takes them (Dynamo's fields are float32, and have no "
          "logit_bias, tool-call markers or reasoning start); Dynamo's sampling, stop and output fields "
          "must then be unset (max_tokens may repeat its value)"),
    Field("prefill_result", "refused", "disaggregated prefill/decode is not implemented"),
    Field("bootstrap_info", "refused", "disaggregated prefill/decode is not implemented"),
    Field("multi_modal_data", "refused", "this model takes text only"),
    Field("mm_processor_kwargs", "refused", "this model takes text only"),
    Field("mm_routing_info", "refused", "this model takes text only"),
    Field("encoder_result", "refused", "this model takes text only"),
    Field("require_reasoning", "refused", "reasoning is split from the answer by whoever renders "
          "the text; the worker cannot require it"),
)  # fmt: skip

_FIELD = {f.name: f for f in FIELDS}


def fields_table() -> str:
    """FIELDS as the markdown table docs/dynamo.md shows (a test keeps the two equal)."""
    rows = ["| field | handling | why |", "|---|---|---|"]
    rows += [f"| `{f.name}` | {f.handling} | {f.why} |" for f in FIELDS]
    return "\n".join(rows) + "\n"


# Routing fields the router used to pick this worker: nothing left for the worker to do.
_ROUTING_KEYS_USED_BY_ROUTER = frozenset({"backend_instance_id", "prefill_worker_id", "decode_worker_id"})


class RefusedField(ValueError):
    """A request field this worker does not honour (with this value); the message names it."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


def _sent(value: Any) -> bool:
    """`null`, and the empty object or list Dynamo writes for an unset group, mean "not sent"."""
    return value is not None and value != {} and value != []


def _check_keys(prefix: str, obj: Mapping[str, Any]) -> None:
    """Refuse keys of `obj` the table does not list, and the listed `refused` ones, when sent."""
    for key, value in obj.items():
        name = f"{prefix}.{key}" if prefix else key
        field = _FIELD.get(name)
        if not _sent(value):
            continue
        if field is None:
            raise RefusedField(name, "not a field this worker knows; leave it out")
        if field.handling == "refused":
            raise RefusedField(name, field.why)


def _object(request: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = request.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RefusedField(name, f"must be an object, got {type(value).__name__}")
    return value


def _int(obj: Mapping[str, Any], key: str, prefix: str, minimum: int | None = None) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RefusedField(f"{prefix}.{key}", f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise RefusedField(f"{prefix}.{key}", f"must be at least {minimum}, got {value}")
    return value


def _float(obj: Mapping[str, Any], key: str, prefix: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RefusedField(f"{prefix}.{key}", f"must be a finite number, got {value!r}")
    return float(value)


def _bool(obj: Mapping[str, Any], key: str, prefix: str) -> bool | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise RefusedField(f"{prefix}.{key}", f"must be true or false, got {value!r}")
    return value


def _ids(obj: Mapping[str, Any], key: str, prefix: str, vocab_size: int) -> tuple[int, ...]:
    value = obj.get(key)
    if value is None:
        return ()
    name = f"{prefix}.{key}" if prefix else key
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise RefusedField(name, "must be a list of token ids")
    if any(not 0 <= t < vocab_size for t in value):
        raise RefusedField(name, f"names a token id outside the vocabulary [0, {vocab_size})")
    return tuple(value)


def _guided_from_dynamo(spec: Mapping[str, Any]) -> GuidedDecoding:
    prefix = "sampling_options.guided_decoding"
    _check_keys(prefix, spec)
    backend = spec.get("backend")
    if backend is not None and backend != "xgrammar":
        raise RefusedField(f"{prefix}.backend", "the engine compiles grammars with xgrammar only")
    given = [k for k in ("json", "regex", "choice", "grammar") if spec.get(k) is not None]
    if len(given) != 1:
        raise RefusedField(
            prefix, f"give exactly one of json, regex, choice, grammar (got {given or 'none'})"
        )
    kind, value = given[0], spec[given[0]]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise RefusedField(f"{prefix}.json", f"not JSON: {exc}") from None
        if not isinstance(value, dict | bool):
            raise RefusedField(f"{prefix}.json", "must be a JSON schema (an object)")
        return GuidedDecoding("json_schema", json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise RefusedField(f"{prefix}.choice", "must be a non-empty list of strings")
        return GuidedDecoding("choice", json.dumps(value))
    if not isinstance(value, str):
        raise RefusedField(f"{prefix}.{kind}", "must be a string")
    return GuidedDecoding("regex" if kind == "regex" else "grammar", value)


def sampling_to_json(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as JSON, exactly (floats as float64; a Dynamo struct would keep float32)."""
    data = dataclasses.asdict(params)
    data["logit_bias"] = [[token, bias] for token, bias in params.logit_bias.items()]  # JSON keys are text
    return data


def sampling_from_json(data: Any, vocab_size: int) -> SamplingParams:
    """The inverse of `sampling_to_json`, checked (RefusedField naming what is wrong)."""
    name = "extra_args.nim.sampling"
    if not isinstance(data, Mapping):
        raise RefusedField(name, "must be an object")
    try:
        values = dict(data)
        guided = values.get("guided")
        if guided is not None:
            tuples = {key: tuple(guided.get(key, ())) for key in ("start_after", "opens_with")}
            values["guided"] = GuidedDecoding(**{**guided, **tuples})
        values["logit_bias"] = {int(t): float(b) for t, b in values.get("logit_bias", ())}
        for key in ("stop", "stop_token_ids"):
            values[key] = tuple(values.get(key, ()))
        params = SamplingParams(**values)
    except (TypeError, ValueError) as exc:  # an unknown key, a wrong type, a value out of range
        raise RefusedField(name, one_line(exc)) from None
    for field, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        if any(not 0 <= t < vocab_size for t in ids):
            raise RefusedField(
                f"{name}.{field}", f"names a token id outside the vocabulary [0, {vocab_size})"
            )
    return params


@dataclass(frozen=True)
class ModelView:
    """What the mapping needs to know of the serving model."""

    served_name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]  # the tokenizer's: dropped from hidden stop ids under ignore_eos
    adapters: Collection[str] = ()  # LoRA adapters served now


def from_dynamo(
    request: Mapping[str, Any], request_id: str, model: ModelView, arrival_time: float = 0.0
) -> GenerationRequest:
    """The engine request for a Dynamo request dict; RefusedField for what cannot be honoured."""
    _check_keys("", request)
    prompt = request.get("token_ids")
    if not isinstance(prompt, list) or not prompt:
        raise RefusedField("token_ids", "the prompt must be a non-empty list of token ids")
    prompt_ids = _ids(request, "token_ids", "", model.vocab_size)
    if len(prompt_ids) >= model.max_model_len:
        raise RefusedField(
            "token_ids",
            f"a prompt of {len(prompt_ids)} tokens does not fit the context of {model.max_model_len}",
        )
    name = request.get("model") or ""
    adapter: str | None = None
    if name and name != model.served_name:
        if name not in model.adapters:
            raise RefusedField("model", f"{name!r} is neither the served model nor one of its adapters")
        adapter = name

    routing = _object(request, "routing")
    dp_rank = routing.get("dp_rank")
    if dp_rank not in (None, 0):
        raise RefusedField("routing.dp_rank", f"this worker has one data-parallel rank (0), got {dp_rank!r}")
    stray = set(routing) - {"dp_rank"} - _ROUTING_KEYS_USED_BY_ROUTER
    if any(_sent(routing[k]) for k in stray):
        raise RefusedField("routing", f"unknown routing fields {sorted(stray)}")

    stop = _object(request, "stop_conditions")
    _check_keys("stop_conditions", stop)
    sampling = _object(request, "sampling_options")
    _check_keys("sampling_options", sampling)
    output = _object(request, "output_options")
    _check_keys("output_options", output)
    extra = _object(request, "extra_args")
    _check_keys("extra_args", extra)
    nim = _object(extra, "nim")
    _check_keys("extra_args.nim", nim)
    if _sent(nim.get("sampling")):
        params = _exact(nim["sampling"], stop, sampling, output, request, model)
    else:
        params = _standard(stop, sampling, output, request, model, len(prompt_ids))
    if params.max_tokens > model.max_model_len - len(prompt_ids):
        total = f"{len(prompt_ids)} prompt tokens + {params.max_tokens}"
        limit = f"exceed the context of {model.max_model_len}"
        raise RefusedField("stop_conditions.max_tokens", f"{total} {limit}")
    return GenerationRequest(request_id, list(prompt_ids), params, arrival_time, adapter)


def _exact(
    data: Any,
    stop: Mapping[str, Any],
    sampling: Mapping[str, Any],
    output: Mapping[str, Any],
    request: Mapping[str, Any],
    model: ModelView,
) -> SamplingParams:
    """This server's router: the exact parameters, with Dynamo's own fields unset (the router's
    max_tokens may repeat them, for Dynamo's load accounting)."""
    params = sampling_from_json(data, model.vocab_size)
    given = [f"stop_conditions.{k}" for k, v in stop.items() if _sent(v) and k != "max_tokens"]
    given += [f"sampling_options.{k}" for k, v in sampling.items() if _sent(v)]
    given += [f"output_options.{k}" for k, v in output.items() if _sent(v)]
    given += ["eos_token_ids"] if _sent(request.get("eos_token_ids")) else []
    if given:
        raise RefusedField(given[0], "give Dynamo's fields or extra_args.nim.sampling, not both")
    if stop.get("max_tokens") not in (None, params.max_tokens):
        raise RefusedField("stop_conditions.max_tokens", "disagrees with extra_args.nim.sampling.max_tokens")
    return params


def _standard(
    stop: Mapping[str, Any],
    sampling: Mapping[str, Any],
    output: Mapping[str, Any],
    request: Mapping[str, Any],
    model: ModelView,
    num_prompt: int,
) -> SamplingParams:
    """Dynamo's own fields (its frontend's requests)."""
    for key in ("n", "best_of"):
        if sampling.get(key) not in (None, 1):
            raise RefusedField(f"sampling_options.{key}", _FIELD[f"sampling_options.{key}"].why)
    if sampling.get("use_beam_search") not in (None, False):
        raise RefusedField("sampling_options.use_beam_search", "beam search is not implemented")
    if sampling.get("length_penalty") not in (None, 1, 1.0):
        raise RefusedField("sampling_options.length_penalty", "only 1.0: it weighs beam search")
    if output.get("formatted_prompt") not in (None, False):
        raise RefusedField("output_options.formatted_prompt", "the worker takes tokens, not text")
    guided: GuidedDecoding | None = None
    if _sent(sampling.get("guided_decoding")):
        value = sampling["guided_decoding"]
        if not isinstance(value, Mapping):
            raise RefusedField("sampling_options.guided_decoding", "must be an object")
        guided = _guided_from_dynamo(value)

    vocab = model.vocab_size
    ignore_eos = bool(_bool(stop, "ignore_eos", "stop_conditions"))
    hidden = _ids(stop, "stop_token_ids_hidden", "stop_conditions", vocab)
    eos = _ids(request, "eos_token_ids", "", vocab)
    if ignore_eos:
        hidden = tuple(t for t in hidden if t not in model.eos_token_ids)
        eos = ()
    stop_ids = list(_ids(stop, "stop_token_ids", "stop_conditions", vocab))
    for token in (*_ids(stop, "stop_token_ids_visible", "stop_conditions", vocab), *hidden, *eos):
        if token not in stop_ids:
            stop_ids.append(token)
    strings = stop.get("stop")
    if strings is not None and not (isinstance(strings, list) and all(isinstance(x, str) for x in strings)):
        raise RefusedField("stop_conditions.stop", "must be a list of strings")
    max_tokens = _int(stop, "max_tokens", "stop_conditions", 1)
    temperature = _float(sampling, "temperature", "sampling_options")
    top_p = _float(sampling, "top_p", "sampling_options")
    repetition = _float(sampling, "repetition_penalty", "sampling_options")
    try:
        return SamplingParams(
            max_tokens=model.max_model_len - num_prompt if max_tokens is None else max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=_int(sampling, "top_k", "sampling_options", -1) or 0,
            min_p=_float(sampling, "min_p", "sampling_options") or 0.0,
            repetition_penalty=1.0 if repetition is None else repetition,
            presence_penalty=_float(sampling, "presence_penalty", "sampling_options") or 0.0,
            frequency_penalty=_float(sampling, "frequency_penalty", "sampling_options") or 0.0,
            seed=_int(sampling, "seed", "sampling_options"),
            stop=tuple(strings or ()),
            stop_token_ids=tuple(stop_ids),
            include_stop_str_in_output=bool(
                _bool(sampling, "include_stop_str_in_output", "sampling_options")
            ),
            ignore_eos=ignore_eos,
            min_tokens=_int(stop, "min_tokens", "stop_conditions", 0) or 0,
            logprobs=_int(output, "logprobs", "output_options", 0),
            prompt_logprobs=_int(output, "prompt_logprobs", "output_options", 0),
            skip_special_tokens=_bool(output, "skip_special_tokens", "output_options") is not False,
            guided=guided,
        )
    except ValueError as exc:  # SamplingParams' own range checks name the field
        raise RefusedField("sampling_options", str(exc)) from None


def to_dynamo(request: GenerationRequest) -> dict[str, Any]:
    """The Dynamo request dict for an engine request (what this server's router sends): the exact
    parameters in extra_args["nim"]["sampling"], and max_tokens where Dynamo's router reads it.
    `from_dynamo` of it (with `model` set) gives `request` back; its id and arrival time are the
    receiver's."""
    return {
        "token_ids": list(request.prompt_token_ids),
        "stop_conditions": {"max_tokens": request.sampling.max_tokens},
        "sampling_options": None,
        "output_options": None,
        "extra_args": {"nim": {"sampling": sampling_to_json(request.sampling)}},
    }


# --- outputs -------------------------------------------------------------------------------------

# Our finish reasons in Dynamo's words, and back (Dynamo normalizes "abort*" to "cancelled").
_TO_DYNAMO: dict[FinishReason, str] = {"stop": "stop", "length": "length", "abort": "cancelled"}
_FROM_DYNAMO: dict[str, FinishReason] = {
    "stop": "stop", "eos": "stop", "length": "length", "cancelled": "abort", "abort": "abort",
}  # fmt: skip


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = out.num_prompt_tokens, out.num_generated_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def to_chunk(out: RequestOutput, token_text: Any, prompt: Sequence[int] = ()) -> dict[str, Any]:
    """A Dynamo output chunk for an engine output that did not fail (a failure is raised, not
    sent). `token_text(id) -> str` names tokens in top_logprobs, which Dynamo's frontend shows
    verbatim; `prompt` places prompt logprobs."""
    chunk: dict[str, Any] = {"token_ids": list(out.token_ids), "index": 0}
    if out.logprobs is not None:
        chunk["log_probs"] = [entry.logprob for entry in out.logprobs]
        chunk["top_logprobs"] = [
            [
                {"rank": rank, "token_id": token, "token": token_text(token), "logprob": logprob}
                for rank, (token, logprob) in enumerate(entry.top, start=1)
            ]
            for entry in out.logprobs
        ]
    if out.prompt_logprobs is not None:
        chunk["engine_data"] = {"prompt_logprobs": _prompt_logprobs(out.prompt_logprobs, prompt, token_text)}
    if out.finished:
        assert out.finish_reason is not None
        chunk["finish_reason"] = _TO_DYNAMO[out.finish_reason]
        chunk["completion_usage"] = usage(out)
    return chunk


def _prompt_logprobs(
    entries: Sequence[TokenLogprob | None], prompt: Sequence[int], token_text: Any
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs shape (as Dynamo's vLLM worker sends it): per prompt token, None for
    the first, else token id (a string) -> {logprob, rank, decoded_token}, the prompt's own first."""
    shaped: list[dict[str, dict[str, Any]] | None] = []
    for token, entry in zip(prompt, entries, strict=False):
        if entry is None:
            shaped.append(None)
            continue
        position = {
            str(token): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": token_text(token)}
        }
        for rank, (alternative, logprob) in enumerate(entry.top, start=1):
            position.setdefault(
                str(alternative), {"logprob": logprob, "rank": rank, "decoded_token": token_text(alternative)}
            )
        shaped.append(position)
    return shaped


@dataclass(frozen=True)
class Chunk:
    """A Dynamo output chunk read back into engine terms (this server's router side)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    finish_reason: FinishReason | None
    num_cached_tokens: int | None  # from completion_usage, on the last chunk


def from_chunk(
    chunk: Mapping[str, Any], prompt: Sequence[int], top: int | None, prompt_top: int | None
) -> Chunk:
    """Read one chunk: token deltas, their logprobs (the chosen token's rank is its place among the
    alternatives, or one past them: Dynamo's chunks carry no rank of the chosen token), prompt
    logprobs, and the finish reason; ValueError for a reason this side does not know."""
    tokens = [int(t) for t in chunk.get("token_ids") or ()]
    logprobs: list[TokenLogprob] | None = None
    if top is not None and chunk.get("log_probs") is not None:
        tops = chunk.get("top_logprobs") or [[] for _ in tokens]
        logprobs = []
        for token, logprob, alternatives in zip(tokens, chunk["log_probs"], tops, strict=True):
            ranked = tuple((int(a["token_id"]), float(a["logprob"])) for a in alternatives)[:top]
            ids = [t for t, _ in ranked]
            rank = ids.index(token) + 1 if token in ids else len(ids) + 1
            logprobs.append(TokenLogprob(token, float(logprob), rank, ranked))
    prompt_entries: list[TokenLogprob | None] | None = None
    engine_data = chunk.get("engine_data") or {}
    if prompt_top is not None and engine_data.get("prompt_logprobs") is not None:
        prompt_entries = []
        for token, position in zip(prompt, engine_data["prompt_logprobs"], strict=False):
            if position is None:
                prompt_entries.append(None)
                continue
            own = position[str(token)]
            # The engine gives exactly `prompt_top` alternatives; the prompt's own token is an extra
            # entry only when it is not among them (its rank is then past theirs).
            by_rank = sorted(position.items(), key=lambda item: item[1]["rank"])[:prompt_top]
            ranked = tuple((int(k), float(v["logprob"])) for k, v in by_rank)
            prompt_entries.append(TokenLogprob(token, float(own["logprob"]), int(own["rank"]), ranked))
    reason = chunk.get("finish_reason")
    finish: FinishReason | None = None
    if reason is not None:
        if reason not in _FROM_DYNAMO:
            raise ValueError(f"the worker ended the request with {reason!r}")
        finish = _FROM_DYNAMO[reason]
    cached = None
    usage_ = chunk.get("completion_usage")
    if isinstance(usage_, Mapping):
        details = usage_.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
    return Chunk(tokens, logprobs, prompt_entries, finish, cached)
