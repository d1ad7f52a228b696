"""GGML's quantized blocks as the kernels' packed grids: codes kept as the file stores them, never re-rounded.

The 4-bit block types (Q4_0, Q4_1, Q4_K) are unpacked into codes 0..15 with a scale and zero point per group
of 32, which is exactly their grid; the 5-bit ones (Q5_0, Q5_1, Q5_K) the same with a plane of fifth bits beside
(q5_blocks: 5.5 bits a value, as the file); Q6_K keeps its own 6.5625 bits a value, each block split into its four
parts, every byte as stored (q6k_parts), and MXFP4 its own 4.25 (mxfp4_blocks: the codes and the exponents as
stored); Q8_0 is int8 codes with their scales. No torch here: the engine's linears
(engine/model/weights.py) and the one-shot path (engine/runtime/quick.py) both pack through packed_matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INT4_GRID_TYPES = ("Q4_0", "Q4_1", "Q4_K")     # 16 levels per group of 32: kept as they are
INT5_GRID_TYPES = ("Q5_0", "Q5_1", "Q5_K")     # 32 levels per group of 32: the same, and a fifth bit each


@dataclass(frozen=True)
class PackedMatrix:
    """One stored [N, K] matrix as the kernels read it: codes [N, K/2] uint8 (bits 4) or [N, K] int8 (bits 8), and
    its grid, keyword arguments of kernels.cpu_quant.Scales (numpy arrays, or the group count `per`); bits 5
    (see q5_blocks): codes as bits 4, the grid's "high" their fifth bits [N, K/8]; kind "Q6_K" (bits 6, see q6k_parts): codes the blocks' low 4 bits [N, K/2], the grid's "high" their high 2 bits [N, K/4];
    kind "MXFP4" (bits 4, see mxfp4_blocks): codes [N, K/2] of E2M1 values and grid {"e8m0": [N, K/32] uint8}, no
    Scales; rows in the Hugging Face order, every array C-contiguous."""
    bits: int
    codes: np.ndarray
    grid: dict
    kind: str = ""          # the file's type where the packed form is the type's own (Q6_K, MXFP4)


def packed_matrix(gf, name: str, heads: int | None, rows: np.ndarray | None = None) -> PackedMatrix | None:
    """The tensor `name` of gf in its packed form (gf a GGUFFile and name its own, or the model's GGUFModel and a
    Hugging Face name: both read through gf.gguf_name); heads: undo llama.cpp's interleaving of that many heads'
    rows (GGUFModel.permuted_heads); rows: then take the rows in this order (every packed kind keeps each row's
    codes and scales on that row, so a row moves whole). None where its type is not one of the
    grids (16-bit, 2-3 bit, IQ types) or its rows are not whole groups of 32."""
    kind, data = gf.raw(name)
    k = gf.tensors[gf.gguf_name(name)].shape[0]
    own = ""
    if k % 32 == 0 and kind in INT4_GRID_TYPES:
        bits, (codes, grid) = 4, q4_blocks(kind, data)
    elif k % 32 == 0 and kind in INT5_GRID_TYPES:
        bits, (codes, grid) = 5, q5_blocks(kind, data)
    elif kind == "Q6_K":            # rows of whole super-blocks: the file holds no other kind
        bits, own, (codes, grid) = 6, kind, q6k_rows(gf, name)
    elif kind == "MXFP4":           # rows of whole blocks of 32, likewise
        codes, e8m0 = mxfp4_blocks(data)
        bits, own, grid = 4, kind, {"e8m0": e8m0}
    elif k % 32 == 0 and kind in INT8_GRID_TYPES:
        bits, (codes, grid) = 8, q8_rows(gf, name)
    else:
        return None
    fix = (lambda a: np.ascontiguousarray(unpermute_rows(a, heads))) if heads else np.ascontiguousarray
    if rows is not None:
        unpermuted = fix
        fix = lambda a: np.ascontiguousarray(np.take(unpermuted(a), rows, axis=0))  # noqa: E731
    return PackedMatrix(bits, fix(codes), {key: fix(a) if isinstance(a, np.ndarray) else a for key, a in grid.items()},
                        own)


def q4_blocks(kind: str, data: np.ndarray) -> tuple[np.ndarray, dict]:
    """4-bit blocks as packed codes [N, K/2] uint8 (Q4_0's nibble order) and their scales.

    The value of code q is q * scale + zero: exactly the file's value, never re-rounded. The scales
    come as keyword arguments of kernels.cpu_quant.Scales: float [N, K/32] scale and zero, or for
    Q4_K its 6-bit codes with the float d and -dmin of each super-block of 8 groups.
    """
    n = data.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        heads, codes = split_blocks(data, size, size - 16)
        # the file's float16 scales as they are (float32 only where -8 * d of Q4_0 leaves float16's range)
        d = _f16(heads[..., 0:2], np.float16)
        # Q4_0: w = d * (q - 8); Q4_1: w = d * q + m
        if kind == "Q4_0":
            d, zero = _centred(d, 8)
        else:
            zero = _f16(heads[..., 2:4], np.float16)
        return codes.reshape(n, -1), {"scale": d, "zero": zero}
    if kind == "Q4_K":
        blocks = data.reshape(n, -1, 144)                                     # super-blocks of 256
        qs = blocks[..., 16:].reshape(n, -1, 4, 32)                           # 4 chunks of 64 values
        codes = np.stack((qs & 0x0F, qs >> 4), 3)                             # [N, S, 4, 2, 32]: groups of 32
        g = codes.reshape(n, -1, 2, 16)                                       # repack: j low, j + 16 high
        packed = g[:, :, 0] | (g[:, :, 1] << 4)
        return packed.reshape(n, -1), k_scales(blocks)
    raise ValueError(kind)


def q5_blocks(kind: str, data: np.ndarray) -> tuple[np.ndarray, dict]:
    """5-bit blocks as q4_blocks' codes (the low 4 bits, Q4_0's nibble order) and a grid with "high" [N, K/8]
    uint8: per group of 32 a little-endian uint32 whose bit j is element j's fifth bit (kernels/cpu_quant.c: q5).
    Q5_0 and Q5_1 store exactly this (their qh word beside their nibbles), so both are the file's bytes; Q5_K's
    super-blocks are repacked into it, nothing re-rounded. Values: Q5_0 d * (q - 16) (scale d, zero -16 d), Q5_1
    d * q + m, Q5_K (d * sc) * q - dmin * m (two-level, as q4_blocks' Q4_K)."""
    n = data.shape[0]
    if kind in ("Q5_0", "Q5_1"):
        size = 22 if kind == "Q5_0" else 24
        heads, codes = split_blocks(data, size, size - 16)
        high = np.ascontiguousarray(heads[..., size - 20:]).reshape(n, -1)          # the qh words as stored
        d = _f16(heads[..., 0:2], np.float16)
        if kind == "Q5_1":
            return codes, {"scale": d, "zero": _f16(heads[..., 2:4], np.float16), "high": high}
        d, zero = _centred(d, 16)
        return codes, {"scale": d, "zero": zero, "high": high}
    if kind == "Q5_K":
        blocks = data.reshape(n, -1, 176)                                     # super-blocks of 256
        qh = blocks[..., 16:48]                                               # bit i of byte l: value 32 i + l
        qs = blocks[..., 48:].reshape(n, -1, 4, 32)                           # 4 chunks of 64 values
        g = np.stack((qs & 0x0F, qs >> 4), 3).reshape(n, -1, 2, 16)           # groups of 32, repacked as Q4_K's
        codes = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, -1)
        bits = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1   # [N, S, 8 groups, 32]
        high = np.packbits(bits, axis=-1, bitorder="little").reshape(n, -1)
        return codes, {**k_scales(blocks), "high": high}
    raise ValueError(kind)


