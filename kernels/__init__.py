"""Cache kernels behind one dispatch point: the page store in Triton on CUDA, in torch elsewhere.

Triton is imported lazily, only when a CUDA tensor arrives, so `import kernels` works on a
machine without triton or without a GPU.

`gpu_path(t)` is the one question every GPU/CPU choice asks: a CUDA tensor with triton, or, for checking
the GPU path on a machine without one, CPU tensors while KVCHAT_GPU_PATH=interpret and
TRITON_INTERPRET=1 are set (every Triton kernel then runs under triton's interpreter).
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .formats import PageFormat

# torch comes in with the first of these names used, not with `import kernels`: the C kernels'
# loader (kernels.cpu_lib) serves a one-shot answer without torch (engine.runtime.quick)
_LAZY = {"reference": ("reference", None), "PageFormat": ("formats", "PageFormat"),
         "bytes_per_block": ("formats", "bytes_per_block"), "page_format": ("formats", "page_format"),
         **{name: ("reference", name) for name in ("dequantize", "quantize")}}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(f".{module}", __name__)
    return value if attr is None else getattr(value, attr)


__all__ = [
    "PageFormat", "page_format", "bytes_per_block",
    "quantize", "dequantize",
    "store_blocks", "triton_available", "gpu_path", "interpreting",
]


@functools.cache
def triton_available() -> bool:
    """True when triton imports and can compile for the GPU here (or runs under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """The GPU path on CPU tensors, every Triton kernel under the interpreter (a test mode; see the docstring)."""
    return os.environ.get("KVCHAT_GPU_PATH") == "interpret" and os.environ.get("TRITON_INTERPRET") == "1"


def gpu_path(t) -> bool:
    """Whether work on `t` (a tensor, a torch.device or a device string) takes the GPU path: Triton kernels,
    weights packed for them, the Triton attention backends."""
    kind = t.device.type if hasattr(t, "device") else (t.type if hasattr(t, "type") else str(t).split(":")[0])
    if kind == "cuda":
        return triton_available()
    return kind == "cpu" and interpreting() and triton_available()


@functools.cache
def sm_count(index: int = 0) -> int:
    """Streaming multiprocessors of CUDA device `index` (the Triton kernels size their grids by it)."""
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


def _use_triton(t) -> bool:
    return gpu_path(t)


def store_blocks(src, block_ids, data, scale, zero, fmt: PageFormat) -> None:
    """src [n, bs, H, D] -> quantized pages at block_ids; see `reference.store_blocks`."""
    if _use_triton(src):
        from .triton_store import store_blocks as impl
    else:
        from .reference import store_blocks as impl
    impl(src, block_ids, data, scale, zero, fmt)
