"""The one memory planner: what a model's weights hold once loaded, the reserve kept beside them, and the
refusal before loading a byte of a model that cannot fit. `kvchat estimate`, the Models page and the loader
all plan with these numbers, so the three agree."""
from __future__ import annotations

import json
import math
import struct
from collections import Counter
from pathlib import Path

from kvchat.engine.errors import ModelLoadError
from kvchat.engine.units import GIB, MIB

# What a running kvchat needs beside weights and KV (Python, torch, the tokenizer, a first KV block and
# work buffers), plus a share of the memory left free for everything else on the machine.
RUNTIME_BYTES = 600 * MIB
FREE_SHARE = 0.05
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
SIXTEEN_BIT = ("bf16", "f16")           # safetensors' names of the stored dtypes the CPU keeps as they are


def margin_for(memory_bytes: int) -> int:
    """The reserve kept beside the weights (and the KV cache) in memory_bytes."""
    return RUNTIME_BYTES + int(FREE_SHARE * memory_bytes)


def parameter_count(mc) -> int:
    """Parameters of a model of this shape: norms and biases included, and per layer its description's extra
    norms (a q and a k norm of head_dim each; Gemma's norms after attention and after the MLP)."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    attn = mc.hidden_size * (2 * q + 2 * kv)
    bias = (q + 2 * kv) * mc.qkv_bias + mc.hidden_size * mc.o_bias
    mlp = 3 * mc.hidden_size * mc.intermediate_size
    mlp_bias = (2 * mc.intermediate_size + mc.hidden_size) * mc.mlp_bias
    layer = attn + bias + mlp + mlp_bias + 2 * mc.hidden_size
    extra = sum(2 * mc.head_dim * spec.qk_norm + 2 * mc.hidden_size * spec.post_norms for spec in mc.layers)
    embed = mc.vocab_size * mc.hidden_size * (1 if mc.tie_word_embeddings else 2)
    return mc.num_layers * layer + extra + embed + mc.hidden_size


def model_dtype_for(dtype: str, device: str) -> str:
    """The model dtype the engine picks: as asked, else fp32 on the CPU and bf16 on a GPU."""
    if dtype != "auto":
        return dtype
    return "bf16" if device.startswith("cuda") else "fp32"


def safetensors_summary(folder) -> tuple[int, int, str]:
    """(parameters, bytes on disk, dominant dtype) of a folder's *.safetensors, from their JSON headers."""
    params, size, dtypes = 0, 0, Counter()
    for f in sorted(Path(folder).glob("*.safetensors")):
        size += f.stat().st_size
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (struct.error, ValueError, MemoryError) as exc:
            raise ModelLoadError(f"{f.name} has no readable safetensors header ({exc}): re-download or re-export "
                                 f"the model") from exc
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(info["shape"])
            params += count
            dtypes[info["dtype"].lower()] += count
    dominant = dtypes.most_common(1)[0][0] if dtypes else "?"
    return params, size, dominant


def folder_weights(folder) -> tuple[int, str]:
    """(bytes on disk, dominant dtype) of a folder's *.safetensors for the fit check. A header that does not
    read gives no dtype (planned at the model dtype): the loader's own message then says what is wrong."""
    try:
        _, size, dtype = safetensors_summary(folder)
    except ModelLoadError:
        return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")), ""
    return size, dtype


def resident_bytes(mc, stored_bytes: int, weights: str, device: str, dtype: str = "auto", source: str = "gguf",
                   stored_dtype: str = "") -> int:
    """Bytes the weights hold once loaded on `device`, as engine.model.weights builds them.

    source: "gguf" (stored_bytes: its tensor bytes), "safetensors" (its files' bytes, stored_dtype their
    dominant dtype) or "preset" (a parameter count times a GGUF type's bytes, planned as a GGUF)."""
    params = parameter_count(mc)
    if weights == "int8":
        return params
    if weights == "int4":
        return params * 5 // 8
    dense = params * DTYPE_BYTES[model_dtype_for(dtype, device)]
    if weights == "dense" or device != "cpu":
        return dense            # dequantized (or cast) to the model dtype; only the CPU keeps stored blocks
    if source == "safetensors" and stored_dtype not in SIXTEEN_BIT:
        return dense            # a float32 folder is cast to the model dtype
    return stored_bytes         # a GGUF's blocks kept packed, a 16-bit folder at its stored dtype


def load_need(mc, stored_bytes: int, weights: str, device: str, memory_bytes: int, dtype: str = "auto",
              source: str = "gguf", stored_dtype: str = "") -> int:
    """Bytes a load needs in memory_bytes: the resident weights and the reserve."""
    return resident_bytes(mc, stored_bytes, weights, device, dtype, source, stored_dtype) + margin_for(memory_bytes)


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


def check_fits(mc, stored_bytes: int, weights: str, device: str, name: str, dtype: str = "auto",
               source: str = "gguf", stored_dtype: str = "") -> None:
    have = available_bytes(device)
    need = load_need(mc, stored_bytes, weights, device, have, dtype, source, stored_dtype)
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
