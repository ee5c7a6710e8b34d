"""The batch-1 decode floor of a checkpoint: every linear weight read once (y = x @ W.T), the
whole pass captured in one CUDA graph and replayed (on the CPU: the same pass timed as a loop);
plus the device's copy bandwidth. No engine reaches it at batch 1; "x of the floor" is the honest
way to state batch-1 decode.

    python3 bench/gpu/floor.py CHECKPOINT_DIR [--json OUT]

Embeddings are skipped (a token reads one row); a tied lm_head is the embedding, read whole, so it
is counted once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def linear_weights(checkpoint: Path, device: torch.device) -> list[torch.Tensor]:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    config = json.loads((checkpoint / "config.json").read_text())
    # On the CPU in float32: what the engine computes in where bf16 has no fast kernels (a rehearsal).
    dtype = None if device.type == "cuda" else torch.float32
    weights = [t.to(device, dtype) for name, t in tensors.items() if t.dim() == 2 and "embed" not in name]
    if config.get("tie_word_embeddings"):
        weights.append(tensors["model.embed_tokens.weight"].to(device, dtype))
    return weights


def floor_ms(weights: list[torch.Tensor], device: torch.device) -> float:
    """Milliseconds of one pass over every weight at batch 1 (median over repeats on the CPU)."""
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], device=device, dtype=w.dtype) for w in weights}

    def one_pass() -> None:
        for w in weights:
            torch.matmul(inputs[w.shape[1]], w.t())

    if device.type != "cuda":
        with torch.inference_mode():
            one_pass()
            times = []
            for _ in range(20):
                started = time.perf_counter()
                one_pass()
                times.append(time.perf_counter() - started)
        return 1000 * statistics.median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            one_pass()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_pass()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graph.replay()
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / 50


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second by a large device copy, in TB/s (GB/s on the CPU: 1e9)."""
    size = 2**31 if device.type == "cuda" else 2**27
    a = torch.empty(size, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * size * 10 / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    weights = linear_weights(args.checkpoint, device)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    ms = floor_ms(weights, device)
    copy = copy_bandwidth(device)
    figures = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "linear_weight_gb": nbytes / 1e9,
        "pass_ms": ms,
        "read_tb_s": nbytes / ms / 1e9,
        "floor_tok_s": 1000 / ms,
        "copy_tb_s": copy / 1e12,
    }
    print(f"{args.checkpoint}: {nbytes / 1e9:.2f} GB of linear weights; one pass {ms:.2f} ms "
          f"({nbytes / ms / 1e9:.2f} TB/s) -> batch-1 ceiling {1000 / ms:.0f} tok/s; copy "
          f"{copy / 1e12:.2f} TB/s read+write on {figures['device']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
