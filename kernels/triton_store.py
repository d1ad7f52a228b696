"""Triton quantize-and-store: the GPU twin of `reference.store_blocks`.

One program owns one (block, head): it reads the block's [bs, D] values, computes the scales (and
zero points) of its format, quantizes and writes the data / scale / zero pages at the block id.
Values are handled as even and odd channels, [bs, D/2] each, because int4 packs channel 2i in the
low nibble and 2i+1 in the high nibble of byte i; the other formats simply store both halves.
Rounding is done explicitly (half to even, as torch.round) so results match the reference
bit for bit, on the GPU and under the interpreter alike.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import FP8_MAX, INT4_LEVELS, INT8_MAX, PageFormat

_AXIS = {"none": 0, "channel": 1, "token": 2, "group": 3}
_KIND = {"int8": 1, "fp8": 2, "int4": 3}


@triton.jit
def _rint(x):
    # Round half to even via the 1.5 * 2**23 trick: exact for |x| < 2**22, far above any code here.
    # (No libdevice: the interpreter cannot call it.)
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _snap_e4m3(y):
    # y: float32 within +-448 -> nearest e4m3 value (ties to even), so the fp8 cast is exact.
    # The interpreter's own float->fp8 cast rounds differently from torch's; this sidesteps it.
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3        # exponent of one step (3 mantissa bits)
    up = ((127 - e) << 23).to(tl.float32, bitcast=True)          # 2**-e
    down = ((127 + e) << 23).to(tl.float32, bitcast=True)        # 2**e
    return _rint(y * up) * down


@triton.jit
def _pow2_code(v):
    # v: float32 > 0, normal -> biased exponent of the smallest power of two >= v
    bits = v.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _pow2_value(code):
    return (code << 23).to(tl.float32, bitcast=True)


@triton.jit
def _stored_scale(r, KIND: tl.constexpr):
    # r: float32 scale -> (what the page stores, the float32 it dequantizes with)
    # one return: the compiler types every return alike, even those a constexpr branch leaves out
    if KIND == 2:      # fp8: a power-of-two scale, stored as its exponent byte
        s = _pow2_code(r)
        f = _pow2_value(s)
    else:
        s = r.to(tl.float16)
        f = s.to(tl.float32)
    return s, f


@triton.jit
def _to_code(y, KIND: tl.constexpr):
    # y: float32 within range -> the value the int8 / fp8 data page stores exactly
    if KIND == 2:
        return _snap_e4m3(y)
    return _rint(y)


@triton.jit
def _e4m3_byte(y):
    # y: float32 that is exactly an e4m3 value (_snap_e4m3) -> its float8_e4m3fn byte, built from the bits: Triton
    # has no e4m3 type before sm_89 (an RTX 30-series card), so fp8 pages are written as bytes everywhere
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80)
    a = tl.abs(y)
    abits = a.to(tl.int32, bitcast=True)
    normal = (((abits >> 23) - 120) << 3) | ((abits >> 20) & 7)           # (exponent + 7) << 3 | 3 mantissa bits
    sub = _rint(a * 512.0).to(tl.int32)                                    # below 2**-6: m * 2**-9
    return (tl.where(a >= 0.015625, normal, sub) | sign).to(tl.uint8)


@triton.jit
def _round_bf16(x):
    # Snap float32 to the bf16 grid (ties to even) so the cast is exact: the interpreter's own
    # float32 -> bf16 cast truncates, the GPU's rounds; this way both equal torch's.
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _reduce(xe, xo, tmask, IS_MAX: tl.constexpr, AXIS: tl.constexpr,
            BS_PAD: tl.constexpr, HALF: tl.constexpr, GROUP: tl.constexpr):
    # xe, xo: [BS_PAD, HALF] even / odd channels -> the statistic for each, broadcast to [BS_PAD, HALF]
    if IS_MAX:
        fill = float("-inf")
    else:
        fill = float("inf")
    if AXIS == 1:      # over the block's tokens, per channel; padded tokens must not count
        xe = tl.where(tmask[:, None], xe, fill)
        xo = tl.where(tmask[:, None], xo, fill)
        if IS_MAX:
            se = tl.broadcast_to(tl.max(xe, 0)[None, :], (BS_PAD, HALF))
            so = tl.broadcast_to(tl.max(xo, 0)[None, :], (BS_PAD, HALF))
        else:
            se = tl.broadcast_to(tl.min(xe, 0)[None, :], (BS_PAD, HALF))
            so = tl.broadcast_to(tl.min(xo, 0)[None, :], (BS_PAD, HALF))
    elif AXIS == 2:    # over all channels of a token
        if IS_MAX:
            s = tl.maximum(tl.max(xe, 1), tl.max(xo, 1))
        else:
            s = tl.minimum(tl.min(xe, 1), tl.min(xo, 1))
        se = tl.broadcast_to(s[:, None], (BS_PAD, HALF))
        so = se
    else:              # over groups of GROUP channels: GROUP // 2 even and GROUP // 2 odd ones
        NG: tl.constexpr = 2 * HALF // GROUP
        ge = tl.reshape(xe, (BS_PAD, NG, GROUP // 2))
        go = tl.reshape(xo, (BS_PAD, NG, GROUP // 2))
        if IS_MAX:
            s = tl.maximum(tl.max(ge, 2), tl.max(go, 2))
        else:
            s = tl.minimum(tl.min(ge, 2), tl.min(go, 2))
        se = tl.reshape(tl.broadcast_to(s[:, :, None], (BS_PAD, NG, GROUP // 2)), (BS_PAD, HALF))
        so = se
    return se, so


@triton.jit
def _store_stat(ptr, se, so, page, head, row, c, tmask, num_heads,
                AXIS: tl.constexpr, HALF: tl.constexpr, GROUP: tl.constexpr):
    # se, so: [BS_PAD, HALF] fp16 statistics of even / odd channels -> their page [num_blocks, ...]
    if AXIS == 1:      # [num_blocks, H, D]: equal over tokens, so collapse the token axis
        base = ptr + (page * num_heads + head) * (2 * HALF) + 2 * c
        tl.store(base, tl.max(se, 0))
        tl.store(base + 1, tl.max(so, 0))
    elif AXIS == 2:    # [num_blocks, bs, H]: channel pair 0 carries the token's value
        tl.store(ptr + row[:, None] + 0 * c[None, :], se, mask=tmask[:, None] & (c == 0)[None, :])
    else:              # [num_blocks, bs, H, D // GROUP]: the first channel pair of each group
        lead = ((2 * c) % GROUP) == 0
        tl.store(ptr + row[:, None] * (2 * HALF // GROUP) + ((2 * c) // GROUP)[None, :], se,
                 mask=tmask[:, None] & lead[None, :])


@triton.jit
def _store_kernel(src, block_ids, data, scale, zero, num_heads, s_n, s_t, s_h, s_d,
                  BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  KIND: tl.constexpr, AXIS: tl.constexpr, ASYM: tl.constexpr, GROUP: tl.constexpr,
                  QMAX: tl.constexpr, LEVELS: tl.constexpr, IS_BF16: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.arange(0, BS_PAD)
    tmask = t < BLOCK_SIZE
    c = tl.arange(0, HALF)
    m2 = tmask[:, None]
    base = src + n.to(tl.int64) * s_n + h * s_h + t[:, None] * s_t
    xe = tl.load(base + (2 * c)[None, :] * s_d, mask=m2, other=0.0).to(tl.float32)
    xo = tl.load(base + (2 * c + 1)[None, :] * s_d, mask=m2, other=0.0).to(tl.float32)
    page = tl.load(block_ids + n).to(tl.int64)
    row = (page * BLOCK_SIZE + t) * num_heads + h                 # [BS_PAD] row of the [*, D'] page view

    if KIND == 0:      # full precision: a plain cast, round to nearest even as torch's .to
        ptr = data + row[:, None] * HEAD_DIM + 2 * c[None, :]
        if IS_BF16:
            xe = _round_bf16(xe)
            xo = _round_bf16(xo)
        tl.store(ptr, xe.to(data.dtype.element_ty), mask=m2)
        tl.store(ptr + 1, xo.to(data.dtype.element_ty), mask=m2)
    else:
        if ASYM and KIND != 3:   # centred: zero = mid-range, q = (x - zero) / scale, scale = max|x - zero| / QMAX
            lo_e, lo_o = _reduce(xe, xo, tmask, False, AXIS, BS_PAD, HALF, GROUP)
            hi_e, hi_o = _reduce(xe, xo, tmask, True, AXIS, BS_PAD, HALF, GROUP)
            z_e = ((hi_e + lo_e) * 0.5).to(tl.float16)
            z_o = ((hi_o + lo_o) * 0.5).to(tl.float16)
            zf_e = z_e.to(tl.float32)
            zf_o = z_o.to(tl.float32)
            r_e = tl.maximum(tl.math.div_rn(tl.maximum(hi_e - zf_e, zf_e - lo_e), QMAX), 1e-6)
            r_o = tl.maximum(tl.math.div_rn(tl.maximum(hi_o - zf_o, zf_o - lo_o), QMAX), 1e-6)
            s_e, sf_e = _stored_scale(r_e, KIND)
            s_o, sf_o = _stored_scale(r_o, KIND)
            qe = tl.minimum(tl.maximum(tl.math.div_rn(xe - zf_e, sf_e), -QMAX), QMAX)
            qo = tl.minimum(tl.maximum(tl.math.div_rn(xo - zf_o, sf_o), -QMAX), QMAX)
            qe = _to_code(qe, KIND)
            qo = _to_code(qo, KIND)
            _store_stat(zero, z_e, z_o, page, h, row, c, tmask, num_heads, AXIS, HALF, GROUP)
        elif ASYM:     # q = round((x - min) / scale), scale = (max - min) / LEVELS, zero = min
            lo_e, lo_o = _reduce(xe, xo, tmask, False, AXIS, BS_PAD, HALF, GROUP)
            hi_e, hi_o = _reduce(xe, xo, tmask, True, AXIS, BS_PAD, HALF, GROUP)
            lo_e = lo_e.to(tl.float16)
            lo_o = lo_o.to(tl.float16)
            s_e = tl.maximum(tl.math.div_rn(hi_e - lo_e.to(tl.float32), LEVELS), 1e-6).to(tl.float16)
            s_o = tl.maximum(tl.math.div_rn(hi_o - lo_o.to(tl.float32), LEVELS), 1e-6).to(tl.float16)
            qe = tl.math.div_rn(xe - lo_e.to(tl.float32), s_e.to(tl.float32))
            qo = tl.math.div_rn(xo - lo_o.to(tl.float32), s_o.to(tl.float32))
            qe = tl.minimum(tl.maximum(_rint(qe), 0.0), LEVELS)
            qo = tl.minimum(tl.maximum(_rint(qo), 0.0), LEVELS)
            _store_stat(zero, lo_e, lo_o, page, h, row, c, tmask, num_heads, AXIS, HALF, GROUP)
        else:          # q = x / scale, scale = max|x| / QMAX
            a_e, a_o = _reduce(tl.abs(xe), tl.abs(xo), tmask, True, AXIS, BS_PAD, HALF, GROUP)
            r_e = tl.maximum(tl.math.div_rn(a_e, QMAX), 1e-6)
            r_o = tl.maximum(tl.math.div_rn(a_o, QMAX), 1e-6)
            s_e, sf_e = _stored_scale(r_e, KIND)
            s_o, sf_o = _stored_scale(r_o, KIND)
            qe = tl.minimum(tl.maximum(tl.math.div_rn(xe, sf_e), -QMAX), QMAX)
            qo = tl.minimum(tl.maximum(tl.math.div_rn(xo, sf_o), -QMAX), QMAX)
            qe = _to_code(qe, KIND)
            qo = _to_code(qo, KIND)
        _store_stat(scale, s_e, s_o, page, h, row, c, tmask, num_heads, AXIS, HALF, GROUP)
        if KIND == 3:  # two codes per byte: even channel low nibble, odd channel high nibble
            packed = qe.to(tl.uint8) | (qo.to(tl.uint8) << 4)
            tl.store(data + row[:, None] * HALF + c[None, :], packed, mask=m2)
        elif KIND == 2:  # fp8 pages come as bytes (store_blocks)
            ptr = data + row[:, None] * HEAD_DIM + 2 * c[None, :]
            tl.store(ptr, _e4m3_byte(qe), mask=m2)
            tl.store(ptr + 1, _e4m3_byte(qo), mask=m2)
        else:
            ptr = data + row[:, None] * HEAD_DIM + 2 * c[None, :]
            tl.store(ptr, qe.to(data.dtype.element_ty), mask=m2)
            tl.store(ptr + 1, qo.to(data.dtype.element_ty), mask=m2)


def store_blocks(src: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor, scale, zero, fmt: PageFormat) -> None:
    """Triton twin of `reference.store_blocks`. src: [n, bs, H, D] float; block_ids: [n]; pages [num_blocks, ...]."""
    n, bs, H, D = src.shape
    assert block_ids.shape == (n,) and data.shape[1:3] == (bs, H), (src.shape, block_ids.shape, data.shape)
    assert D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0, "head_dim must be a power of two"
    for t in (data, scale, zero):
        # Page offsets are computed from shapes, so pages must be dense.
        assert t is None or (t.is_contiguous() and t.device == src.device)
    assert (scale is not None) == fmt.is_quantized and (zero is not None) == (fmt.is_quantized and not fmt.symmetric)
    if fmt.name == "int4":
        assert not fmt.symmetric, "int4 pages are asymmetric (scale + zero point)"
    if fmt.scale_axis == "group":
        assert D % fmt.group == 0 and fmt.group % 2 == 0
    if n == 0:
        return
    kind = _KIND.get(fmt.name, 0)
    if fmt.name == "fp8":             # written as bytes: see _e4m3_byte
        data = data.view(torch.uint8)
    _store_kernel[(n, H)](
        src, block_ids, data, data if scale is None else scale, data if zero is None else zero, H,
        *src.stride(),
        BLOCK_SIZE=bs, BS_PAD=max(2, triton.next_power_of_2(bs)),  # no 1-wide tiles on the GPU
        HEAD_DIM=D,
        KIND=kind, AXIS=_AXIS[fmt.scale_axis], ASYM=fmt.is_quantized and not fmt.symmetric, GROUP=fmt.group,
        QMAX=FP8_MAX if fmt.name == "fp8" else INT8_MAX, LEVELS=INT4_LEVELS, IS_BF16=data.dtype == torch.bfloat16,
        num_warps=4,
    )
