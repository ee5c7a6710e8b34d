"""Whether the engine speculates, with what, and why: decided once when the core is built, shown in
/v1/metadata (executionPaths.speculative_decoding) and logged once."""

from __future__ import annotations

import logging

from service.engine.protocol import PathChoice
from service.engine.speculative_config import SpeculativeConfig
from service.engine.torch.speculative.draft import DraftModel
from service.engine.torch.speculative.speculator import MAX_BACKOFF_STEPS, Speculator

log = logging.getLogger(__name__)

SETTING = "NIM_SPECULATIVE_CONFIG"


def speculation(
    config: SpeculativeConfig | None, max_model_len: int, draft: DraftModel | None
) -> tuple[Speculator | None, PathChoice]:
    """The speculator (None: no speculation) and the choice as /v1/metadata shows it."""
    if config is None:
        return None, PathChoice("speculative_decoding", False, f"{SETTING} is unset", SETTING)
    if config.method == "draft_model" and draft is None:
        raise ValueError("a draft model's speculation needs the draft model")
    reason = (
        f"{config.describe()} ({SETTING}); greedy output unchanged, sampled rows by rejection sampling; "
        f"a request backs off (up to {MAX_BACKOFF_STEPS} steps) after verifications that accept nothing"
    )
    log.info("speculative decoding: %s", reason)
    speculator = Speculator(config, max_model_len, draft if config.method == "draft_model" else None)
    return speculator, PathChoice("speculative_decoding", True, reason, SETTING)
