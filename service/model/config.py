"""Model hyper-parameters, read from a Hugging Face ``config.json`` or a GGUF file's metadata.

``ModelConfig`` is the one description the model code builds from, whatever the checkpoint format.
Everything the Llama-family implementation needs to differ by family (attention biases, q/k norm,
rope scaling, tied embeddings) is an explicit field here, so the model never looks at family names.
How each family's config.json reads (its config class's defaults, what the family fixes, its own
fields) is one `Family` entry in `FAMILIES`: adding a family is an entry there, not a branch.
Anything this code cannot run faithfully is refused with ``UnsupportedModelError`` at config time,
not discovered as garbage output later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from service.model import architectures as registry
from service.model.architectures import UnsupportedModelError
from service.model.gguf_file import metadata_float, metadata_int, metadata_str

if TYPE_CHECKING:
    import gguf

# The checkpoint formats a model is read from: a GGUF file, or a Hugging Face safetensors directory.
ModelFormat = Literal["gguf", "hf_dir"]

SUPPORTED_HF_ARCHITECTURES: dict[str, str] = registry.HF_FAMILIES  # HF name -> family
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = registry.GGUF_ARCHITECTURES
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3")

# HF config classes' own default for a rope_theta a config.json omits (most families').
_DEFAULT_THETA = 10_000.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a family of registry.ARCHITECTURES: "llama", "qwen3_moe", "gemma3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # HF form without rope_theta, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}; None means plain RoPE.
    # Not hashed (a dict cannot be; equal configs still hash alike): configs key caches
    # (lora.adaptable), and a Llama 3.1 or Gemma 3 config with scaling must hash too.
    rope_scaling: dict[str, Any] | None = dataclasses.field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (qwen2; llama/qwen3 when attention_bias)
    qk_norm: bool  # qwen3: per-head RMSNorm on q and k before rope
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # checkpoint dtype from config.json ("bfloat16", ...); None for GGUF
    # Recorded but NOT implemented (Mistral, Mixtral, Qwen with use_sliding_window): those models
    # attend fully, exact only while the context fits the window (loading caps it there).
    sliding_window: int | None = None
    attention_output_bias: bool = False  # bias on o_proj (llama/qwen3 attention_bias=True)
    mlp_bias: bool = False  # bias on gate/up/down (llama mlp_bias=True)
    # Per-frequency divisors of the plain inverse frequencies, as llama.cpp stores llama3 scaling
    # (the GGUF ``rope_freqs`` tensor); None when absent. Applied on top of rope_scaling.
    rope_freq_factors: tuple[float, ...] | None = None
    # Mixture of experts (0 experts: every layer's MLP is dense). The layers in `sparse_layers` run
    # a routed block of `num_experts` SiLU-gated MLPs of `moe_intermediate_size` instead, each token
    # through the `num_experts_per_tok` best by softmax of the router's logits, weighted by those
    # probabilities (renormalised to sum to 1 when `norm_topk_prob`).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    # Implemented sliding-window attention (Gemma 3): per layer, the window it attends over (the
    # query at p sees keys p - window < j <= p) or None for a full-attention layer; () where every
    # layer attends fully. Windowed layers rotate with `rope_local_theta` and no scaling.
    layer_windows: tuple[int | None, ...] = ()
    rope_local_theta: float | None = None
    attention_scale: float | None = None  # the factor on q·k; None: head_dim ** -0.5
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh" (Gemma)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise UnsupportedModelError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} entries; expected head_dim/2 = "
                f"{self.head_dim // 2}"
            )

        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise UnsupportedModelError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise UnsupportedModelError(f"sliding windows must be at least 1, got {self.layer_windows}")

    def tensor_parallel_refusal(self, size: int) -> str | None:
        """Why `size` tensor-parallel ranks cannot shard this model (None: they can): each rank
        takes whole attention heads, whole kv heads (or shares one when there are fewer than ranks)
        and an equal slice of the MLP's and every expert's intermediate dimension. The one rule:
        the engine's layout (engine.models.tensor_parallel.TPLayout) and selection apply it."""
        problems = []
        if self.num_heads % size:
            problems.append(f"{self.num_heads} attention heads")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            problems.append(f"{self.num_kv_heads} kv heads (neither divides the other)")
        if self.intermediate_size % size:
            problems.append(f"intermediate size {self.intermediate_size}")
        if self.num_experts and self.moe_intermediate_size % size:
            problems.append(f"expert intermediate size {self.moe_intermediate_size}")
        if not problems:
            return None
        return f"tensor parallelism {size} does not divide this model's {', '.join(problems)}"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json`` (transformers 4.x or 5.x layout)."""
        architecture = _hf_architecture(cfg)
        family = FAMILIES[architecture]
        hidden_act = cfg.get(family.activation_key, family.activation)
        if hidden_act != family.activation:
            raise UnsupportedModelError(
                f"{family.activation_key} {hidden_act!r} is not supported for {architecture}; "
                f"only {family.activation!r}"
            )

        hidden_size = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = cfg.get("head_dim") or family.head_dim or hidden_size // num_heads
        max_positions = int(cfg.get("max_position_embeddings") or family.max_positions)

        rope_theta, rope_scaling = family.rope(cfg, max_positions, family.rope_theta)
        attention_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False)) if family.mlp_bias is None else family.mlp_bias

        eos = cfg.get("eos_token_id")
        eos_token_ids = (
            tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        )
        bos = cfg.get("bos_token_id")

        return cls(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", family.rms_norm_eps)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tie_word_embeddings)),
            attention_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            qk_norm=family.qk_norm,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_token_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=_hf_sliding_window(cfg, family, max_positions),
            attention_output_bias=attention_bias if family.o_bias is None else family.o_bias,
            mlp_bias=mlp_bias,
            hidden_act=hidden_act,
            **family.extra(cfg),
        )

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> ModelConfig:
        """Build from a GGUF file's metadata (and, for llama3 rope scaling, its ``rope_freqs`` tensor)."""
        architecture = metadata_str(reader, "general.architecture")
        if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )
        arch = architecture

        def key(name: str) -> str:
            return f"{arch}.{name}"

        hidden_size = metadata_int(reader, key("embedding_length"))
        num_heads = metadata_int(reader, key("attention.head_count"))
        num_kv_heads = metadata_int(reader, key("attention.head_count_kv"), default=num_heads)
        head_dim = metadata_int(reader, key("attention.key_length"), default=hidden_size // num_heads)
        value_dim = metadata_int(reader, key("attention.value_length"), default=head_dim)
        if value_dim != head_dim:
            raise UnsupportedModelError(f"key_length {head_dim} != value_length {value_dim} is not supported")
        rope_dim = metadata_int(reader, key("rope.dimension_count"), default=head_dim)
        if rope_dim != head_dim:
            raise UnsupportedModelError(
                f"partial rotary embeddings (rope.dimension_count={rope_dim}, head_dim={head_dim}) "
                "are not supported"
            )
        max_positions = metadata_int(reader, key("context_length"))

        tensor_names = {t.name for t in reader.tensors}
        vocab_size = metadata_int(reader, key("vocab_size"), default=None)
        if vocab_size is None:
            if "tokenizer.ggml.tokens" in reader.fields:
                vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
            else:
                vocab_size = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1])

        rope_scaling = _gguf_rope_scaling(reader, arch, max_positions)
        rope_freq_factors = None
        for tensor in reader.tensors:
            if tensor.name == "rope_freqs.weight":
                if tensor.tensor_type.name != "F32":
                    raise UnsupportedModelError(f"rope_freqs tensor of type {tensor.tensor_type.name}")
                rope_freq_factors = tuple(float(x) for x in tensor.data.reshape(-1))

        eos_token_ids: list[int] = []
        for field in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ):
            token = metadata_int(reader, field, default=None)
            if token is not None and token not in eos_token_ids:
                eos_token_ids.append(token)

        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=metadata_int(reader, key("feed_forward_length")),
            num_layers=metadata_int(reader, key("block_count")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=metadata_float(reader, key("attention.layer_norm_rms_epsilon")),
            rope_theta=metadata_float(reader, key("rope.freq_base"), default=_DEFAULT_THETA),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=metadata_int(reader, "tokenizer.ggml.bos_token_id", default=None),
            eos_token_ids=tuple(eos_token_ids),
            torch_dtype=None,
            sliding_window=None,
            attention_output_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            rope_freq_factors=rope_freq_factors,
        )


