"""The one memory planner: what a model's weights hold once loaded, the reserve kept beside them, and the
refusal before loading a byte of a model that cannot fit. `kvchat estimate`, the Models page and the loader
all plan with these numbers, so the three agree.

Each memory is judged with its own arithmetic: a GPU's free memory against what lands on the GPU (the weights
in the form the loader gives them there, the reserve), the host's RAM against what stays on the host (the
runtime and the one matrix being read at a time). The memory itself is a DeviceMemory, read from the machine
or given as numbers, so a GPU plan is testable where there is none."""
from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.errors import ModelLoadError
from kvchat.engine.units import DTYPE_BYTES, GIB, MIB

# What a running kvchat needs beside weights and KV (Python, torch, the tokenizer, a first KV block and
# work buffers), plus a share of the memory left free for everything else on the machine.
RUNTIME_BYTES = 600 * MIB
FREE_SHARE = 0.05
SIXTEEN_BIT = ("bf16", "f16")           # safetensors' names of the stored dtypes the CPU keeps as they are
# a verdict per memory: fits; fits, but leaves under TIGHT_SHARE of that memory for the KV cache and the rest of
# the machine (a long chat will not fit); does not fit (the loader refuses)
FITS, TIGHT, TOO_BIG = "fits", "tight", "does not fit"
TIGHT_SHARE = 0.10


def margin_for(memory_bytes: int) -> int:
    """The reserve kept beside the weights (and the KV cache) in memory_bytes."""
    return RUNTIME_BYTES + int(FREE_SHARE * memory_bytes)


def parameter_count(mc) -> int:
    """Parameters of a model of this shape (parameter_counts' first)."""
    return parameter_counts(mc)[0]


def parameter_counts(mc) -> tuple[int, int]:
    """(every parameter, the parameters one decoded token reads) of a model of this shape: norms and biases included,
    and per layer its description's extra norms (a q and a k norm of head_dim each; Gemma's norms after attention
    and after the MLP) and sink logits, each layer at its own head size (a layer over another's KV without k and v
    projections), and per-layer input embeddings. A routed layer holds its router and every expert, and a token reads the
    router and the `used` experts it picks. A token reads one row of the embedding table; a tied table is the output
    head too, read whole."""
    h, heads = mc.hidden_size, mc.num_heads
    total = active = 0
    for i, spec in enumerate(mc.layers):
        d = mc.layer_head_dim(i) if hasattr(mc, "layer_head_dim") else mc.head_dim
        q = heads * d
        kv = (mc.layer_kv_heads(i) if hasattr(mc, "layer_kv_heads") else mc.num_kv_heads) * d
        own = (2 - spec.value_from_key) * kv if spec.kv_source is None else 0      # k and v projections
        shared = (h * (2 * q + own) + (q + own) * spec.qkv_bias + h * spec.o_bias
                  + 2 * h + (d + d * (spec.kv_source is None)) * spec.qk_norm + 2 * h * spec.post_norms
                  + heads * spec.sink_logits + h * q * spec.attn_gate + spec.output_scale)
        if getattr(mc, "per_layer_input", 0):       # the per-layer input's gate, projection and norm
            shared += 2 * h * mc.per_layer_input + h
        la = spec.linear
        if la is not None:              # Gated DeltaNet: q|k|v, z, b, a in; out; conv taps, dt, A, the gated norm
            v = la.value_heads * la.value_dim
            shared = (h * (la.channels + v + 2 * la.value_heads) + v * h + la.channels * la.conv_kernel
                      + 2 * la.value_heads + la.value_dim + 2 * h)
        ex = spec.experts
        f = spec.ffn or mc.intermediate_size
        mlp = 3 * h * f + (2 * f + h) * spec.mlp_bias
        if ex is None:
            total, active = total + shared + mlp, active + shared + mlp
            continue
        router = ex.count * (h + ex.router_bias)
        expert = 3 * h * ex.ffn + (2 * ex.ffn + h) * ex.expert_bias
        router += 3 * h * ex.shared_ffn + h * bool(ex.shared_ffn)      # a shared expert (and its gate): every token
        if ex.beside_dense:             # Gemma 4: the dense MLP too, the router's scales and three more norms
            router += mlp + h + ex.count + 3 * h
        total += shared + router + ex.count * expert
        active += shared + router + ex.used * expert
    ple = getattr(mc, "per_layer_input", 0) * mc.num_layers
    if ple:                             # the per-layer embeddings: a token reads its row; their projection and norm
        extra = ple * h + mc.per_layer_input
        total, active = total + mc.per_layer_vocab * ple + extra, active + ple + extra
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


