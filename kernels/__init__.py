"""Cache kernels: Triton on CUDA, the torch reference elsewhere, behind one dispatch point.

Triton is imported lazily, only when a CUDA tensor arrives, so `import kernels` works on a
machine without triton or without a GPU.
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
         **{name: ("reference", name) for name in ("apply_rope", "dequantize", "gather_kv", "merge_attention",
                                                   "quantize", "rope_cos_sin", "slot_positions")}}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(f".{module}", __name__)
    return value if attr is None else getattr(value, attr)


__all__ = [
    "PageFormat", "page_format", "bytes_per_block",
    "quantize", "dequantize", "rope_cos_sin", "apply_rope", "slot_positions", "gather_kv", "merge_attention",
    "paged_decode_attention", "store_blocks", "triton_available",
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


def paged_decode_attention(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero,
                           block_tables, seq_lens, window_starts, num_sinks,
                           inv_freq, sm_scale: float, k_fmt: PageFormat, v_fmt: PageFormat):
    """q [B, Hq, D] -> out [B, Hq, D], lse [B, Hq] float32; see `reference.paged_decode_attention`."""
    if _use_triton(q):
        from .triton_attention import paged_decode_attention as impl
    else:
        from .reference import paged_decode_attention as impl
    return impl(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, block_tables, seq_lens,
                window_starts, num_sinks, inv_freq, sm_scale, k_fmt, v_fmt)


def store_blocks(src, block_ids, data, scale, zero, fmt: PageFormat) -> None:
    """src [n, bs, H, D] -> quantized pages at block_ids; see `reference.store_blocks`."""
    if _use_triton(src):
        from .triton_store import store_blocks as impl
    else:
        from .reference import store_blocks as impl
    impl(src, block_ids, data, scale, zero, fmt)