def _hf_architecture(cfg: dict[str, Any]) -> str:
    architectures = cfg.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_HF_ARCHITECTURES:
            return SUPPORTED_HF_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if not architectures and model_type in registry.HF_MODEL_TYPES:
        return registry.HF_MODEL_TYPES[model_type]
    described = ", ".join(architectures) if architectures else f"model_type {model_type!r}"
    raise UnsupportedModelError(registry.unsupported(described))


def _mixtral_experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's mixture-of-experts fields (MixtralConfig's defaults for keys it omits): every
    layer routed, top-k renormalised."""
    return {
        "num_experts": int(cfg.get("num_local_experts", 8)),
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 2)),
        "moe_intermediate_size": int(cfg["intermediate_size"]),
        "norm_topk_prob": True,
        "sparse_layers": tuple(range(int(cfg["num_hidden_layers"]))),
    }


def _qwen3_moe_experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's mixture-of-experts fields (Qwen3MoeConfig's defaults for keys it omits)."""
    layers = int(cfg["num_hidden_layers"])
    # Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th.
    num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return {
        "num_experts": num_experts if sparse else 0,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 768)),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "sparse_layers": sparse,
    }


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's windowed layers, local RoPE base and attention scale (Gemma3TextConfig's
    defaults for keys it omits); what it sets that this engine does not compute is refused."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(name) is not None:
            raise UnsupportedModelError(f"gemma3 with {name}={cfg[name]} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("gemma3 with use_bidirectional_attention is not supported")
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != layers:
        raise UnsupportedModelError(f"gemma3 layer_types {layer_types} are not supported")
    window = cfg.get("sliding_window", 4096)
    if window is None and "sliding_attention" in layer_types:
        raise UnsupportedModelError("gemma3 has sliding_attention layers but no sliding_window")
    params = cfg.get("rope_parameters") or {}
    local = params.get("sliding_attention") if _per_layer_type(params) else None
    if local is not None and (local.get("rope_type") or local.get("type") or "default") != "default":
        raise UnsupportedModelError(f"gemma3 sliding-attention rope {local} is not supported; only default")
    local_theta = (local or {}).get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0
    return {
        "layer_windows": tuple(int(window) if t == "sliding_attention" else None for t in layer_types),
        "rope_local_theta": float(local_theta),
        "attention_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
    }


def _gemma3_rope(
    cfg: dict[str, Any], max_positions: int, default_theta: float
) -> tuple[float, dict[str, Any] | None]:
    """The full-attention layers' rope: transformers 5's rope_parameters["full_attention"] or 4.x's
    rope_theta and rope_scaling; plain or linear scaling only (what Gemma 3 checkpoints use)."""
    params = cfg.get("rope_parameters") or {}
    if _per_layer_type(params):
        cfg = {"rope_parameters": params.get("full_attention") or {}}
    theta, scaling = _hf_rope(cfg, max_positions, default_theta)
    if scaling is not None and scaling["rope_type"] != "linear":
        raise UnsupportedModelError(
            f"gemma3 rope scaling type {scaling['rope_type']!r} is not supported; supported: linear"
        )
    return theta, scaling


def _per_layer_type(params: dict[str, Any]) -> bool:
    """Whether rope parameters are given per layer type (transformers 5's Gemma 3 form)."""
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def _hf_rope(
    cfg: dict[str, Any], max_positions: int, default_theta: float = _DEFAULT_THETA
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 5's ``rope_parameters`` or 4.x's
    ``rope_theta`` and ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if _per_layer_type(params):
        raise UnsupportedModelError("per-layer-type rope parameters are not supported")
    rope_theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or default_theta)
    partial = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return rope_theta, None
    if "factor" not in params:
        raise UnsupportedModelError(f"rope scaling {rope_type!r} needs a 'factor'")
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(params["factor"])}
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor"):
            if name not in params:
                raise UnsupportedModelError(f"llama3 rope scaling needs {name!r}")
            scaling[name] = float(params[name])
        original = params.get("original_max_position_embeddings") or cfg.get(
            "original_max_position_embeddings"
        )
        scaling["original_max_position_embeddings"] = int(original or max_positions)
    return rope_theta, scaling


