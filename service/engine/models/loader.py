"""Checkpoint readers and model construction.

Readers yield ``(hf_parameter_name, tensor)`` pairs one tensor at a time, so peak memory is the
model plus one tensor. Only formats that cannot execute code are read: safetensors and GGUF.
Pickle-based checkpoints (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) are refused, never unpickled.

Weights come out in the profile's precision: a float tensor, or for quantized precisions the
linear layers as a format value of service.engine.models.quant, taken directly from the file
where its format maps exactly (GGUF Q4_0/Q4_1 for int4_wo, ModelOpt FP8/NVFP4 checkpoints) and
quantized at load otherwise (`quantize_at_load`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from service.engine.models import gguf_blocks
from service.engine.models.base import ONE_PROCESS, BuildOptions, CausalLM, CpuPrepackable
from service.engine.models.cpu_linear import prepacking_supported
from service.engine.models.modelopt import read_quantized
from service.engine.models.moe import Experts, per_expert
from service.engine.models.quant import (
    Int4Weight,
    QuantizedWeight,
    gguf_q4_0,
    gguf_q4_1,
    quantize,
)
from service.engine.models.quant_linear import CPU_INT_KERNEL_DTYPE, Int4Linear, Int8Linear, int4_layers_on
from service.engine.models.registry import model_class
from service.engine.models.tensor_parallel import TPLayout, pad_rows
from service.engine.native import w4a8
from service.engine.precision import FLOAT_PRECISIONS
from service.model.config import ModelConfig, UnsupportedModelError
from service.model.gguf_file import gguf_reader
from service.model.quantization import QuantizationError
from service.store.checkpoint import Checkpoint, inspect_local, weight_files

Weight = torch.Tensor | QuantizedWeight
# Group size for int4 quantized at load from a float checkpoint (GGUF files use their 32).
log = logging.getLogger(__name__)

DEFAULT_INT4_GROUP = 128
_LAYER_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
    r"|(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2))\.weight"
)


def linear_role(name: str, config: ModelConfig) -> str | None:
    """'layer' for a decoder layer's projection (an expert's too; a mixture-of-experts router
    stays float, as in vLLM), 'logits' for the output projection (the embedding when tied), None
    for anything else (norms, biases, an untied embedding)."""
    if _LAYER_LINEAR.fullmatch(name):
        return "layer"
    if name == "lm_head.weight" or (name == "model.embed_tokens.weight" and config.tie_word_embeddings):
        return "logits"
    return None


def target_format(precision: str, role: str | None) -> str | None:
    """The format a weight of this role is held in under `precision` (None: float).

    The logits layer loads in the activation dtype under every precision (ModelOpt exports
    exclude lm_head too); on the CPU, weight-only int profiles then hold it so that a step reads
    fewer bytes, once the model is built (BuildOptions.logits_format, NIM_COMPACT_LOGITS).
    """
    if role != "layer" or precision in FLOAT_PRECISIONS:
        return None
    return precision


def quantize_at_load(
    weights: Iterable[tuple[str, Weight]],
    precision: str,
    config: ModelConfig,
    int4_group: int = DEFAULT_INT4_GROUP,
) -> Iterator[tuple[str, Weight]]:
    """Float weights of quantized roles quantized into `precision`'s formats; the rest as given."""
    for name, tensor in weights:
        target = target_format(precision, linear_role(name, config))
        if target is not None and isinstance(tensor, torch.Tensor):
            if target == "nvfp4":
                raise QuantizationError(
                    f"{name}: nvfp4 weights are read from ModelOpt NVFP4 checkpoints, not quantized at load"
                )
            yield name, quantize(tensor, target, name, int4_group)
        else:
            yield name, tensor


def quantizes_at_load(source: Checkpoint | Path, model_format: str, precision: str) -> bool:
    """Whether loading the checkpoint in `precision` quantizes any weight (the work worth caching),
    as opposed to reading every quantized weight from the file as it is."""
    if precision in FLOAT_PRECISIONS:
        return False
    checkpoint = inspected(source)
    if model_format != "gguf":
        return checkpoint.quantization is None
    reader = gguf_reader(checkpoint.path)
    for tensor in reader.tensors:
        if tensor.name in _GGUF_CONFIG_TENSORS:
            continue
        role = linear_role(gguf_to_hf_name(tensor.name), checkpoint.config)
        if target_format(precision, role) is not None and not (
            precision == "int4_wo" and tensor.tensor_type in _GGUF_INT4
        ):
            return True
    return False


def inspected(source: Checkpoint | Path) -> Checkpoint:
    """The checkpoint as planning inspected it (EngineConfig.checkpoint); a path, as tests and
    tools pass, is inspected here."""
    return source if isinstance(source, Checkpoint) else inspect_local(Path(source))


