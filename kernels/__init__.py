"""Cache kernels behind one dispatch point: the page store in Triton on CUDA, in torch elsewhere.

Triton is imported lazily, only when a CUDA tensor arrives, so `import kernels` works on a
machine without triton or without a GPU. The CUDA decode attention is not here yet: it comes with
the GPU issue (27), on the engine's own page layout.
"""
from __future__ import annotations

import functools
import importlib
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
    "store_blocks", "triton_available",
]


@functools.cache
def triton_available() -> bool:
    """True when triton imports and can compile for the GPU here (or runs under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _use_triton(t) -> bool:
    return t.is_cuda and triton_available()


def store_blocks(src, block_ids, data, scale, zero, fmt: PageFormat) -> None:
    """src [n, bs, H, D] -> quantized pages at block_ids; see `reference.store_blocks`."""
    if _use_triton(src):
        from .triton_store import store_blocks as impl
    else:
        from .reference import store_blocks as impl
    impl(src, block_ids, data, scale, zero, fmt)
