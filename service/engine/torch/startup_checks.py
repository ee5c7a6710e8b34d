"""Start-up checks of the CUDA paths that have not been measured on a GPU, against the paths they
replace.

Each check runs before the server is ready, over every shape the path will meet while serving,
compiling whatever it launches, and returns None when the new path agrees with the proven one (to
the dtype's rounding; NaN never agrees), else one line saying what failed. The caller then falls
back to the proven path and logs that line; nothing here runs inside a step.

| path                 | proven path                | shapes checked                                    |
|----------------------|----------------------------|---------------------------------------------------|
| unified attention    | gathered cache blocks      | every launch shape `launch_shape` can pick for the |
|                      |                            | step's longest query run, windowed where a layer  |
|                      |                            | has a window; several sequences and a lone one    |
| fp8 `_scaled_mm`     | the dequantized matmul     | every layer's (out, in) shape at 1, 2, 4, ... up  |
|                      |                            | to the step's token budget tokens                 |
| fp8 rows kernel      | the dequantized matmul     | every layer's shape at 1, 2, 5, 8 and 16 rows     |
| fused kernels        | PyTorch's ops              | the model's own forward at one token and a chunk  |
| decode CUDA graphs   | the same step run eagerly  | every batch-size bucket (cuda_graphs.capture)     |

The engine process, the fifth such path, is checked by starting it (service.serving).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from service.engine.models import triton_fp8, triton_ops
from service.engine.models.base import CausalLM
from service.engine.models.llama_layers import RMSNorm
from service.engine.models.quant_linear import FP8Linear
from service.engine.models.rope import RotaryEmbedding
from service.engine.protocol import PathChoice
from service.engine.torch.kv_pool import KVCacheSpec, KVPool
from service.engine.torch.paged_attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillChunk,
    UnifiedStep,
    decode_mask,
    prefill_mask,
)
from service.engine.torch.triton_unified_attention import launch_shape
from service.model.config import ModelConfig
from service.util import one_line

# The settings that turn each path off (the names /v1/metadata and the log lines give).
UNIFIED_SETTING = "NIM_UNIFIED_ATTENTION=off"
GRAPHS_SETTING = "NIM_ENFORCE_EAGER=1"
FP8_SETTING = "NIM_FP8_SCALED_MM=off"
FP8_ROWS_SETTING = "NIM_FP8_SCALED_MM=scaled-mm"  # _scaled_mm at every size: the rows kernel off
FUSED_SETTING = "NIM_FUSED_KERNELS=0"
COMPACT_LOGITS_SETTING = "NIM_COMPACT_LOGITS=off"
WEIGHT_ONLY_LOGITS_SETTING = "NIM_COMPACT_LOGITS=weight-only"  # the logits' input rows not quantized


def close_enough(got: torch.Tensor, want: torch.Tensor, bound: float) -> str | None:
    """None when every element of `got` is within `bound` x max(1, max |want|) of `want` (NaN and
    inf never are), else how far it is."""
    difference = (got.float() - want.float()).abs()
    error = float(difference.max()) if difference.numel() else 0.0
    scale = max(1.0, float(want.float().abs().max())) if want.numel() else 1.0
    if not math.isfinite(error) or not bool(torch.isfinite(got).all()):
        return "non-finite values"
    if error > bound * scale:
        return f"differs by {error:.3g} (bound {bound * scale:.3g})"
    return None


# --- Unified attention ---------------------------------------------------------------------------

# (cached, new) tokens per sequence of a check step; decodes (new == 1) come first, as in a step.
Layout = tuple[tuple[int, int], ...]


def unified_layouts(max_query_lens: Sequence[int]) -> Iterator[tuple[int, Layout]]:
    """For each longest query run: two decodes, a continued and a fresh prompt chunk; then the same
    chunk alone (a lone sequence compiles differently: Triton makes integer arguments equal to 1
    constants)."""
    for m in max_query_lens:
        yield m, ((37, 1), (5, 1), (21, m), (0, m if m <= 4 else m - 3))
        yield m, ((3, m),)


def unified_query_lens(model: CausalLM, cache_dtype: str, max_tokens: int) -> list[int]:
    """One longest query run per launch shape the unified kernel can pick for steps of up to
    `max_tokens` tokens (launch_shape's block_q doubles from 1 until it stops growing; the last
    run covers several query blocks)."""
    config = model.config
    group = config.num_heads // config.num_kv_heads
    dtype = model.activation_dtype
    lens, shapes = [], []
    m = 1
    while m <= max_tokens:
        shape = launch_shape(m, group, config.head_dim, dtype, cache_dtype)
        if shape in shapes:
            break
        shapes.append(shape)
        lens.append(m)
        m *= 2
    longest = min(max_tokens, 2 * lens[-1] + 5)  # several query blocks of the widest shape
    if longest > lens[-1]:
        lens.append(longest)
    return lens


def check_unified_attention(
    model: CausalLM, pool: KVPool, device: torch.device, max_tokens: int
) -> str | None:
    """The unified kernel against gathered attention on random steps shaped like the model (its
    heads, head size, dtype, cache dtype and block size), at every launch shape, with each window
    size class the model's layers use; None when every one agrees."""
    config = model.config
    windows: list[int | None] = [None]
    if any(w is not None for w in config.layer_windows):
        windows.append(8)  # the windowed kernel variant, with a window the check's contexts exceed
    lens = unified_query_lens(model, pool.spec.cache_dtype, max_tokens)
    for m, layout in unified_layouts(lens):
        for window in windows:
            try:
                why = _check_unified_step(model, pool, device, layout, window)
            except Exception as exc:  # a kernel that does not compile or launch here
                why = one_line(exc, with_type=True)
            if why is not None:
                shown = f"longest query run {m}" + ("" if window is None else f", window {window}")
                return f"the unified attention kernel failed its start-up check ({shown}): {why}"
    return None


