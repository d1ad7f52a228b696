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
from kvchat.engine.units import DTYPE_BYTES, GIB, MIB

# What a running kvchat needs beside weights and KV (Python, torch, the tokenizer, a first KV block and
# work buffers), plus a share of the memory left free for everything else on the machine.
RUNTIME_BYTES = 600 * MIB
FREE_SHARE = 0.05
SIXTEEN_BIT = ("bf16", "f16")           # safetensors' names of the stored dtypes the CPU keeps as they are


def margin_for(memory_bytes: int) -> int:
    """The reserve kept beside the weights (and the KV cache) in memory_bytes."""
    return RUNTIME_BYTES + int(FREE_SHARE * memory_bytes)


def parameter_count(mc) -> int:
    """Parameters of a model of this shape (parameter_counts' first)."""
    return parameter_counts(mc)[0]


def parameter_counts(mc) -> tuple[int, int]:
    """(every parameter, the parameters one decoded token reads) of a model of this shape: norms and biases included,
    and per layer its description's extra norms (a q and a k norm of head_dim each; Gemma's norms after attention
    and after the MLP) and sink logits. A routed layer holds its router and every expert, and a token reads the
    router and the `used` experts it picks. A token reads one row of the embedding table; a tied table is the output
    head too, read whole."""
    h, heads, d = mc.hidden_size, mc.num_heads, mc.head_dim
    q, kv = heads * d, mc.num_kv_heads * d
    total = active = 0
    for spec in mc.layers:
        shared = (h * (2 * q + 2 * kv) + (q + 2 * kv) * spec.qkv_bias + h * spec.o_bias
                  + 2 * h + 2 * d * spec.qk_norm + 2 * h * spec.post_norms + heads * spec.sink_logits)
        ex = spec.experts
        if ex is None:
            f = mc.intermediate_size
            mlp = 3 * h * f + (2 * f + h) * spec.mlp_bias
            total, active = total + shared + mlp, active + shared + mlp
            continue
        router = ex.count * (h + ex.router_bias)
        expert = 3 * h * ex.ffn + (2 * ex.ffn + h) * ex.expert_bias
        total += shared + router + ex.count * expert
        active += shared + router + ex.used * expert
    table = mc.vocab_size * h
    if mc.tie_word_embeddings:
        return total + table + h, active + table + h
    return total + 2 * table + h, active + table + 2 * h


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


def gguf_read_bytes(gf, mc) -> int:
    """Of a GGUF's tensor bytes, those one decoded token reads: all but the experts its router leaves out (a routed
    layer's expert tensors, 3-D or one per expert, times used / count) and all but one row of the embedding table
    (a tied table is the output head too, read whole)."""
    read = 0
    for name, t in gf.tensors.items():
        parts = name.split(".")
        if name == "token_embd.weight" and "output.weight" in gf.tensors and len(t.shape) == 2:
            read += t.n_bytes // max(1, t.shape[1])
        elif parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < mc.num_layers and _expert_tensor(parts) \
                and mc.layers[int(parts[1])].experts is not None:
            ex = mc.layers[int(parts[1])].experts
            read += t.n_bytes * ex.used // ex.count
        else:
            read += t.n_bytes
    return read


def _expert_tensor(parts: list[str]) -> bool:
    # blk.N.ffn_gate_exps.weight (and .bias); Mixtral's older blk.N.ffn_gate.E.weight
    return parts[2].endswith("_exps") or (len(parts) == 5 and parts[3].isdigit())


def safetensors_read_bytes(folder, mc) -> int:
    """safetensors' counterpart of gguf_read_bytes, from the files' headers: a layer's tensors under mlp.experts
    (or block_sparse_moe.experts) times used / count, one row of model.embed_tokens where lm_head is its own."""
    tensors = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                tensors[name] = (info["shape"], end - start)
    read = 0
    for name, (shape, size) in tensors.items():
        parts = name.split(".")
        layer = int(parts[2]) if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit() else None
        ex = mc.layers[layer].experts if layer is not None and layer < mc.num_layers else None
        if name == "model.embed_tokens.weight" and "lm_head.weight" in tensors and shape:
            read += size // max(1, shape[0])
        elif ex is not None and ".experts." in name:
            read += size * ex.used // ex.count
        else:
            read += size
    return read


def folder_weights(folder) -> tuple[int, str]:
    """(bytes on disk, dominant dtype) of a folder's *.safetensors for the fit check. A header that does not
    read gives no dtype (planned at the model dtype): the loader's own message then says what is wrong."""
    try:
        _, size, dtype = safetensors_summary(folder)
    except ModelLoadError:
        return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")), ""
    return size, dtype


def resident_bytes(mc, stored_bytes: int, weights: str, device: str, dtype: str = "auto", source: str = "gguf",
                   stored_dtype: str = "", params: int | None = None) -> int:
    """Bytes the weights hold once loaded on `device`, as engine.model.weights builds them.

    source: "gguf" (stored_bytes: its tensor bytes), "safetensors" (its files' bytes, stored_dtype their
    dominant dtype) or "preset" (a parameter count times a GGUF type's bytes, planned as a GGUF). params: the
    parameters stored_bytes hold (default: the model's all; a part of them, such as what one token reads, planned
    the same way)."""
    params = parameter_count(mc) if params is None else params
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
