"""What the installed tensorrt_llm release honours, decided once from its version.

Most of the adapter finds capabilities by what imports (see `api.py`). Sampling is different:
every release accepts every SamplingParams field, and what its sampler then applies is only
known from the release. This module is the one place that knowledge lives; the engine refuses
what the installed release would ignore (a 400 naming the field and the release), and the
selection explanation (`list-model-profiles --explain`, /v1/metadata) states the same decision.

The facts, from TensorRT-LLM's sources and trackers (see the README's TensorRT-LLM section):

- PyTorch backend, default sampler (TorchSampler) before 1.3.0rc24: repetition_penalty,
  presence_penalty, frequency_penalty, min_p and a per-request seed are accepted and ignored
  (NVIDIA/TensorRT-LLM#9442, reported on 1.2.0rc3). Penalties were implemented for TorchSampler by
  #16485 (in 1.3.0rc24's documented feature list), min_p by #16590 (counted from 1.3.0rc26 here,
  the first release known to carry both), a per-request seed by #17172, which was shipped with a
  warning because the pinned FlashInfer reads the seed of a batch's first row only: no release
  is known to honour a seed in a batch, so it is refused on every one.
- Its logprobs (`SamplingParams.logprobs=k`) are the k most likely tokens of each position; up
  to 1.3.0rc25 the sampled token is among them only when it is one of those k, so a request that
  samples (temperature > 0) would get positions without its token's logprob. From 1.3.0rc26 the
  sampled token's logprob is always returned (`logprobs=0` is the sampled token alone).
- The TensorRT-engine backend (`_tensorrt_engine`, 1.2 series) samples in the C++ executor, which
  applies penalties, min_p and seeds.

An unparsable version string is taken as the oldest behaviour (everything above refused).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

# SamplingParams fields a sampler may silently ignore, in our SamplingParams' names.
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
_PENALTIES_FROM = (1, 3, 0, 24)  # TorchSampler applies penalties (#16485)
_MIN_P_FROM = (1, 3, 0, 26)  # ... and min_p (#16590)
_SAMPLED_LOGPROB_FROM = (1, 3, 0, 26)  # logprobs always include the sampled token
_FINAL = 10**6  # a final release sorts after all of its release candidates
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:rc(\d+))?")


def version_key(version: str) -> tuple[int, int, int, int]:
    """(major, minor, patch, release candidate) for ordering; (0, 0, 0, 0) when unreadable."""
    found = _VERSION.match(version.strip())
    if found is None:
        return (0, 0, 0, 0)
    major, minor, patch, rc = found.groups()
    return (int(major), int(minor), int(patch), int(rc) if rc is not None else _FINAL)


@dataclass(frozen=True)
class Release:
    """What one tensorrt_llm release's sampler does with our sampling fields."""

    version: str
    ignored: tuple[str, ...]  # fields its sampler accepts and does not apply: refused
    sampled_logprob: bool  # logprobs always include the sampled token's

    def statement(self) -> str:
        """One line for the selection explanation and /v1/metadata."""
        refused = ", ".join(self.ignored) if self.ignored else "nothing"
        logprobs = (
            "logprobs at any temperature"
            if self.sampled_logprob
            else "logprobs at temperature 0 only (its top-k may miss the sampled token)"
        )
        return f"tensorrt_llm {self.version}: its sampler ignores {refused} (refused with a 400); {logprobs}"


def release(version: str, built_engine: bool = False) -> Release:
    """The decision for `version` (tensorrt_llm.__version__), on either backend."""
    if built_engine:  # the C++ executor samples: everything applies; logprobs are refused there
        return Release(version, (), True)
    key = version_key(version)
    ignored: list[str] = []
    if key < _PENALTIES_FROM:
        ignored += PENALTIES
    if key < _MIN_P_FROM:
        ignored.append("min_p")
    ignored.append("seed")
    return Release(version, tuple(ignored), key >= _SAMPLED_LOGPROB_FROM)


def installed_version() -> str | None:
    """The installed tensorrt_llm's version without importing it (importing starts MPI and CUDA):
    its distribution metadata, else the `__version__` literal in its version.py."""
    try:
        return importlib.metadata.version("tensorrt_llm")
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("tensorrt_llm")
    if spec is None or spec.origin is None:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"__version__\s*=\s*[\"']([^\"']+)[\"']", text)
    return found.group(1) if found else None
