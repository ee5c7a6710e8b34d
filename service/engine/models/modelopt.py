"""NVIDIA ModelOpt checkpoints (FP8, NVFP4) as published on the Hugging Face Hub.

A ModelOpt export is a safetensors checkpoint plus its quantization settings, either in
``hf_quant_config.json`` (``{"producer": ..., "quantization": {"quant_algo": ..., ...}}``) or in
config.json's ``quantization_config`` (``quant_method: modelopt``). Each quantized linear layer
``<prefix>`` stores:

- FP8 (``quant_algo`` FP8): ``<prefix>.weight`` e4m3 [N, K], ``<prefix>.weight_scale`` fp32 scalar,
  ``<prefix>.input_scale`` fp32 scalar (static activation scale);
- FP8_PER_CHANNEL_PER_TOKEN: the same with ``weight_scale`` per output row ([N] or [N, 1]) and no
  input scale (activations are scaled per token at run time);
- NVFP4: ``<prefix>.weight`` uint8 [N, K/2] (two e2m1 per byte), ``<prefix>.weight_scale`` e4m3
  [N, K/16], ``<prefix>.weight_scale_2`` fp32 scalar, ``<prefix>.input_scale`` fp32 scalar;
- optionally ``k_proj.k_scale`` / ``v_proj.v_scale``: static KV-cache scales.

Layers the export excluded (``exclude_modules``, typically lm_head) are plain bf16 tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from service.engine.models.quant import FP8Weight, NVFP4Weight, QuantizedWeight
from service.model.quantization import CheckpointQuantization, QuantizationError

log = logging.getLogger(__name__)

_SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


def read_quantized(
    files: list[Path], quant: CheckpointQuantization
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every tensor of the checkpoint, each quantized linear's tensors combined into one format value
    under ``<prefix>.weight``; static KV scales are skipped (the KV cache scales per token)."""
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files]
        where: dict[str, Any] = {}
        for file, handle in zip(files, handles, strict=True):
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name in where:
                    raise QuantizationError(f"{name}: appears in more than one shard (again in {file.name})")
                where[name] = handle
        scaled = {name.rsplit(".", 1)[0] for name in where if name.endswith(".weight_scale")}

        def get(key: str) -> torch.Tensor | None:
            return where[key].get_tensor(key) if key in where else None

        skipped_kv = 0
        for name, handle in where.items():
            prefix, _, leaf = name.rpartition(".")
            if name.endswith(_KV_SCALE_SUFFIXES):
                skipped_kv += 1
                continue
            if leaf in _SCALE_SUFFIXES:
                if prefix not in scaled:
                    raise QuantizationError(f"{name}: a scale without {prefix}.weight_scale")
                continue  # read with its weight
            if leaf == "weight" and prefix in scaled:
                tensors = {suffix: get(f"{prefix}.{suffix}") for suffix in _SCALE_SUFFIXES}
                yield name, _combine(name, handle.get_tensor(name), tensors, quant)
            else:
                yield name, handle.get_tensor(name)
    if skipped_kv:
        log.info(
            "checkpoint's %d static KV-cache scales (k_scale/v_scale) not used: the fp8/int8 KV cache "
            "computes a scale per token and head",
            skipped_kv,
        )


def _combine(
    name: str,
    weight: torch.Tensor,
    scales: dict[str, torch.Tensor | None],
    quant: CheckpointQuantization,
) -> QuantizedWeight:
    scale = scales["weight_scale"]
    if scale is None:
        raise QuantizationError(f"{name}: no weight_scale")
    input_scale = scales["input_scale"]
    rows = int(weight.shape[0]) if weight.dim() == 2 else 0
    if weight.dim() != 2:
        raise QuantizationError(f"{name}: quantized weights must be 2-D, got shape {tuple(weight.shape)}")
    if input_scale is not None:
        input_scale = input_scale.float().reshape(-1)
        if input_scale.numel() != 1:
            raise QuantizationError(f"{name}: input_scale must hold one value, got {input_scale.numel()}")
        input_scale = input_scale.reshape(())
    if quant.precision == "fp8":
        if weight.dtype != torch.float8_e4m3fn:
            raise QuantizationError(
                f"{name}: {quant.quant_algo} weights must be float8_e4m3fn, got {weight.dtype}"
            )
        if scale.dtype != torch.float32:
            raise QuantizationError(f"{name}.weight_scale: must be float32, got {scale.dtype}")
        if scale.numel() == 1:
            per_row = scale.reshape(1).expand(rows).clone()
        elif tuple(scale.shape) in ((rows,), (rows, 1)):
            per_row = scale.reshape(rows).clone()
        else:
            raise QuantizationError(
                f"{name}.weight_scale: shape {tuple(scale.shape)} is neither per-tensor nor per-row ({rows})"
            )
        return FP8Weight(weight, per_row, input_scale).validate(name)
    global_scale = scales["weight_scale_2"]
    if global_scale is None:
        raise QuantizationError(f"{name}: NVFP4 weights need weight_scale_2")
    if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
        raise QuantizationError(
            f"{name}.weight_scale_2: must be one float32 value, "
            f"got {global_scale.dtype} {tuple(global_scale.shape)}"
        )
    return NVFP4Weight(weight, scale, global_scale.reshape(1).expand(rows).clone(), input_scale).validate(
        name
    )
