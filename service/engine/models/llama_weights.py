"""Weight loading for the Llama family: an HF-named checkpoint, tensor by tensor, into a model whose
q/k/v and gate/up projections are each one fused Linear.

The checkpoint's separate shards (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``)
are written into row slices of their fused layer; a quantized weight replaces its linear layer.
Strict: every parameter is written exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from service.engine.models.llama_layers import LINEAR_ROLES
from service.engine.models.quant import QuantizedWeight, concat_rows
from service.engine.models.quant_linear import make_linear
from service.model.config import ModelConfig
from service.model.quantization import QuantizationError

# checkpoint projection name -> (fused module name, shard index within it)
_FUSED_SHARDS: dict[str, tuple[str, int]] = {
    part: (module, index)
    for _, module, parts in LINEAR_ROLES.values()
    if len(parts) > 1
    for index, part in enumerate(parts)
}


def _checkpoint_name(param_name: str, shard: int | None) -> str:
    """The HF checkpoint name that fills (param_name, shard)."""
    if shard is None:
        return param_name
    prefix, fused_name, suffix = param_name.rsplit(".", 2)
    shard_name = next(n for n, (f, s) in _FUSED_SHARDS.items() if f == fused_name and s == shard)
    return f"{prefix}.{shard_name}.{suffix}"


def load_checkpoint(
    model: nn.Module,
    config: ModelConfig,
    weights: Iterable[tuple[str, Tensor | QuantizedWeight]],
    target_device: torch.device,
) -> None:
    """Write HF-named checkpoint weights into `model`, a Llama module tree of `config` (casting
    float tensors' dtype/device).

    Float tensors are copied into their parameters; a parameter still on 'meta' is allocated
    on ``target_device`` (in its own dtype) when first written. A quantized weight replaces its linear
    layer with a QuantLinear (for fused layers, once every shard has arrived; shards must share
    a format); a quantized embedding is dequantized (it is looked up, and the logits layer
    stays in the activation dtype: see loader.target_format).

    Strict: every parameter (every shard of a fused one) must be written exactly once; unknown
    names, duplicates and shape mismatches raise. Rotary ``inv_freq`` buffers are ignored, and so
    is ``lm_head.weight`` when embeddings are tied (HF ties it to the embedding regardless).
    """
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int | None]] = set()
    pending: dict[str, dict[int, QuantizedWeight]] = {}  # fused layer -> its quantized shards so far
    for checkpoint_name, tensor in weights:
        if checkpoint_name.endswith("rotary_emb.inv_freq"):
            continue
        if checkpoint_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target_name, shard = checkpoint_name, None
        parts = checkpoint_name.split(".")
        if len(parts) >= 3 and parts[-2] in _FUSED_SHARDS:
            fused_name, shard = _FUSED_SHARDS[parts[-2]]
            target_name = ".".join([*parts[:-2], fused_name, parts[-1]])
        if target_name not in params:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} matches no parameter of this model")
        key = (target_name, shard)
        if key in loaded:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} appears more than once")
        start, size = 0, params[target_name].shape[0]
        if shard is not None:
            start, size = _shard_rows(config, target_name.split(".")[-2], shard)
        expected_shape = (size, *params[target_name].shape[1:])
        if tuple(tensor.shape) != expected_shape:
            raise ValueError(
                f"checkpoint tensor {checkpoint_name!r} has shape {tuple(tensor.shape)}; "
                f"expected {expected_shape}"
            )
        loaded.add(key)
        if not isinstance(tensor, Tensor):
            if target_name == "model.embed_tokens.weight":
                tensor = tensor.dequantize()
            elif shard is None:
                _quantize_layer(model, target_name, tensor, params, target_device)
                continue
            else:
                shards = pending.setdefault(target_name, {})
                shards[shard] = tensor
                if len(shards) == (3 if target_name.endswith("qkv_proj.weight") else 2):
                    try:
                        fused = concat_rows([shards[i] for i in sorted(shards)])
                    except QuantizationError as error:
                        raise QuantizationError(f"{target_name}: {error}") from error
                    _quantize_layer(model, target_name, fused, params, target_device)
                    del pending[target_name]
                continue
        if target_name in pending:
            raise ValueError(f"{checkpoint_name!r} is float but other shards of its layer are quantized")
        destination = _materialize(model, target_name, params, target_device).data
        destination.narrow(0, start, size).copy_(tensor)

    # The parameters left now (a subclass may have replaced some while the weights streamed in,
    # as quantized layers replace their nn.Linear).
    missing = _expected_weights(model) - loaded
    if missing:
        names = sorted(_checkpoint_name(name, shard) for name, shard in missing)
        raise ValueError(f"checkpoint lacks {len(names)} parameter(s): {', '.join(names[:10])}")
    if pending:
        raise ValueError(f"fused layer(s) with quantized and float shards: {', '.join(sorted(pending))}")


def _shard_rows(config: ModelConfig, fused_name: str, shard: int) -> tuple[int, int]:
    """(first row, row count) of checkpoint shard `shard` within fused layer `fused_name`."""
    if fused_name == "qkv_proj":
        sizes: tuple[int, ...] = (config.q_size, config.kv_size, config.kv_size)
    else:
        sizes = (config.intermediate_size, config.intermediate_size)
    start = sum(sizes[:shard])
    return start, sizes[shard]


def _expected_weights(model: nn.Module) -> set[tuple[str, int | None]]:
    """(parameter, shard of a fused one) for every parameter a checkpoint must write."""
    expected: set[tuple[str, int | None]] = set()
    for name, _ in model.named_parameters():
        module_name = name.rsplit(".", 2)[-2]
        if module_name in ("qkv_proj", "gate_up_proj"):
            shard_count = 3 if module_name == "qkv_proj" else 2
            expected.update((name, shard) for shard in range(shard_count))
        else:
            expected.add((name, None))
    return expected


def _materialize(
    model: nn.Module, name: str, params: dict[str, nn.Parameter], device: torch.device
) -> nn.Parameter:
    """The parameter `name`, allocated on `device` if it is still on 'meta'."""
    param = params[name]
    if not param.is_meta:
        return param
    module_name, _, attr = name.rpartition(".")
    real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
    model.get_submodule(module_name).register_parameter(attr, real)
    params[name] = real
    return real


def _quantize_layer(
    model: nn.Module,
    weight_name: str,
    weight: QuantizedWeight,
    params: dict[str, nn.Parameter],
    device: torch.device,
) -> None:
    """Replace the linear layer owning `weight_name` with one over `weight`."""
    module_name = weight_name.rpartition(".")[0]
    dtype = params[weight_name].dtype
    # The bias Parameter itself (maybe still on 'meta'): _materialize finds it on the new layer.
    bias = params.get(f"{module_name}.bias")
    parent_name, _, attr = module_name.rpartition(".")
    layer = make_linear(weight, bias, dtype, device)
    setattr(model.get_submodule(parent_name), attr, layer)