def packs_gguf(device: str) -> bool:
    """Whether a GGUF's blocks stay packed on `device`, by the loader's own rule (engine.model.weights.from_gguf):
    always on the CPU (the C kernels), on a GPU where its Triton kernels run; else dequantized to the model dtype."""
    if device == "cpu":
        return True
    from kvchat import kernels
    return kernels.gpu_path(device)


def resident_bytes(mc, stored_bytes: int, weights: str, device: str, dtype: str = "auto", source: str = "gguf",
                   stored_dtype: str = "", params: int | None = None, packed: bool | None = None) -> int:
    """Bytes the weights hold once loaded on `device`, as engine.model.weights builds them.

    source: "gguf" (stored_bytes: its tensor bytes), "safetensors" (its files' bytes, stored_dtype their
    dominant dtype) or "preset" (a parameter count times a GGUF type's bytes, planned as a GGUF). params: the
    parameters stored_bytes hold (default: the model's all; a part of them, such as what one token reads, planned
    the same way). packed: whether a GGUF's blocks stay packed on the device (default: packs_gguf(device))."""
    params = parameter_count(mc) if params is None else params
    if weights == "int8":
        return params
    if weights == "int4":
        return params * 5 // 8
    dense = params * DTYPE_BYTES[model_dtype_for(dtype, device)]
    if weights == "dense":
        return dense            # dequantized to the model dtype: the reference path
    if source == "safetensors":
        # the CPU keeps a 16-bit folder at its stored dtype and casts the rest; a GPU casts all to the model dtype
        return stored_bytes if device == "cpu" and stored_dtype in SIXTEEN_BIT else dense
    if packed is None:
        packed = packs_gguf(device)
    return stored_bytes if packed else dense      # a GGUF's blocks as the file holds them, on the CPU and the GPU


def load_need(mc, stored_bytes: int, weights: str, device: str, memory_bytes: int, dtype: str = "auto",
              source: str = "gguf", stored_dtype: str = "", packed: bool | None = None) -> int:
    """Bytes a load needs in memory_bytes (the device's): the resident weights and the reserve."""
    return resident_bytes(mc, stored_bytes, weights, device, dtype, source, stored_dtype,
                          packed=packed) + margin_for(memory_bytes)


def staging_bytes(mc, stored_bytes: int, weights: str, source: str = "gguf", packed: bool = True) -> int:
    """Host bytes a load to a GPU holds at once beside the runtime: the largest matrix the loader reads before
    moving it (a fused q/k/v, gate/up, a layer's experts or the embedding table), packed at the file's bytes a
    weight, else dequantized to float32."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    largest = max([mc.vocab_size * h, h * (q + 2 * kv), 2 * h * mc.intermediate_size]
                  + [2 * spec.experts.count * h * spec.experts.ffn for spec in mc.layers if spec.experts is not None])
    if packed and weights == "auto" and source != "safetensors":
        return math.ceil(largest * stored_bytes / max(1, parameter_count(mc)))
    return 4 * largest


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The memory a load lands in: free_bytes of the device (available RAM for "cpu", free GPU memory for "cuda")
    and host_free_bytes of the host's RAM (the same number on the CPU), read by device_memory or given as numbers.
    packs_gguf: a GGUF's blocks stay packed there (packs_gguf(device))."""
    device: str
    free_bytes: int
    host_free_bytes: int
    packs_gguf: bool = True
    source: str = ""                # where free_bytes was read: "free GPU memory (pynvml)", "available RAM ..."

    def __post_init__(self):
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device={self.device!r}: plan for cpu or cuda")
        if min(self.free_bytes, self.host_free_bytes) < 0:
            raise ValueError(f"free_bytes={self.free_bytes}, host_free_bytes={self.host_free_bytes}: memory is never "
                             f"negative")

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"


