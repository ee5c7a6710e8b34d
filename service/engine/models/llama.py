"""One Llama-family decoder: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

The model works on a flat batch of T tokens (any mix of sequences, prefill or decode): it embeds
them, runs the decoder layers and hands each layer's q/k/v to an ``Attention`` object, which alone
knows which earlier keys each token may see. The model holds no KV state.

Submodules are called through ``.forward`` inside the model: nn.Module.__call__'s hook handling
costs about 2 µs a call, a few hundred calls a CPU decode step; nothing registers hooks on it.

Numerics follow transformers' implementation operation for operation (RMSNorm in float32 then
cast back, rotate-half RoPE with cos/sin computed in float32 then cast to the activation dtype,
SiLU(gate) * up), so logits match it to float rounding. For speed q/k/v and gate/up are each one
fused Linear; ``load_weights`` writes the checkpoint's separate shards into row slices of them.

Its building blocks live beside it: the layers in llama_layers.py, RoPE in rope.py, and the
checkpoint loading in llama_weights.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.engine.models.attention import Attention
from service.engine.models.base import (
    ONE_PROCESS,
    BuildOptions,
    CausalLM,
    LinearLayer,
    LinearPart,
    LlamaStack,
)
from service.engine.models.cpu_linear import HalfPackedLinear, PackedLinear, prepack_linears
from service.engine.models.llama_layers import LINEAR_ROLES, LlamaDecoderLayer, RMSNorm
from service.engine.models.llama_weights import load_checkpoint
from service.engine.models.quant import Int8Weight, QuantizedWeight
from service.engine.models.quant_linear import Int8Embedding, Int8Linear
from service.engine.models.rope import RotaryEmbedding
from service.engine.models.tensor_parallel import Collectives
from service.engine.models.w8a8 import W8A8Linear
from service.engine.native.q8 import Q8Linear
from service.model.config import ModelConfig


def _embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding; built on 'meta' (the loader's case, weights come next) without its random
    init, whose `normal_` on meta imports torch._dynamo: 3 s of every start, for nothing."""
    if torch.empty(0).device.type == "meta":
        return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
    return nn.Embedding(num_embeddings, embedding_dim)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__()
        # Float, or int8 once loaded as BuildOptions.logits_format says (LlamaForCausalLM._quantize_logits).
        self.embed_tokens: nn.Embedding | Int8Embedding = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, options) for i in range(config.num_layers))
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, options.fused_kernels, options.cpu_fused_ops
        )

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """The layers, typed (an nn.ModuleList yields plain Modules)."""
        return [cast(LlamaDecoderLayer, layer) for layer in self.layers]


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF's (``model.layers.N.self_attn.o_proj.weight``, ...), except the
    fused ``qkv_proj`` and ``gate_up_proj``. With tied embeddings there is no ``lm_head``: logits use
    ``model.embed_tokens.weight``.
    """

    def __init__(self, config: ModelConfig, options: BuildOptions = ONE_PROCESS) -> None:
        """`config` is this rank's (`layout.local_config()`) under tensor parallelism: its shard then
        joins the others' through all-reduces after each row-parallel projection and the
        vocab-parallel embedding, and an all-gather of logits."""
        super().__init__()
        parallel = options.tensor_parallel
        if parallel is not None and config != parallel.layout.local_config():
            raise ValueError("a tensor-parallel model is built from its layout's local config")
        self.config = config
        self.model = LlamaModel(config, options)
        self.rotary = RotaryEmbedding(config, options.fused_kernels, native=options.cpu_fused_ops)
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.logits_format = options.logits_format
        self.tp: Collectives | None = None
        self.vocab_start = 0  # this rank's first vocabulary row
        self.full_vocab_size = config.vocab_size
        if parallel is not None:
            self.tp = parallel.collectives
            self.vocab_start = parallel.layout.vocab_start
            self.full_vocab_size = parallel.layout.config.vocab_size

    def forward(self, input_ids: Tensor, positions: Tensor, attention: Attention) -> Tensor:
        """input_ids, positions: [T] int64, a flat token batch. Returns final-norm hidden states [T, hidden].

        Positions index the RoPE tables, so each must be < max_position_embeddings.
        """
        hidden = self._embed(input_ids)  # [T, hidden]
        rope = self.rotary.for_positions(positions, hidden.dtype)
        residual: Tensor | None = None
        for layer in self.model.layers:
            hidden, residual = layer.forward(hidden, residual, rope, attention)
        assert residual is not None, "a model has at least one layer"
        normed, _ = self.model.norm.add_forward(hidden, residual)
        return normed

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def tensor_parallel(self) -> bool:
        return self.tp is not None

    def linear_layers(self) -> list[LinearLayer]:
        """Per layer: qkv, o, gate_up, down (base.CausalLM)."""
        config = self.config
        hidden, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
        rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
        rows |= {"gate_proj": inter, "up_proj": inter, "down_proj": hidden}
        inputs = {"qkv": hidden, "o": q, "gate_up": hidden, "down": inter}
        linears = []
        for index, layer in enumerate(self.model.decoder_layers()):
            for role in self._linear_roles(index):
                block, module_name, parts = LINEAR_ROLES[role]
                prefix = f"model.layers.{index}.{block}"
                linears.append(
                    LinearLayer(
                        layer=index,
                        role=role,
                        in_features=inputs[role],
                        parts=tuple(LinearPart(p, f"{prefix}.{p}.weight", rows[p]) for p in parts),
                        module=getattr(getattr(layer, block), module_name),
                    )
                )
        return linears

    def _linear_roles(self, layer: int) -> tuple[str, ...]:
        """The roles of decoder layer `layer`'s linear layers, in forward order (a subclass whose
        layers differ, e.g. routed experts in place of the MLP, names fewer)."""
        return tuple(LINEAR_ROLES)

    def set_linear(self, layer: int, role: str, module: nn.Module) -> None:
        if role not in self._linear_roles(layer):
            raise ValueError(f"decoder layer {layer} has no {role!r} linear layer")
        block, module_name, _ = LINEAR_ROLES[role]
        setattr(getattr(self.model.decoder_layers()[layer], block), module_name, module)

    def llama_stack(self) -> LlamaStack:
        layers = self.model.decoder_layers()
        norms = [
            n.weight for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        qk_norms: list[Tensor] = []
        for layer in layers:
            attn = layer.self_attn
            if attn.q_norm is not None and attn.k_norm is not None:
                qk_norms += [attn.q_norm.weight, attn.k_norm.weight]
        return LlamaStack(
            embedding=self.model.embed_tokens,
            rope_tables=self.rotary.lookup_full,
            norms=norms,
            qk_norms=qk_norms,
            final_norm=self.model.norm.weight,
            fused_ops=self.model.norm.native,
        )

    def _embed(self, input_ids: Tensor) -> Tensor:
        if self.tp is None:
            embedded: Tensor = self.model.embed_tokens(input_ids)
            return embedded
        # Vocab-parallel: each rank looks up the ids in its rows, zeros elsewhere; the sum is the lookup.
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.config.vocab_size)
        embedded = self.model.embed_tokens(torch.where(mine, local, 0))
        return self.tp.all_reduce(embedded * mine[:, None].to(embedded.dtype))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> [N, vocab] float32 (matmul in the model dtype, as HF does, then upcast)."""
        if self.lm_head is None:
            logits: Tensor = F.linear(hidden, self._float_table())
        else:
            logits = self.lm_head(hidden)
        if self.tp is not None:  # vocab-parallel: every rank's slice, then the padding cut
            logits = self.tp.all_gather_last(logits)[..., : self.full_vocab_size]
        return logits.float()

    def prepack_for_cpu(self) -> None:
        """Hold every linear layer, the logits projection included, in oneDNN's packed layout.

        Inference-only and irreversible (packed weights cannot be loaded into or trained); call
        after `load_weights` where `prepacking_supported` says so.
        """
        if self.lm_head is None:  # tied: the embedding stays a plain tensor for lookups
            self.lm_head = PackedLinear(self._float_table(), None)
            self.lm_head.pad_small = self.lm_head.needs_padding()
        prepack_linears(self, keep=self.kept_unpacked())

    def kept_unpacked(self) -> list[nn.Module]:
        """Linear layers `prepack_for_cpu` leaves as they are (their weights read as tensors)."""
        return []

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, Tensor | QuantizedWeight]], device: torch.device | None = None
    ) -> None:
        """Write HF-named checkpoint weights into this model (llama_weights.load_checkpoint: strict,
        float tensors cast to their parameters' dtype/device, quantized ones replacing their linear
        layers), a parameter still on 'meta' allocated on ``device``.

        Also rebuilds the RoPE tables, which a model materialised from 'meta' lacks.
        """
        target_device = device if device is not None else next(self.parameters()).device
        load_checkpoint(self, self.config, weights, target_device)
        if self.logits_format in ("int8", "w8a8"):
            self._quantize_logits(target_device)
        elif self.logits_format == "fp16":
            self._half_logits()
        elif self.logits_format == "q8":
            self._q8_logits(target_device)
        if self.rotary.cos_cached.is_meta:
            self.rotary.materialize(target_device)
        self.rotary.reset_cache()

    def _float_table(self) -> Tensor:
        """The float embedding table: the logits layer too while lm_head is None (tied, float)."""
        embedding = self.model.embed_tokens
        assert isinstance(embedding, nn.Embedding), "an int8 table comes with an Int8Linear lm_head"
        return embedding.weight

    def _half_logits(self) -> None:
        """The logits projection as float16 in fbgemm's packed layout (BuildOptions.logits_format
        "fp16"), from the float32 weights just loaded; tied, the float table stays for lookups."""
        untied = self.lm_head
        assert untied is None or isinstance(untied, nn.Linear), "a float logits layer is packed"
        self.lm_head = HalfPackedLinear(self._float_table() if untied is None else untied.weight)

    def _q8_logits(self, device: torch.device) -> None:
        """The logits projection as Q8 blocks (BuildOptions.logits_format "q8": native/q8.py), from
        the float weights just loaded. Lookups: under float32 activations the float table stays;
        under bf16 the embedding becomes int8 rows with one scale each (as the "int8" and "w8a8"
        formats hold it), the float table freed."""
        embedding, untied = self.model.embed_tokens, self.lm_head
        assert isinstance(embedding, nn.Embedding), "the logits are quantized once, after loading"
        assert untied is None or isinstance(untied, nn.Linear), "a float logits layer is quantized"
        self.lm_head = Q8Linear(embedding.weight if untied is None else untied.weight)
        if self.activation_dtype != torch.float32:
            table = Int8Weight.quantize(embedding.weight)
            self.model.embed_tokens = Int8Embedding(table, self.activation_dtype, device)

    def _quantize_logits(self, device: torch.device) -> None:
        """The logits projection and the embedding as int8 (BuildOptions.logits_format "int8" or
        "w8a8"), from the float weights just loaded; tied, the int8 values serve both and the float
        table is freed ("w8a8": the head's kernel takes a packed copy, lookups keep the rows).
        Per-row scales: each rank's vocab-parallel rows quantize as the whole table's would."""
        dtype, embedding, untied = self.activation_dtype, self.model.embed_tokens, self.lm_head
        assert isinstance(embedding, nn.Embedding), "the logits are quantized once, after loading"
        assert untied is None or isinstance(untied, nn.Linear), "a float logits layer is quantized"
        head = Int8Weight.quantize(embedding.weight if untied is None else untied.weight)
        if untied is None and self.logits_format == "w8a8":
            self.lm_head = W8A8Linear(head, device)
            self.model.embed_tokens = Int8Embedding(head, dtype, device)
        elif untied is None:
            self.lm_head = Int8Linear(head, None, dtype, device)
            self.model.embed_tokens = Int8Embedding(head, dtype, device, q=self.lm_head.q)
        else:
            w8a8 = self.logits_format == "w8a8"
            self.lm_head = W8A8Linear(head, device) if w8a8 else Int8Linear(head, None, dtype, device)
            self.model.embed_tokens = Int8Embedding(Int8Weight.quantize(embedding.weight), dtype, device)

    def weight_nbytes(self) -> int:
        """Bytes of weights one decode step reads (the embedding table only where it is the logits
        layer too): the numerator of achieved weight bandwidth."""
        tensors: dict[int, Tensor] = {}
        packed_half = 0  # HalfPackedLinear's and W8A8Linear's opaque weights, by their own count
        for module in self.modules():
            if isinstance(module, nn.Embedding | Int8Embedding | RotaryEmbedding):
                continue
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if isinstance(module, PackedLinear):
                own += [module.packed] + ([] if module.bias is None else [module.bias])
            if isinstance(module, HalfPackedLinear | W8A8Linear):
                packed_half += module.nbytes
            tensors.update((id(t), t) for t in own)
        total = packed_half + sum(t.numel() * t.element_size() for t in tensors.values())
        if self.lm_head is None:  # tied float logits read the embedding table
            table = self._float_table()
            total += table.numel() * table.element_size()
        return total


if TYPE_CHECKING:
    _IMPLEMENTS: type[CausalLM] = LlamaForCausalLM  # mypy holds the class to the protocol
