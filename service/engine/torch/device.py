"""Where and in what precision the PyTorch engine runs, from what PyTorch itself sees (the host's
CPU flags decide bf16 or fp32 on the CPU), and how much memory that device has free."""

from __future__ import annotations

import torch

from service.host import cpu_has_fast_bf16, host_memory_available


def choose_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("NIM_DEVICE=cuda but no CUDA device is available to PyTorch")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested != "auto":
        dtype: torch.dtype = getattr(torch, requested)
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def free_memory_bytes(device: torch.device) -> int:
    """Memory this process could still allocate on `device` (on the CPU: service.host's reading)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_memory_available()
