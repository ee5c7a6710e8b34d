"""Small random checkpoints of the non-Llama families, and their GGUF conversions, for comparing
this server with llama.cpp's llama-server on the same weights (bench/compare_llama.py).

    .venv/bin/python bench/arch_checkpoints.py --out ~/.cache/nim-bench/arch [--quantize]
    # prints one line per family: <family> <HF dir> <f32 GGUF> [<Q4_1 GGUF>]

Each family gets a Hugging Face directory written by transformers (random weights, seeded, float32
safetensors) with the embedded model's tokenizer (SmolLM2's 49,152-token BPE and its ChatML
template, rebuilt from its GGUF by service.text.tokenizer), and an f32 GGUF made from that
directory by llama.cpp's own convert_hf_to_gguf.py (from the tree bench/build_llama_server.sh
unpacked). Our server serves the directory, llama-server the GGUF: the same weights in each
one's native loader.

One adjustment to the conversion, about metadata, not weights: llama.cpp's converter recognises
a BPE tokenizer by hashing how it splits a test string; the rebuilt tokenizer is SmolLM2's
vocabulary without its exact pre-tokenizer, so the hash is unknown and the converter is told it is
"smollm" (the GGUF then splits text as llama.cpp splits SmolLM2's; prompt token counts may differ
from ours by a few percent).

With --quantize each f32 GGUF also gets a Q4_1 copy by llama.cpp's own llama-quantize (built beside
llama-server by bench/build_llama_server.sh), token embeddings and output in Q8_0: the embedded
GGUF's mix, and the same weight bytes as this server's int4_wo profile (group-32 int4 with a
scale and zero, an int8 logits head). Compare like with like: where this server selects int4_wo
for a float checkpoint (hosts with bf16 activations), its figures go against the Q4_1 file, not
the f32 one (bench/README.md "The families against llama-server at equal precision").

Shapes (about the size of the embedded 135M model's per-token work, so decode is compute-bound on
a CPU as the embedded comparison is):
- qwen3_moe: hidden 512, 12 layers, 8 query / 4 KV heads of 64, 32 experts of 256, top 4.
- gemma3: Gemma 3 270M's layer shape (hidden 640, 18 layers, 4 query / 1 KV head of 256,
  intermediate 2048, five sliding layers of window 512 to one global), this vocabulary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LLAMA_WORK = Path.home() / ".cache" / "nim-bench" / "llama"


def _tokenizer(out: Path) -> int:
    """The embedded tokenizer into `out` (tokenizer.json, tokenizer_config.json); its vocab size."""
    from service.store.model_store import embedded_model_path
    from service.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(embedded_model_path())
    tok.backend.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config.update(tok.template_tokens)
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.backend.get_vocab_size(with_added_tokens=True)


def _model(family: str, vocab: int):  # a transformers PreTrainedModel
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=vocab,
            hidden_size=512,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=1536,
            moe_intermediate_size=256,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
        return transformers.Qwen3MoeForCausalLM(config)
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(
            vocab_size=vocab,
            hidden_size=640,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=2048,
            query_pre_attn_scalar=256,
            sliding_window=512,
            max_position_embeddings=4096,
        )
        return transformers.Gemma3ForCausalLM(config)
    raise SystemExit(f"unknown family {family!r}")


def write_checkpoint(family: str, out: Path) -> Path:
    directory = out / f"tiny-{family}"
    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(directory)
    model = _model(family, vocab).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def convert(directory: Path, gguf: Path, llama_tree: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on `directory`, told the tokenizer is SmolLM2's."""
    if gguf.is_file():
        return gguf
    script = llama_tree / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"{script} not found: run bench/build_llama_server.sh first")
    # The converter imports its own gguf-py; run it in this interpreter with the pre-tokenizer named.
    code = (
        "import sys, runpy\n"
        f"sys.path.insert(0, {str(llama_tree / 'gguf-py')!r})\n"
        f"sys.path.insert(0, {str(llama_tree)!r})\n"
        "import convert_hf_to_gguf as c\n"
        "from conversion.base import TextModel\n"
        "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'smollm'\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(directory)!r}, '--outtype', 'f32',"
        f" '--outfile', {str(gguf)!r}]\n"
        "c.main()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    return gguf


def quantize(f32: Path, tool: Path) -> Path:
    """`f32` as Q4_1 (token embeddings and output Q8_0) by llama-quantize, beside it."""
    out = f32.with_name(f32.name.replace(".f32.gguf", ".q4_1.gguf"))
    if out.is_file():
        return out
    argv = [str(tool), "--output-tensor-type", "q8_0", "--token-embedding-type", "q8_0"]
    subprocess.run([*argv, str(f32), str(out), "Q4_1"], check=True, stdout=subprocess.DEVNULL)
    return out


def llama_quantize() -> Path:
    found = sorted(LLAMA_WORK.glob("build-*/bin/llama-quantize"))
    if not found:
        raise SystemExit(f"no llama-quantize under {LLAMA_WORK}: run bench/build_llama_server.sh first")
    return found[-1]


def llama_tree() -> Path:
    found = sorted(LLAMA_WORK.glob("src-*/llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise SystemExit(f"no llama.cpp tree under {LLAMA_WORK}: run bench/build_llama_server.sh first")
    return found[-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache" / "nim-bench" / "arch")
    parser.add_argument("--families", nargs="+", default=["qwen3_moe", "gemma3"])
    parser.add_argument("--quantize", action="store_true", help="also a Q4_1 GGUF of each (llama-quantize)")
    args = parser.parse_args()
    tree = llama_tree()
    tool = llama_quantize() if args.quantize else None
    for family in args.families:
        directory = write_checkpoint(family, args.out)
        gguf = convert(directory, args.out / f"tiny-{family}.f32.gguf", tree)
        quantized = [quantize(gguf, tool)] if tool is not None else []
        print(family, directory, gguf, *quantized)


if __name__ == "__main__":
    main()
