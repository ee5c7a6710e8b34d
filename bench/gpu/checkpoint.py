"""A random-weight Llama-architecture checkpoint of a named shape (Hugging Face layout, bf16
safetensors), for timing where no model can be downloaded: decode speed depends on the shapes, not
on the weight values (load it with ignore_eos).

    python3 bench/gpu/checkpoint.py SHAPE OUT_DIR TOKENIZER_DIR

SHAPE: tiny (the CPU rehearsal's: 2 layers of 64), smol (SmolLM2-135M), 1b (Llama-3.2-1B),
8b (Llama-3.1-8B). TOKENIZER_DIR holds tokenizer.json (and tokenizer_config.json with the chat
template, which is copied along); its vocabulary size is the checkpoint's (the embedded model's
49,152 tokens make an 8B lm_head of 0.4 GB instead of Llama-3.1's 1.05 GB; the floor is measured on
the same file, so ratios hold). Runs on CUDA when available (8B: about 20 s on an H100, mostly the
write), else on the CPU.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES: dict[str, dict[str, object]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True, rope_theta=10000.0),
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0),
}  # fmt: skip


def vocab_size(tokenizer_dir: Path) -> int:
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    added = max((t["id"] for t in tokenizer.get("added_tokens", [])), default=-1)
    return max(len(tokenizer["model"]["vocab"]), added + 1)


def write(shape: str, out: Path, tokenizer_dir: Path) -> float:
    """Write the checkpoint; its size in GB."""
    spec = SHAPES[shape]
    hidden, inter = int(spec["hidden_size"]), int(spec["intermediate_size"])  # type: ignore[call-overload]
    heads, kv_heads = int(spec["num_attention_heads"]), int(spec["num_key_value_heads"])  # type: ignore[call-overload]
    kv = kv_heads * (hidden // heads)
    vocab = vocab_size(tokenizer_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": ones(hidden)}
    layer_shapes = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    for i in range(int(spec["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = ones(hidden)
        for name, size in layer_shapes.items():
            tensors[p + name] = rand(*size)
    if not spec["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(vocab, hidden)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, rms_norm_eps=1e-5,
        max_position_embeddings=8192, hidden_act="silu", torch_dtype="bfloat16", **spec,
    )  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out)
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9


def main() -> None:
    shape, out, tokenizer_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    started = time.monotonic()
    size = write(shape, out, tokenizer_dir)
    print(f"{shape}: {size:.2f} GB of bf16 weights in {out} ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