@dataclass(frozen=True, slots=True)
class Fit:
    """A plan's verdict (FITS, TIGHT, TOO_BIG): the worse of the device's (need_bytes of free_bytes) and, for a GPU,
    the host's (host_need_bytes of host_free_bytes; 0 of them on the CPU, where both are one memory)."""
    verdict: str
    device: str
    need_bytes: int
    free_bytes: int
    host_need_bytes: int = 0
    host_free_bytes: int = 0
    weight_bytes: int = 0           # of need_bytes: the weights as they sit on the device

    @property
    def fits(self) -> bool:
        return self.verdict != TOO_BIG

    def message(self, name: str, weights: str) -> str:
        """Why a load is refused, with the numbers of the memory that does not hold it."""
        if self.device != "cpu" and self.host_need_bytes > self.host_free_bytes:
            need, have, where = self.host_need_bytes, self.host_free_bytes, "memory (RAM beside the GPU)"
        else:
            need, have, where = self.need_bytes, self.free_bytes, "GPU memory" if self.device != "cpu" else "memory"
        return (f"{name} needs about {need / GIB:.1f} GiB of {where} with weights={weights!r} and {have / GIB:.1f} "
                f"GiB is free: close other programs, choose a smaller quantization (Q4_K_M) or a smaller model")


def judge(need: int, free: int) -> str:
    """One memory's verdict: TOO_BIG past it, TIGHT within TIGHT_SHARE of it, else FITS."""
    if need > free:
        return TOO_BIG
    return TIGHT if free - need < TIGHT_SHARE * free else FITS


def plan_fit(mc, stored_bytes: int, weights: str, memory: DeviceMemory, dtype: str = "auto", source: str = "gguf",
             stored_dtype: str = "") -> Fit:
    """The device-aware verdict on loading a model of stored_bytes into `memory` (check_fits refuses on TOO_BIG;
    the Models page shows it)."""
    device = memory.device
    resident = resident_bytes(mc, stored_bytes, weights, device, dtype, source, stored_dtype, packed=memory.packs_gguf)
    need = resident + margin_for(memory.free_bytes)
    verdicts = [judge(need, memory.free_bytes)]
    host_need = 0
    if memory.on_gpu:
        host_need = (margin_for(memory.host_free_bytes)
                     + staging_bytes(mc, stored_bytes, weights, source, memory.packs_gguf))
        verdicts.append(judge(host_need, memory.host_free_bytes))
    worst = max(verdicts, key=(FITS, TIGHT, TOO_BIG).index)
    return Fit(worst, device, need, memory.free_bytes, host_need, memory.host_free_bytes if memory.on_gpu else 0,
               resident)


def available_bytes(device: str) -> int:
    """Free memory of `device`: the GPU's (torch's CUDA, already started by a load), else the host's RAM."""
    if device.startswith("cuda"):
        import torch
        free, _ = torch.cuda.mem_get_info()
        return free
    return host_available_bytes()


def host_available_bytes() -> int:
    try:                      # Linux: the kernel's own estimate, as psutil reports it, without importing psutil (40-90 ms)
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    import psutil
    return psutil.virtual_memory().available


def nvml_free() -> int | None:
    """Free memory of GPU 0 as the NVIDIA driver reports it (pynvml: torch's CUDA is not started); None without one."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def device_memory(device: str = "auto") -> DeviceMemory:
    """The memory of this machine where a load on `device` would land ("auto": the GPU the driver reports, else
    the CPU), read without starting CUDA: what the Models page plans with."""
    host = host_available_bytes()
    free = nvml_free() if device != "cpu" else None
    if free is None:
        if device.startswith("cuda"):
            raise ModelLoadError(f"device={device!r}: no NVIDIA GPU answers (pynvml); plan for cpu instead")
        return DeviceMemory("cpu", host, host, True, "available RAM (psutil)")
    gpu = "cuda" if device == "auto" else device
    return DeviceMemory(gpu, free, host, packs_gguf(gpu), "free GPU memory (pynvml)")


def check_fits(mc, stored_bytes: int, weights: str, device: str, name: str, dtype: str = "auto",
               source: str = "gguf", stored_dtype: str = "", memory: DeviceMemory | None = None) -> None:
    """Refuse, before a byte is read, a load whose device or host memory cannot hold it (plan_fit's TOO_BIG).
    memory: the numbers to plan with (default: this machine's, the GPU's read by the CUDA a load has started)."""
    if memory is None:
        free = available_bytes(device)
        host = free if device == "cpu" else host_available_bytes()
        memory = DeviceMemory(device, free, host, packs_gguf(device))
    fit = plan_fit(mc, stored_bytes, weights, memory, dtype, source, stored_dtype)
    if not fit.fits:
        raise ModelLoadError(fit.message(name, weights))


def trim_heap() -> None:
    """Give the allocator's free pages back to the system after a load's temporaries (glibc only)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
