"""Refuse a model that cannot fit before loading a byte of it, with the numbers."""
from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError
GIB = 2**30
# what a load needs beside the weights: Python, torch, the tokenizer, a first KV block and work buffers
OVERHEAD_BYTES = 600 * 2**20


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def resident_estimate(mc, stored_bytes: int, weights: str) -> int:
    """Bytes the weights will hold once loaded: the stored size for packed or kept dtypes, 4 B a weight dense."""
    params = mc.num_layers * (mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
                              + 3 * mc.hidden_size * mc.intermediate_size) \
        + mc.vocab_size * mc.hidden_size * (1 if mc.tie_word_embeddings else 2)
    if weights == "dense":
        return params * 4
    if weights == "int8":
        return params
    if weights == "int4":
        return params * 5 // 8
    return int(stored_bytes * 1.1)


def available_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch
        free, _ = torch.cuda.mem_get_info()
        return free
    try:                      # Linux: the kernel's own estimate, as psutil reports it, without importing psutil (40-90 ms)
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    import psutil
    return psutil.virtual_memory().available


def check_fits(mc, stored_bytes: int, weights: str, device: str, name: str) -> None:
    need = resident_estimate(mc, stored_bytes, weights) + OVERHEAD_BYTES
    have = available_bytes(device)
    if need > have:
        where = "GPU memory" if device.startswith("cuda") else "memory"
        raise ModelLoadError(f"{name} needs about {need / GIB:.1f} GiB of {where} with weights={weights!r} "
                             f"and {have / GIB:.1f} GiB is free: close other programs, choose a smaller "
                             f"quantization (Q4_K_M) or a smaller model")


def trim_heap() -> None:
    """Give the allocator's free pages back to the system after a load's temporaries (glibc only)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