def _hf_sliding_window(cfg: dict[str, Any], family: Family, max_positions: int) -> int | None:
    """The recorded (not implemented) window: None where it never applies or covers the context."""
    if family.sliding_window == "never":
        return None
    if family.sliding_window == "when_enabled" and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window", family.default_window)
    if window is None or int(window) >= max_positions:
        return None
    return int(window)


def _no_extra(cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


RopeReader = Callable[[dict[str, Any], int, float], tuple[float, dict[str, Any] | None]]


@dataclass(frozen=True)
class Family:
    """How a family's config.json reads into ModelConfig: its HF config class's defaults for keys a
    config.json omits (save_pretrained leaves out values equal to them), and what the family fixes."""

    rms_norm_eps: float
    max_positions: int
    head_dim: int | None = None  # when omitted; None: hidden_size // num_attention_heads
    activation: str = "silu"  # the one MLP activation accepted
    activation_key: str = "hidden_act"
    qkv_bias: bool | None = None  # None: the config's attention_bias (False when omitted)
    o_bias: bool | None = None  # None: the config's attention_bias
    mlp_bias: bool | None = False  # None: the config's mlp_bias
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # The recorded window: "never", "when_enabled" (use_sliding_window) or "always".
    sliding_window: str = "never"
    default_window: int | None = None  # sliding_window when the config omits it
    rope_theta: float = _DEFAULT_THETA
    rope: RopeReader = _hf_rope
    extra: Callable[[dict[str, Any]], dict[str, Any]] = _no_extra  # family-only fields


# One entry per family of registry.ARCHITECTURES.
FAMILIES: dict[str, Family] = {
    "llama": Family(1e-6, 2048, mlp_bias=None),
    "mistral": Family(
        1e-6, 4096 * 32, qkv_bias=False, o_bias=False, sliding_window="always", default_window=4096
    ),
    "qwen2": Family(1e-6, 32768, qkv_bias=True, o_bias=False, sliding_window="when_enabled"),
    "qwen3": Family(1e-6, 32768, head_dim=128, qk_norm=True, sliding_window="when_enabled"),
    "qwen3_moe": Family(1e-6, 32768, qk_norm=True, sliding_window="when_enabled", extra=_qwen3_moe_experts),
    "mixtral": Family(
        1e-5, 4096 * 32, qkv_bias=False, o_bias=False, sliding_window="always", extra=_mixtral_experts
    ),
    "gemma3": Family(
        1e-6,
        131_072,
        head_dim=256,
        activation="gelu_pytorch_tanh",
        activation_key="hidden_activation",
        qk_norm=True,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rope=_gemma3_rope,
        extra=_gemma3_fields,
    ),
}


def _gguf_rope_scaling(reader: gguf.GGUFReader, arch: str, max_positions: int) -> dict[str, Any] | None:
    scaling_type = metadata_str(reader, f"{arch}.rope.scaling.type", default=None)
    if scaling_type in (None, "none"):
        return None
    if scaling_type != "linear":
        raise UnsupportedModelError(
            f"GGUF rope scaling type {scaling_type!r} is not supported; supported: linear"
        )
    factor = metadata_float(reader, f"{arch}.rope.scaling.factor", default=None)
    if factor is None:
        raise UnsupportedModelError("GGUF linear rope scaling without rope.scaling.factor")
    return {"rope_type": "linear", "factor": factor}
