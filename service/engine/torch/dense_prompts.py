"""Whether a step's prompt rows go through dense bf16 copies of the int4 weights
(service.engine.models.prompt_rows), and why: decided once the model is loaded, before the
warm-up, and shown in /v1/metadata (executionPaths.dense_prompt_rows).

Chosen where every condition holds: native int4 projections (the int4_wo profile on the CPU),
bf16 activations (the CPUs with a bf16 matmul: AVX512-BF16 or AMX), one process (no tensor
parallelism), the probe finding every row of a TILE-row call computed alike at each layer shape,
and the copies (2 bytes a weight) within MEMORY_SHARE of the memory available. A layer whose
packed layout does not unpack as expected keeps all its rows on the int4 kernel (and says so).
"""

from __future__ import annotations

import logging

import torch

from service.engine.models.base import CausalLM
from service.engine.models.prompt_rows import TILE, tile_problem
from service.engine.models.quant_linear import Int4Linear
from service.engine.protocol import PathChoice
from service.engine.torch.device import free_memory_bytes

log = logging.getLogger(__name__)

SETTING = "NIM_DENSE_PROMPT_ROWS=off"
MEMORY_SHARE = 0.25  # the dense copies may take at most this share of the memory available


def dense_prompt_path(
    model: CausalLM, enabled: bool, device: torch.device, dtype: torch.dtype, tensor_parallel: bool
) -> PathChoice:
    def chosen(used: bool, reason: str) -> PathChoice:
        return PathChoice("dense_prompt_rows", used, reason, SETTING)

    layers = [
        layer.module
        for layer in model.linear_layers()
        if isinstance(layer.module, Int4Linear) and layer.module.native
    ]
    if not layers:
        return chosen(False, "no native int4 projections (the int4_wo profile on the CPU)")
    if not enabled:
        return chosen(False, f"off ({SETTING}): prompt rows run the int4 kernel")
    if dtype != torch.bfloat16 or device.type != "cpu":
        return chosen(False, f"{dtype} activations: prompt rows run the int4 kernel (bf16 ones only)")
    if tensor_parallel:
        return chosen(False, "tensor parallelism: prompt rows run the int4 kernel")
    for shape in sorted({(m.in_features, m.out_features) for m in layers}):
        problem = tile_problem(*shape)
        if problem is not None:
            log.warning("%s; prompt rows run the int4 kernel", problem)
            return chosen(False, f"{problem}; prompt rows run the int4 kernel")
    nbytes = sum(2 * m.in_features * m.out_features for m in layers)
    available = free_memory_bytes(device)
    if nbytes > MEMORY_SHARE * available:
        why = (f"bf16 copies of the int4 layers ({nbytes / 2**20:.0f} MiB) would take more than "
               f"{MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available")  # fmt: skip
        return chosen(False, f"{why}: prompt rows run the int4 kernel")
    kept = []
    for module in layers:
        problem = module.attach_dense()
        if problem is not None:
            kept.append(problem)
    attached = len(layers) - len(kept)
    if kept:
        log.warning("%d int4 layers keep every row on the int4 kernel: %s", len(kept), kept[0])
    reason = (
        f"prompt rows through bf16 copies of {attached} int4 layers ({nbytes / 2**20:.0f} MiB), "
        f"{TILE} rows a call; decode rows on the int4 kernel"
    )
    if kept:
        reason += f" ({len(kept)} layers all int4: {kept[0]})"
    log.info("dense prompt rows: %s", reason)
    return chosen(attached > 0, reason)
