"""Triton dequantize-and-multiply: y = x @ W^T with W kept packed (the GPU twin of the C GEMV/GEMM in cpu_quant).

The packed forms are the CPU's (engine/model/linears.py, cpu_quant.Scales):
- 4-bit codes [N, K/2] uint8, groups of 32 along K: byte j of a group holds element j in its low nibble and
  element j + 16 in its high one; w = q * scale + zero, or w = scale * (q - 8) (offset8, GGUF Q4_0);
- int8 codes [N, K] in groups of 16 or 32, w = q * scale (+ zero);
- scales (and zeros) float32 / float16 per group, or uint8 / int8 codes times a float32 super-scale per `per`
  groups (the K-quants' two levels, as the file stores them);
- MXFP4 (mxfp4_matmul): 4-bit codes in the same nibble order, each an E2M1 value doubled
  (cpu_quant.MXFP4_VALUES), and a uint8 E8M0 exponent e per group of 32: w = value * 2^(e - 128), gguf's.
Every weight element is dequantized in registers from those bytes, tile by tile; no dense copy of a weight
exists, in VRAM or anywhere else.

Two kernels. Decode rows (T <= DECODE_ROWS, a GEMV-like shape): each program owns BLOCK_N outputs of every row
and a slice of K (split-K, so a 576-wide layer still fills a GPU), multiplies by broadcast and sum (tensor cores
need 16 rows), and the slices are summed in torch; the slicing depends on the weight's shape only, so a row's
result does not depend on how many rows came with it. Prompt rows: [BLOCK_M, BLOCK_N] tiles, each K tile of the
weight dequantized and fed to tl.dot, which runs on the tensor cores (TF32 on CUDA, about 3 decimal digits per
product; KVCHAT_MATMUL_IEEE=1 asks for float32 FMAs instead, which the end-to-end check on a GPU uses; under
triton's interpreter always float32).

Why not torch's int4 weight-only matmul (`torch._weight_int4pack_mm`): it wants its own tiled repacking of the
codes, bf16 scales-and-zeros in groups it chooses, and knows neither offset8 nor the K-quants' two-level scales
nor int8 groups of 16; repacking GGUF's codes for it would round the scales the file stores.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import cpu_quant, sm_count

DECODE_ROWS = 8          # up to this many rows take the split-K GEMV kernel
# the tiles on a GPU (the interpreter takes larger ones: _decode_blocks, packed_matmul)
GPU_TILES = {"_gemv_kernel": {"BLOCK_N": 16, "BLOCK_K": 128},
             "_gemm_kernel": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "PRECISION": "tf32"}}
_ZERO_NONE, _ZERO_PLAIN, _ZERO_SUP, _ZERO_OFFSET8 = 0, 1, 2, 3


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _mxfp4_tile(codes_ptr, e8m0_ptr, n2, k2, mask, K, G):
    # n2 [BN, 1] output rows, k2 [1, BK] input columns -> the MXFP4 weights [BN, BK] (0 outside the mask): the
    # code's E2M1 value doubled (magnitudes 0, 1, 2, 3, 4, 6, 8, 12 for c & 7; c >= 8 negative), times 2^(e - 128)
    # built from the float's bits as gguf builds it (a subnormal for e < 2)
    byte = tl.load(codes_ptr + n2 * (K // 2) + (k2 // 32) * 16 + (k2 % 16), mask=mask, other=0).to(tl.int32)
    c = (byte >> (((k2 % 32) // 16) * 4)) & 15
    m = c & 7
    mag = tl.where(m < 4, m, tl.where(m < 6, 2 * m - 4, 4 * m - 16))
    q = tl.where(c >= 8, -mag, mag).to(tl.float32)
    e = tl.load(e8m0_ptr + n2 * G + k2 // 32, mask=mask, other=0).to(tl.int32)
    bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)
    return bits.to(tl.float32, bitcast=True) * q


@triton.jit
def _weight_tile(codes_ptr, scale_ptr, zero_ptr, ssup_ptr, zsup_ptr, n_idx, k_idx, n_mask, k_mask, K, G, GS,
                 BITS: tl.constexpr, GROUP: tl.constexpr, PER: tl.constexpr, SCALE_SUP: tl.constexpr,
                 ZERO: tl.constexpr):
    # n_idx [BN] output rows, k_idx [BK] input columns -> the float32 weights [BN, BK] (0 outside the masks)
    mask = n_mask[:, None] & k_mask[None, :]
    n2 = n_idx[:, None].to(tl.int64)
    k2 = k_idx[None, :]
    if BITS == 4:
        byte = tl.load(codes_ptr + n2 * (K // 2) + (k2 // 32) * 16 + (k2 % 16), mask=mask, other=0).to(tl.int32)
        q = ((byte >> (((k2 % 32) // 16) * 4)) & 15).to(tl.float32)
    else:
        q = tl.load(codes_ptr + n2 * K + k2, mask=mask, other=0).to(tl.float32)
    g = k2 // GROUP
    s = tl.load(scale_ptr + n2 * G + g, mask=mask, other=0).to(tl.float32)
    if SCALE_SUP:
        s = tl.load(ssup_ptr + n2 * GS + g // PER, mask=mask, other=0) * s
    w = q * s
    if ZERO == 1:
        w = w + tl.load(zero_ptr + n2 * G + g, mask=mask, other=0).to(tl.float32)
    elif ZERO == 2:
        w = w + tl.load(zsup_ptr + n2 * GS + g // PER, mask=mask, other=0) \
            * tl.load(zero_ptr + n2 * G + g, mask=mask, other=0).to(tl.float32)
    elif ZERO == 3:
        w = w + s * -8.0
    return w


@triton.jit
def _gemv_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, ssup_ptr, zsup_ptr, y_ptr, M, N, K, G, GS, K_SPLIT,
                 BITS: tl.constexpr, GROUP: tl.constexpr, PER: tl.constexpr, SCALE_SUP: tl.constexpr,
                 ZERO: tl.constexpr, FP4: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_idx < N
    m_idx = tl.arange(0, M_PAD)
    m_mask = m_idx < M
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    k_lo = pid_s * K_SPLIT
    for k0 in range(0, K_SPLIT, BLOCK_K):
        k_idx = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_mask = k_idx < K
        x = tl.load(x_ptr + m_idx[:, None] * K + k_idx[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
        if FP4:         # MXFP4: scale_ptr holds the e8m0 exponents
            w = _mxfp4_tile(codes_ptr, scale_ptr, n_idx[:, None].to(tl.int64), k_idx[None, :],
                            n_mask[:, None] & k_mask[None, :], K, G)
        else:
            w = _weight_tile(codes_ptr, scale_ptr, zero_ptr, ssup_ptr, zsup_ptr, n_idx, k_idx, n_mask, k_mask, K, G,
                             GS, BITS, GROUP, PER, SCALE_SUP, ZERO)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = y_ptr + pid_s * M * N + m_idx[:, None] * N + n_idx[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemm_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, ssup_ptr, zsup_ptr, y_ptr, M, N, K, G, GS,
                 BITS: tl.constexpr, GROUP: tl.constexpr, PER: tl.constexpr, SCALE_SUP: tl.constexpr,
                 ZERO: tl.constexpr, FP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m_idx < M
    n_mask = n_idx < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_idx < K
        x = tl.load(x_ptr + m_idx[:, None].to(tl.int64) * K + k_idx[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0)
        if FP4:         # MXFP4: scale_ptr holds the e8m0 exponents
            w = _mxfp4_tile(codes_ptr, scale_ptr, n_idx[:, None].to(tl.int64), k_idx[None, :],
                            n_mask[:, None] & k_mask[None, :], K, G)
        else:
            w = _weight_tile(codes_ptr, scale_ptr, zero_ptr, ssup_ptr, zsup_ptr, n_idx, k_idx, n_mask, k_mask, K, G,
                             GS, BITS, GROUP, PER, SCALE_SUP, ZERO)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    out = y_ptr + m_idx[:, None].to(tl.int64) * N + n_idx[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


def _scale_args(scales: cpu_quant.Scales) -> tuple:
    """The kernels' scale pointers and flags: (scale, zero, scale_sup, zero_sup, G, GS, per, SCALE_SUP, ZERO)."""
    s = scales
    two_level = s.scale_sup is not None
    if s.offset8:
        zero_kind = _ZERO_OFFSET8
    elif s.zero is None:
        zero_kind = _ZERO_NONE
    elif s.zero_sup is not None:
        zero_kind = _ZERO_SUP
    else:
        zero_kind = _ZERO_PLAIN
    G = s.scale.shape[1]
    sup = s.scale_sup if two_level else s.scale
    GS = sup.shape[1]
    return (s.scale.contiguous(), (s.zero if s.zero is not None else s.scale).contiguous(), sup.contiguous(),
            (s.zero_sup if s.zero_sup is not None else sup).contiguous(), G, GS, s.per, two_level, zero_kind)