def _check_unified_step(
    model: CausalLM, pool: KVPool, device: torch.device, layout: Layout, window: int | None
) -> str | None:
    config = model.config
    dtype = model.activation_dtype
    spec = KVCacheSpec(1, config.num_kv_heads, config.head_dim, pool.spec.block_size,
                       pool.spec.cache_dtype, dtype)  # fmt: skip
    block = spec.block_size
    tables, used = [], 0
    for cached, new in layout:  # descending block ids: read through the table, not in order
        count = -(-(cached + new) // block)
        tables.append(list(range(used + count - 1, used - 1, -1)))
        used += count
    generator = torch.Generator(device=device).manual_seed(len(layout) * 1000 + sum(n for _, n in layout))

    def rand(rows: int, heads: int) -> torch.Tensor:
        values = torch.randn(rows, heads, config.head_dim, generator=generator, device=device)
        return values.to(dtype)

    def slots(table: list[int], start: int, end: int) -> list[int]:
        return [table[p // block] * block + p % block for p in range(start, end)]

    check_pool = KVPool(spec, used, device)
    for (cached, _), table in zip(layout, tables, strict=True):
        if cached:
            at = torch.tensor(slots(table, 0, cached), device=device)
            check_pool.write(0, at, rand(cached, spec.num_kv_heads), rand(cached, spec.num_kv_heads))
    total = sum(new for _, new in layout)
    q = rand(total, config.num_heads)
    k, v = rand(total, spec.num_kv_heads), rand(total, spec.num_kv_heads)
    step_slots = [s for (c, n), t in zip(layout, tables, strict=True) for s in slots(t, c, c + n)]
    slot_mapping = torch.tensor(step_slots, device=device)
    num_decodes = sum(1 for _, n in layout if n == 1)
    unified = AttentionMetadata(
        slot_mapping, num_decodes, None, None, (), unified=_unified_step(check_pool, layout, tables, device)
    )
    gathered = _gathered_meta(check_pool, layout, tables, slot_mapping, device, dtype)
    scale = 1.0 / math.sqrt(config.head_dim)
    got = PagedAttention(check_pool, unified, config.num_heads, config.head_dim)(0, q, k, v, window=window)
    want = PagedAttention(check_pool, gathered, config.num_heads, config.head_dim)(
        0, q, k, v, window=window, scale=scale
    )
    # Quantized caches: the gathered decodes read their own new key rounded, the kernel as computed.
    bound = {"int8": 3e-2, "fp8": 1e-1}.get(spec.cache_dtype, 1e-4 if dtype == torch.float32 else 3e-2)
    return close_enough(got, want, bound)


def _unified_step(pool: KVPool, layout: Layout, tables: list[list[int]], device: torch.device) -> UnifiedStep:
    starts = [0]
    for _, new in layout:
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    padded = [t + [pool.scratch_block] * (width - len(t)) for t in tables]
    return UnifiedStep(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + n for c, n in layout], dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(n for _, n in layout),
    )


def _gathered_meta(
    pool: KVPool,
    layout: Layout,
    tables: list[list[int]],
    slot_mapping: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionMetadata:
    """The same step as the runner describes it for the gathered path (decodes first)."""
    block = pool.spec.block_size
    num_decodes = sum(1 for _, n in layout if n == 1)
    decode_ids = mask = None
    if num_decodes:
        decodes = list(zip(layout[:num_decodes], tables[:num_decodes], strict=True))
        width = max(len(t) for _, t in decodes)
        padded = [b for _, t in decodes for b in t + [0] * (width - len(t))]
        lens = torch.tensor([c + n for (c, n), _ in decodes], device=device)
        decode_ids = pool.head_block_ids(torch.tensor(padded, device=device))
        mask = decode_mask(lens, width * block, dtype)
    prefills = []
    start = num_decodes
    for (cached, new), table in list(zip(layout, tables, strict=True))[num_decodes:]:
        chunk_mask = prefill_mask(cached, new, len(table) * block, device, dtype)
        ids = pool.head_block_ids(torch.tensor(table, device=device))
        prefills.append(PrefillChunk(start, new, cached + new, ids, chunk_mask))
        start += new
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decodes=num_decodes,
        decode_block_ids=decode_ids,
        decode_mask=mask,
        prefills=tuple(prefills),
    )


# --- fp8 _scaled_mm --------------------------------------------------------------------------------

FP8_BOUND = 0.1  # relative (Frobenius) error of e4m3 activations against the weight-only matmul


def token_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, ... and `max_tokens` itself: the matmul heights a step of up to `max_tokens` tokens
    can have, by the powers of two the GEMM libraries choose their kernels by."""
    counts = [1]
    while counts[-1] * 2 < max_tokens:
        counts.append(counts[-1] * 2)
    if max_tokens > 1:
        counts.append(max_tokens)
    return counts


def native_fp8_layers(model: CausalLM) -> list[FP8Linear]:
    return [m for m in model.modules() if isinstance(m, FP8Linear) and m.native]  # type: ignore[attr-defined]


def check_fp8_scaled_mm(model: CausalLM, max_tokens: int) -> str | None:
    """Every distinct fp8 layer kind (shape, scaling, bias) natively (`_scaled_mm`, activations
    quantized to e4m3) against the same layer emulated (its weight dequantized), at every token
    count of `token_counts`; None when each is within FP8_BOUND relative error."""
    return _check_fp8_layers(
        model,
        lambda layer: (layer.tensorwise, layer.static_input),
        token_counts(max_tokens),
        lambda layer, x: layer(x),
        FP8_BOUND,
        "fp8 _scaled_mm",
    )


def _check_fp8_layers(
    model: CausalLM,
    variant: Callable[[FP8Linear], tuple[bool, ...]],
    counts: Sequence[int],
    run: Callable[[FP8Linear, torch.Tensor], torch.Tensor],
    bound: float,
    what: str,
) -> str | None:
    """`run` on every distinct native fp8 layer kind (shape, bias and `variant`) against the same
    layer emulated, at each row count of `counts`; the first disagreement beyond `bound` (relative)
    or failure, in one line naming `what`, else None."""
    seen: set[tuple[object, ...]] = set()
    generator = torch.Generator(device=model.device).manual_seed(0)
    for layer in native_fp8_layers(model):
        kind = (layer.out_features, layer.in_features, layer.bias is not None, *variant(layer))
        if kind in seen:
            continue
        seen.add(kind)
        for count in counts:
            x = torch.randn(count, layer.in_features, generator=generator, device=model.device)
            x = x.to(layer.dtype)
            why: str | None
            try:
                got = run(layer, x)
                want = layer.emulated(x)
            except Exception as exc:
                why = one_line(exc, with_type=True)
            else:
                why = _relative_error(got, want, bound)
            if why is not None:
                return (
                    f"{what} failed its start-up check ({count} x {layer.in_features} -> "
                    f"{layer.out_features}): {why}"
                )
    return None


def _relative_error(got: torch.Tensor, want: torch.Tensor, bound: float) -> str | None:
    if not bool(torch.isfinite(got).all()):
        return "non-finite values"
    error = float(torch.linalg.vector_norm(got.float() - want.float()))
    norm = float(torch.linalg.vector_norm(want.float()))
    if error > bound * max(norm, 1e-6):
        return f"relative error {error / max(norm, 1e-6):.3g} (bound {bound})"
    return None


FP8_ROWS_BOUND = 2e-2  # the rows kernel is weight-only too: bf16 rounding of the output and scaled weight
FP8_ROWS_COUNTS = (1, 2, 5, 8, triton_fp8.ROWS_MAX)  # decode buckets, and a count between them


def check_fp8_rows_kernel(model: CausalLM) -> str | None:
    """The Triton fp8 rows kernel (steps of at most triton_fp8.ROWS_MAX rows) for every distinct fp8
    layer kind against the same layer emulated, at FP8_ROWS_COUNTS rows; None when each is within
    FP8_ROWS_BOUND relative error. Compiles the kernel before any step launches it."""
    return _check_fp8_layers(
        model,
        lambda layer: (),
        FP8_ROWS_COUNTS,
        lambda layer, x: triton_fp8.fp8_rows_linear(x, layer.q, layer.scale, layer.bias),
        FP8_ROWS_BOUND,
        "the fp8 rows kernel",
    )


def use_fp8_rows_kernel(model: CausalLM) -> None:
    """Native fp8 layers run steps of at most triton_fp8.ROWS_MAX rows through the rows kernel."""
    for layer in native_fp8_layers(model):
        layer.rows_kernel = True


def use_emulated_fp8(model: CausalLM) -> None:
    """Every fp8 layer computes emulated from now on (the proven path: weight-only, dequantized)."""
    for layer in native_fp8_layers(model):
        layer.native = False


# --- Fused kernels --------------------------------------------------------------------------------


def check_fused_kernels(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> str | None:
    """Each fused kernel against the PyTorch ops it replaces, at the shapes of a model of `config`
    (this rank's, under tensor parallelism), for one token and a chunk of 37: RMSNorm alone and with
    the residual add over the hidden size, SiLU-mul over the intermediate size, RoPE over the q and
    k heads. None when every one agrees to the dtype's rounding. Run before the model is built, so
    the model is built with the kernels or without them."""
    generator = torch.Generator(device=device).manual_seed(0)
    bound = 1e-3 if dtype == torch.float32 else 5e-2

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device).to(dtype)

    hidden, inter = config.hidden_size, config.intermediate_size
    plain, fused = (RMSNorm(hidden, config.rms_norm_eps, on).to(device, dtype) for on in (False, True))
    with torch.no_grad():
        fused.weight.copy_(plain.weight.add_(0.1 * rand(hidden)))
    plain_rope, fused_rope = (RotaryEmbedding(config, on).to(device) for on in (False, True))
    heads = config.num_heads + config.num_kv_heads
    for tokens in (1, 37):
        x, residual, gate_up = rand(tokens, hidden), rand(tokens, hidden), rand(tokens, 2 * inter)
        qk = rand(tokens, heads, config.head_dim)
        top = config.max_position_embeddings
        positions = torch.randint(0, top, (tokens,), device=device, generator=generator)
        silu_mul = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        try:
            fused_silu_mul = triton_ops.silu_mul(gate_up) if triton_ops.runs_on(gate_up) else silu_mul
            checks = [
                ("RMSNorm", fused.forward(x), plain.forward(x)),
                ("RMSNorm with the residual add", torch.cat(fused.add_forward(x, residual)),
                 torch.cat(plain.add_forward(x, residual))),
                ("SiLU-mul", fused_silu_mul, silu_mul),
                ("RoPE", fused_rope.for_positions(positions, dtype)(qk.clone()),
                 plain_rope.for_positions(positions, dtype)(qk.clone())),
            ]  # fmt: skip
        except Exception as exc:
            why = one_line(exc, with_type=True)
            return f"the fused kernels failed their start-up check ({tokens} tokens): {why}"
        for name, got, want in checks:
            failed = close_enough(got, want, bound)
            if failed is not None:
                return f"the fused kernels failed their start-up check ({name}, {tokens} tokens): {failed}"
    return None


def choice(name: str, setting: str, failure: str | None, used_reason: str) -> PathChoice:
    """The PathChoice of a path whose check ran: used when it passed, else not, with the failure."""
    if failure is None:
        return PathChoice(name, True, used_reason, setting)
    return PathChoice(name, False, f"{failure}; running the proven path instead", setting)
