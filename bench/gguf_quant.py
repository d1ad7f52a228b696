"""GGML block quantizers that gguf-py lacks: Q4_K, Q5_K and Q6_K, in numpy, into the exact block layouts gguf's
dequantizer reads; the other types through gguf-py's own quantize.

Their scales are rounded up (not to the nearest level) so that every sub-block's grid covers all its
values: the error of each weight is then at most half a step of its sub-block.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

QK_K = 256


def _f16_at_least(v: np.ndarray) -> np.ndarray:
    """The smallest float16 >= v (v >= 0, float32), returned as float32."""
    h = v.astype(np.float16)
    low = h.astype(np.float32) < v
    if low.any():
        h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h.astype(np.float32)


def _ceil_ratio(num: np.ndarray, den: np.ndarray, top: int) -> np.ndarray:
    """ceil(num / den) clipped to 0..top, 0 where den == 0 (den broadcasts against num)."""
    den = np.broadcast_to(den, num.shape)
    out = np.zeros(num.shape, dtype=np.float32)
    np.divide(num, den, out=out, where=den > 0)
    return np.clip(np.ceil(out), 0, top)


def _rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % QK_K:
        raise ValueError(f"expected [rows, K] with K a multiple of {QK_K}, got {x.shape}")
    return x


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K % 256 == 0) -> Q4_K blocks, uint8 [rows, K // 256 * 144].

    Block of 256 = 8 sub-blocks of 32; w = d * sc_j * q - dmin * mn_j with q in 0..15 and 6-bit sc, mn.
    """
    rows, k = _rows(x).shape
    head, qs, _ = _k_blocks(x, 15)
    return np.concatenate([head, qs], axis=-1).reshape(rows, k // QK_K * 144)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K % 256 == 0) -> Q5_K blocks, uint8 [rows, K // 256 * 176]: Q4_K's scales with q in
    0..31, its low 4 bits packed as Q4_K's and the fifth bit of sub-block j as bit j of qh[32]."""
    rows, k = _rows(x).shape
    head, qs, q = _k_blocks(x, 31)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << np.uint8(j)
    return np.concatenate([head, qh, qs], axis=-1).reshape(rows, k // QK_K * 176)


def _k_blocks(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's common part: (d, dmin and the packed 6-bit scales [n, 16], the low 4 bits of q packed two a
    byte [n, 128], q itself [n, 8, 32] in 0..top)."""
    x = _rows(x)
    b = x.reshape(-1, 8, 32)
    n = b.shape[0]
    m = -np.minimum(b.min(axis=-1), 0)                                # [n, 8] >= 0: the sub-block's -min
    dmin = _f16_at_least(m.max(axis=-1) / 63)                         # [n]
    mn = _ceil_ratio(m, dmin[:, None], 63)                            # dmin * mn >= m: the grid starts at or below min
    span = np.maximum(b.max(axis=-1) + dmin[:, None] * mn, 0)         # from the grid's bottom to the max
    d = _f16_at_least(span.max(axis=-1) / (top * 63))
    sc = _ceil_ratio(span / top, d[:, None], 63)                      # top * d * sc >= span: it reaches the max
    step = (d[:, None] * sc)[..., None]
    zero = (dmin[:, None] * mn)[..., None]
    q = np.zeros(b.shape, dtype=np.float32)
    np.divide(b + zero, step, out=q, where=step > 0)
    q = np.clip(np.rint(q), 0, top).astype(np.uint8)

    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                             mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=-1)
    low = (q & 0x0F).reshape(n, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    head = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(n, 2), scales], axis=-1)
    return head, qs, q


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K % 256 == 0) -> Q6_K blocks, uint8 [rows, K // 256 * 210].

    Block of 256 = 16 sub-blocks of 16; w = d * sc_j * (q - 32) with q in 0..63 and int8 sc.
    """
    x = _rows(x)
    rows, k = x.shape
    b = x.reshape(-1, 16, 16)
    n = b.shape[0]
    s = np.abs(b).max(axis=-1) / 31                                   # [n, 16]
    d = _f16_at_least(s.max(axis=-1) / 127)
    sc = _ceil_ratio(s, d[:, None], 127)                              # 31 * d * sc >= amax: nothing clips
    step = (d[:, None] * sc)[..., None]
    q = np.zeros(b.shape, dtype=np.float32)
    np.divide(b, step, out=q, where=step > 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)

    ql = ((q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)).reshape(n, 128)
    hi = ((q >> 4) & 0x03).reshape(n, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8),
                             d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=-1)
    return blocks.reshape(rows, k // QK_K * 210)


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [rows, K] -> the bytes (or float16 / float32 values) a GGUF stores for type_name."""
    if type_name == "F32":
        return np.asarray(x, dtype=np.float32)
    if type_name == "Q4_K":
        return quantize_q4_k(x)
    if type_name == "Q5_K":
        return quantize_q5_k(x)
    if type_name == "Q6_K":
        return quantize_q6_k(x)
    return gguf_quantize(np.asarray(x, dtype=np.float32), GGMLQuantizationType[type_name])