def _decode_blocks(N: int, K: int, device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, K per split) of the GEMV kernel: a function of the weight's shape and device only."""
    if _interpreting():
        # few, large programs: the interpreter runs them one by one, at a cost per operation, not per element
        block_n, block_k = min(1024, triton.next_power_of_2(N)), min(256, triton.next_power_of_2(K))
        return block_n, block_k, triton.cdiv(K, block_k) * block_k
    block_n, block_k = GPU_TILES["_gemv_kernel"]["BLOCK_N"], GPU_TILES["_gemv_kernel"]["BLOCK_K"]
    tiles = triton.cdiv(K, block_k)
    sms = sm_count(torch.device(device).index or 0) if torch.device(device).type == "cuda" else 1
    split = max(1, min(tiles, (4 * sms) // triton.cdiv(N, block_n)))
    return block_n, block_k, triton.cdiv(tiles, split) * block_k


def packed_matmul(x: torch.Tensor, codes: torch.Tensor, scales: cpu_quant.Scales, bits: int, group: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (any float dtype) times the packed weight [N, K] transposed -> float32 [T, N] (+ bias)."""
    assert bits in (4, 8) and x.dim() == 2
    T, K = x.shape
    N = codes.shape[0]
    assert codes.shape[1] * (2 if bits == 4 else 1) == K, (codes.shape, x.shape)
    if bits == 4:
        assert group == 32
    x = x.float().contiguous()
    sc, zero, ssup, zsup, G, GS, per, two_level, zero_kind = _scale_args(scales)
    assert G * group == K, (G, group, K)
    y = _matmul(x, codes, sc, zero, ssup, zsup, G, GS, bits, group, per, two_level, zero_kind, False)
    return y if bias is None else y + bias.float()


def mxfp4_matmul(x: torch.Tensor, codes: torch.Tensor, e8m0: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (any float dtype) times the MXFP4 weight [N, K] (codes [N, K/2] uint8, e8m0 [N, K/32] uint8)
    transposed -> float32 [T, N] (+ bias); the same two kernels as packed_matmul, the weights read as MXFP4."""
    assert x.dim() == 2 and codes.dtype == e8m0.dtype == torch.uint8
    T, K = x.shape
    N = codes.shape[0]
    assert codes.shape[1] * 2 == K and e8m0.shape == (N, K // 32), (codes.shape, e8m0.shape, x.shape)
    x, codes, e8m0 = x.float().contiguous(), codes.contiguous(), e8m0.contiguous()
    y = _matmul(x, codes, e8m0, e8m0, e8m0, e8m0, K // 32, K // 32, 4, 32, 1, False, _ZERO_NONE, True)
    return y if bias is None else y + bias.float()


def _matmul(x, codes, sc, zero, ssup, zsup, G, GS, bits, group, per, two_level, zero_kind, fp4) -> torch.Tensor:
    """x [T, K] float32 contiguous times the packed weight: the GEMV-like kernel for decode rows, else the tiled
    one -> float32 [T, N]."""
    T, K = x.shape
    N = codes.shape[0]
    if T == 0:
        y = x.new_zeros(0, N)
    elif T <= DECODE_ROWS:
        block_n, block_k, k_split = _decode_blocks(N, K, x.device)
        splits = triton.cdiv(K, k_split)
        part = torch.empty(splits, T, N, dtype=torch.float32, device=x.device)
        _gemv_kernel[(triton.cdiv(N, block_n), splits)](
            x, codes, sc, zero, ssup, zsup, part, T, N, K, G, GS, k_split, BITS=bits, GROUP=group, PER=per,
            SCALE_SUP=two_level, ZERO=zero_kind, FP4=fp4, M_PAD=max(2, triton.next_power_of_2(T)), BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=4)
        y = part[0] if splits == 1 else part.sum(0)
    else:
        y = torch.empty(T, N, dtype=torch.float32, device=x.device)
        tiles = GPU_TILES["_gemm_kernel"]
        bm, bn, bk = (64, 256, 128) if _interpreting() else (tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"])
        _gemm_kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn))](
            x, codes, sc, zero, ssup, zsup, y, T, N, K, G, GS, BITS=bits, GROUP=group, PER=per,
            SCALE_SUP=two_level, ZERO=zero_kind, FP4=fp4, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            PRECISION="ieee" if _interpreting() or os.environ.get("KVCHAT_MATMUL_IEEE") == "1" else tiles["PRECISION"],
            num_warps=4)
    return y


def packed_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scales: cpu_quant.Scales, bits: int, group: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """packed_matmul in torch: dequantize the whole weight (cpu_quant's references), then one matmul."""
    if bits == 4:
        w = cpu_quant.q4_dequant_ref(codes, scales)
    else:
        w = cpu_quant.q8_dequant_ref(codes, scales, None, group)
    y = x.float() @ w.t()
    return y if bias is None else y + bias.float()


def mxfp4_matmul_ref(x: torch.Tensor, codes: torch.Tensor, e8m0: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """mxfp4_matmul in torch: the whole weight dequantized (cpu_quant.mxfp4_dequant_ref), then one matmul."""
    y = x.float() @ cpu_quant.mxfp4_dequant_ref(codes, e8m0).t()
    return y if bias is None else y + bias.float()