def load_hf_dir(
    source: Checkpoint | Path, precision: str
) -> tuple[ModelConfig, Iterator[tuple[str, Weight]]]:
    """An HF checkpoint directory: its config, and its weights in `precision` (see the module doc).

    A quantized (ModelOpt) checkpoint serves only its own precision; anything else is refused
    before a tensor is read.
    """
    checkpoint = inspected(source)
    config, files, quant = checkpoint.config, list(checkpoint.weight_files), checkpoint.quantization
    if quant is None:
        return config, quantize_at_load(per_expert(_read_safetensors(files)), precision, config)
    if quant.precision != precision:
        raise QuantizationError(
            f"{checkpoint.path} is a ModelOpt {quant.quant_algo} checkpoint: it serves as {quant.precision}, "
            f"not {precision}; choose one of its {quant.precision} profiles"
        )
    return config, read_quantized(files, quant)


def hf_dir_shards(
    source: Checkpoint | Path, precision: str, layout: TPLayout
) -> Iterator[tuple[str, Weight]] | None:
    """A tensor-parallel rank's shards of an HF directory's weights, reading only their bytes,
    where weights are used as stored (a float precision of an unquantized checkpoint); None
    elsewhere. Weights quantized at load are quantized whole and then sliced (an int8 row's scale
    spans the whole row), so each rank's shards equal the one-rank weights; ModelOpt checkpoints
    are read whole too. Either way a rank holds one whole tensor at most besides its shards."""
    if precision not in FLOAT_PRECISIONS:
        return None
    checkpoint = inspected(source)
    if checkpoint.quantization is not None:
        return None
    return _read_safetensor_shards(list(checkpoint.weight_files), layout)


