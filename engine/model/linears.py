"""Linear layers over packed weights, used by prefill and decode alike.

One interface (`__call__(x [T, K]) -> [T, N]`, `nbytes`, `kind`, `dequantize()`), these kinds:

- `DenseLinear`: a plain tensor (the fp32 reference path, or 16-bit weights kept 16-bit).
- `Q4Linear`: 4-bit codes, two per byte, in groups of 32 along K with a scale and a zero per group
  (w = q * scale + zero). Q4_0, Q4_1 and Q4_K blocks are exactly this grid: their codes are kept
  as the file has them, never re-rounded.
- `Q5Linear`: Q4Linear's codes and a plane of fifth bits beside them, codes 0..31: GGUF Q5_0, Q5_1 and Q5_K at
  their own 5.5 bits a weight (the q4 kernels read the plane, kernels/cpu_quant.c).
- `Q8Linear`: int8 codes in groups of 16 or 32 with a scale (and a zero) per group: Q8_0 is exactly this grid.
- `Q6Linear`: GGUF Q6_K at its own 6.5625 bits a weight, the file's bits in its kernel's order.
- `MXFP4Linear`: GGUF MXFP4 (gpt-oss's experts) at its own 4.25 bits a weight: 4-bit E2M1 codes in the q4 order
  and a power-of-two (E8M0) scale per group of 32, the file's bytes as they are.

Decode steps (a few rows) run kernels/cpu_quant.c, which reads the packed codes and quantizes the
activations to int16 per group of 32 (llama.cpp uses int8); prefill dequantizes a slab of rows at a
time into a scratch buffer and runs the BLAS GEMM, so no dense copy of a weight ever persists. Where the CPU
multiplies bf16 natively (AMX), prefill can take the slabs and the prompt rows in bf16 (`prefill_dtype`,
EngineConfig.prefill): oneDNN's bf16 GEMM, about 5x the fp32 one there, in calls of a fixed BF16_TILE rows so
that a row's bits never depend on the rows it is batched with. Where the CPU has AVX2 or AVX-512, prompt rows can
instead be rounded to int8 per group of 32 (llama.cpp's Q8_0) and multiplied by the codes themselves, eight or
sixteen weight rows at a time (prefill int8: cpu_quant.gemm8, gemm8_q6k), with no slab at all.

Past 450 lines on purpose: the kinds share one interface and one dispatch, and each is short beside the others.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvchat import kernels
from kvchat.kernels import cpu_quant

GROUP = 32
SLAB_BYTES = 32 * 2**20      # prefill dequantizes at most this much of a weight at once
ROWS_IN_C = 8                # embedding lookups of up to this many ids dequantize row by row in C (_Packed.rows)
GEMM_MIN_ROWS = 16           # MKL's sgemm gives a row the same bits for any row count from about 12 up
BF16_TILE = 64               # oneDNN's bf16 GEMM: a row's bits depend on the call's row count (measured), not its
                             # place in it or its neighbours; so every call has this many rows (zeros pad the last)


def _cut(t: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[ids].contiguous()


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, hidden]; statistics in fp32 as the reference does
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def gated(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The gated MLP's activation: x [T, 2K] (gate | up) -> act(gate) * up [T, K]; act one of spec.ACTIVATIONS
    (silu: SwiGLU; gelu_tanh: GELU with the tanh approximation, Gemma's gelu_pytorch_tanh)."""
    if act == "gelu_tanh" and x.dim() == 2 and not kernels.gpu_path(x):
        got = cpu_quant.gelu_gate(x)        # the one-call step's GELU, so both paths give the same bits
        if got is not None:
            return got
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


class _Fused:
    """fused(): what a layer does around a matmul, in one call: RMSNorm or the gated activation before (swiglu:
    the input is gate | up, act names the gate's activation), residual after.

    Here as plain torch ops; packed linears run decode steps of it inside the C kernel (SwiGLU only: another
    activation runs in torch first, the kernel then only multiplies).
    """

    def fused(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
              residual: torch.Tensor | None = None, split: int | None = None, act: str = "silu") -> torch.Tensor:
        # x: [T, K] ([T, 2K] with swiglu) -> [T, N]; split (decode rows first) matters to packed kinds only
        if norm is not None:
            x = rms_norm(x, norm, eps)
        elif swiglu:
            x = gated(x, act)
        y = self(x, split=split)
        return y if residual is None else residual + y

    def kernel_parts(self) -> list | None:
        """This linear as decode_layers' parts (cpu_quant.QLin), or None where the kernel does not cover it."""
        return None


