"""CPU kernels over quantized weights (cpu_quant.c), built once with the machine's C compiler; and the
decode attention over full-precision (attn_decode) and quantized (attn_decode_quant) KV pages.

`available()` says whether the library could be built and loaded; callers fall back to torch's
packed kernels when it cannot. Each function has a torch reference below with the same signature.
The library links the OpenMP runtime torch already loaded (libgomp), so both share one thread pool.

Past 450 lines on purpose: it is the ctypes face of one C library, each entry point beside its torch reference;
splitting it would put a kernel and its reference in different files. The one-call decode step's table and inputs
are cpu_step's.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .formats import PageFormat

from . import cpu_lib
from .cpu_lib import BUILT, GDN, HEADER, KV_SOURCE, MAX_ROWS, SOURCE, QLin, SharedExpert, _build  # noqa: F401

_lib = None
_error: str | None = None


def available() -> bool:
    global _lib, _error
    if _lib is None and _error is None:
        _lib, _error = cpu_lib.library(), cpu_lib.library_error()
    return _lib is not None


_kv_lib = None
_kv_error: str | None = None
_kv_thread: threading.Thread | None = None
_kv_lock = threading.Lock()


def _build_kv() -> None:
    global _kv_lib, _kv_error
    try:
        _kv_lib = _build(source=KV_SOURCE)
    except (OSError, RuntimeError) as exc:
        _kv_error = str(exc)


def kv_kernels_ready(wait: bool = False) -> bool:
    """Whether the quantized-KV decode attention (its own library, cpu_kv_quant.c) is loaded. The first call
    starts building it in the background (about 10 s once per machine, cached after): until it is ready,
    quantized caches decode through torch. wait=True blocks until the build is done."""
    global _kv_thread
    if _kv_lib is not None or _kv_error is not None or not available():
        return _kv_lib is not None
    with _kv_lock:
        if _kv_thread is None:
            _kv_thread = threading.Thread(target=_build_kv, name="kvchat-kv-kernels", daemon=True)
            _kv_thread.start()
    if wait:
        _kv_thread.join()
    return _kv_lib is not None


def unavailable_reason() -> str | None:
    available()
    return _error


_local = threading.local()


def _out(out: torch.Tensor | None, n: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if out is None:
        return torch.empty(n, k, dtype=dtype)
    assert out.shape == (n, k) and out.dtype == dtype and out.is_contiguous()
    return out


def slab(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """n values of a buffer this thread reuses for dequantized weights (prefill's slabs): a fresh
    allocation per slab costs a page fault per 4 KiB, about a tenth of a second per prompt here."""
    name = "slab" if dtype == torch.float32 else "slab_bf16"
    buf = getattr(_local, name, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype)
        setattr(_local, name, buf)
    return buf[:n]


def _scratch_bytes(n: int) -> torch.Tensor:
    """A scratch buffer of at least n bytes, reused by this thread's kernel calls (one at a time)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < n:
        buf = _local.scratch = torch.empty(max(n, 1 << 16), dtype=torch.uint8)
    return buf


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class Mass:
    """Where a decode row's attention went, measured by the attention kernels: out [..., B, Hq, mcols] float32
    receives each head's softmax probability summed per column, the last column the learned sink's share (0
    without sink logits); cols int32, the column of every attended row, each sequence's rows one after another
    (in the kernel's row order: the held past, the new token last)."""

    cols: torch.Tensor
    out: torch.Tensor

    def __post_init__(self):
        assert self.cols.dtype == torch.int32 and self.cols.is_contiguous() and not self.cols.is_cuda
        assert self.out.dtype == torch.float32 and self.out.is_contiguous() and not self.out.is_cuda

    @staticmethod
    def args(mass: "Mass | None", rows: int, b: int, hq: int) -> tuple:
        """The kernels' (cols, mcols, mass) arguments; (None, 0, None): not measured."""
        if mass is None:
            return None, 0, None
        assert mass.cols.shape[0] == rows and mass.out.shape[-3:-1] == (b, hq), "one column per row, [B, Hq] out"
        assert hq <= 128, "the kernels measure mass for at most 128 query heads"
        return mass.cols.data_ptr(), mass.out.shape[-1], mass.out.data_ptr()


PREP_NONE, PREP_RMSNORM, PREP_SWIGLU = 0, 1, 2


MAX_GROUPS = 1024     # MAXG in the C source: groups per row


@dataclass(frozen=True, eq=False)
class Scales:
    """Per-group scales (and zeros) of a packed weight, stored as one of the C kernels' kinds.

    scale, zero: [N, G] float32 or float16; or uint8 / int8 codes that multiply scale_sup / zero_sup
    [N, G / per] float32 (the K-quants' two-level scales, kept as the file has them). offset8: 4-bit codes
    centred on 8 (GGUF Q4_0: w = scale * (q - 8)), float16 scales and no zero stored; the kernels take
    zero = -8 * scale, exact in float32. Not storing it saves a tenth of the bytes a decode step reads. 5-bit codes
    (q5: GGUF Q5_0, w = scale * (q - 16)) the same with centre 16; the C kernels take the centre from the codes'
    width (a fifth-bit plane given: 16). kpacked: the K-quants' own scale bytes (Q4_K, Q5_K): scale [N, G / 8 * 12]
    uint8, eight 6-bit scales and eight 6-bit mins a super-block as the file packs them, scale_sup d and zero_sup
    dmin [N, G / 8] float16; zero is the same tensor as scale (the kernels read the mins there): exactly the
    file's bytes (kind 5 in the C source).
    """
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    scale_sup: torch.Tensor | None = None
    zero_sup: torch.Tensor | None = None
    per: int = 1
    offset8: bool = False
    centre: int = 8
    kpacked: bool = False

    def __post_init__(self):
        assert not self.offset8 or (self.zero is None and self.scale.dtype == torch.float16)
        assert self.centre in (8, 16)
        if self.kpacked:
            assert self.scale.dtype == torch.uint8 and self.per == 8 and self.scale.shape[-1] % 12 == 0
            assert self.scale_sup.dtype == self.zero_sup.dtype == torch.float16
            object.__setattr__(self, "zero", self.scale)        # the mins are in the same bytes

    @property
    def kind(self) -> int:
        if self.kpacked:
            return 5
        if self.offset8:
            return 4
        if self.scale_sup is not None:
            return 2 if self.scale.dtype == torch.uint8 else 3
        return 1 if self.scale.dtype == torch.float16 else 0

    @property
    def groups(self) -> int:
        """Scales per row (groups of the row's codes)."""
        return self.scale.shape[-1] // 12 * 8 if self.kpacked else self.scale.shape[-1]

    def args(self) -> tuple:
        assert self.groups <= MAX_GROUPS and self.scale.is_contiguous()
        assert self.zero is None or (self.zero.is_contiguous() and self.zero.dtype == self.scale.dtype)
        return self.kind, _ptr(self.scale_sup), _ptr(self.zero_sup), self.per

    def implicit_zero(self, centre: int = 8) -> "Scales":
        """These scales with the zero left out where it is exactly -centre * scale (Q4_0: 8, Q5_0: 16): the offset8
        form."""
        if self.offset8 or self.zero is None or self.scale_sup is not None or self.scale.dtype != torch.float16 \
                or self.zero.dtype != torch.float16 or not torch.equal(self.zero.float(), self.scale.float() * -centre):
            return self
        return Scales(self.scale, offset8=True, centre=centre)

    def _map(self, fn) -> "Scales":
        some = lambda t: None if t is None else fn(t)            # noqa: E731
        return Scales(fn(self.scale), None if self.kpacked else some(self.zero), some(self.scale_sup),
                      some(self.zero_sup), self.per, self.offset8, self.centre, self.kpacked)

    def unpacked(self) -> "Scales":
        """kpacked scales as kind 2 (a byte per 6-bit scale and min, float32 d and -dmin: the Triton kernels' and
        the int8 grid's form), the same values; other kinds as they are."""
        if not self.kpacked:
            return self
        sc, mn = _kpack_codes(self.scale)
        return Scales(sc, mn, self.scale_sup.float(), -self.zero_sup.float(), per=8)

    def rows(self, lo: int, hi: int) -> "Scales":
        return self._map(lambda t: t[lo:hi])

    def index(self, ids: torch.Tensor) -> "Scales":
        return self._map(lambda t: t[ids])

    def to(self, device) -> "Scales":
        return self._map(lambda t: t.to(device))

    def dense(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 [N, G] scales and zeros (or None)."""
        def widen(t, sup):
            if t is None:
                return None
            if sup is None:
                return t.float()
            return sup.float().repeat_interleave(self.per, -1) * t.float()
        if self.kpacked:
            return self.unpacked().dense()
        scale = widen(self.scale, self.scale_sup)
        return scale, scale * -self.centre if self.offset8 else widen(self.zero, self.zero_sup)

    @property
    def nbytes(self) -> int:
        zero = None if self.kpacked else self.zero                # kpacked: the same bytes as scale
        return sum(t.numel() * t.element_size() for t in (self.scale, zero, self.scale_sup, self.zero_sup)
                   if t is not None)


def _kpack_codes(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K-quant scale bytes [N, S * 12] -> the 6-bit scales and mins [N, S * 8] uint8 (engine/gguf/blocks.py's
    _k_scale_min over torch)."""
    b = p.reshape(*p.shape[:-1], -1, 12).to(torch.int32)
    a, m, c = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat((a & 63, (c & 15) | ((a >> 2) & 48)), -1)
    mn = torch.cat((m & 63, (c >> 4) | ((m >> 2) & 48)), -1)
    flat = lambda t: t.reshape(*p.shape[:-1], -1).to(torch.uint8).contiguous()     # noqa: E731
    return flat(sc), flat(mn)


def _scales(scale, zero) -> Scales:
    return scale if isinstance(scale, Scales) else Scales(scale, zero)


ACT8 = 8        # the mode bit that asks for int8 activations (kernels/cpu_act8.h)


def _prep_args(x, k, norm, eps, swiglu, residual, act=16):
    mode = PREP_RMSNORM if norm is not None else PREP_SWIGLU if swiglu else PREP_NONE
    mode |= ACT8 if act == 8 else 0
    assert x.shape[1] == (2 * k if swiglu else k) and x.is_contiguous() and x.dtype == torch.float32
    assert x.shape[0] <= MAX_ROWS, f"{x.shape[0]} rows: the matvecs take at most {MAX_ROWS} a call (fused() splits)"
    assert residual is None or residual.is_contiguous()
    return mode, _ptr(norm), float(eps), _ptr(residual)


# x: [M, K] fp32 contiguous ([M, 2K] with swiglu), M <= MAX_ROWS; codes: [N, K/2] uint8; scale, zero: [N, K/32]
# fp32. Optional: norm [K] applies RMSNorm to x first, swiglu applies silu(x[:, :K]) * x[:, K:], residual
# [M, N] is added to the output. -> [M, N]
# high: q5's fifth bits [N, K/8] uint8 (a little-endian uint32 per group, bit j element j's bit 4), or None
def q4_gemv(x: torch.Tensor, codes: torch.Tensor, scale, zero=None, norm=None, eps=0.0,
            swiglu=False, residual=None, act: int = 16, high: torch.Tensor | None = None) -> torch.Tensor:
    s = _scales(scale, zero)
    n, k = codes.shape[0], codes.shape[1] * 2
    _check_high(codes, high, s)
    m = x.shape[0]
    y = torch.empty(m, n)
    scratch = _scratch_bytes(m * k * 7)
    _lib.q4_gemv(x.data_ptr(), m, k, codes.data_ptr(), s.scale.data_ptr(), _ptr(s.zero), n, y.data_ptr(),
                 scratch.data_ptr(), *_prep_args(x, k, norm, eps, swiglu, residual, act), *s.args(), _ptr(high))
    return y


def gemm8_available() -> bool:
    """Whether this build multiplies prompt rows with int8 activations (gemm8_rows: AVX-512 VNNI or AVX2)."""
    if not available():
        return False
    if id(_lib) not in _gemm8_builds:         # asked once a library (the tests swap variants in)
        _gemm8_builds[id(_lib)] = _lib.gemm8_rows(None, 0, 32, None, 4, None, None, None, 0, None, 0, None, None, 1) == 0
    return _gemm8_builds[id(_lib)]


_gemm8_builds: dict[int, bool] = {}


# Prompt rows x [T, K] fp32 against packed codes with int8 activations (llama.cpp's Q8_0 rounding of x per group of
# 32), sixteen weight rows a step (eight on AVX2): q4 codes [N, K/2] (bits 4, high: q5's fifth bits) or q8 codes
# [N, K] in groups of 32 (bits 8) -> [T, N]. A row's result depends only on the row (not on T).
def gemm8(x: torch.Tensor, codes: torch.Tensor, scale, zero=None, bits: int = 4,
          high: torch.Tensor | None = None) -> torch.Tensor:
    s = _scales(scale, zero)
    assert x.dtype == torch.float32 and x.is_contiguous() and bits in (4, 8)
    n, k = codes.shape[0], codes.shape[1] * (2 if bits == 4 else 1)
    assert x.shape[1] == k and s.groups == k // 32, (x.shape, codes.shape, s.groups)
    if bits == 4:
        _check_high(codes, high, s)
    y = torch.empty(x.shape[0], n)
    return _gemm8_done(_lib.gemm8_rows(x.data_ptr(), x.shape[0], k, codes.data_ptr(), bits, _ptr(high),
                                       s.scale.data_ptr(), _ptr(s.zero), n, y.data_ptr(), *s.args()), y, k)


def _gemm8_done(got: int, y: torch.Tensor, k: int) -> torch.Tensor:
    """y, once an int8 prompt-row call returned `got` (0 done, 1 not in this build, 2 out of memory)."""
    if got == 2:
        raise MemoryError(f"int8 prompt rows: no memory for {y.shape[0]} x {k} activations")
    assert got == 0, "gemm8 is not in this build (gemm8_available)"
    return y


# Prompt rows x [T, K] fp32 against Q6_K rows (q6k_gemv's arrays) with int8 activations, as gemm8 -> [T, N]
def gemm8_q6k(x: torch.Tensor, codes: torch.Tensor, high: torch.Tensor, scales: Scales) -> torch.Tensor:
    parts = _q6k_args(codes, high, scales)
    n, k = codes.shape[0], codes.shape[1] * 2
    assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == k, (x.shape, codes.shape)
    y = torch.empty(x.shape[0], n)
    return _gemm8_done(_lib.gemm8_q6k_rows(x.data_ptr(), x.shape[0], k, *parts, n, y.data_ptr()), y, k)


def _check_high(codes: torch.Tensor, high: torch.Tensor | None, s: Scales) -> None:
    assert s.centre == (16 if high is not None else 8) or not s.offset8, "Q5_0's implicit zero needs its fifth bits"
    assert high is None or (high.dtype == torch.uint8 and high.is_contiguous()
                            and high.shape == (codes.shape[0], codes.shape[1] // 4)), (codes.shape, high)


# codes: [N, K] int8; scale (zero or None): [N, K/G] fp32; the rest as q4_gemv -> [M, N]
def q8_gemv(x: torch.Tensor, codes: torch.Tensor, scale, zero, group: int,
            norm=None, eps=0.0, swiglu=False, residual=None, act: int = 16) -> torch.Tensor:
    s = _scales(scale, zero)
    n, k = codes.shape
    m = x.shape[0]
    y = torch.empty(m, n)
    scratch = _scratch_bytes(m * k * 7)
    _lib.q8_gemv(x.data_ptr(), m, k, codes.data_ptr(), s.scale.data_ptr(), _ptr(s.zero), group, n, y.data_ptr(),
                 scratch.data_ptr(), *_prep_args(x, k, norm, eps, swiglu, residual, act), *s.args())
    return y


def q4_dequant(codes: torch.Tensor, scale, zero=None, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32, high: torch.Tensor | None = None) -> torch.Tensor:
    """codes [N, K/2] (and q5's fifth bits high) -> float32 [N, K] (into out, contiguous, when given);
    dtype=bfloat16: the float32 values rounded as .bfloat16() rounds them, in the same pass."""
    s = _scales(scale, zero)
    n, half = codes.shape
    _check_high(codes, high, s)
    out = _out(out, n, half * 2, dtype)
    fn = _lib.q4_dequant if dtype == torch.float32 else _lib.q4_dequant_bf16
    fn(codes.data_ptr(), s.scale.data_ptr(), _ptr(s.zero), n, half * 2, out.data_ptr(), *s.args(), _ptr(high))
    return out


def q8_dequant(codes: torch.Tensor, scale, zero, group: int, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    s = _scales(scale, zero)
    n, k = codes.shape
    out = _out(out, n, k, dtype)
    fn = _lib.q8_dequant if dtype == torch.float32 else _lib.q8_dequant_bf16
    fn(codes.data_ptr(), s.scale.data_ptr(), _ptr(s.zero), group, n, k, out.data_ptr(), *s.args())
    return out


# ---- GGUF Q6_K at its own 6.5625 bits a value (kernels/cpu_q6k.h) ----------------------------------------

def _q6k_args(codes: torch.Tensor, high: torch.Tensor, scales: Scales) -> tuple[int, int, int, int]:
    """codes [N, K/2] uint8 (the low 4 bits), high [N, K/4] uint8 (the high 2), scales.scale [N, K/16] int8 and
    scales.scale_sup [N, K/256] float16 (d), all contiguous (cpu_q6k.h says which bit goes where)."""
    n, half = codes.shape
    k = half * 2
    assert k % 256 == 0 and k // 32 <= MAX_GROUPS and scales.per == 16, (codes.shape, scales.per)
    assert codes.dtype == high.dtype == torch.uint8 and high.shape == (n, k // 4)
    assert scales.scale.dtype == torch.int8 and scales.scale.shape == (n, k // 16)
    assert scales.scale_sup.dtype == torch.float16 and scales.scale_sup.shape == (n, k // 256)
    assert all(t.is_contiguous() for t in (codes, high, scales.scale, scales.scale_sup))
    return codes.data_ptr(), high.data_ptr(), scales.scale.data_ptr(), scales.scale_sup.data_ptr()


# x: [M, K] fp32 contiguous ([M, 2K] with swiglu), M <= MAX_ROWS; the prep and act as for q4_gemv -> [M, N]
def q6k_gemv(x: torch.Tensor, codes: torch.Tensor, high: torch.Tensor, scales: Scales, norm=None, eps=0.0,
             swiglu=False, residual=None, act: int = 16) -> torch.Tensor:
    parts = _q6k_args(codes, high, scales)
    n, k = codes.shape[0], codes.shape[1] * 2
    m = x.shape[0]
    y = torch.empty(m, n)
    scratch = _scratch_bytes(m * k * 7)
    _lib.q6k_gemv(x.data_ptr(), m, k, *parts, n, y.data_ptr(), scratch.data_ptr(),
                  *_prep_args(x, k, norm, eps, swiglu, residual, act))
    return y


def q6k_dequant(codes: torch.Tensor, high: torch.Tensor, scales: Scales, out: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> float32 [N, K], gguf's values bit for bit (into out when given); dtype=bfloat16: those rounded."""
    parts = _q6k_args(codes, high, scales)
    n, k = codes.shape[0], codes.shape[1] * 2
    out = _out(out, n, k, dtype)
    (_lib.q6k_dequant if dtype == torch.float32 else _lib.q6k_dequant_bf16)(*parts, n, k, out.data_ptr())
    return out


# ---- GGUF MXFP4 at its own 4.25 bits a value (kernels/cpu_mxfp4.h) ---------------------------------------

def _mxfp4_args(codes: torch.Tensor, e8m0: torch.Tensor) -> tuple[int, int]:
    """(N, K) of codes [N, K/2] uint8 (the q4 nibble order) and e8m0 [N, K/32] uint8, both contiguous."""
    n, half = codes.shape
    k = half * 2
    assert k % 32 == 0 and k // 32 <= MAX_GROUPS, codes.shape
    assert codes.dtype == e8m0.dtype == torch.uint8 and e8m0.shape == (n, k // 32), (codes.shape, e8m0.shape)
    assert codes.is_contiguous() and e8m0.is_contiguous()
    return n, k


# x: [M, K] fp32 contiguous ([M, 2K] with swiglu), M <= MAX_ROWS; the prep and act as for q4_gemv -> [M, N]
def mxfp4_gemv(x: torch.Tensor, codes: torch.Tensor, e8m0: torch.Tensor, norm=None, eps=0.0, swiglu=False,
               residual=None, act: int = 16) -> torch.Tensor:
    n, k = _mxfp4_args(codes, e8m0)
    m = x.shape[0]
    y = torch.empty(m, n)
    scratch = _scratch_bytes(m * k * 7)
    _lib.mxfp4_gemv(x.data_ptr(), m, k, codes.data_ptr(), e8m0.data_ptr(), n, y.data_ptr(), scratch.data_ptr(),
                    *_prep_args(x, k, norm, eps, swiglu, residual, act))
    return y


def mxfp4_dequant(codes: torch.Tensor, e8m0: torch.Tensor, out: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> float32 [N, K], gguf's values bit for bit (into out when given); dtype=bfloat16: those rounded."""
    n, k = _mxfp4_args(codes, e8m0)
    out = _out(out, n, k, dtype)
    (_lib.mxfp4_dequant if dtype == torch.float32 else _lib.mxfp4_dequant_bf16)(codes.data_ptr(), e8m0.data_ptr(),
                                                                                  n, k, out.data_ptr())
    return out


MAX_ATTEND_HEAD_DIM = 512   # the decode attention's alone (attn_decode, decode_attend, attn_decode_quant)


def can_attend(q: torch.Tensor, pages: torch.Tensor) -> bool:
    """The C decode attention covers fp32 and bf16 pages on the CPU, head_dim <= 512, heads x head_dim <= 16384."""
    return can_attend_pages(q.shape[-2], pages)


def can_attend_pages(hq: int, pages: torch.Tensor) -> bool:
    hkv, d = pages.shape[-2:]
    return (pages.dtype in (torch.float32, torch.bfloat16) and not pages.is_cuda and d <= MAX_ATTEND_HEAD_DIM
            and d % 2 == 0 and hq % hkv == 0 and hq * d <= 16384 and pages.is_contiguous() and available())


# q, q_sink: [Hq, D] fp32, rotated (q at the new token's position, q_sink where the sinks see it);
# k_pages, v_pages: [R, Hkv, D] fp32 or bf16, keys stored rotated; rows: [L] int64 page rows, the
# first n_sink of them sinks -> [Hq, D]
def attn_decode(q, q_sink, n_sink: int, k_pages, v_pages, rows, sm_scale: float) -> torch.Tensor:
    hq, d = q.shape
    hkv = k_pages.shape[-2]
    n = rows.shape[0]
    out = torch.empty(hq, d)
    scratch = torch.empty(hq * n + 4 * hq * (d + 2))
    _lib.attn_decode_rot(q.data_ptr(), q_sink.data_ptr(), int(n_sink), hq, hkv, d, k_pages.data_ptr(),
                         v_pages.data_ptr(), int(k_pages.dtype == torch.bfloat16), rows.data_ptr(), n,
                         float(sm_scale), out.data_ptr(), scratch.data_ptr())
    return out


def attn_decode_batch(q, q_sink, n_sink: torch.Tensor, k_pages, v_pages, rows, offsets, sm_scale: float,
                      sink_logits: torch.Tensor | None = None, mass: Mass | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """B sequences' decode attention in one call: q, q_sink [B, Hq, D] fp32 rotated; n_sink [B] int32; rows the
    sequences' page rows one after another, sequence b's at rows[offsets[b]:offsets[b + 1]] (int64); sink_logits
    [Hq] the layer's learned sink logits or None; softcap: cap * tanh(score / cap) (Gemma 2) or None -> [B, Hq, D],
    each sequence's bits equal to attn_decode on it alone. mass: where to measure each row's attention (Mass), or
    None."""
    b, hq, d = q.shape
    hkv = k_pages.shape[-2]
    out = torch.empty(b, hq, d)
    scratch = torch.empty(hq * rows.shape[0] + 4 * b * hq * (d + 2))
    sink_logits = _sink_logits(sink_logits, hq)
    _lib.attn_decode_batch(b, q.data_ptr(), q_sink.data_ptr(), n_sink.data_ptr(), hq, hkv, d, k_pages.data_ptr(),
                           v_pages.data_ptr(), int(k_pages.dtype == torch.bfloat16), rows.data_ptr(),
                           offsets.data_ptr(), float(sm_scale), float(softcap or 0.0), _ptr(sink_logits),
                           out.data_ptr(), scratch.data_ptr(),
                           *Mass.args(mass, rows.shape[0], b, hq))
    return out


def argmax(t: torch.Tensor) -> int | None:
    """The first index of the largest value of a contiguous float32 CPU vector (torch.argmax's pick), in C; None
    where the kernels are not built, the tensor is of another kind, or it holds a NaN (torch then picks)."""
    if not available() or t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
        return None
    i = _lib.argmax_f32(t.data_ptr(), t.numel())
    return None if i < 0 else int(i)


def all_finite(t: torch.Tensor) -> bool | None:
    """Whether every value of a contiguous float32, bfloat16 or float16 CPU tensor is finite, at memory speed;
    None where the kernels cannot tell (another dtype or layout, no kernels)."""
    kinds = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    if not available() or t.dtype not in kinds or not t.is_contiguous() or t.is_cuda:
        return None
    return bool(_lib.all_finite(t.data_ptr(), t.numel(), kinds[t.dtype]))


CHECK_P = 0x9E3779B97F4A7C15
CHECK_KEY = np.array([0xB8FE6C3923A44BBE, 0x7C01812CF721AD1C, 0xDED46DE9839097DB, 0x7240A4A4B7B3671F,
                      0xCB79E64EB85F0A27, 0xC2B1C6F0E59D4E97, 0x165BFA39CA1D7B5C, 0x3AA3C14C0A5E87E9], dtype=np.uint64)


def checksum(data) -> bytes:
    """64 bytes, the eight lanes of kernels/cpu_quant.c's checksum64 over the bytes of `data` (a buffer or a
    contiguous CPU tensor): at memory speed in C, else checksum_ref's numpy loops (the same lanes)."""
    if isinstance(data, torch.Tensor):
        assert data.is_contiguous() and not data.is_cuda
        view = data.view(-1).view(torch.uint8).numpy() if data.numel() else np.empty(0, np.uint8)
    else:
        view = np.frombuffer(data, dtype=np.uint8)
    if not available():
        return checksum_ref(view)
    out = np.zeros(8, dtype=np.uint64)
    _lib.checksum64(view.ctypes.data, view.size, out.ctypes.data)
    return out.tobytes()


def checksum_ref(view: np.ndarray, chunk: int = 1 << 18) -> bytes:
    """checksum64 in numpy: a chunk of stripes at a time, lanes summed modulo 2^64 (uint64 arithmetic wraps)."""
    n, acc = view.size, np.zeros(8, dtype=np.uint64)
    stripes = n // 64
    tail = np.zeros(64, np.uint8)
    tail[:n - 64 * stripes] = view[64 * stripes:]
    parts = [(lo, view[64 * lo:64 * min(stripes, lo + chunk)]) for lo in range(0, stripes, chunk)]
    if n % 64:
        parts.append((stripes, tail))
    with np.errstate(over="ignore"):
        for lo, part in parts:
            v = part.view(np.uint64).reshape(-1, 8)
            s = (np.arange(lo, lo + v.shape[0], dtype=np.uint64) * np.uint64(CHECK_P))[:, None]
            k = v ^ CHECK_KEY ^ s
            acc += ((k & np.uint64(0xFFFFFFFF)) * (k >> np.uint64(32)) + v).sum(0, dtype=np.uint64)
    return acc.tobytes()


def can_attend_prompt(hq: int, pages: torch.Tensor) -> bool:
    """attn_prompt covers fp32 and bf16 pages on the CPU, head_dim a multiple of 16 up to 512."""
    hkv, d = pages.shape[-2:]
    return can_attend_pages(hq, pages) and d % 16 == 0 and hq // hkv <= 64


def attn_prompt(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, rows: torch.Tensor, sm_scale: float,
                softcap: float | None = None, sink_keys: torch.Tensor | None = None,
                outside: torch.Tensor | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Prompt (or verification) rows' attention over fp32 or bf16 pages read in place (kernels/cpu_prompt_attn.h):
    q [T, Hq, D] fp32 rotated; rows [P + T] int64 the keys' page rows, the T new ones last (already written), row t
    reading keys 0 .. P + t; sink_keys [n_sink, Hkv, D] fp32: the first keys as this step sees them (turned sinks),
    or None; outside [T, P + T] bool (keys outside a row's own window) or None; softcap and sink_logits as
    softmax_attention's -> [T, Hq, D]. A row's bits do not depend on the other rows of the call."""
    t, hq, d = q.shape
    hkv = k_pages.shape[-2]
    assert k_pages.dtype == v_pages.dtype and k_pages.is_contiguous() and v_pages.is_contiguous()
    q = q.float().contiguous()
    rows = rows.to(torch.int64).contiguous()
    keep = [q, rows]
    if sink_keys is not None:
        sink_keys = sink_keys.float().contiguous()
        keep.append(sink_keys)
    if outside is not None:
        outside = outside.to(torch.uint8).contiguous()
        assert outside.shape == (t, rows.shape[0])
    sink_logits = _sink_logits(sink_logits, hq)
    out = torch.empty(t, hq, d)
    args = cpu_lib.PromptArgs(t, rows.shape[0] - t, hq, hkv, d, int(k_pages.dtype == torch.bfloat16),
                              0 if sink_keys is None else sink_keys.shape[0], q.data_ptr(), _ptr(sink_keys),
                              _ptr(sink_logits), k_pages.data_ptr(), v_pages.data_ptr(), rows.data_ptr(),
                              _ptr(outside), float(sm_scale), float(softcap or 0.0), out.data_ptr())
    rc = _lib.attn_prompt(ctypes.byref(args))
    if rc == -1:
        raise MemoryError("attn_prompt: out of memory for its buffers")
    if rc:
        raise ValueError(f"attn_prompt: shapes it does not take (head_dim {d}, {hq} / {hkv} heads)")
    return out


def _sink_logits(sink_logits: torch.Tensor | None, hq: int) -> torch.Tensor | None:
    """A layer's sink logits as the kernels read them: float32 [Hq], contiguous, on the CPU (None: none)."""
    if sink_logits is None:
        return None
    assert sink_logits.shape == (hq,), f"sink logits {tuple(sink_logits.shape)} for {hq} query heads"
    return sink_logits.to("cpu", torch.float32).contiguous()


def decode_attend(q, k, v, cos, sin, sink_cos, sink_sin, n_sink, k_pages, v_pages, new_rows, rows, offsets,
                  sm_scale: float, sink_logits: torch.Tensor | None = None, mass: Mass | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """B sequences' one new token each, from projections to attention output, in one call.

    q [B, Hq, D], k, v [B, Hkv, D] fp32 with contiguous rows (views of one qkv matmul's columns do), keys
    before RoPE; cos, sin [B, D] at the new tokens' positions; sink_cos, sink_sin [B, D] or None; n_sink [B]
    int32; k_pages, v_pages [R, Hkv, D] fp32 or bf16, written at new_rows [B]; rows / offsets and sink_logits as
    for attn_decode_batch (each sequence's new row included, last), softcap and mass -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = k_pages.shape[-2]
    for t in (q, k, v):
        assert t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == d, "rows of [H, D] fp32"
    assert k_pages.is_contiguous() and v_pages.is_contiguous() and k_pages.dtype == v_pages.dtype
    out = torch.empty(b, hq, d)
    scratch = _scratch_bytes(4 * (2 * b * hq * d + hq * rows.shape[0] + 4 * b * hq * (d + 2)))
    sink_logits = _sink_logits(sink_logits, hq)
    _lib.decode_attend(b, q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0), hq, hkv, d,
                       cos.data_ptr(), sin.data_ptr(), _ptr(sink_cos), _ptr(sink_sin), n_sink.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(),
                       int(k_pages.dtype == torch.bfloat16), new_rows.data_ptr(), rows.data_ptr(), offsets.data_ptr(),
                       float(sm_scale), float(softcap or 0.0), _ptr(sink_logits), out.data_ptr(), scratch.data_ptr(),
                       *Mass.args(mass, rows.shape[0], b, hq))
    return out


def attn_decode_ref(q, q_sink, n_sink: int, k_pages, v_pages, rows, sm_scale: float,
                    sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    hq, d = q.shape
    k, v = k_pages[rows].float(), v_pages[rows].float()           # [L, Hkv, D]
    hkv = k.shape[1]
    scores = torch.cat((torch.einsum("hgd,lhd->hgl", q_sink.view(hkv, -1, d), k[:n_sink]),
                        torch.einsum("hgd,lhd->hgl", q.view(hkv, -1, d), k[n_sink:])), -1)
    w = _softmax_ref(scores * sm_scale, sink_logits)
    return torch.einsum("hgl,lhd->hgd", w, v).reshape(hq, d)


def _softmax_ref(scores: torch.Tensor, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """scores [Hkv, G, L] -> softmax over L; sink logits [Hkv * G]: a column each that joins it and is dropped."""
    if sink_logits is None:
        return torch.softmax(scores, -1)
    sink = sink_logits.to(scores).view(*scores.shape[:2], 1)
    return torch.softmax(torch.cat((scores, sink), -1), -1)[..., :-1]


# ---- torch references (same signatures) ------------------------------------------------------------

def q4_dequant_ref(codes: torch.Tensor, scale, zero=None, high: torch.Tensor | None = None) -> torch.Tensor:
    scale, zero = _scales(scale, zero).dense()
    n, half = codes.shape
    b = codes.view(n, half // 16, 16)
    q = torch.cat((b & 15, b >> 4), -1)                          # [N, G, 32]
    if high is not None:                                         # q5: bit j of a group's uint32 is element j's bit 4
        bits = high.view(n, half // 16, 4).to(torch.int32)
        word = bits[..., 0] | bits[..., 1] << 8 | bits[..., 2] << 16 | bits[..., 3] << 24
        q = q | (((word[..., None] >> torch.arange(32, device=high.device)) & 1) << 4).to(torch.uint8)
    q = q.float()
    zero = torch.zeros_like(scale) if zero is None else zero
    return (q * scale[..., None] + zero[..., None]).view(n, half * 2)


def q8_dequant_ref(codes: torch.Tensor, scale, zero, group: int) -> torch.Tensor:
    scale, zero = _scales(scale, zero).dense()
    n, k = codes.shape
    w = codes.view(n, k // group, group).float() * scale[..., None]
    if zero is not None:
        w = w + zero[..., None]
    return w.view(n, k)


def q6k_codes_ref(codes: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """The 6-bit codes 0..63 [N, K] uint8 in value order, from the file's bits (kernels/cpu_q6k.h says where)."""
    n = codes.shape[0]
    shifts = lambda *s: torch.tensor(s, dtype=torch.uint8, device=codes.device)   # noqa: E731
    # per half-block of 128 values: ql bytes A [2, 32] (groups c, c + 2 in their low / high nibbles), qh Q [32]
    low = (codes.view(n, -1, 1, 2, 32) >> shifts(0, 4).view(1, 1, 2, 1, 1)) & 15          # [N, halves, 2, 2, 32]
    high = (high.view(n, -1, 1, 32) >> shifts(0, 2, 4, 6).view(1, 1, 4, 1)) & 3         # [N, halves, 4, 32]
    return (low.reshape(n, -1, 4, 32) | high << 4).reshape(n, -1)


def q6k_dequant_ref(codes: torch.Tensor, high: torch.Tensor, scales: Scales) -> torch.Tensor:
    # as gguf: d * sc rounded to float32 once (Scales.dense), then times q - 32
    dsc, _ = scales.dense()
    n = codes.shape[0]
    q = q6k_codes_ref(codes, high).view(n, -1, 16).to(torch.int16) - 32
    return (dsc[..., None] * q.float()).view(n, -1)


MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)     # E2M1 doubled, as gguf's kvalues


def e8m0_ref(e8m0: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8) -> float32 2^(e - 128), built from the bits as gguf's e8m0_to_fp32_half builds them
    (e < 2: a subnormal)."""
    e = e8m0.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e.clamp(max=1), (e - 1) << 23).view(torch.float32)


def mxfp4_dequant_ref(codes: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    # codes [N, K/2] uint8, e8m0 [N, K/32] uint8 -> float32 [N, K]: as gguf, the one product 2^(e - 128) * value
    n, half = codes.shape
    b = codes.view(n, half // 16, 16)
    q = torch.cat((b & 15, b >> 4), -1).long()                   # [N, G, 32]
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=codes.device)[q]
    return (e8m0_ref(e8m0)[..., None] * values).view(n, half * 2)


def prep_ref(x, norm=None, eps=0.0, swiglu=False):
    if norm is not None:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), norm, eps)
    if swiglu:
        a, b = x.chunk(2, -1)
        return torch.nn.functional.silu(a) * b
    return x


def q4_gemv_ref(x, codes, scale, zero, norm=None, eps=0.0, swiglu=False, residual=None, high=None):
    y = prep_ref(x, norm, eps, swiglu) @ q4_dequant_ref(codes, scale, zero, high).t()
    return y if residual is None else y + residual


def q8_gemv_ref(x, codes, scale, zero, group, norm=None, eps=0.0, swiglu=False, residual=None):
    y = prep_ref(x, norm, eps, swiglu) @ q8_dequant_ref(codes, scale, zero, group).t()
    return y if residual is None else y + residual


def q6k_gemv_ref(x, codes, high, scales, norm=None, eps=0.0, swiglu=False, residual=None):
    y = prep_ref(x, norm, eps, swiglu) @ q6k_dequant_ref(codes, high, scales).t()
    return y if residual is None else y + residual


def mxfp4_gemv_ref(x, codes, e8m0, norm=None, eps=0.0, swiglu=False, residual=None):
    y = prep_ref(x, norm, eps, swiglu) @ mxfp4_dequant_ref(codes, e8m0).t()
    return y if residual is None else y + residual


# ---- decode attention over quantized KV pages (attn_decode_quant in the C source) -----------------------

class _KVComp(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("head", ctypes.c_void_p), ("tail", ctypes.c_void_p), ("kind", ctypes.c_int),
                ("axis", ctypes.c_int), ("group", ctypes.c_int), ("full", ctypes.c_int)]


_KINDS = {"int8": 0, "fp8": 1, "int4": 2}
_AXES = {"channel": 0, "token": 1, "group": 2}
_FULL = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True, eq=False)
class QuantPages:
    """One layer component's quantized storage as the decode kernel reads it.

    data, scale, zero: page tensors [blocks, ...] laid out as `fmt.shapes`; head: [bs, H, D] full-precision
    rows of the table's first block (None: that block lives in the pages); tail: [bs, H, D] full-precision
    rows of the sequence's partly filled last block (None when it has none).
    """
    fmt: PageFormat
    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    head: torch.Tensor | None
    tail: torch.Tensor | None

    def struct(self) -> _KVComp:
        full = self.head if self.head is not None else self.tail
        for t in (self.data, self.scale, self.zero, self.head, self.tail):
            assert t is None or t.is_contiguous()
        return _KVComp(_ptr(self.data), _ptr(self.scale), _ptr(self.zero), _ptr(self.head), _ptr(self.tail),
                       _KINDS[self.fmt.name], _AXES[self.fmt.scale_axis], self.fmt.group,
                       _FULL[full.dtype] if full is not None else 0)


def can_attend_quantized(q: torch.Tensor, k_fmt: PageFormat, v_fmt: PageFormat, full_dtype, data) -> bool:
    """The C quantized decode attention: int8, fp8 and int4 K and V on the CPU, head_dim <= 512, even."""
    d = q.shape[-1]
    return (k_fmt.name in _KINDS and v_fmt.name in _KINDS and full_dtype in _FULL and not data.is_cuda
            and not q.is_cuda and d <= MAX_ATTEND_HEAD_DIM and d % 2 == 0
            and all(f.scale_axis != "group" or d % f.group == 0 for f in (k_fmt, v_fmt)) and kv_kernels_ready())


def _half_rope(cos_h, sin_h, pos):
    assert cos_h.dtype == sin_h.dtype == torch.float32 and cos_h.is_contiguous() and sin_h.is_contiguous()
    assert pos.dtype == torch.int64 and pos.is_contiguous() and int(pos.max()) < cos_h.shape[0]


# q [Hq, D], k_new, v_new [Hkv, D] fp32: the new token's query and key before RoPE, and its value, attended
# last; kp, vp: the layer's K and V pages; slots [P] int64 the held past, ascending (slot // block_size
# indexes table, the block ids); n_full: full blocks of the sequence (slots at or past n_full * block_size
# are in the tails); cos_h, sin_h [N, D/2] fp32 half RoPE tables; pos [P + 1] int64 rows of them: each past
# key's effective position, then the new token's (the query's too) -> [Hq, D]
def attn_decode_quant(q, k_new, v_new, kp: QuantPages, vp: QuantPages, slots, table, n_full: int,
                      block_size: int, cos_h, sin_h, pos, sm_scale: float, check: bool = True,
                      sink_logits: torch.Tensor | None = None, mass: Mass | None = None) -> torch.Tensor:
    """mass: where to measure the row's attention (Mass of one sequence, its columns for the P + 1 rows), or None."""
    hq, d = q.shape
    hkv = k_new.shape[0]
    n = slots.shape[0]
    if check:
        assert hq % hkv == 0 and pos.shape[0] == n + 1 and slots.dtype == table.dtype == torch.int64
        assert q.dtype == k_new.dtype == v_new.dtype == torch.float32 and table.is_contiguous()
        assert q.is_contiguous() and k_new.is_contiguous() and v_new.is_contiguous() and slots.is_contiguous()
        _half_rope(cos_h, sin_h, pos)
    out = torch.empty(hq, d)
    scratch = torch.empty(hq * (n + 1 + d) + 64 * hq * (d + 2))
    ks, vs = kp.struct(), vp.struct()
    sink_logits = _sink_logits(sink_logits, hq)
    _kv_lib.attn_decode_quant(q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), hq, hkv, d, int(block_size),
                           slots.data_ptr(), n, table.data_ptr(), int(n_full),
                           ctypes.addressof(ks), ctypes.addressof(vs), cos_h.data_ptr(), sin_h.data_ptr(),
                           pos.data_ptr(), float(sm_scale), _ptr(sink_logits), torch.get_num_threads(),
                           out.data_ptr(), scratch.data_ptr(), *Mass.args(mass, n + 1, 1, hq))
    return out


def can_attend_prompt_quantized(hq: int, hkv: int, d: int) -> bool:
    """attn_prompt_quant's shapes (the pages' kinds as can_attend_quantized): head_dim a multiple of 16 up to 512."""
    return d % 16 == 0 and d <= MAX_ATTEND_HEAD_DIM and hq % hkv == 0 and hq // hkv <= 64


# q [T, Hq, D] fp32 rotated at the rows' positions; k_new, v_new [T, Hkv, D] the rows' own keys before RoPE and
# values, attended after the held past (slots, table, n_full, block_size, cos_h, sin_h as attn_decode_quant's; pos
# [P + T] every key's effective position); outside, softcap and sink_logits as attn_prompt's -> [T, Hq, D]
def attn_prompt_quant(q, k_new, v_new, kp: QuantPages, vp: QuantPages, slots, table, n_full: int, block_size: int,
                      cos_h, sin_h, pos, sm_scale: float, softcap: float | None = None,
                      outside: torch.Tensor | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Prompt (or verification) rows' attention over quantized pages read in place (attn_prompt's arithmetic, each
    held row dequantized and its key rotated as the torch path's gathered copy is, so the two give the same bits)."""
    t, hq, d = q.shape
    hkv, n = k_new.shape[1], slots.shape[0]
    assert pos.shape[0] == n + t and slots.dtype == table.dtype == torch.int64
    assert slots.is_contiguous() and table.is_contiguous()
    _half_rope(cos_h, sin_h, pos)
    q, k_new, v_new = (x.float().contiguous() for x in (q, k_new, v_new))
    if outside is not None:
        outside = outside.to(torch.uint8).contiguous()
        assert outside.shape == (t, n + t)
    sink_logits = _sink_logits(sink_logits, hq)
    out = torch.empty(t, hq, d)
    ks, vs = kp.struct(), vp.struct()
    pages = cpu_lib.PromptQuantPages(ctypes.addressof(ks), ctypes.addressof(vs), k_new.data_ptr(), v_new.data_ptr(),
                                     cos_h.data_ptr(), sin_h.data_ptr(), slots.data_ptr(), table.data_ptr(),
                                     pos.data_ptr(), int(block_size), int(n_full))
    args = cpu_lib.PromptArgs(t, n, hq, hkv, d, 0, 0, q.data_ptr(), None, _ptr(sink_logits), None, None, None,
                              _ptr(outside), float(sm_scale), float(softcap or 0.0), out.data_ptr())
    rc = _kv_lib.attn_prompt_quant(ctypes.byref(args), ctypes.byref(pages))
    if rc == -1:
        raise MemoryError("attn_prompt_quant: out of memory for its buffers")
    if rc:
        raise ValueError(f"attn_prompt_quant: shapes it does not take (head_dim {d}, {hq} / {hkv} heads)")
    return out


def _rows_ref(p: QuantPages, slots, table, n_full: int, bs: int) -> torch.Tensor:
    from .reference import dequantize
    parts = []
    for s in slots.tolist():
        b, off = divmod(s, bs)
        if b >= n_full:
            parts.append(p.tail[off].float())
        elif b == 0 and p.head is not None:
            parts.append(p.head[off].float())
        else:
            i = int(table[b])
            deq = dequantize(p.data[i:i + 1], p.scale[i:i + 1], None if p.zero is None else p.zero[i:i + 1], p.fmt)
            parts.append(deq[0, off])
    return torch.stack(parts)


def attn_decode_quant_ref(q, k_new, v_new, kp: QuantPages, vp: QuantPages, slots, table, n_full: int,
                          block_size: int, cos_h, sin_h, pos, sm_scale: float, check: bool = True,
                          sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    hq, d = q.shape
    hkv = k_new.shape[0]
    k = torch.cat((_rows_ref(kp, slots, table, n_full, block_size), k_new[None])) if slots.numel() else k_new[None]
    v = torch.cat((_rows_ref(vp, slots, table, n_full, block_size), v_new[None])) if slots.numel() else v_new[None]
    cos, sin = cos_h[pos], sin_h[pos]
    c, s = cos[-1], sin[-1]
    q = torch.cat((q[:, :d // 2] * c - q[:, d // 2:] * s, q[:, d // 2:] * c + q[:, :d // 2] * s), -1)
    k = torch.cat((k[..., :d // 2] * cos[:, None] - k[..., d // 2:] * sin[:, None],
                   k[..., d // 2:] * cos[:, None] + k[..., :d // 2] * sin[:, None]), -1)
    scores = torch.einsum("hgd,lhd->hgl", q.view(hkv, -1, d), k) * sm_scale
    return torch.einsum("hgl,lhd->hgd", _softmax_ref(scores, sink_logits), v).reshape(hq, d)


# ---- a decode step of all decoder layers in one call (decode_layers in the C source) ----------------------

def qk_norm_(qkv: torch.Tensor, hq: int, hkv: int, d: int, q_w: torch.Tensor, k_w: torch.Tensor, eps: float) -> bool:
    """qkv [T, n] fp32 contiguous on the CPU: its q and k heads RMS-normed in place (qk_norm_rows, the norm the
    one-call step computes, so both paths give the same bits). False (nothing done) where the kernel cannot."""
    if not (available() and qkv.dtype == torch.float32 and qkv.is_contiguous() and not qkv.is_cuda
            and q_w.dtype == k_w.dtype == torch.float32 and q_w.is_contiguous() and k_w.is_contiguous()):
        return False
    _lib.qk_norm_rows(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], hq, hkv, d, q_w.data_ptr(), k_w.data_ptr(),
                      float(eps))
    return True


def decode_split(rows: int, split: int | None) -> int:
    """How many leading rows of a call are decode rows (the kernels' matvecs): split where the caller says, else all
    of them up to MAX_ROWS rows, else none."""
    if split is not None:
        return split
    return rows if rows <= MAX_ROWS else 0


_ONES: dict[int, torch.Tensor] = {}         # head_norm_'s multiplier where there is none, by width


def head_norm_(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> bool:
    """x [T, heads, D] fp32 (each row's heads contiguous, rows at any stride) RMS-normed over D in place, times w
    [D] (None: no multiplier, Gemma 4's values): qk_norm_rows, the one-call step's norm. False (nothing done) where
    the kernel cannot."""
    if not (available() and x.dtype == torch.float32 and x.dim() == 3 and not x.is_cuda and x.stride(2) == 1
            and x.stride(1) == x.shape[2] and (w is None or (w.dtype == torch.float32 and w.is_contiguous()))):
        return False
    if w is None:
        w = _ONES.get(x.shape[2])
        if w is None:
            w = _ONES[x.shape[2]] = torch.ones(x.shape[2])
    _lib.qk_norm_rows(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], 0, x.shape[2], w.data_ptr(), w.data_ptr(),
                      float(eps))
    return True


def norm_add_(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> bool:
    """y [T, H] = x + RMSNorm(y) * w in place (norm_add_rows: a post-norm and its residual, the one-call step's own
    arithmetic). False (nothing done) where the kernel cannot: not fp32 contiguous CPU tensors, no kernels."""
    if not (available() and y.dtype == x.dtype == w.dtype == torch.float32 and y.is_contiguous()
            and x.is_contiguous() and w.is_contiguous() and not y.is_cuda and y.dim() == 2 and x.shape == y.shape):
        return False
    _lib.norm_add_rows(y.data_ptr(), x.data_ptr(), y.shape[0], y.shape[1], w.data_ptr(), float(eps))
    return True


def beside_add(x: torch.Tensor, dense: torch.Tensor, routed: torch.Tensor, norms: tuple, post: torch.Tensor,
               eps: float) -> torch.Tensor | None:
    """x + RMSNorm(RMSNorm(dense) * norms[0] + RMSNorm(routed) * norms[2]) * post over [T, H] rows (Gemma 4's MLP and
    its experts side by side; norms: the Layer's beside) in C (beside_rows, the one-call step's own arithmetic;
    dense is overwritten); None (nothing done) where the kernel cannot: not fp32 contiguous CPU tensors."""
    ws = (norms[0], norms[2], post)
    ts = (x, dense, routed, *ws)
    if not (available() and all(t.dtype == torch.float32 and t.is_contiguous() and not t.is_cuda for t in ts)
            and dense.dim() == 2 and x.shape == dense.shape == routed.shape):
        return None
    out = torch.empty_like(dense)
    _lib.beside_rows(dense.data_ptr(), routed.data_ptr(), x.data_ptr(), dense.shape[0], dense.shape[1],
                     *(w.data_ptr() for w in ws), float(eps), out.data_ptr())
    return out


def softcap_(x: torch.Tensor, cap: float) -> bool:
    """x = cap * tanh(x / cap) in place (softcap_rows: Gemma's final logit cap, 0.06 instead of 0.45 ms over
    262,144 logits); False (nothing done) where x is not a contiguous fp32 CPU tensor or the kernels are not
    loaded."""
    if not (available() and x.dtype == torch.float32 and x.is_contiguous() and not x.is_cuda):
        return False
    _lib.softcap_rows(x.data_ptr(), x.numel(), float(cap))
    return True


def sigmoid_mul_(o: torch.Tensor, gate: torch.Tensor) -> bool:
    """o *= sigmoid(gate) in place (sigmoid_mul_rows: Qwen3.5's output gate, the one-call step's own); False (nothing
    done) where the two are not contiguous fp32 CPU tensors of one size or the kernels are not loaded."""
    if not (available() and o.dtype == gate.dtype == torch.float32 and o.is_contiguous() and gate.is_contiguous()
            and o.numel() == gate.numel() and not o.is_cuda and not gate.is_cuda):
        return False
    _lib.sigmoid_mul_rows(o.data_ptr(), gate.data_ptr(), o.numel())
    return True


def gelu_gate(gu: torch.Tensor) -> torch.Tensor | None:
    """gelu_tanh(gate) * up of gu [T, 2F] fp32 (gate | up) -> [T, F], as the one-call step computes it
    (gelu_gate_rows); None where the kernel cannot."""
    if not (available() and gu.dtype == torch.float32 and gu.is_contiguous() and not gu.is_cuda and gu.dim() == 2):
        return None
    out = torch.empty(gu.shape[0], gu.shape[1] // 2)
    _lib.gelu_gate_rows(gu.data_ptr(), gu.shape[0], gu.shape[1] // 2, out.data_ptr())
    return out


def qlin(codes: torch.Tensor, scale, bits: int, group: int = 32, act: int = 16,
         high: torch.Tensor | None = None) -> QLin:
    """codes [N, K/2] uint8 (bits 4) or [N, K] int8 (bits 8), contiguous; scale a Scales; act: activation bits.
    bits 6: GGUF Q6_K, codes its low 4 bits and high its high 2 (q6k_gemv's arguments); the struct carries high
    in its zero field and d in ssup (kernels/cpu_q6k.h). bits 4 with high: q5, its fifth bits (q4_gemv's)."""
    s = _scales(scale, None)
    n = codes.shape[0]
    k = codes.shape[1] * (1 if bits == 8 else 2)
    if bits == 6:
        _q6k_args(codes, high, s)
        return QLin(codes.data_ptr(), s.scale.data_ptr(), high.data_ptr(), s.scale_sup.data_ptr(), None, 6, s.kind,
                    16, 16, n, k, act)
    kind, ssup, zsup, per = s.args()
    if bits == 4:
        _check_high(codes, high, s)
    return QLin(codes.data_ptr(), s.scale.data_ptr(), _ptr(s.zero), ssup, zsup, bits, kind, per, group, n, k, act,
                _ptr(high) if bits == 4 else None)


class ExpertTable:
    """A routed MLP as moe_layer_rows reads it (cpu_lib.MoE): the router and E gate, up and down linears (QLin
    each), their biases, the routing settings (act 0 SwiGLU, 1 gpt-oss's, 2 GELU-tanh; router_norm: the router's own
    input norm, expert_scale: each expert's weight multiplier, Gemma 4's); `hits` [E] int64 counts the tokens routed
    to each expert."""

    def __init__(self, router: QLin, gate: list, up: list, down: list, router_bias, biases: tuple, used: int,
                 normalize: bool, act: int, alpha: float, limit: float, router_norm: torch.Tensor | None = None,
                 expert_scale: torch.Tensor | None = None):
        self.count = len(gate)
        self._arrays = [(QLin * self.count)(*parts) for parts in (gate, up, down)]
        self._keep = [None if b is None else b.float().contiguous()
                      for b in (router_bias, *biases, router_norm, expert_scale)]
        self.hits = torch.zeros(self.count, dtype=torch.int64)
        self.struct = cpu_lib.MoE(self.count, used, act, int(normalize), alpha, limit, router, _ptr(self._keep[0]),
                                  *(ctypes.addressof(a) for a in self._arrays), *(_ptr(b) for b in self._keep[1:4]),
                                  None, *(_ptr(b) for b in self._keep[4:]))

    def counting(self, on: bool) -> None:
        """Count the tokens routed to each expert (into hits) or not."""
        self.struct.hits = self.hits.data_ptr() if on else None


def moe_layer(x: torch.Tensor, norm: torch.Tensor, eps: float, table: ExpertTable,
              residual: torch.Tensor | None) -> torch.Tensor:
    """residual + the routed MLP of RMSNorm(x) * norm for decode rows x [M, H] fp32: the norm, the router, the
    routing and each row's k experts in C (moe_layer_rows), as decode_layers computes a layer with experts."""
    m, h = x.shape
    x = x.contiguous()
    y = torch.empty(m, h)
    residual = None if residual is None else residual.float().contiguous()
    rc = _lib.moe_layer_rows(m, h, x.data_ptr(), norm.data_ptr(), float(eps), ctypes.addressof(table.struct),
                             _ptr(residual), y.data_ptr())
    if rc:
        raise RuntimeError(f"moe_layer_rows failed ({rc}): {'out of memory' if rc == -1 else 'the experts do not chain'}")
    return y


def shared_table(gu: list, down: list, gate: torch.Tensor) -> SharedExpert | None:
    """A shared expert as shared_expert_rows reads it: gu the gate | up linear's kernel parts (at most 3), down's (one),
    gate its [1, H] or [H] fp32 weight (kept alive by the struct); None where they are not so, or the kernels are not
    loaded."""
    if not (available() and gu and len(gu) <= 3 and down and len(down) == 1 and gate.dtype == torch.float32
            and gate.is_contiguous() and not gate.is_cuda):
        return None
    table = SharedExpert()
    for j, part in enumerate(gu):
        table.gu[j] = part
    table.ngu, table.down, table.gate = len(gu), down[0], gate.data_ptr()
    table.keep = gate
    return table


def shared_expert_(y: torch.Tensor, x: torch.Tensor, norm: torch.Tensor, eps: float, table: SharedExpert) -> None:
    """y [M, H] += the shared expert of RMSNorm(x) * norm for decode rows (fp32 contiguous, y in place): in C
    (shared_expert_rows), as decode_layers computes it after a routed MLP."""
    assert y.dtype == x.dtype == torch.float32 and y.is_contiguous() and y.shape == x.shape
    x = x.contiguous()
    rc = _lib.shared_expert_rows(x.shape[0], x.shape[1], x.data_ptr(), norm.data_ptr(), float(eps),
                                 ctypes.addressof(table), y.data_ptr())
    if rc:
        why = "out of memory" if rc == -1 else "widths do not chain"
        raise RuntimeError(f"shared_expert_rows failed ({rc}): {why}")


def moe_grouped(xn: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, wts: torch.Tensor, table: ExpertTable,
                out: torch.Tensor) -> None:
    """out [T, H] fp32 (zeros or the residual) += each row's routed experts over prompt rows grouped by expert, in one
    C call (moe_grouped_rows): xn [T, H] fp32 normed rows; rows int32 row ids expert by expert, counts int32 [E] the
    group sizes, wts fp32 each row's weight in its group."""
    xn, rows, counts, wts = xn.contiguous(), rows.contiguous(), counts.contiguous(), wts.contiguous()
    rc = _lib.moe_grouped_rows(xn.shape[0], xn.shape[1], xn.data_ptr(), rows.data_ptr(), counts.data_ptr(),
                               wts.data_ptr(), ctypes.addressof(table.struct), out.data_ptr())
    if rc:
        raise RuntimeError(f"moe_grouped_rows failed ({rc}): {'out of memory' if rc == -1 else 'the experts do not chain'}")


def gdn_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> torch.Tensor | None:
    """The gated delta rule over T tokens in C (cpu_gdn.h): q, k [T, Hk, Dk] as the convolution gave them (the
    kernel normalizes them), v [T, H, Dv], g, beta [T, H], all fp32; state [H, Dk, Dv] fp32 contiguous, updated in
    place -> outputs [T, H, Dv]. None (nothing done) where the kernels are not loaded or the shapes are not theirs."""
    if not (available() and state.dtype == torch.float32 and state.is_contiguous() and not state.is_cuda
            and q.shape[-1] <= 1024 and v.shape[-1] <= 1024):
        return None
    T, hk, dk = q.shape
    h, dv = v.shape[1:]
    q, k, v = (t.float().contiguous() for t in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(T, h, dv)
    rc = _lib.gdn_rule(T, hk, h, dk, dv, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                       state.data_ptr(), out.data_ptr())
    return None if rc else out


def gdn_table(conv: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor, norm: torch.Tensor, key_heads: int,
              key_dim: int) -> GDN | None:
    """A Gated DeltaNet mixer's vectors as gdn_mix reads them: conv [K, C], A and dt_bias [H], norm [Dv], fp32
    contiguous on the CPU (the struct keeps them alive); None where they are not, or the kernels are not loaded."""
    vecs = (conv, A, dt_bias, norm)
    if not available() or any(t.dtype != torch.float32 or not t.is_contiguous() or t.is_cuda for t in vecs):
        return None
    K, C = conv.shape
    H, Dv = A.shape[0], norm.shape[0]
    if C != 2 * key_heads * key_dim + H * Dv or dt_bias.shape != (H,):
        return None
    table = GDN(key_heads, key_dim, H, Dv, K, *(t.data_ptr() for t in vecs))
    table.keep = vecs
    return table


def gdn_mix(table: GDN, proj: torch.Tensor, eps: float, tail: torch.Tensor, matrices: torch.Tensor,
            new_tail: torch.Tensor | None = None, new_matrices: torch.Tensor | None = None):
    """One sequence's T rows through a Gated DeltaNet mixer in C (cpu_gdn.h: gdn_mix): proj [T, >= C + H Dv + 2 H]
    fp32 rows (mixed | z | b | a), the state's tail [K - 1, C] and matrices [H, Dk, Dv] (read, not written) ->
    (out [T, H Dv] for out_proj, the new tail, the new matrices), into new_tail / new_matrices where given (not the
    state's own). None (nothing done) where proj is not fp32 rows on the CPU."""
    width = 2 * table.Hk * table.Dk + 2 * table.H * table.Dv + 2 * table.H
    if proj.dtype != torch.float32 or proj.is_cuda or proj.stride(1) != 1 or proj.shape[1] < width or not (
            tail.is_contiguous() and matrices.is_contiguous()):
        return None
    T = proj.shape[0]
    new_tail = torch.empty_like(tail) if new_tail is None else new_tail
    new_matrices = torch.empty_like(matrices) if new_matrices is None else new_matrices
    out = torch.empty(T, table.H * table.Dv)
    rc = _lib.gdn_mix(ctypes.byref(table), T, proj.data_ptr(), proj.stride(0), eps, tail.data_ptr(),
                      new_tail.data_ptr(), matrices.data_ptr(), new_matrices.data_ptr(), out.data_ptr())
    if rc == -1:
        raise MemoryError("gdn_mix: out of memory")
    return None if rc else (out, new_tail, new_matrices)


def choose_blocks(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, summary: torch.Tensor, ids: torch.Tensor,
                  k: int, out: torch.Tensor, scores: torch.Tensor, disk: torch.Tensor | None = None,
                  disk_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Quest's choice (engine/runtime/retrieval.py): q [Hq, D] float32 before RoPE, cos / sin [D] float32 at its
    position, summary bf16 [blocks, Hkv, 2D] (max, min), ids int64 [n] the candidates' block ids -> out int32 [k], the
    k best candidates' indices ascending; scores float32 [n] gets every candidate's score (0 for the best). disk,
    disk_rows: more candidates (after the n), rows disk_rows of disk (bf16 [*, Hkv, 2D]): blocks on disk."""
    n = ids.shape[0] + (0 if disk is None else disk_rows.shape[0])
    hq, d = q.shape
    assert q.dtype == cos.dtype == sin.dtype == scores.dtype == torch.float32 and summary.dtype == torch.bfloat16
    assert ids.dtype == torch.int64 and out.dtype == torch.int32 and 0 < k < n <= scores.shape[0]
    assert q.is_contiguous() and summary.is_contiguous() and ids.is_contiguous() and cos.numel() == sin.numel() == d
    if disk is not None:
        assert disk.dtype == torch.bfloat16 and disk.is_contiguous() and disk_rows.dtype == torch.int64
        disk_rows = disk_rows.contiguous()
    _lib.choose_blocks(q.data_ptr(), cos.data_ptr(), sin.data_ptr(), hq, summary.shape[1], d, summary.data_ptr(),
                       ids.data_ptr(), ids.shape[0], None if disk is None else disk.data_ptr(),
                       None if disk is None else disk_rows.data_ptr(), 0 if disk is None else disk_rows.shape[0], k,
                       out.data_ptr(), scores.data_ptr())
    return out[:k]


def prebuild() -> list[Path]:
    """Compile every variant of both libraries (and the CPU probe) into the package: make's install step and the
    bundle run this, so that a first start on any x86-64 CPU (or this architecture's) loads a build made for its
    instructions instead of compiling. A variant the compiler cannot build (AVX-512 on an old one) is skipped."""
    cpu_lib._build(cpu_lib.PROBE_SOURCE, into=BUILT, variant=list(cpu_lib.variants())[-1])
    for variant in cpu_lib.variants():
        for source in (SOURCE, KV_SOURCE):
            try:
                _build(source=source, into=BUILT, variant=variant)
            except (OSError, RuntimeError) as exc:
                print(f"skipped the {variant} build of {source.name}: {exc}")
    return sorted(BUILT.glob("*.so"))


if __name__ == "__main__":
    for path in prebuild():
        print(path)