def _read_safetensor_shards(files: list[Path], layout: TPLayout) -> Iterator[tuple[str, Weight]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                split = layout.split_of(name)
                if split is None or split[0] == "bias":  # replicated (or rank 0's bias): small
                    # (a layer's stacked experts are read whole, then each expert sliced)
                    for part, tensor in per_expert([(name, handle.get_tensor(name))]):
                        yield part, layout.shard(part, tensor)
                    continue
                how, start, stop = split
                stored = handle.get_slice(name)  # reads only the bytes indexed below
                if how == "columns":
                    yield name, stored[:, start:stop]
                    continue
                rows = stored.get_shape()[0]
                part = stored[start : min(stop, rows)]
                yield name, part if stop <= rows else pad_rows(part, stop - start, name)


def load_safetensors_dir(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the ``*.safetensors`` files in ``path`` (sharded via the index, or not).

    Errors are raised on the call, before the first tensor is read, not on first iteration.
    """
    return _read_safetensors(list(weight_files(Path(path))))


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, handle.get_tensor(name)


# GGUF tensor names -> HF names. Per block: blk.N.<gguf> -> model.layers.N.<hf>.
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Consumed by ModelConfig.from_gguf (llama3 rope scaling), not a parameter.
_GGUF_CONFIG_TENSORS = {"rope_freqs.weight"}


def gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_BLOCK_PATTERN.fullmatch(name)
    if match is None or match.group(2) not in _GGUF_BLOCK_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {name!r} is not understood by this loader")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[part]}.{kind}"


def unpermute_llama_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for its interleaved-pair RoPE.

    convert_hf_to_gguf.py stores ``w.reshape(H, 2, D/2, *rest).swapaxes(1, 2).reshape(shape)`` so
    that each head's rows interleave its two halves; HF's rotate-half RoPE needs them back in halves.
    Works for weights [H*D, in] and biases [H*D].
    """
    shape = weight.shape
    half = shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def dequantize_gguf_tensor(tensor: gguf.ReaderTensor) -> np.ndarray:
    """float32 numpy array in row-major HF order ([out, in] for a weight) for any type gguf can dequantize."""
    try:
        # np.asarray drops the np.memmap subclass, whose per-slice bookkeeping dominates dequantization.
        raw = np.asarray(tensor.data)
        array = gguf_blocks.dequantize(raw, tensor.tensor_type)  # the common types, on every thread
        if array is None:
            array = gguf.quants.dequantize(raw, tensor.tensor_type)
    except NotImplementedError as error:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be dequantized"
        ) from error
    # GGUF lists dims fastest-first (ne order); numpy's row-major shape is the reverse.
    expected_shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    array = array.reshape(expected_shape)
    if array.dtype != np.float32:
        array = array.astype(np.float32)
    return array


def load_gguf(
    source: Checkpoint | Path, precision: str = "fp32"
) -> tuple[ModelConfig, Iterator[tuple[str, Weight]]]:
    """Read a GGUF file: its config (the inspection's, when given one), and its tensors under HF
    names in `precision`: float32 for float precisions (cast by the model), Q4_0/Q4_1 blocks as int4
    directly under int4_wo, the rest quantized at load (int4 groups of 32, as the file's own).

    The file is memory-mapped; tensors are read one at a time as the iterator is consumed.
    """
    path = source.path if isinstance(source, Checkpoint) else Path(source)
    reader = gguf_reader(path)
    config = source.config if isinstance(source, Checkpoint) else ModelConfig.from_gguf(reader)
    if precision == "nvfp4":
        raise QuantizationError(
            f"{path}: nvfp4 weights are read from ModelOpt NVFP4 checkpoints, not GGUF files"
        )
    return config, quantize_at_load(_read_gguf_tensors(reader, config, precision), precision, config, 32)


_GGUF_INT4 = {gguf.GGMLQuantizationType.Q4_0: gguf_q4_0, gguf.GGMLQuantizationType.Q4_1: gguf_q4_1}


def _read_gguf_tensors(
    reader: gguf.GGUFReader, config: ModelConfig, precision: str
) -> Iterator[tuple[str, Weight]]:
    # llama.cpp permutes q/k only for the llama architecture (its non-NeoX RoPE); qwen2/qwen3 use
    # NeoX RoPE and are stored as in HF.
    permuted = config.architecture == "llama"
    for tensor in reader.tensors:
        if tensor.name in _GGUF_CONFIG_TENSORS:
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        heads = None
        if permuted and ".self_attn.q_proj." in hf_name:
            heads = config.num_heads
        elif permuted and ".self_attn.k_proj." in hf_name:
            heads = config.num_kv_heads
        direct = _GGUF_INT4.get(tensor.tensor_type)
        if direct is not None and target_format(precision, linear_role(hf_name, config)) == "int4_wo":
            k, n = (int(d) for d in tensor.shape.tolist())
            weight = direct(np.asarray(tensor.data), n, k)
            if heads is not None:
                q, scale, zero = (_unpermute_rows(t, heads) for t in (weight.q, weight.scale, weight.zero))
                weight = Int4Weight(q, scale, zero, weight.group_size)
            yield hf_name, weight.validate(hf_name)
            continue
        array = dequantize_gguf_tensor(tensor)
        if heads is not None:
            array = unpermute_llama_rope_rows(array, heads)
        if not array.flags.writeable:  # a view of the read-only memory map (F32 tensors)
            array = array.copy()
        yield hf_name, torch.from_numpy(np.ascontiguousarray(array))


def _unpermute_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(unpermute_llama_rope_rows(t.numpy(), num_heads)))


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, Weight]],
    dtype: torch.dtype,
    device: torch.device | str,
    options: BuildOptions = ONE_PROCESS,
) -> CausalLM:
    """Build the registry's model for `config` with `options` on 'meta' and load ``weights`` onto
    ``device``: each float parameter is allocated in ``dtype`` when it is first written, and
    quantized weights replace their linear layers, so no full-precision copy of a quantized layer
    is ever allocated. With `options.prepack_cpu` the linear layers are then held in oneDNN's
    packed layout, where the model and this dtype allow it (`prepacking_supported`).

    Returns the model in eval mode with gradients off.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = model_class(config.architecture)(config, options)
    model = model.to(dtype=dtype)
    kernel = _w4a8_kernel(options.int4_kernel)
    with int4_layers_on(kernel):
        model.load_weights(weights, device=device)
    if kernel == "w4a8":
        _after_w4a8(model)
    if options.int_kernels_in_bf16:
        assert isinstance(model, nn.Module)
        for module in model.modules():
            if isinstance(module, Int4Linear | Int8Linear):
                module.compute_in(CPU_INT_KERNEL_DTYPE)
    model.eval()
    model.requires_grad_(False)
    if options.prepack_cpu and isinstance(model, CpuPrepackable) and prepacking_supported(dtype, device):
        model.prepack_for_cpu()
    return model


def _w4a8_kernel(requested: str) -> str:
    """The int4 kernel a build asking for `requested` gets: W4A8 only where it is loaded (built on
    first use), else aten's, logged."""
    if requested != "w4a8":
        return "aten"
    problem = w4a8.problem()
    if problem is not None:
        log.warning("int4 layers stay on aten's int4 kernel: %s", problem)
        return "aten"
    return "w4a8"


def _after_w4a8(model: CausalLM) -> None:
    """Log the int4 layers that stayed on aten's kernel (once per reason), and run each routed
    layer whose experts are all on W4A8 in one call (Experts.fuse_w4a8)."""
    assert isinstance(model, nn.Module)
    kept: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, Int4Linear) and module.w4a8_problem is not None:
            kept[module.w4a8_problem] = kept.get(module.w4a8_problem, 0) + 1
    for why, count in kept.items():
        log.warning("%d int4 layers stay on aten's int4 kernel: %s", count, why)
    unfused: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, Experts) and module.gate_up_layers is not None:
            reason = module.fuse_w4a8()
            if reason is not None:
                unfused[reason] = unfused.get(reason, 0) + 1
    for why, count in unfused.items():
        log.warning("%d routed layers run their experts one kernel call each: %s", count, why)
