"""Torch references of the cache kernels: page quantize / dequantize and the page store.

The engine runs these on the CPU; on CUDA the dispatch in kernels/__init__.py picks the Triton
store (`triton_store.store_blocks`, with this `store_blocks`'s signature).
"""
from __future__ import annotations

import torch

from .formats import FP8_DTYPE, FP8_MAX, INT4_LEVELS, INT8_MAX, SCALE_DTYPE, PageFormat

_MIN_SCALE = 1e-6


def _reduce_dims(fmt: PageFormat) -> tuple[int, ...]:
    # over x: [n, bs, H, D]
    return {"channel": (1,), "token": (3,), "group": (4,)}[fmt.scale_axis]


def _grouped(x: torch.Tensor, fmt: PageFormat) -> torch.Tensor:
    if fmt.scale_axis == "group":
        return x.unflatten(-1, (x.shape[-1] // fmt.group, fmt.group))
    return x


def pow2_code(v: torch.Tensor) -> torch.Tensor:
    """Biased exponent of the smallest power of two >= v (v float32, normal): 2 ** (code - 127)."""
    bits = v.float().contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def pow2_value(code: torch.Tensor) -> torch.Tensor:
    return (code.to(torch.int32) << 23).view(torch.float32)


def _scale(raw: torch.Tensor, fmt: PageFormat) -> torch.Tensor:
    """The scale a format stores for a raw scale, as the float32 it dequantizes with."""
    raw = raw.clamp_min(_MIN_SCALE)
    if fmt.name == "fp8":
        return pow2_value(pow2_code(raw))
    return raw.to(SCALE_DTYPE).float()


def _stored(scale: torch.Tensor, fmt: PageFormat) -> torch.Tensor:
    return pow2_code(scale).to(torch.uint8) if fmt.name == "fp8" else scale.to(SCALE_DTYPE)


def quantize(x: torch.Tensor, fmt: PageFormat):
    """x: [n, bs, H, D] float -> (data, scale, zero) laid out as `fmt.shapes` per block."""
    assert x.dim() == 4
    if not fmt.is_quantized:
        return x.to(fmt.data_dtype()), None, None
    xf = _grouped(x.float(), fmt)
    dims = _reduce_dims(fmt)
    if fmt.symmetric:
        amax = xf.abs().amax(dim=dims, keepdim=True)
        qmax = FP8_MAX if fmt.name == "fp8" else INT8_MAX
        scale = _scale(amax / qmax, fmt)
        y = xf / scale
        if fmt.name == "fp8":
            q = y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        else:
            q = y.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        zero = None
    elif fmt.name != "int4":   # int8 / fp8 centred on the mid-range (zero), codes symmetric around it
        lo, hi = xf.amin(dim=dims, keepdim=True), xf.amax(dim=dims, keepdim=True)
        zero = ((hi + lo) / 2).to(SCALE_DTYPE).float()
        qmax = FP8_MAX if fmt.name == "fp8" else INT8_MAX
        scale = _scale(torch.maximum(hi - zero, zero - lo) / qmax, fmt)
        y = (xf - zero) / scale
        if fmt.name == "fp8":
            q = y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        else:
            q = y.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        lo = xf.amin(dim=dims, keepdim=True).to(SCALE_DTYPE).float()
        hi = xf.amax(dim=dims, keepdim=True)
        scale = ((hi - lo) / INT4_LEVELS).clamp_min(_MIN_SCALE).to(SCALE_DTYPE).float()
        q = ((xf - lo) / scale).round().clamp(0, INT4_LEVELS).to(torch.uint8)
        zero = lo
    if fmt.scale_axis == "group":
        q = q.flatten(-2)
    if fmt.name == "int4":
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    scale = _stored(scale.squeeze(dims[0]), fmt)
    if zero is not None:
        zero = zero.squeeze(dims[0]).to(SCALE_DTYPE)
    return q, scale, zero


def dequantize(data: torch.Tensor, scale, zero, fmt: PageFormat) -> torch.Tensor:
    """Inverse of `quantize`: [n, bs, H, D'] pages -> [n, bs, H, D] float32."""
    if not fmt.is_quantized:
        return data.float()
    if fmt.name == "int4":
        q = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2).float()
    else:
        q = data.float()
    s = pow2_value(scale) if fmt.name == "fp8" else scale.float()
    z = zero.float() if zero is not None else None
    if fmt.scale_axis == "channel":      # [n, H, D] -> broadcast over tokens
        s = s.unsqueeze(1)
        z = z.unsqueeze(1) if z is not None else None
    elif fmt.scale_axis == "token":      # [n, bs, H] -> broadcast over channels
        s = s.unsqueeze(-1)
        z = z.unsqueeze(-1) if z is not None else None
    else:                                # [n, bs, H, G] -> repeat per group
        s = s.repeat_interleave(fmt.group, dim=-1)
        z = z.repeat_interleave(fmt.group, dim=-1) if z is not None else None
    return q * s + z if z is not None else q * s


def store_blocks(src: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor, scale, zero, fmt: PageFormat) -> None:
    """Quantize whole blocks and write them into their pages.

    src: [n, bs, H, D] float; block_ids: [n] int; data/scale/zero: page tensors [num_blocks, ...].
    """
    assert src.shape[0] == block_ids.shape[0]
    q, s, z = quantize(src, fmt)
    idx = block_ids.long()
    if q.dtype == FP8_DTYPE:  # index_copy_ has no float8 kernel on the CPU; copy the bytes
        data, q = data.view(torch.uint8), q.view(torch.uint8)
    data.index_copy_(0, idx, q)
    if s is not None:
        scale.index_copy_(0, idx, s)
    if z is not None:
        zero.index_copy_(0, idx, z)