def k_scales(blocks: np.ndarray) -> dict:
    """Q4_K / Q5_K super-blocks [N, S, size] -> their scales as Scales(kpacked=True) keywords: the 12 scale bytes
    [N, S * 12] and d, dmin [N, S] float16, as stored."""
    n = blocks.shape[0]
    part = lambda lo, hi: np.ascontiguousarray(blocks[..., lo:hi])      # noqa: E731
    return {"scale": part(4, 16).reshape(n, -1), "scale_sup": part(0, 2).view(np.float16)[..., 0],
            "zero_sup": part(2, 4).view(np.float16)[..., 0], "per": 8, "kpacked": True}


def mxfp4_blocks(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 rows [N, K/32 * 17] -> (codes [N, K/2] uint8, e8m0 [N, K/32] uint8), the bytes as stored: a block is
    its E8M0 exponent e, then 16 bytes of 4-bit codes in Q4_0's nibble order (byte j: value j low, j + 16 high),
    code c meaning MXFP4_VALUES[c] * 2^(e - 128) (kernels/cpu_mxfp4.h)."""
    heads, codes = split_blocks(data, 17, 1)
    return codes, heads.reshape(data.shape[0], -1)


INT8_GRID_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K")     # as int8 codes (q8_rows): Q8_0, and the others widened


def q6k_parts(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K rows [N, nb * 210] -> each block's parts, row by row: ql [N, K/2] uint8 (the low 4 bits of the codes),
    qh [N, K/4] uint8 (the high 2), sc [N, K/16] int8, d [N, K/256] float16; every byte as the file has it
    (kernels/cpu_q6k.h reads them so)."""
    n = data.shape[0]
    b = data.reshape(n, -1, 210)
    part = lambda lo, hi: np.ascontiguousarray(b[..., lo:hi]).reshape(n, -1)      # noqa: E731
    return part(0, 128), part(128, 192), part(192, 208).view(np.int8), part(208, 210).view(np.float16)


def q6k_rows(gf, name: str, chunk: int = 4096) -> tuple[np.ndarray, dict]:
    """GGUFFile gf's Q6_K tensor `name` as (ql, grid): grid {"high": qh, "scale": sc, "scale_sup": d, "per": 16}
    (q6k_parts), a chunk of rows at a time, each chunk's file pages released at once."""
    _, data = gf.raw(name)
    t = gf.tensors[gf.gguf_name(name)]
    n, k = data.shape[0], t.shape[0]
    ql, qh = np.empty((n, k // 2), np.uint8), np.empty((n, k // 4), np.uint8)
    sc, d = np.empty((n, k // 16), np.int8), np.empty((n, k // 256), np.float16)
    row_bytes = data.shape[1]
    for lo in range(0, n, chunk):
        rows = data[lo:lo + chunk]
        ql[lo:lo + chunk], qh[lo:lo + chunk], sc[lo:lo + chunk], d[lo:lo + chunk] = q6k_parts(rows)
        gf.release_range(t.offset + lo * row_bytes, rows.shape[0] * row_bytes)
    return ql, {"high": qh, "scale": sc, "scale_sup": d, "per": 16}


def q8_grid(kind: str, data: np.ndarray) -> tuple[dict, int]:
    """Scales of the 5-8 bit types from their block headers (Scales keyword arguments) and the group size."""
    n = data.shape[0]
    if kind == "Q8_0":
        return {"scale": _f16(data.reshape(n, -1, 34)[..., 0:2])}, 32
    if kind == "Q5_0":
        return {"scale": _f16(data.reshape(n, -1, 22)[..., 0:2])}, 32
    if kind == "Q5_1":
        b = data.reshape(n, -1, 24)
        return {"scale": _f16(b[..., 0:2]), "zero": _f16(b[..., 2:4])}, 32
    if kind == "Q5_K":
        b = data.reshape(n, -1, 176)
        sc, mn = _k_scale_min(b[..., 4:16])
        return {"scale": sc.astype(np.uint8).reshape(n, -1), "scale_sup": _f16(b[..., 0:2]),
                "zero": mn.astype(np.uint8).reshape(n, -1), "zero_sup": -_f16(b[..., 2:4]), "per": 8}, 32
    raise ValueError(kind)


def dense_scales(grid: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 [N, G] scale and zero of a grid from q8_grid / q4_blocks, computed as gguf computes them."""
    def widen(q, sup):
        if q is None or sup is None:
            return q
        return (np.repeat(sup, grid.get("per", 1), axis=-1) * q.astype(np.float32)).astype(np.float32)
    return widen(grid["scale"], grid.get("scale_sup")), widen(grid.get("zero"), grid.get("zero_sup"))


def split_blocks(data: np.ndarray, size: int, head: int, heads: np.ndarray | None = None,
                 body: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows of blocks of `size` bytes [N, nb * size] -> each block's first `head` bytes [N, nb, head] (the scales)
    and the rest [N, nb * (size - head)] (the codes), into heads / body when given. The C kernels' split_blocks
    where they load (a few GB/s), else numpy's strided copies (1-2 GB/s)."""
    n = data.shape[0]
    nb = data.shape[1] // size
    heads = np.empty((n, nb, head), dtype=np.uint8) if heads is None else heads.reshape(n, nb, head)
    body = np.empty((n, nb * (size - head)), dtype=np.uint8) if body is None else body.reshape(n, nb * (size - head))
    from kvchat.kernels import cpu_lib
    lib = cpu_lib.library()
    src = data if data.flags.c_contiguous else None
    if lib is not None and src is not None and heads.flags.c_contiguous and body.flags.c_contiguous:
        lib.split_blocks(src.ctypes.data, n * nb, size, head, heads.ctypes.data, body.ctypes.data)
    else:
        blocks = data.reshape(n, nb, size)
        heads[...] = blocks[..., :head]
        body[...] = blocks[..., head:].reshape(n, -1)
    return heads, body


def _centred(d: np.ndarray, centre: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero) of codes centred on `centre` (Q4_0: 8, Q5_0: 16), w = d * (q - centre): zero = -centre * d,
    exact (a power of two); both float16 as stored, or float32 where the zero leaves float16's range."""
    wide = d.astype(np.float32)
    zero = wide * -centre
    if np.abs(zero).max(initial=0) <= 65504:
        return d, zero.astype(np.float16)
    return wide, zero


def _f16(b: np.ndarray, dtype=np.float32) -> np.ndarray:
    # [..., 2] bytes -> [...] float32 (or float16, as stored)
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(dtype)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # s: [..., 12] bytes holding eight 6-bit scales and eight 6-bit mins (the K-quant packing)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), -1)
    mn = np.concatenate((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def unpermute_rows(x: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (pairs interleaved) back to the Hugging Face half-split order."""
    n = x.shape[0]
    return x.reshape(num_heads, n // num_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def q8_rows(gf, name: str, chunk: int = 2048):
    """Codes [N, K] int8 and the file's own scales (and zeros) of GGUFFile gf's 5-8 bit tensor `name`, a chunk
    of rows at a time.

    Each value the file holds is code * scale + zero exactly, so the codes are recovered by
    rounding (value - zero) / scale of gguf's own dequantization: nothing is re-quantized.
    """
    kind, data = gf.raw(name)
    t = gf.tensors[gf.gguf_name(name)]
    n, k = data.shape[0], t.shape[0]
    if kind == "Q8_0":
        # the codes are the blocks' bytes after their scale: copied a chunk of rows at a time, each
        # chunk's file pages released at once, so a large table never sits in memory twice
        codes, scale = np.empty((n, k), dtype=np.int8), np.empty((n, k // 32), dtype=np.float16)   # scales as stored
        row_bytes = data.shape[1]
        for lo in range(0, n, chunk):
            rows = data[lo:lo + chunk]
            split_blocks(rows, 34, 2, scale[lo:lo + chunk].view(np.uint8), codes[lo:lo + chunk].view(np.uint8))
            gf.release_range(t.offset + lo * row_bytes, rows.shape[0] * row_bytes)
        return codes, {"scale": scale}
    from gguf import GGMLQuantizationType     # the other types are dequantized by gguf itself
    from gguf.quants import dequantize
    qtype = GGMLQuantizationType[kind]
    grid, group = q8_grid(kind, data)
    scale, zero = dense_scales(grid)
    codes = np.empty((n, k), dtype=np.int8)
    for lo in range(0, n, chunk):
        w = np.asarray(dequantize(data[lo:lo + chunk], qtype), dtype=np.float32).reshape(-1, k // group, group)
        if zero is not None:
            w = w - zero[lo:lo + chunk, :, None]
        s = scale[lo:lo + chunk, :, None]
        q = np.divide(w, s, out=np.zeros_like(w), where=s != 0)
        codes[lo:lo + chunk] = np.rint(q).reshape(-1, k)
    return codes, grid
