"""Speculative decoding as vLLM users configure it: the JSON of vLLM's `--speculative-config`.

NIM_SPECULATIVE_CONFIG (or `serve --speculative-config JSON`) holds it; NIM_DRAFT_MODEL_PATH names a
draft model on its own (or agrees with the JSON's "model"). What is understood:

- `{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": A, "prompt_lookup_max": B}`:
  prompt lookup (no second model): the longest suffix of A..B tokens that occurred earlier in the
  request's tokens proposes the K tokens that followed it. As in vLLM, an unset bound takes the
  other's value, and both unset are 5 (vLLM's default ngram window).
- `{"model": PATH, "num_speculative_tokens": K}` (method "draft_model", implied by "model"): a smaller
  model sharing the target's tokenizer proposes K tokens a step (its argmax for greedy rows, drawn
  from its own distribution for sampled ones: service.engine.torch.speculative.draft).
- `disable_by_batch_size`: no speculation while that many requests or more run (vLLM's meaning);
  `draft_tensor_parallel_size` passes when 1.

Any other key, or another method (eagle, medusa, mtp, ...), stops the start with one line saying
which and what is understood, since an ignored setting would silently serve something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

SpeculativeMethod = Literal["ngram", "draft_model"]

DEFAULT_LOOKUP = 5  # vLLM's ngram window when neither bound is set
DRAFT_MODEL_DEFAULT_TOKENS = 4  # NIM_DRAFT_MODEL_PATH without a config: tokens proposed a step
MAX_SPECULATIVE_TOKENS = 16

KNOWN_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "draft_tensor_parallel_size",
)
# vLLM's other methods: refused by name (they need trained heads or model code this server lacks).
OTHER_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix", "ernie_mtp")


class SpeculativeConfigError(ValueError):
    """The speculative config cannot be honoured; the message says what and what to do, in one line."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP  # ngram
    prompt_lookup_max: int = DEFAULT_LOOKUP  # ngram
    model: str | None = None  # draft_model: the draft's directory (or .gguf)
    disable_by_batch_size: int | None = None  # no speculation while this many requests run

    def describe(self) -> str:
        if self.method == "ngram":
            window = f"{self.prompt_lookup_min}..{self.prompt_lookup_max}"
            return (
                f"ngram prompt lookup ({window}-token suffixes), {self.num_speculative_tokens} tokens a step"
            )
        return f"draft model {self.model}, {self.num_speculative_tokens} tokens a step"


def parse_speculative_config(
    text: str | None, draft_model_path: str | None = None
) -> SpeculativeConfig | None:
    """NIM_SPECULATIVE_CONFIG's JSON and NIM_DRAFT_MODEL_PATH -> the config, or None (both unset)."""
    raw = (text or "").strip()
    if not raw:
        if draft_model_path:
            return SpeculativeConfig("draft_model", DRAFT_MODEL_DEFAULT_TOKENS, model=draft_model_path)
        return None
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError as exc:
        example = '{"method": "ngram", "num_speculative_tokens": 4}'
        raise SpeculativeConfigError(
            f"NIM_SPECULATIVE_CONFIG is not JSON ({exc.msg}): give vLLM's --speculative-config, "
            f"e.g. {example}"
        ) from None
    if not isinstance(fields, dict):
        raise SpeculativeConfigError(
            "NIM_SPECULATIVE_CONFIG must be a JSON object (vLLM's --speculative-config)"
        )
    unknown = sorted(set(fields) - set(KNOWN_KEYS))
    if unknown:
        raise SpeculativeConfigError(
            f"NIM_SPECULATIVE_CONFIG: unknown key {unknown[0]!r}; "
            f"this server understands {', '.join(KNOWN_KEYS)}"
        )
    return _resolve(fields, draft_model_path)


def _resolve(fields: dict[str, Any], draft_model_path: str | None) -> SpeculativeConfig:
    model = fields.get("model")
    method = fields.get("method")
    if model == "[ngram]":  # vLLM's older spelling of the ngram method
        model, method = None, method or "ngram"
    if method is None:
        method = "draft_model" if model or draft_model_path else None
    if method in OTHER_METHODS:
        raise SpeculativeConfigError(
            f'NIM_SPECULATIVE_CONFIG: method {method!r} is not implemented here; use "ngram" or a draft '
            'model ({"model": PATH, "num_speculative_tokens": N})'
        )
    if method not in ("ngram", "draft_model"):
        raise SpeculativeConfigError(
            f"NIM_SPECULATIVE_CONFIG: method {method!r} is unknown; "
            'use "ngram" or "draft_model" (with "model")'
        )
    tokens = _positive(
        fields, "num_speculative_tokens", None if method == "ngram" else DRAFT_MODEL_DEFAULT_TOKENS
    )
    if tokens > MAX_SPECULATIVE_TOKENS:
        raise SpeculativeConfigError(
            f"NIM_SPECULATIVE_CONFIG: num_speculative_tokens={tokens} is more than {MAX_SPECULATIVE_TOKENS}"
        )
    tp = fields.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise SpeculativeConfigError(
            f"NIM_SPECULATIVE_CONFIG: draft_tensor_parallel_size={tp!r}: the draft runs on one rank (use 1)"
        )
    by_batch = fields.get("disable_by_batch_size")
    if by_batch is not None:
        by_batch = _positive(fields, "disable_by_batch_size", None)
    if method == "ngram":
        if model:
            raise SpeculativeConfigError('NIM_SPECULATIVE_CONFIG: method "ngram" takes no "model"')
        low = fields.get("prompt_lookup_min")
        high = fields.get("prompt_lookup_max")
        low = _positive(fields, "prompt_lookup_min", None) if low is not None else None
        high = _positive(fields, "prompt_lookup_max", None) if high is not None else None
        low, high = (low or high or DEFAULT_LOOKUP), (high or low or DEFAULT_LOOKUP)
        if low > high:
            raise SpeculativeConfigError(
                f"NIM_SPECULATIVE_CONFIG: prompt_lookup_min={low} is more than prompt_lookup_max={high}"
            )
        return SpeculativeConfig("ngram", tokens, low, high, disable_by_batch_size=by_batch)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in fields:
            raise SpeculativeConfigError(
                f"NIM_SPECULATIVE_CONFIG: {key} is an ngram setting, not a draft model's"
            )
    if model and draft_model_path and str(model) != draft_model_path:
        raise SpeculativeConfigError(
            f"NIM_SPECULATIVE_CONFIG names draft model {model!r} but "
            f"NIM_DRAFT_MODEL_PATH={draft_model_path!r}: set one"
        )
    path = str(model or draft_model_path or "")
    if not path:
        raise SpeculativeConfigError(
            'NIM_SPECULATIVE_CONFIG: method "draft_model" needs "model" (or NIM_DRAFT_MODEL_PATH)'
        )
    return SpeculativeConfig("draft_model", tokens, model=path, disable_by_batch_size=by_batch)


def _positive(fields: dict[str, Any], key: str, default: int | None) -> int:
    value = fields.get(key, default)
    if value is None:
        raise SpeculativeConfigError(f"NIM_SPECULATIVE_CONFIG: {key} is required (a positive integer)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpeculativeConfigError(f"NIM_SPECULATIVE_CONFIG: {key}={value!r} is not a positive integer")
    return value
