"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral.

Both are the Llama-family decoder (llama.py's attention, RMSNorm, RoPE and decoder layer) with a
routed block in place of the MLP in their sparse layers (`ModelConfig.sparse_layers`; Qwen3-MoE may
keep some dense). The block follows transformers' routing operation for operation: router logits
in the activation dtype, softmax over experts in float32, top-k, the k weights renormalised when
`norm_topk_prob` (Mixtral always), then cast back to the activation dtype; each token's output is
the weighted sum of its k experts' SiLU(gate) * up -> down.

Experts are held stacked as transformers 5 holds them (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]); `load_weights` also takes the per-expert checkpoint names
(``mlp.experts.E.{gate,up,down}_proj``, Mixtral's ``block_sparse_moe.experts.E.w1/w3/w2``) and stacks
them layer by layer. Quantized experts (int8_wo, int4_wo, fp8: quantized at load expert by expert,
as the loader quantizes every decoder projection; the router stays float) are held as one
quantized linear layer per expert and projection, running the dense layers' kernels (native or
emulated per quant_linear's table), still grouped by expert; on the CPU's W4A8 kernel every expert of
a layer runs in one call (`FusedExperts`: native/w4a8.cpp's MoE op). nvfp4 experts are refused. There is
no fused CUDA MoE kernel yet (vLLM's fused_moe is the reference design): on CUDA the experts run
one matmul per expert that has rows, and under graph capture the float experts are gathered per
row and quantized ones run every row through every expert.

Under tensor parallelism (service.engine.models.tensor_parallel) each expert is split over its
intermediate dimension: a rank holds every expert's gate/up rows and down columns of its share,
routes every token itself (the router is replicated) and one all-reduce of the weighted routed sum
completes the layer. LoRA adapts the attention projections only (`linear_layers` names no expert).
The scripted CPU decode runs them too (`llama_stack` names each routed layer's router and
experts; scripted_decode.py routes as `SparseMoeBlock` and `Experts.grouped` do, op for op, but
for a lone token, whose chosen experts it runs directly: the same rows, bitwise).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.engine.models.base import ONE_PROCESS, BuildOptions, CausalLM, LlamaStack, RoutedMlp
from service.engine.models.llama import LlamaForCausalLM
from service.engine.models.llama_layers import Reduce, all_reduce_of
from service.engine.models.quant import NVFP4Weight, QuantizedWeight, concat_rows
from service.engine.models.quant_linear import Int4Linear, make_linear
from service.engine.models.tensor_parallel import EXPERT_PROJECTIONS
from service.engine.native import fused_ops
from service.model.config import ModelConfig, UnsupportedModelError
from service.model.quantization import QuantizationError

# One expert's projection in a per-expert checkpoint: (layer prefix, expert, projection).
_EXPERT_WEIGHT = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# transformers 5's stacked experts of one layer: (layer prefix, which).
_STACKED_EXPERTS = re.compile(
    r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)"
)


def per_expert(
    weights: Iterable[tuple[str, Tensor | QuantizedWeight]],
) -> Iterator[tuple[str, Tensor | QuantizedWeight]]:
    """`weights` with each stacked expert tensor (transformers 5: ``mlp.experts.gate_up_proj``
    [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) given as the per-expert tensors Hub
    checkpoints hold (``mlp.experts.E.{gate,up,down}_proj.weight``, views), so that sharding and
    quantizing at load see one [N, K] weight per projection; the rest as given."""
    for name, tensor in weights:
        match = _STACKED_EXPERTS.fullmatch(name)
        if match is None or not isinstance(tensor, Tensor) or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix, which = match.groups()
        for expert, weight in enumerate(tensor.unbind(0)):
            where = f"{prefix}.mlp.experts.{expert}"
            if which == "down_proj":
                yield f"{where}.down_proj.weight", weight
                continue
            gate, up = weight.chunk(2)
            yield f"{where}.gate_proj.weight", gate
            yield f"{where}.up_proj.weight", up


@dataclass(frozen=True)
class FusedExperts:
    """A routed layer's experts, all on the W4A8 kernel, stacked for its MoE op (w4a8_moe): each
    (token, choice) pair a row of its own, grouped by expert inside the op, gate_up, SiLU-mul and
    down each rounded to the activation dtype as Experts.expert rounds them, and each token's
    choices weighted and summed in choice order. A pair's values depend on its token and expert
    alone, so a token's output does not depend on what else shares the step."""

    gate_up: Tensor  # [E, tiles, blocks, 256]: w4a8.pack's layout, expert by expert
    gate_up_scales: Tensor
    down: Tensor
    down_scales: Tensor
    gate_up_group: int
    down_group: int

    @staticmethod
    def stack(gate_up: list[Int4Linear], down: list[Int4Linear]) -> FusedExperts | str:
        for layers in (gate_up, down):
            if len({(m.group_size, tuple(m.packed.shape), tuple(m.scales_zeros.shape)) for m in layers}) != 1:
                return "the experts' layers differ in shape or group size"
        return FusedExperts(
            torch.stack([m.packed for m in gate_up]),
            torch.stack([m.scales_zeros for m in gate_up]),
            torch.stack([m.packed for m in down]),
            torch.stack([m.scales_zeros for m in down]),
            gate_up[0].group_size,
            down[0].group_size,
        )

    def __call__(self, x: Tensor, expert_ids: Tensor, weights: Tensor, intermediate: int) -> Tensor:
        out: Tensor = torch.ops.nim_cpu.w4a8_moe(
            x, expert_ids, weights, self.gate_up, self.gate_up_scales, self.down, self.down_scales,
            self.gate_up_group, self.down_group, intermediate,
        )  # fmt: skip
        return out


class Experts(nn.Module):
    """`num_experts` SiLU-gated MLPs, stacked: gate_up_proj [E, 2I, H] (rows: gate | up) and
    down_proj [E, H, I]; or, quantized (`quantize`), one quantized linear layer per expert and
    projection (service.engine.models.quant_linear: the dense layers' kernels, native or emulated
    as the table there says)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = experts
        self.intermediate_size = inter
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        # Quantized: expert e's gate_up and down layers (the Parameters above are then gone).
        self.gate_up_layers: nn.ModuleList | None = None
        self.down_layers: nn.ModuleList | None = None
        # Every expert on the W4A8 kernel (`fuse_w4a8`): their weights stacked, run in one call.
        self.fused: FusedExperts | None = None

    def quantize(
        self, gate_up: list[QuantizedWeight], down: list[QuantizedWeight], device: torch.device
    ) -> None:
        """Hold expert e's weights as the quantized gate_up[e] and down[e], in place of the float
        stacks (whose Parameters go: nothing of them is ever allocated)."""
        dtype = self.gate_up_proj.dtype
        del self.gate_up_proj, self.down_proj
        self.gate_up_layers = nn.ModuleList(make_linear(w, None, dtype, device) for w in gate_up)
        self.down_layers = nn.ModuleList(make_linear(w, None, dtype, device) for w in down)

    def fuse_w4a8(self) -> str | None:
        """Run every expert in one call of the W4A8 MoE kernel (native/w4a8.cpp's w4a8_moe): their
        layers' weights stacked (each layer then holds a view of its share); None, or why not."""
        gate_up = [m for m in self.gate_up_layers or [] if isinstance(m, Int4Linear) and m.kernel == "w4a8"]
        down = [m for m in self.down_layers or [] if isinstance(m, Int4Linear) and m.kernel == "w4a8"]
        if not gate_up or len(gate_up) != len(down) or len(gate_up) != self.num_experts:
            return "not every expert is on the W4A8 kernel"
        fused = FusedExperts.stack(gate_up, down)
        if isinstance(fused, str):
            return fused
        for e, (g, d) in enumerate(zip(gate_up, down, strict=True)):
            g.packed, g.scales_zeros = fused.gate_up[e], fused.gate_up_scales[e]
            d.packed, d.scales_zeros = fused.down[e], fused.down_scales[e]
        self.fused = fused
        return None

    def forward(self, x: Tensor, expert_ids: Tensor) -> Tensor:
        """x: [N, H] rows each routed to one expert, expert_ids: [N] -> each row's expert output [N, H].

        Grouped where slice sizes can be read back; under CUDA graph capture, where they cannot (a
        capture must not synchronise with the host), float experts are gathered per row and
        quantized ones run every row through every expert, each row keeping its own's output.
        """
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.gathered(x, expert_ids) if self.gate_up_layers is None else self.every(x, expert_ids)
        return self.grouped(x, expert_ids)

    def expert(self, rows: Tensor, expert: int) -> Tensor:
        """Expert `expert`'s MLP over `rows` [n, H] -> [n, H]."""
        inter = self.intermediate_size
        if self.gate_up_layers is None or self.down_layers is None:
            gate_up = F.linear(rows, self.gate_up_proj[expert])  # [n, 2I]
        else:
            gate_up = self.gate_up_layers[expert].forward(rows)
        activated = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        if self.down_layers is None:
            return F.linear(activated, self.down_proj[expert])
        down: Tensor = self.down_layers[expert].forward(activated)
        return down

    def every(self, x: Tensor, expert_ids: Tensor) -> Tensor:
        """Every row through every expert, each row keeping its own expert's output: no host
        sync, each expert's weights read once, E times the arithmetic (meant for decode-sized N)."""
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            out = torch.where((expert_ids == expert)[:, None], self.expert(x, expert), out)
        return out

    def grouped(self, x: Tensor, expert_ids: Tensor) -> Tensor:
        """Rows grouped by expert (a stable sort), one matmul per expert over its contiguous
        slice (a loop over the experts that have rows, never over tokens)."""
        order = torch.argsort(expert_ids, stable=True)
        counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()
        grouped = x[order]
        out = torch.empty_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            out[order[start : start + count]] = self.expert(grouped[start : start + count], expert)
            start += count
        return out

    def gathered(self, x: Tensor, expert_ids: Tensor) -> Tensor:
        """Each row times its own expert's weights, gathered: one batched matmul each way, no
        host sync, but N copies of an expert's weights (meant for decode-sized N)."""
        inter = self.intermediate_size
        gate_up = torch.bmm(self.gate_up_proj[expert_ids], x.unsqueeze(-1)).squeeze(-1)  # [N, 2I]
        activated = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        return torch.bmm(self.down_proj[expert_ids], activated.unsqueeze(-1)).squeeze(-1)


class SparseMoeBlock(nn.Module):
    """Router (``gate``) and experts, in place of a decoder layer's MLP."""

    def __init__(self, config: ModelConfig, reduce: Reduce | None = None, native: bool = False) -> None:
        super().__init__()
        self.reduce = reduce  # tensor parallelism: the all-reduce after the weighted routed sum
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)
        # The routing as one fused CPU op (BuildOptions.cpu_fused_ops); the gate then stays a plain
        # nn.Linear (MoeForCausalLM.kept_unpacked), its weight what the op takes.
        self.native = native

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of each token's top-k experts."""
        if self.native and x.device.type == "cpu":
            return fused_ops.route(x, self.gate.weight, self.top_k, self.norm_topk_prob)
        logits = self.gate.forward(x)  # [T, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), expert_ids

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, H]
        weights, expert_ids = self.route(x)
        fused = self.experts.fused
        if fused is not None:  # every expert on the W4A8 kernel: one call (FusedExperts)
            routed = fused(x, expert_ids, weights, self.experts.intermediate_size)
            return routed if self.reduce is None else self.reduce(routed)
        tokens = x.shape[0]
        # Each (token, choice) pair is one row: row r belongs to token r // k.
        expanded = x.repeat_interleave(self.top_k, dim=0)  # [T*k, H]
        outputs = self.experts.forward(expanded, expert_ids.reshape(-1))  # [T*k, H]
        weighted = outputs * weights.reshape(-1, 1)
        routed = weighted.view(tokens, self.top_k, -1).sum(dim=1)
        # Tensor-parallel: each rank's experts hold a slice of the intermediate dimension; the
        # sum of the ranks' weighted partial outputs is the layer's output.
        return routed if self.reduce is None else self.reduce(routed)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers' ``mlp`` is a `SparseMoeBlock`."""

    def __init__(self, config: ModelConfig, options: BuildOptions = ONE_PROCESS) -> None:
        if config.num_experts == 0 or not config.sparse_layers:
            raise UnsupportedModelError(f"{config.architecture}: a config with no experts in any layer")
        super().__init__(config, options)
        for index in config.sparse_layers:
            # setattr: LlamaDecoderLayer types its mlp as the dense one.
            block = SparseMoeBlock(config, all_reduce_of(options), options.cpu_fused_ops)
            setattr(self.model.decoder_layers()[index], "mlp", block)  # noqa: B010

    def kept_unpacked(self) -> list[nn.Module]:
        """Routers the fused CPU op reads (SparseMoeBlock.native): their weights stay plain."""
        blocks = [layer.mlp for layer in self.model.decoder_layers()]
        return [block.gate for block in blocks if isinstance(block, SparseMoeBlock) and block.native]

    def _linear_roles(self, layer: int) -> tuple[str, ...]:
        """Attention's linears in every layer; gate_up and down only in the dense layers (the
        router and the experts are no `CausalLM.linear_layers` role)."""
        return ("qkv", "o") if layer in self.config.sparse_layers else super()._linear_roles(layer)

    def llama_stack(self) -> LlamaStack:
        """The Llama stack with each routed layer's router and experts (float: views of the
        stacked weights, as `Experts.expert` reads them; quantized: their layers)."""
        routed: list[RoutedMlp | None] = []
        for layer in self.model.decoder_layers():
            block = layer.mlp
            if not isinstance(block, SparseMoeBlock):
                routed.append(None)
                continue
            experts = block.experts
            if experts.gate_up_layers is None or experts.down_layers is None:
                gate_up: list[nn.Module | Tensor] = list(experts.gate_up_proj.detach().unbind(0))
                down: list[nn.Module | Tensor] = list(experts.down_proj.detach().unbind(0))
            else:
                gate_up, down = list(experts.gate_up_layers), list(experts.down_layers)
            fused = experts.fused
            if fused is None:
                routed.append(RoutedMlp(block.gate, gate_up, down))
                continue
            stacked = (fused.gate_up, fused.gate_up_scales, fused.down, fused.down_scales)
            groups = (fused.gate_up_group, fused.down_group)
            routed.append(RoutedMlp(block.gate, gate_up, down, stacked, groups))
        return replace(super().llama_stack(), routed=routed)

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, Tensor | QuantizedWeight]], device: torch.device | None = None
    ) -> None:
        """LlamaForCausalLM.load_weights (strict), with per-expert tensors stacked per layer first;
        a layer's quantized experts become its `Experts`' quantized layers as they complete."""
        target = device if device is not None else next(self.parameters()).device
        super().load_weights(self._stacked(weights, target), device)

    def _stacked(
        self, weights: Iterable[tuple[str, Tensor | QuantizedWeight]], device: torch.device
    ) -> Iterator[tuple[str, Tensor | QuantizedWeight]]:
        """`weights` with Mixtral's ``block_sparse_moe`` read as ``mlp`` and each layer's per-expert
        projections, once all have arrived, yielded as its two stacked tensors (float) or held
        by its experts as quantized layers (the rest as given)."""
        experts = self.config.num_experts
        floats: dict[str, dict[tuple[str, int], Tensor]] = {}  # layer prefix -> (projection, expert)
        quantized: dict[str, dict[tuple[str, int], QuantizedWeight]] = {}
        for name, tensor in weights:
            match = _EXPERT_WEIGHT.fullmatch(name)
            if match is None:
                yield name.replace(".block_sparse_moe.", ".mlp."), tensor
                continue
            prefix, expert = match.group(1), int(match.group(2))
            projection = EXPERT_PROJECTIONS.get(match.group(3))
            if projection is None or expert >= experts:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of this model")
            if isinstance(tensor, NVFP4Weight):
                raise UnsupportedModelError(f"{name}: nvfp4 experts are not supported (int8, int4, fp8 are)")
            key = (projection, expert)
            if key in floats.get(prefix, {}) or key in quantized.get(prefix, {}):
                raise ValueError(f"checkpoint tensor {name!r} appears more than once")
            if isinstance(tensor, Tensor):
                floats.setdefault(prefix, {})[key] = tensor
            else:
                quantized.setdefault(prefix, {})[key] = tensor
            float_layer, quantized_layer = floats.get(prefix, {}), quantized.get(prefix, {})
            if len(float_layer) + len(quantized_layer) < 3 * experts:
                continue
            if float_layer and quantized_layer:
                raise ValueError(f"{prefix}: some expert weights are quantized and others float")
            if float_layer:
                del floats[prefix]
                gate_up = [
                    torch.cat([float_layer[("gate", e)], float_layer[("up", e)]]) for e in range(experts)
                ]
                yield f"{prefix}.mlp.experts.gate_up_proj", torch.stack(gate_up)
                yield (
                    f"{prefix}.mlp.experts.down_proj",
                    torch.stack([float_layer[("down", e)] for e in range(experts)]),
                )
                continue
            del quantized[prefix]
            self._quantize_experts(prefix, quantized_layer, device)
        if floats or quantized:
            prefix = next(iter({**floats, **quantized}))
            count = len(floats.get(prefix, {})) + len(quantized.get(prefix, {}))
            raise ValueError(f"checkpoint has {count} of the {3 * experts} expert weights of {prefix}")

    def _quantize_experts(
        self, prefix: str, layer: dict[tuple[str, int], QuantizedWeight], device: torch.device
    ) -> None:
        """Hold the routed layer at `prefix`'s experts as quantized layers of `layer`'s weights."""
        experts = range(self.config.num_experts)
        try:
            gate_up = [concat_rows([layer[("gate", e)], layer[("up", e)]]) for e in experts]
        except QuantizationError as error:
            raise QuantizationError(f"{prefix} experts: {error}") from error
        self._experts(prefix).quantize(gate_up, [layer[("down", e)] for e in experts], device)

    def _experts(self, prefix: str) -> Experts:
        """The experts of the routed layer at `prefix` ("model.layers.N")."""
        experts = self.get_submodule(f"{prefix}.mlp.experts")
        if not isinstance(experts, Experts):
            raise ValueError(f"{prefix} is not a routed layer: it has no experts")
        return experts


if TYPE_CHECKING:
    _IMPLEMENTS: type[CausalLM] = MoeForCausalLM  # mypy holds the class to the protocol