def _biased(parts: list, bias: torch.Tensor | None) -> list | None:
    """A packed linear's kernel parts with its bias, each part its columns' share, which lin_apply adds as fused()
    does: the product, then the bias, then any residual. None where the kernel cannot read the bias (float32 [N]
    contiguous on the CPU)."""
    if bias is None:
        return parts
    if bias.dtype != torch.float32 or bias.device.type != "cpu" or not bias.is_contiguous() \
            or bias.shape != (sum(p.N for p in parts),):
        return None
    col = 0
    for p in parts:
        p.bias = bias[col:].data_ptr()
        col += p.N
    return parts


class DenseLinear(_Fused):
    """y = x @ W^T (+ b); W kept in its own dtype (fp32, bf16 or fp16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight.contiguous(), bias
        self.out_features, self.in_features = weight.shape
        self.kind = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(weight.dtype, "dense")

    def __call__(self, x: torch.Tensor, split: int | None = None) -> torch.Tensor:
        # x: [T, K] -> [T, N] in x.dtype. On the CPU, fewer than GEMM_MIN_ROWS rows are padded with zeros: MKL
        # rounds a row of a 1-row (GEMV) or few-row call differently from the same row in a larger GEMM, so without
        # the padding a served stream's tokens could depend on what it was batched with (a near-tie flips).
        T = x.shape[0]
        if x.device.type == "cpu" and x.dim() == 2 and 0 < T < GEMM_MIN_ROWS:
            return self(torch.cat((x, x.new_zeros(GEMM_MIN_ROWS - T, x.shape[1]))))[:T]
        if x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def take_rows(self, ids: torch.Tensor) -> "DenseLinear":
        """This linear with its output rows in the order ids (a new linear; see _Packed.take_rows)."""
        return DenseLinear(self.weight[ids], _cut(self.bias, ids))

    def moved(self, device) -> "DenseLinear":
        self.weight = self.weight.to(device)
        self.bias = None if self.bias is None else self.bias.to(device)
        return self

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weight, self.bias)


def _compact(scale, zero) -> cpu_quant.Scales:
    """Scales as given (two-level K-quant scales stay two-level), floats as float16 where that is exact."""
    if isinstance(scale, cpu_quant.Scales):
        if scale.scale_sup is not None or scale.offset8:
            return scale
        scale, zero = scale.scale, scale.zero
    if scale.dtype == torch.float16 and (zero is None or zero.dtype == torch.float16):
        return cpu_quant.Scales(scale.contiguous(), zero.contiguous() if zero is not None else None)   # as stored
    scale = scale.float().contiguous()
    zero = zero.float().contiguous() if zero is not None else None
    if torch.equal(scale.half().float(), scale) and (zero is None or torch.equal(zero.half().float(), zero)):
        return cpu_quant.Scales(scale.half(), zero.half() if zero is not None else None)
    return cpu_quant.Scales(scale, zero)


class _Packed(_Fused):
    """Shared by the packed kinds: decode through the C kernel, prefill through dequantized slabs."""

    bias: torch.Tensor | None = None
    out_features: int
    in_features: int

    def _gemv(self, x: torch.Tensor, **prep) -> torch.Tensor:
        raise NotImplementedError

    def _gemm8(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dequant_rows(self, lo: int, hi: int, out: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows lo..hi as float32 [hi - lo, K] (into out, when given and the C kernels are available); dtype=
        bfloat16: those values rounded to bf16."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, split: int | None = None) -> torch.Tensor:
        # x: [T, K] -> [T, N] in x.dtype
        return self.fused(x, split=split)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup from the same bits a tied output head reads: [T, K] float32. A decode step's few ids go
        through the C dequantizer a row at a time (the torch reference, a dozen ops, took 0.3 ms of every step: 2% of
        a Qwen3-0.6B token); the same values bit for bit (tests/test_gguf_weights.py)."""
        if ids.numel() <= ROWS_IN_C and self.codes.device.type == "cpu" and cpu_quant.available():
            out = [self._dequant_rows(i, i + 1) for i in ids.view(-1).tolist()]
            return out[0] if len(out) == 1 else torch.cat(out)
        return self._rows_ref(ids)

    def _rows_ref(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    prefill_dtype = torch.float32       # the GEMM's: float32, bfloat16, or int8 (gemm8: Transformer.set_prefill)
    int8_rows = False                   # whether prompt rows can take gemm8 (int8 activations against the codes)
    act_bits = 16                       # decode rows' activations in the C kernel: 16, or 8 (set_activations)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt rows: dequantized slabs through the BLAS GEMM. fp32: one call of at least GEMM_MIN_ROWS rows
        (zeros pad the rest), a row count from which MKL gives each row the same bits whatever the count. bf16:
        slabs and rows rounded to bf16 (to nearest even, as torch rounds), products summed in fp32 and each output
        rounded to bf16 by oneDNN, in calls of exactly BF16_TILE rows."""
        T, K = x.shape
        dtype = self.prefill_dtype
        if dtype == torch.int8:     # a kind gemm8 reads, where the build has it; else the exact GEMM
            if self.int8_rows and cpu_quant.gemm8_available():
                return self._gemm8(x.contiguous())
            dtype = torch.float32
        bf16 = dtype == torch.bfloat16
        rows = -(-T // BF16_TILE) * BF16_TILE if bf16 else max(T, GEMM_MIN_ROWS)
        tile = BF16_TILE if bf16 else rows
        if rows > T or x.dtype != dtype:
            padded = torch.zeros(rows, K, dtype=dtype)
            padded[:T] = x
            x = padded
        y = torch.empty(rows, self.out_features)
        step = min(self.out_features, max(16, SLAB_BYTES // (4 * K)))
        buf = cpu_quant.slab(step * K, dtype) if cpu_quant.available() else None
        for lo in range(0, self.out_features, step):
            hi = min(self.out_features, lo + step)
            out = None if buf is None else buf[:(hi - lo) * K].view(hi - lo, K)
            w = self._dequant_rows(lo, hi, out, dtype)
            for r in range(0, rows, tile):
                # bf16: the slab times the rows' transpose, 1.6-3x faster in oneDNN than the rows times the slab's
                # transpose (it packs the small operand, not the slab), the same tile of rows a call
                y[r:r + tile, lo:hi] = (w @ x[r:r + tile].t()).t() if bf16 else x[r:r + tile] @ w.t()
        return y[:T]

    def fused(self, x, norm=None, eps=0.0, swiglu=False, residual=None, split=None, act="silu"):
        """split: how many leading rows are decode rows (one generated token of a sequence each); they run
        through the C kernel MAX_ROWS at a time, the rest (prompt rows) through the GEMM. A row's result
        then depends only on the row and its kind, never on what it is batched with (tested). None: the
        kernel for up to MAX_ROWS rows, else the GEMM. act: the gate's activation with swiglu; the kernel's
        SwiGLU computes silu only, so another one is applied here in torch and the kernel runs a plain GEMV."""
        if swiglu and act != "silu":
            x, swiglu = gated(x, act), False
        if kernels.gpu_path(x):
            return self._gpu(x, norm, eps, swiglu, residual)
        T, dtype = x.shape[0], x.dtype
        split = cpu_quant.decode_split(T, split)
        if not cpu_quant.available():
            split = 0
        if split == T <= cpu_quant.MAX_ROWS and dtype == torch.float32 and self.bias is None:   # a decode step
            return self._gemv(x if x.is_contiguous() else x.contiguous(), norm=norm, eps=eps, swiglu=swiglu,
                              residual=None if residual is None else residual.contiguous())
        x = x.float().contiguous()
        if residual is not None:
            residual = residual.float().contiguous()
        in_kernel = residual is not None and self.bias is None     # the kernel adds the residual itself
        parts = []
        for lo in range(0, split, cpu_quant.MAX_ROWS):
            hi = min(split, lo + cpu_quant.MAX_ROWS)
            parts.append(self._gemv(x[lo:hi], norm=norm, eps=eps, swiglu=swiglu,
                                    residual=residual[lo:hi] if in_kernel else None))
        if split < T:
            xs = x[split:]
            if norm is not None:
                xs = rms_norm(xs, norm, eps)
            elif swiglu:
                gate, up = xs.chunk(2, dim=-1)
                xs = F.silu(gate) * up
            y = self._gemm(xs)
            if in_kernel:
                y += residual[split:]
            parts.append(y)
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.bias is not None:
            y += self.bias
            if residual is not None:
                y += residual
        return y.to(dtype)

    def dequantize(self) -> torch.Tensor:
        return self._dequant_rows(0, self.out_features)

    bits: int
    group: int = GROUP

    def _gpu(self, x, norm, eps, swiglu, residual) -> torch.Tensor:
        """The GPU path: every row through the Triton dequantize-and-multiply kernels (kernels/triton_matmul.py,
        a GEMV-like one for decode rows, a tiled one for prompt rows), the weights never unpacked in memory; the
        norm or the SwiGLU before and the residual after in torch."""
        from kvchat.kernels.triton_matmul import packed_matmul
        if norm is not None:
            x = rms_norm(x, norm, eps)
        elif swiglu:
            x = gated(x)
        y = packed_matmul(x, self.codes, self.scales, self.bits, self.group, self.bias)
        return (y if residual is None else residual.float() + y).to(x.dtype)

    def moved(self, device) -> "_Packed":
        """This linear's codes, scales and bias on `device` (the packed forms stay packed; the K-quants' own scale
        bytes as a byte per scale on the GPU path, the form its Triton kernels read)."""
        self.codes = self.codes.to(device)
        self.scales = (self.scales.unpacked() if kernels.gpu_path(device) else self.scales).to(device)
        self.bias = None if self.bias is None else self.bias.to(device)
        return self


class Q4Linear(_Packed):
    kind = "q4"
    bits = 4

    def __init__(self, codes: torch.Tensor, scale, zero: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        # codes: [N, K/2] uint8 (group g, byte j: element j low nibble, j + 16 high); scale, zero: [N, K/32],
        # or a cpu_quant.Scales
        n, half = codes.shape
        self.scales = _compact(scale, zero).implicit_zero()       # Q4_0: no zeros stored
        assert half % 16 == 0 and self.scales.scale.shape[0] == n and self.scales.groups == half // 16, \
            (codes.shape, self.scales.scale.shape)
        self.codes = codes.contiguous()
        self.bias = bias
        self.out_features, self.in_features = n, half * 2

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale, zero, bias=None) -> "Q4Linear":
        """q: [N, K] integers 0..15 in natural order."""
        n, k = q.shape
        g = q.to(torch.uint8).view(n, k // GROUP, 2, 16)
        return cls((g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2), scale, zero, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Q4Linear":
        """Round a float [N, K] weight to 16 levels per group of 32, from its min to its max."""
        n, k = weight.shape
        w = weight.float().view(n, k // GROUP, GROUP)
        lo = w.amin(-1)
        scale = ((w.amax(-1) - lo) / 15).clamp_min(1e-8)
        q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).view(n, k)
        return cls.from_codes(q, scale, lo, bias)

    int8_rows = True

    def _gemv(self, x, **prep):
        return cpu_quant.q4_gemv(x, self.codes, self.scales, act=self.act_bits, **prep)

    def _gemm8(self, x):
        return cpu_quant.gemm8(x, self.codes, self.scales, bits=4)

    def take_rows(self, ids: torch.Tensor) -> "Q4Linear":
        """This linear with its output rows in the order ids: each row's codes and scales move whole, so every
        output is the same number in its new place (a partial rotation's head order, Transformer)."""
        return Q4Linear(self.codes[ids], self.scales.index(ids), bias=_cut(self.bias, ids))

    def kernel_parts(self):
        return _biased([cpu_quant.qlin(self.codes, self.scales, 4, act=self.act_bits)], self.bias)

    def _rows_ref(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_quant.q4_dequant_ref(self.codes[ids], self.scales.index(ids))

    def _dequant_rows(self, lo, hi, out=None, dtype=torch.float32):
        if not cpu_quant.available():
            return cpu_quant.q4_dequant_ref(self.codes[lo:hi], self.scales.rows(lo, hi)).to(dtype)
        return cpu_quant.q4_dequant(self.codes[lo:hi], self.scales.rows(lo, hi), out=out, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.bias) + self.scales.nbytes


class MXFP4Linear(_Packed):
    """GGUF MXFP4 (gpt-oss's expert weights) as the file holds it, 4.25 bits a weight: 4-bit codes of the E2M1
    values doubled (cpu_quant.MXFP4_VALUES: 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12), two a byte in the q4 order, and an
    E8M0 exponent e per group of 32; w = value * 2^(e - 128), exactly gguf's. kernels/cpu_mxfp4.h runs it."""
    kind = "mxfp4"
    bits = 4

    def __init__(self, codes: torch.Tensor, e8m0: torch.Tensor, bias: torch.Tensor | None = None):
        # codes: [N, K/2] uint8 (group g, byte j: element j low nibble, j + 16 high); e8m0: [N, K/32] uint8
        n, half = codes.shape
        assert half % 16 == 0 and e8m0.shape == (n, half // 16), (codes.shape, e8m0.shape)
        assert codes.dtype == e8m0.dtype == torch.uint8, (codes.dtype, e8m0.dtype)
        self.codes, self.e8m0 = codes.contiguous(), e8m0.contiguous()
        self.bias = bias
        self.out_features, self.in_features = n, half * 2

    def _gemv(self, x, **prep):
        return cpu_quant.mxfp4_gemv(x, self.codes, self.e8m0, act=self.act_bits, **prep)

    def _dequant_rows(self, lo, hi, out=None, dtype=torch.float32):
        if not cpu_quant.available() or self.codes.device.type != "cpu":
            return cpu_quant.mxfp4_dequant_ref(self.codes[lo:hi], self.e8m0[lo:hi]).to(dtype)
        return cpu_quant.mxfp4_dequant(self.codes[lo:hi], self.e8m0[lo:hi], out=out, dtype=dtype)

    def _rows_ref(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup from the same bits a tied output head reads: [T, K]."""
        return cpu_quant.mxfp4_dequant_ref(self.codes[ids], self.e8m0[ids])

    def take_rows(self, ids: torch.Tensor) -> "MXFP4Linear":
        return MXFP4Linear(self.codes[ids], self.e8m0[ids], _cut(self.bias, ids))

    def expert_view(self, lo: int, hi: int) -> "MXFP4Linear":
        """Rows lo..hi (one expert of a 3-D expert tensor) as views of these arrays: nothing copied."""
        return MXFP4Linear(self.codes[lo:hi], self.e8m0[lo:hi])

    KERNEL_KIND = 8             # KIND_MXFP4 in cpu_quant.c: lin_apply's bits-4 linears of this kind are MXFP4

    def kernel_parts(self):
        """As lin_apply reads it (decode_layers, moe_layer_rows): bits 4 of kind KIND_MXFP4, the exponents as its
        scale."""
        if self.codes.device.type != "cpu":
            return None
        return _biased([cpu_quant.QLin(self.codes.data_ptr(), self.e8m0.data_ptr(), None, None, None, 4,
                                       self.KERNEL_KIND, 1, 32, self.out_features, self.in_features, self.act_bits)],
                       self.bias)

    def _gpu(self, x, norm, eps, swiglu, residual) -> torch.Tensor:
        """The Triton dequantize-and-multiply kernels (triton_matmul.mxfp4_matmul); the rest as _Packed._gpu."""
        from kvchat.kernels.triton_matmul import mxfp4_matmul
        if norm is not None:
            x = rms_norm(x, norm, eps)
        elif swiglu:
            x = gated(x)
        y = mxfp4_matmul(x, self.codes, self.e8m0, self.bias)
        return (y if residual is None else residual.float() + y).to(x.dtype)

    def moved(self, device) -> "MXFP4Linear":
        self.codes, self.e8m0 = self.codes.to(device), self.e8m0.to(device)
        self.bias = None if self.bias is None else self.bias.to(device)
        return self

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.e8m0, self.bias)


class Q8Linear(_Packed):
    kind = "q8"
    bits = 8

    def __init__(self, codes: torch.Tensor, scale, zero: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        # codes: [N, K] int8; scale (and zero): [N, K / G] with G = 16 or 32, or a cpu_quant.Scales
        n, k = codes.shape
        self.scales = _compact(scale, zero)
        self.group = k // self.scales.scale.shape[1]
        assert self.group in (16, 32) and k % 32 == 0, (codes.shape, self.scales.scale.shape)
        self.codes = codes.to(torch.int8).contiguous()
        self.bias = bias
        self.out_features, self.in_features = n, k

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Q8Linear":
        """Symmetric int8 per group of 32."""
        n, k = weight.shape
        w = weight.float().view(n, k // GROUP, GROUP)
        scale = (w.abs().amax(-1) / 127).clamp_min(1e-12)
        q = (w / scale[..., None]).round().clamp(-127, 127).view(n, k)
        return cls(q, scale, None, bias)

    def _gemv(self, x, **prep):
        return cpu_quant.q8_gemv(x, self.codes, self.scales, None, self.group, act=self.act_bits, **prep)

    @property
    def int8_rows(self) -> bool:
        return self.group == 32

    def _gemm8(self, x):
        return cpu_quant.gemm8(x, self.codes, self.scales, bits=8)

    def take_rows(self, ids: torch.Tensor) -> "Q8Linear":
        return Q8Linear(self.codes[ids], self.scales.index(ids), bias=_cut(self.bias, ids))

    def kernel_parts(self):
        return _biased([cpu_quant.qlin(self.codes, self.scales, 8, self.group, act=self.act_bits)], self.bias)

    def _dequant_rows(self, lo, hi, out=None, dtype=torch.float32):
        if not cpu_quant.available():
            return cpu_quant.q8_dequant_ref(self.codes[lo:hi], self.scales.rows(lo, hi), None, self.group).to(dtype)
        return cpu_quant.q8_dequant(self.codes[lo:hi], self.scales.rows(lo, hi), None, self.group, out=out,
                                    dtype=dtype)

    def _rows_ref(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup from the same codes a tied output head reads: [T, K]."""
        return cpu_quant.q8_dequant_ref(self.codes[ids], self.scales.index(ids), None, self.group)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.bias) + self.scales.nbytes


class Q6Linear(_Packed):
    """GGUF Q6_K as the file holds it, 210 bytes per 256 weights: the low 4 bits of the 6-bit codes (codes [N, K/2])
    and their high 2 bits (high [N, K/4]), each byte as the blocks store it (kernels/cpu_q6k.h says where each bit
    is), an int8 scale per 16 weights and a float16 d per 256 (scales: cpu_quant.Scales(sc, scale_sup=d, per=16));
    w = (d * sc) * (q - 32), exactly gguf's values. kernels/cpu_q6k.h runs it, with no int8 copy of the codes."""
    kind = "q6"
    bits = 6
    group = 16
    int8_rows = True

    def __init__(self, codes: torch.Tensor, high: torch.Tensor, scales: cpu_quant.Scales,
                 bias: torch.Tensor | None = None):
        n, half = codes.shape
        assert half % 128 == 0 and high.shape == (n, half // 2) and scales.per == 16, (codes.shape, high.shape)
        assert scales.scale.shape == (n, half // 8) and scales.scale_sup.shape == (n, half // 128)
        self.codes, self.high, self.scales = codes.contiguous(), high.contiguous(), scales
        self.bias = bias
        self.out_features, self.in_features = n, half * 2

    def _gemv(self, x, **prep):
        return cpu_quant.q6k_gemv(x, self.codes, self.high, self.scales, act=self.act_bits, **prep)

    def _gemm8(self, x):
        return cpu_quant.gemm8_q6k(x, self.codes, self.high, self.scales)

    def take_rows(self, ids: torch.Tensor) -> "Q6Linear":
        return Q6Linear(self.codes[ids], self.high[ids], self.scales.index(ids), _cut(self.bias, ids))

    def kernel_parts(self):
        return _biased([cpu_quant.qlin(self.codes, self.scales, 6, 16, act=self.act_bits, high=self.high)], self.bias)

    def _dequant_rows(self, lo, hi, out=None, dtype=torch.float32):
        if not cpu_quant.available() or self.codes.device.type != "cpu":
            w = cpu_quant.q6k_dequant_ref(self.codes[lo:hi], self.high[lo:hi], self.scales.rows(lo, hi))
            return w.to(dtype)
        return cpu_quant.q6k_dequant(self.codes[lo:hi], self.high[lo:hi], self.scales.rows(lo, hi), out=out,
                                     dtype=dtype)

    def _rows_ref(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup from the same bits a tied output head reads: [T, K]."""
        return cpu_quant.q6k_dequant_ref(self.codes[ids], self.high[ids], self.scales.index(ids))

    def expert_view(self, lo: int, hi: int) -> "Q6Linear":
        """Rows lo..hi (one expert of a 3-D expert tensor) as views of these arrays: nothing copied."""
        return Q6Linear(self.codes[lo:hi], self.high[lo:hi], self.scales.rows(lo, hi))

    def _gpu(self, x, norm, eps, swiglu, residual) -> torch.Tensor:
        return _slabs_gpu(self, x, norm, eps, swiglu, residual)

    def widened(self) -> Q8Linear:
        """The same weights as int8 codes q - 32 beside the same scales (8.6 bits a weight): the grid the Triton
        kernels read, as every Q6_K tensor was held before it kept its own bits."""
        codes = (cpu_quant.q6k_codes_ref(self.codes, self.high).to(torch.int16) - 32).to(torch.int8)
        s = self.scales
        return Q8Linear(codes, cpu_quant.Scales(s.scale, scale_sup=s.scale_sup.float(), per=16), self.bias)

    def moved(self, device) -> "_Packed":
        return _moved_own_bits(self, device)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.high, self.bias) + self.scales.nbytes


def _moved_own_bits(lin, device) -> _Packed:
    """A kind with a plane of high bits (Q5Linear, Q6Linear) on `device`: on the GPU path its widened int8 form (no
    Triton kernel reads those bits yet; _slabs_gpu would dequantize the whole matrix every step), elsewhere its
    arrays moved."""
    if kernels.gpu_path(device):
        return lin.widened().moved(device)
    lin.codes, lin.high = lin.codes.to(device), lin.high.to(device)
    lin.scales = lin.scales.to(device)
    lin.bias = None if lin.bias is None else lin.bias.to(device)
    return lin


def _slabs_gpu(lin: _Packed, x, norm, eps, swiglu, residual) -> torch.Tensor:
    """GPU tensors reach a kind the Triton kernels do not read (Q5Linear, Q6Linear) only where it was not moved()
    there (moved() widens it): slabs of rows dequantized through torch and multiplied, no dense copy kept."""
    if norm is not None:
        x = rms_norm(x, norm, eps)
    elif swiglu:
        x = gated(x)
    xf = x.float()
    K = lin.in_features
    y = torch.empty(x.shape[0], lin.out_features, device=x.device)
    step = min(lin.out_features, max(16, SLAB_BYTES // (4 * K)))
    for lo in range(0, lin.out_features, step):
        hi = min(lin.out_features, lo + step)
        y[:, lo:hi] = xf @ lin._dequant_rows(lo, hi).t()
    if lin.bias is not None:
        y += lin.bias.float()
    return (y if residual is None else residual.float() + y).to(x.dtype)


class Q5Linear(_Packed):
    """GGUF Q5_0, Q5_1 and Q5_K at their own 5.5 bits a weight: Q4Linear's codes (the low 4 bits, [N, K/2]) and
    high [N, K/8] uint8, per group of 32 a little-endian uint32 whose bit j is element j's fifth bit
    (engine/gguf/blocks.py: q5_blocks); w = q * scale + zero, q in 0..31, the scales as Q4Linear's (Q5_0's zero
    -16 * scale left implicit, Q5_K's two-level). The q4 kernels run it, reading the plane beside the nibbles."""
    kind = "q5"
    bits = 5

    def __init__(self, codes: torch.Tensor, high: torch.Tensor, scales, bias: torch.Tensor | None = None):
        n, half = codes.shape
        self.scales = _compact(scales, None).implicit_zero(16)      # Q5_0: no zeros stored
        assert half % 16 == 0 and high.shape == (n, half // 4) and high.dtype == torch.uint8, (codes.shape, high.shape)
        assert self.scales.scale.shape[0] == n and self.scales.groups == half // 16
        assert self.scales.zero is not None or self.scales.offset8
        self.codes, self.high = codes.contiguous(), high.contiguous()
        self.bias = bias
        self.out_features, self.in_features = n, half * 2

    int8_rows = True

    def _gemv(self, x, **prep):
        return cpu_quant.q4_gemv(x, self.codes, self.scales, act=self.act_bits, high=self.high, **prep)

    def _gemm8(self, x):
        return cpu_quant.gemm8(x, self.codes, self.scales, bits=4, high=self.high)

    def take_rows(self, ids: torch.Tensor) -> "Q5Linear":
        return Q5Linear(self.codes[ids], self.high[ids], self.scales.index(ids), _cut(self.bias, ids))

    def kernel_parts(self):
        return _biased([cpu_quant.qlin(self.codes, self.scales, 4, act=self.act_bits, high=self.high)], self.bias)

    def _rows_ref(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_quant.q4_dequant_ref(self.codes[ids], self.scales.index(ids), high=self.high[ids])

    def _dequant_rows(self, lo, hi, out=None, dtype=torch.float32):
        if not cpu_quant.available() or self.codes.device.type != "cpu":
            return cpu_quant.q4_dequant_ref(self.codes[lo:hi], self.scales.rows(lo, hi), high=self.high[lo:hi]).to(dtype)
        return cpu_quant.q4_dequant(self.codes[lo:hi], self.scales.rows(lo, hi), out=out, dtype=dtype,
                                    high=self.high[lo:hi])

    def expert_view(self, lo: int, hi: int) -> "Q5Linear":
        """Rows lo..hi (one expert of a 3-D expert tensor) as views of these arrays: nothing copied."""
        return Q5Linear(self.codes[lo:hi], self.high[lo:hi], self.scales.rows(lo, hi))

    def _gpu(self, x, norm, eps, swiglu, residual) -> torch.Tensor:
        return _slabs_gpu(self, x, norm, eps, swiglu, residual)

    def widened(self) -> Q8Linear:
        """The same weights as int8 codes beside the same scales, the grid the Triton kernels read (and every
        5-bit tensor's before it kept its own bits): Q5_0 as q - 16 with no zero, the others as q."""
        n, half = self.codes.shape
        b = self.codes.view(n, half // 16, 16)
        q = torch.cat((b & 15, b >> 4), -1).view(n, half * 2).to(torch.int16)
        word = self.high.view(n, half // 16, 4).to(torch.int32)
        word = word[..., 0] | word[..., 1] << 8 | word[..., 2] << 16 | word[..., 3] << 24
        q = q | ((((word[..., None] >> torch.arange(32)) & 1) << 4).view(n, half * 2)).to(torch.int16)
        s = self.scales.unpacked()
        if s.offset8:
            return Q8Linear((q - 16).to(torch.int8), cpu_quant.Scales(s.scale), self.bias)
        return Q8Linear(q.to(torch.int8), s, self.bias)

    def moved(self, device) -> "_Packed":
        return _moved_own_bits(self, device)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.high, self.bias) + self.scales.nbytes


class ConcatLinear(_Fused):
    """Several linears of one input side by side (q|k|v of mixed GGUF types): outputs concatenated."""

    def __init__(self, parts: list, bias: torch.Tensor | None = None):
        self.parts, self.bias = parts, bias
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.kind = "+".join(sorted({p.kind for p in parts}))

    def __call__(self, x: torch.Tensor, split: int | None = None) -> torch.Tensor:
        y = torch.cat([p(x, split=split) for p in self.parts], -1)
        return y + self.bias if self.bias is not None else y

    def fused(self, x, norm=None, eps=0.0, swiglu=False, residual=None, split=None, act="silu"):
        if not all(isinstance(p, _Packed) for p in self.parts):
            return super().fused(x, norm, eps, swiglu, residual, split, act)
        # packed parts each take the norm / SwiGLU themselves (inside the kernel for decode rows), then the bias,
        # then the residual, as decode_layers does: the two paths give the same bits
        y = torch.cat([p.fused(x, norm=norm, eps=eps, swiglu=swiglu, split=split, act=act) for p in self.parts], -1)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y

    def kernel_parts(self):
        parts = [p.kernel_parts() for p in self.parts]
        if len(parts) > 3 or any(p is None for p in parts):
            return None
        flat = [q for p in parts for q in p]
        if self.bias is not None and any(q.bias for q in flat):        # a part's own bias and the whole's: not read
            return None
        return _biased(flat, self.bias)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts], 0)

    def take_rows(self, ids: torch.Tensor) -> "ConcatLinear":
        """Each part's rows reordered within the part (ids may not move a row across parts: a ValueError)."""
        parts, lo = [], 0
        for p in self.parts:
            hi = lo + p.out_features
            local = ids[lo:hi] - lo
            if local.numel() != hi - lo or bool(((local < 0) | (local >= hi - lo)).any()):
                raise ValueError("take_rows would move rows between the parts of a concatenation")
            parts.append(p.take_rows(local))
            lo = hi
        return ConcatLinear(parts, _cut(self.bias, ids))

    def moved(self, device) -> "ConcatLinear":
        self.parts = [p.moved(device) for p in self.parts]
        self.bias = None if self.bias is None else self.bias.to(device)
        return self

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts) + _nbytes(self.bias)


def cat_bias(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(b is None for b in biases) else torch.cat(biases)


def quantize_float(weight: torch.Tensor, bias: torch.Tensor | None, kind: str):
    """Opt-in weight quantization of a float tensor on load (weights="int8" / "int4"), groups of 32."""
    n, k = weight.shape
    if k % GROUP:
        return DenseLinear(weight.float(), bias)
    return Q4Linear.from_float(weight, bias) if kind == "int4" else Q8Linear.from_float(weight, bias)
