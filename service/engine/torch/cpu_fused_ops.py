"""Whether a CPU model runs its norms and MoE routing as fused native ops (/v1/metadata:
executionPaths.cpu_fused_ops).

Chosen where the model is on the CPU, NIM_CPU_FUSED_OPS is auto, the native CPU ops extension
builds here (native/extension.py) and its start-up check passes (native/fused_ops.check: the ops
against the aten sequences they replace, every row alike at any batch size). Then every
Llama-family RMSNorm (with the residual add before it) and every MoE layer's routing is one op
(BuildOptions.cpu_fused_ops), in eager modules and the scripted decode alike, and so is the greedy
sampler's argmax (ModelRunner.fused_sampling: the same ids and values), the table RoPE (bitwise
its three aten ops) and decode rows' attention,
each row reading its blocks of the paged cache in place (decode_path.DecodeAttention.NATIVE, where
the cache holds the activations' dtype; Gemma 3's scripted step gathers its blocks); else aten's
ops. Gemma 3's norms (1 + w, one rounding) keep aten's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from torch import nn

from service.engine.models.base import CausalLM
from service.engine.models.llama_layers import RMSNorm
from service.engine.models.moe import SparseMoeBlock
from service.engine.models.rope import RotaryEmbedding
from service.engine.native import extension, fused_ops
from service.engine.protocol import PathChoice

log = logging.getLogger(__name__)

SETTING = "NIM_CPU_FUSED_OPS=off"
NAME = "cpu_fused_ops"


def choose(device: torch.device, enabled: bool) -> PathChoice:
    """The choice for a model on `device`, before it is built (`.used`: BuildOptions.cpu_fused_ops);
    `path` restates it once the model is built."""
    if device.type != "cpu":
        return PathChoice(NAME, False, "the model is not on the CPU", SETTING)
    if not enabled:
        return PathChoice(NAME, False, f"off ({SETTING}): aten's op sequences", SETTING)
    started = time.monotonic()
    problem = extension.problem()
    if problem is None:
        try:
            problem = fused_ops.check()
        except Exception as error:  # an op that raises (a stale build, say): aten's ops, not a failed start
            problem = f"the fused ops' start-up check failed ({type(error).__name__}: {error})"
    if problem is not None:
        log.warning(
            "%s; norms, routing and decode attention run aten's ops (%s skips them)", problem, SETTING
        )
        return PathChoice(NAME, False, f"{problem}; aten's op sequences instead", SETTING)
    return PathChoice(
        NAME,
        True,
        f"checked against aten's ops and batch-invariant at start-up ({extension.isa()}, "
        f"{time.monotonic() - started:.2f} s)",
        SETTING,
    )


def path(model: CausalLM, choice: PathChoice) -> PathChoice:
    """The choice as /v1/metadata shows it, once the model is built: what runs fused in it (the
    greedy argmax always does; norms only in Llama-family models, routing only in MoE ones)."""
    if not choice.used:
        return choice
    assert isinstance(model, nn.Module)
    norms = sum(isinstance(m, RMSNorm) and m.native for m in model.modules())
    routers = sum(isinstance(m, SparseMoeBlock) and m.native for m in model.modules())
    fused = [f"{norms} RMSNorms (with their residual adds)"] if norms else []
    fused += [f"{routers} MoE routers"] if routers else []
    rotary = getattr(model, "rotary", None)
    fused += ["the rotary embedding"] if isinstance(rotary, RotaryEmbedding) and rotary.native else []
    fused += ["the greedy argmax"]
    return replace(choice, reason=f"{', '.join(fused)} as one native op each; {choice.reason}")


def with_decode_attention(choice: PathChoice, native: bool) -> PathChoice:
    """`path`'s choice with how decode rows attend, once the engine's decode path is chosen
    (decode_path.DecodeAttention.NATIVE where the cache holds the activations' dtype and the step
    calls the op; Gemma 3's scripted step and int8/fp8 caches gather their blocks)."""
    if not choice.used:
        return choice
    if native:
        how = "decode attention too, each row's blocks of the paged cache read in place"
    else:
        how = "decode attention gathers its cache blocks (a quantized cache, or Gemma 3's scripted step)"
    return replace(choice, reason=f"{choice.reason}; {how}")
