"""Triton decode attention over paged keys and values: one new query token per sequence, any number of sequences.

The pages are one flat [R, Hkv, D] tensor per layer (Component.flat_pages: block b's slot i is row b * bs + i);
each sequence reads its own list of rows (`rows[offsets[b]:offsets[b + 1]]`, sinks first, the new token last,
already written). Keys are read in one of three ways:
- stored rotated (full-precision pages): as they are;
- the same, with the first n_sink rows of a sequence turned by that sequence's delta (its sinks, seen from the
  query at its in-cache position: step_plan.SeqStep.delta_cos);
- stored before RoPE (the quantized layouts, dequantized into a scratch by the caller): each row turned by its own
  cos/sin at its effective position, in the kernel.
Scores are q . k times the layer's scale, then soft-capped (Gemma 2) or not. Queries come rotated.

Split-K (flash-decoding): the grid is (sequence, KV head, split); one program reads a slice of a sequence's rows for
every query head of its KV head (GQA: the G heads share each K and V load), keeps an online softmax (max, sum,
weighted values) and writes it out; torch merges the slices. On a GPU the splits are chosen so that one long
sequence still fills the chip; under triton's interpreter there is one split per sequence.
Heads are handled as two halves ([.., D/2] each) because rotate-half RoPE mixes channel i with i + D/2.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_ROT_NONE, _ROT_SINKS, _ROT_KEYS = 0, 1, 2
GPU_TILES = {"_decode_kernel": {"BLOCK_N": 32}}     # on a GPU (the interpreter takes 64 rows a tile)
_NEG = tl.constexpr(-1.0e30)          # a global a jitted function reads must be a constexpr


@triton.jit
def _turn(x1, x2, c1, c2, s1, s2):
    # rotate-half RoPE on the two halves: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, offs_ptr, nsink_ptr, rc_ptr, rs_ptr, m_ptr, l_ptr, acc_ptr,
                   stride_kr, stride_kh, stride_vr, stride_vh, scale, softcap, SPLIT_LEN, SPLITS,
                   HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DH: tl.constexpr,
                   DH_PAD: tl.constexpr, BLOCK_N: tl.constexpr, ROT: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(offs_ptr + b)
    end = tl.load(offs_ptr + b + 1)
    lo = start + s * SPLIT_LEN
    hi = tl.minimum(end, lo + SPLIT_LEN)
    g_idx = tl.arange(0, G_PAD)
    d_idx = tl.arange(0, DH_PAD)
    g_mask = g_idx < G
    d_mask = d_idx < DH
    qd_mask = g_mask[:, None] & d_mask[None, :]
    heads = h * G + g_idx
    q_at = q_ptr + (b * HQ + heads)[:, None] * D + d_idx[None, :]
    q1 = tl.load(q_at, mask=qd_mask, other=0).to(tl.float32)
    q2 = tl.load(q_at + DH, mask=qd_mask, other=0).to(tl.float32)
    m = tl.full([G_PAD], _NEG, dtype=tl.float32)
    l = tl.zeros([G_PAD], dtype=tl.float32)
    acc1 = tl.zeros([G_PAD, DH_PAD], dtype=tl.float32)
    acc2 = tl.zeros([G_PAD, DH_PAD], dtype=tl.float32)
    if ROT == 1:
        n_sink = tl.load(nsink_ptr + b)
        c1 = tl.load(rc_ptr + b * D + d_idx, mask=d_mask, other=1)
        c2 = tl.load(rc_ptr + b * D + DH + d_idx, mask=d_mask, other=1)
        s1 = tl.load(rs_ptr + b * D + d_idx, mask=d_mask, other=0)
        s2 = tl.load(rs_ptr + b * D + DH + d_idx, mask=d_mask, other=0)
    for it in range(0, SPLIT_LEN, BLOCK_N):
        j = lo + it + tl.arange(0, BLOCK_N)
        j_mask = j < hi
        kd_mask = j_mask[:, None] & d_mask[None, :]
        r = tl.load(rows_ptr + j, mask=j_mask, other=0).to(tl.int64)
        k_at = k_ptr + r[:, None] * stride_kr + h * stride_kh + d_idx[None, :]
        k1 = tl.load(k_at, mask=kd_mask, other=0).to(tl.float32)
        k2 = tl.load(k_at + DH, mask=kd_mask, other=0).to(tl.float32)
        if ROT == 1:
            sink = ((j - start) < n_sink)[:, None]
            k1, k2 = _turn(k1, k2, tl.where(sink, c1[None, :], 1.0), tl.where(sink, c2[None, :], 1.0),
                           tl.where(sink, s1[None, :], 0.0), tl.where(sink, s2[None, :], 0.0))
        elif ROT == 2:
            t_at = j[:, None].to(tl.int64) * D + d_idx[None, :]
            k1, k2 = _turn(k1, k2, tl.load(rc_ptr + t_at, mask=kd_mask, other=1),
                           tl.load(rc_ptr + t_at + DH, mask=kd_mask, other=1),
                           tl.load(rs_ptr + t_at, mask=kd_mask, other=0), tl.load(rs_ptr + t_at + DH, mask=kd_mask,
                                                                                    other=0))
        sc = (tl.sum(q1[:, None, :] * k1[None, :, :], axis=2) + tl.sum(q2[:, None, :] * k2[None, :, :], axis=2)) * scale
        if SOFTCAP:
            # cap * tanh(sc / cap), tanh from exp (exact at both ends: exp overflows to inf, or goes to 0)
            sc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * sc / softcap) + 1.0))
        sc = tl.where(j_mask[None, :], sc, _NEG)
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.where(j_mask[None, :], tl.exp(sc - m_new[:, None]), 0.0)
        l = l * alpha + tl.sum(p, axis=1)
        v_at = v_ptr + r[:, None] * stride_vr + h * stride_vh + d_idx[None, :]
        v1 = tl.load(v_at, mask=kd_mask, other=0).to(tl.float32)
        v2 = tl.load(v_at + DH, mask=kd_mask, other=0).to(tl.float32)
        acc1 = acc1 * alpha[:, None] + tl.sum(p[:, :, None] * v1[None, :, :], axis=1)
        acc2 = acc2 * alpha[:, None] + tl.sum(p[:, :, None] * v2[None, :, :], axis=1)
        m = m_new
    part = (b * HQ + heads) * SPLITS + s
    tl.store(m_ptr + part, m, mask=g_mask)
    tl.store(l_ptr + part, l, mask=g_mask)
    a_at = acc_ptr + part[:, None] * D + d_idx[None, :]
    tl.store(a_at, acc1, mask=qd_mask)
    tl.store(a_at + DH, acc2, mask=qd_mask)


def _splits(lengths: list[int], kv_heads: int, device, block_n: int) -> int:
    longest = max(lengths)
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.device(device).type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(4 * sms, len(lengths) * kv_heads)          # programs enough to fill the chip
    return max(1, min(want, triton.cdiv(longest, 4 * block_n)))   # each split at least a few tiles


def decode_attention(q_rot: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, rows: torch.Tensor,
                     offsets: torch.Tensor, lengths: list[int], scale: float, softcap: float | None = None,
                     n_sink: torch.Tensor | None = None, delta_cos: torch.Tensor | None = None,
                     delta_sin: torch.Tensor | None = None, key_cos: torch.Tensor | None = None,
                     key_sin: torch.Tensor | None = None) -> torch.Tensor:
    """q_rot [B, Hq, D] (rotated); k_pages, v_pages [R, Hkv, D] (any float dtype, last dim contiguous); rows the
    page rows of every sequence one after another, offsets [B + 1] where each starts, lengths their B sizes (ints,
    so the grid needs no copy from the device). Sinks: n_sink [B] int32 and delta_cos/sin [B, D]; or keys stored
    before RoPE: key_cos/sin [len(rows), D] per row. -> float32 [B, Hq, D]."""
    B, HQ, D = q_rot.shape
    HKV = k_pages.shape[1]
    assert D % 2 == 0 and HQ % HKV == 0 and k_pages.stride(2) == 1 and v_pages.stride(2) == 1
    assert len(lengths) == B and min(lengths) > 0
    dev = q_rot.device
    G = HQ // HKV
    block_n = GPU_TILES["_decode_kernel"]["BLOCK_N"] if os.environ.get("TRITON_INTERPRET") != "1" else 64
    splits = _splits(lengths, HKV, dev, block_n)
    split_len = triton.cdiv(triton.cdiv(max(lengths), splits), block_n) * block_n
    if key_cos is not None:
        rot, rc, rs = _ROT_KEYS, key_cos.float().contiguous(), key_sin.float().contiguous()
        assert rc.shape == (rows.shape[0], D)
    elif n_sink is not None and bool((n_sink > 0).any()):
        rot, rc, rs = _ROT_SINKS, delta_cos.float().contiguous(), delta_sin.float().contiguous()
        assert rc.shape == (B, D)
    else:
        rot, rc, rs = _ROT_NONE, q_rot, q_rot                      # unused
    sinks = (n_sink if n_sink is not None else torch.zeros(B, dtype=torch.int32)).to(dev, torch.int32)
    q = q_rot.float().contiguous()
    m = torch.empty(B, HQ, splits, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(B, HQ, splits, D, dtype=torch.float32, device=dev)
    _decode_kernel[(B, HKV, splits)](
        q, k_pages, v_pages, rows.to(dev, torch.int64).contiguous(), offsets.to(dev, torch.int64).contiguous(), sinks,
        rc, rs, m, l, acc, k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1), float(scale),
        float(softcap or 1.0), split_len, splits, HQ=HQ, G=G, G_PAD=max(2, triton.next_power_of_2(G)), D=D, DH=D // 2,
        DH_PAD=triton.next_power_of_2(D // 2), BLOCK_N=block_n, ROT=rot, SOFTCAP=softcap is not None, num_warps=4)
    if splits == 1:
        return acc[:, :, 0] / l
    top = m.max(-1, keepdim=True).values
    w = torch.exp(m - top)
    return (acc * w[..., None]).sum(2) / (l * w).sum(-1, keepdim=True)


def decode_attention_ref(q_rot, k_pages, v_pages, rows, offsets, lengths, scale, softcap=None, n_sink=None,
                         delta_cos=None, delta_sin=None, key_cos=None, key_sin=None) -> torch.Tensor:
    """decode_attention in torch, one sequence at a time (gather, turn, softmax)."""
    from engine.model.rope import rotate
    outs = []
    HKV = k_pages.shape[1]
    for b, n in enumerate(lengths):
        lo = int(offsets[b])
        r = rows[lo:lo + n].to(k_pages.device)
        k = k_pages.index_select(0, r).float()
        v = v_pages.index_select(0, r).float()
        if key_cos is not None:
            k = rotate(k, key_cos[lo:lo + n].float(), key_sin[lo:lo + n].float())
        elif n_sink is not None and int(n_sink[b]):
            ns = int(n_sink[b])
            k[:ns] = rotate(k[:ns], delta_cos[b:b + 1].float(), delta_sin[b:b + 1].float())
        q = q_rot[b].float().view(HKV, -1, q_rot.shape[-1])                    # [Hkv, G, D]
        sc = torch.einsum("hgd,nhd->hgn", q, k) * scale
        if softcap is not None:
            sc = torch.tanh(sc / softcap) * softcap
        outs.append(torch.einsum("hgn,nhd->hgd", sc.softmax(-1), v).reshape(1, -1, q_rot.shape[-1]))
    return torch.cat(outs)


def bench_decode_full(device, tokens: int, kv_heads: int, heads: int, head_dim: int, runs: int, sync) -> float:
    """Median seconds of one decode attention over `tokens` rows of bf16 K and V pages (one sequence, its rows in
    16-row blocks in a shuffled order, as a long conversation's block table holds them)."""
    g = torch.Generator().manual_seed(0)
    bs = 16
    n_blocks = triton.cdiv(tokens, bs)
    k = torch.randn(n_blocks * bs, kv_heads, head_dim, generator=g).to(device, torch.bfloat16)
    v = torch.randn(n_blocks * bs, kv_heads, head_dim, generator=g).to(device, torch.bfloat16)
    order = torch.randperm(n_blocks, generator=g)
    rows = (order[:, None] * bs + torch.arange(bs)).reshape(-1)[:tokens].to(device)
    offsets = torch.tensor([0, tokens], device=device)
    q = torch.randn(1, heads, head_dim, generator=g).to(device)
    scale = head_dim ** -0.5
    decode_attention(q, k, v, rows, offsets, [tokens], scale)        # compile
    import time
    times = []
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        decode_attention(q, k, v, rows, offsets, [tokens], scale)
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
