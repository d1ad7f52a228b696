"""Triton decode attention over paged keys and values: one new query token per sequence, any number of sequences.

The pages are one flat [R, Hkv, D] tensor per layer (Component.flat_pages: block b's slot i is row b * bs + i);
each sequence reads its own list of rows (`rows[offsets[b]:offsets[b + 1]]`, sinks first, the new token last,
already written). Keys are read in one of three ways:
- stored rotated (full-precision pages): as they are;
- the same, with the first n_sink rows of a sequence turned by that sequence's delta (its sinks, seen from the
  query at its in-cache position: step_plan.SeqStep.delta_cos);
- stored before RoPE (the quantized layouts): each row turned by its own cos/sin at its effective position.
Pages are full precision (any float dtype) or quantized (QuantPages: int8, fp8 read from its bytes, int4; scales
per channel of a block, per token or per group, zero points where asymmetric), dequantized as they are loaded.
Scores are q . k times the layer's scale, then soft-capped (Gemma 2) or not. Queries come rotated.

Split-K (flash-decoding): the grid is (sequence, KV head, split); one program reads a slice of a sequence's rows for
every query head of its KV head (GQA: the G heads share each K and V load), keeps an online softmax (max, sum,
weighted values) and writes it out; torch merges the slices. On a GPU the splits are chosen so that one long
sequence still fills the chip; under triton's interpreter there is one split per sequence.
Heads are handled as two halves ([.., D/2] each) because rotate-half RoPE mixes channel i with i + D/2.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import sm_count
from .formats import PageFormat

_ROT_NONE, _ROT_SINKS, _ROT_KEYS = 0, 1, 2
GPU_TILES = {"_decode_kernel": {"BLOCK_N": 32}}     # on a GPU (the interpreter takes 64 rows a tile)
_NEG = tl.constexpr(-1.0e30)          # a global a jitted function reads must be a constexpr


@triton.jit
def _turn(x1, x2, c1, c2, s1, s2):
    # rotate-half RoPE on the two halves: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _e4m3_value(b):
    # float8_e4m3fn bytes -> float32, from the bits (Triton has no e4m3 type before sm_89)
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((b & 0x80) << 24) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125                                   # 2**-9
    return tl.where(e == 0, tl.where((b & 0x80) != 0, -sub, sub), normal)


@triton.jit
def _rows(data, scale, zero, r, h, d, mask, H, stride_r, stride_h, D: tl.constexpr, BS: tl.constexpr,
          KIND: tl.constexpr, AXIS: tl.constexpr, ASYM: tl.constexpr, GROUP: tl.constexpr):
    # page rows r [N] of KV head h, channels d [C] -> float32 [N, C], dequantized as kernels.reference.dequantize:
    # KIND 0 full precision (any float dtype, strided), 1 int8, 2 fp8 (bytes), 3 int4 (two channels a byte);
    # AXIS 1 a scale per (block, head, channel), 2 per (row, head), 3 per (row, head, group of GROUP channels)
    r2 = r[:, None]
    d2 = d[None, :]
    if KIND == 0:
        return tl.load(data + r2 * stride_r + h * stride_h + d2, mask=mask, other=0).to(tl.float32)
    at = r2 * H + h
    if KIND == 3:
        byte = tl.load(data + at * (D // 2) + d2 // 2, mask=mask, other=0).to(tl.int32)
        q = ((byte >> ((d2 % 2) * 4)) & 15).to(tl.float32)
    elif KIND == 2:
        q = _e4m3_value(tl.load(data + at * D + d2, mask=mask, other=0))
    else:
        q = tl.load(data + at * D + d2, mask=mask, other=0).to(tl.float32)
    if AXIS == 1:
        s_at = ((r2 // BS) * H + h) * D + d2
    elif AXIS == 2:
        s_at = at + 0 * d2
    else:
        s_at = at * (D // GROUP) + d2 // GROUP
    if KIND == 2:       # a power of two, stored as its exponent byte
        sc = (tl.load(scale + s_at, mask=mask, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        sc = tl.load(scale + s_at, mask=mask, other=0).to(tl.float32)
    if ASYM:
        return q * sc + tl.load(zero + s_at, mask=mask, other=0).to(tl.float32)
    return q * sc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, rows_ptr, offs_ptr, nsink_ptr, rc_ptr, rs_ptr,
                   m_ptr, l_ptr, acc_ptr, HKV, stride_kr, stride_kh, stride_vr, stride_vh, scale, softcap, SPLIT_LEN,
                   SPLITS, HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DH: tl.constexpr,
                   DH_PAD: tl.constexpr, BLOCK_N: tl.constexpr, ROT: tl.constexpr, SOFTCAP: tl.constexpr,
                   BS: tl.constexpr, K_KIND: tl.constexpr, K_AXIS: tl.constexpr, K_ASYM: tl.constexpr,
                   K_GROUP: tl.constexpr, V_KIND: tl.constexpr, V_AXIS: tl.constexpr, V_ASYM: tl.constexpr,
                   V_GROUP: tl.constexpr):
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
        k1 = _rows(k_ptr, ks_ptr, kz_ptr, r, h, d_idx, kd_mask, HKV, stride_kr, stride_kh, D, BS, K_KIND, K_AXIS,
                   K_ASYM, K_GROUP)
        k2 = _rows(k_ptr, ks_ptr, kz_ptr, r, h, d_idx + DH, kd_mask, HKV, stride_kr, stride_kh, D, BS, K_KIND, K_AXIS,
                   K_ASYM, K_GROUP)
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
        v1 = _rows(v_ptr, vs_ptr, vz_ptr, r, h, d_idx, kd_mask, HKV, stride_vr, stride_vh, D, BS, V_KIND, V_AXIS,
                   V_ASYM, V_GROUP)
        v2 = _rows(v_ptr, vs_ptr, vz_ptr, r, h, d_idx + DH, kd_mask, HKV, stride_vr, stride_vh, D, BS, V_KIND, V_AXIS,
                   V_ASYM, V_GROUP)
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
    longest = max(1, max(lengths))
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.device(device).type != "cuda":
        return 1
    sms = sm_count(torch.device(device).index or 0)
    want = triton.cdiv(4 * sms, len(lengths) * kv_heads)          # programs enough to fill the chip
    return max(1, min(want, triton.cdiv(longest, 4 * block_n)))   # each split at least a few tiles


@dataclass(frozen=True)
class QuantPages:
    """A quantized page component as the kernel reads it in place: data [num_blocks, bs, H, D'] (int8, fp8, int4
    packed two channels a byte), scale and zero pages (kernels/formats.py), and its format. Rows are page rows,
    block id * bs + slot, as for full-precision pages."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    fmt: PageFormat

    @property
    def num_heads(self) -> int:
        return self.data.shape[2]


_QKIND = {"int8": 1, "fp8": 2, "int4": 3}
_QAXIS = {"channel": 1, "token": 2, "group": 3}


def _source(x) -> tuple:
    """(data, scale, zero, stride_r, stride_h) pointers and (kind, axis, asym, group, bs) constexprs of one side."""
    if isinstance(x, QuantPages):
        data = x.data.view(torch.uint8) if x.fmt.name == "fp8" else x.data
        assert data.is_contiguous() and x.scale.is_contiguous()
        zero = x.zero if x.zero is not None else x.scale
        return (data, x.scale, zero, 0, 0), (_QKIND[x.fmt.name], _QAXIS[x.fmt.scale_axis], x.zero is not None,
                                             x.fmt.group, x.data.shape[1])
    assert x.stride(2) == 1
    return (x, x, x, x.stride(0), x.stride(1)), (0, 0, False, 1, 1)


def attention_partials(q_rot: torch.Tensor, k_pages, v_pages, rows: torch.Tensor, offsets: torch.Tensor,
                       lengths: list[int], scale: float, softcap: float | None = None,
                       n_sink: torch.Tensor | None = None, delta_cos: torch.Tensor | None = None,
                       delta_sin: torch.Tensor | None = None, key_cos: torch.Tensor | None = None,
                       key_sin: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's online-softmax state over the given rows: (max, sum, weighted values) [B, Hq, S(, D)] per split;
    a sequence may have no rows here (its state is then empty). merge_partials turns states into outputs."""
    B, HQ, D = q_rot.shape
    HKV = k_pages.num_heads if isinstance(k_pages, QuantPages) else k_pages.shape[1]
    assert D % 2 == 0 and HQ % HKV == 0 and len(lengths) == B
    dev = q_rot.device
    G = HQ // HKV
    block_n = GPU_TILES["_decode_kernel"]["BLOCK_N"] if os.environ.get("TRITON_INTERPRET") != "1" else 64
    splits = _splits(lengths, HKV, dev, block_n)
    split_len = max(block_n, triton.cdiv(triton.cdiv(max(lengths), splits), block_n) * block_n)
    if key_cos is not None:
        rot, rc, rs = _ROT_KEYS, key_cos.float().contiguous(), key_sin.float().contiguous()
        assert rc.shape == (rows.shape[0], D)
    elif n_sink is not None:          # (rows of sequences without sinks: n_sink 0, untouched)
        rot, rc, rs = _ROT_SINKS, delta_cos.float().contiguous(), delta_sin.float().contiguous()
        assert rc.shape == (B, D)
    else:
        rot, rc, rs = _ROT_NONE, q_rot, q_rot                      # unused
    sinks = (n_sink if n_sink is not None else torch.zeros(B, dtype=torch.int32)).to(dev, torch.int32)
    (k, ks, kz, k_sr, k_sh), (k_kind, k_axis, k_asym, k_group, k_bs) = _source(k_pages)
    (v, vs, vz, v_sr, v_sh), (v_kind, v_axis, v_asym, v_group, v_bs) = _source(v_pages)
    q = q_rot.float().contiguous()
    m = torch.empty(B, HQ, splits, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(B, HQ, splits, D, dtype=torch.float32, device=dev)
    _decode_kernel[(B, HKV, splits)](
        q, k, ks, kz, v, vs, vz, rows.to(dev, torch.int64).contiguous(), offsets.to(dev, torch.int64).contiguous(),
        sinks, rc, rs, m, l, acc, HKV, k_sr, k_sh, v_sr, v_sh, float(scale), float(softcap or 1.0), split_len, splits,
        HQ=HQ, G=G, G_PAD=max(2, triton.next_power_of_2(G)), D=D, DH=D // 2, DH_PAD=triton.next_power_of_2(D // 2),
        BLOCK_N=block_n, ROT=rot, SOFTCAP=softcap is not None, BS=max(k_bs, v_bs), K_KIND=k_kind, K_AXIS=k_axis,
        K_ASYM=k_asym, K_GROUP=k_group, V_KIND=v_kind, V_AXIS=v_axis, V_ASYM=v_asym, V_GROUP=v_group, num_warps=4)
    return m, l, acc


def merge_partials(*parts, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """States of attention_partials over disjoint rows of the same queries -> float32 [B, Hq, D]. sink_logits [Hq]:
    the layer's learned sink logits (gpt-oss), one more term per head in the max and the sum with no value, folded
    in here once (not in every split)."""
    m = torch.cat([p[0] for p in parts], -1)
    l = torch.cat([p[1] for p in parts], -1)
    acc = torch.cat([p[2] for p in parts], -2)
    if m.shape[-1] == 1 and sink_logits is None:
        return acc[:, :, 0] / l
    top = m.max(-1, keepdim=True).values
    if sink_logits is not None:
        sink = sink_logits.to(m).view(1, -1, 1)
        top = torch.maximum(top, sink)
    w = torch.exp(m - top)
    total = (l * w).sum(-1, keepdim=True)
    if sink_logits is not None:
        total = total + torch.exp(sink - top)
    return (acc * w[..., None]).sum(2) / total


def decode_attention(q_rot: torch.Tensor, k_pages, v_pages, rows: torch.Tensor, offsets: torch.Tensor,
                     lengths: list[int], scale: float, softcap: float | None = None,
                     n_sink: torch.Tensor | None = None, delta_cos: torch.Tensor | None = None,
                     delta_sin: torch.Tensor | None = None, key_cos: torch.Tensor | None = None,
                     key_sin: torch.Tensor | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """q_rot [B, Hq, D] (rotated); k_pages, v_pages: [R, Hkv, D] full-precision pages (any float dtype, last dim
    contiguous) or QuantPages read in place; rows the page rows of every sequence one after another, offsets [B + 1]
    where each starts, lengths their B sizes (ints, so the grid needs no copy from the device). Sinks: n_sink [B]
    int32 and delta_cos/sin [B, D]; or keys stored before RoPE: key_cos/sin [len(rows), D] per row. sink_logits
    [Hq]: the layer's learned sink logits (merge_partials), or None. -> float32 [B, Hq, D]."""
    assert min(lengths) > 0
    return merge_partials(attention_partials(q_rot, k_pages, v_pages, rows, offsets, lengths, scale, softcap,
                                             n_sink, delta_cos, delta_sin, key_cos, key_sin), sink_logits=sink_logits)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as engine.model.rope applies it: x [N, H, D] by cos/sin [N or 1, D]."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]


def _flat(x) -> torch.Tensor:
    if isinstance(x, QuantPages):
        from .reference import dequantize
        return dequantize(x.data, x.scale, x.zero, x.fmt).flatten(0, 1)
    return x


def decode_attention_ref(q_rot, k_pages, v_pages, rows, offsets, lengths, scale, softcap=None, n_sink=None,
                         delta_cos=None, delta_sin=None, key_cos=None, key_sin=None, sink_logits=None) -> torch.Tensor:
    """decode_attention in torch, one sequence at a time (gather, turn, softmax)."""
    outs = []
    k_pages, v_pages = _flat(k_pages), _flat(v_pages)
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
        if sink_logits is not None:         # a column per head that joins the softmax and is dropped
            sc = torch.cat((sc, sink_logits.to(sc).view(*sc.shape[:2], 1)), -1)
            p = sc.softmax(-1)[..., :-1]
        else:
            p = sc.softmax(-1)
        outs.append(torch.einsum("hgn,nhd->hgd", p, v).reshape(1, -1, q_rot.shape[-1]))
    return torch.cat(outs)


def bench_decode_full(device, tokens: int, kv_heads: int, heads: int, head_dim: int, runs: int, sync,
                      fmt: str = "bf16") -> float:
    """Median seconds of one decode attention over `tokens` rows of K and V pages (one sequence, its rows in 16-row
    blocks in a shuffled order, as a long conversation's block table holds them). fmt: bf16 pages, or a quantized
    format (int8, fp8, int4) in kvchat's key / value recipes, read in place."""
    import time
    from .formats import page_format
    from . import store_blocks
    g = torch.Generator().manual_seed(0)
    bs = 16
    n_blocks = triton.cdiv(tokens, bs)
    order = torch.randperm(n_blocks, generator=g)
    rows = (order[:, None] * bs + torch.arange(bs)).reshape(-1)[:tokens].to(device)
    offsets = torch.tensor([0, tokens], device=device)
    q = torch.randn(1, heads, head_dim, generator=g).to(device)
    sides = []
    for role in "kv":
        src = torch.randn(n_blocks, bs, kv_heads, head_dim, generator=g).to(device)
        if fmt == "bf16":
            sides.append(src.to(torch.bfloat16).flatten(0, 1))
            continue
        f = page_format(fmt, role)
        pages = {name: torch.zeros((n_blocks, *shape), dtype=dtype, device=device)
                 for name, (shape, dtype) in f.shapes(bs, kv_heads, head_dim).items()}
        store_blocks(src, torch.arange(n_blocks, device=device), pages["data"], pages.get("scale"), pages.get("zero"), f)
        sides.append(QuantPages(pages["data"], pages["scale"], pages.get("zero"), f))
    kw = {}
    if fmt != "bf16":
        angles = torch.arange(tokens)[:, None] * (1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))[None, :]
        angles = torch.cat((angles, angles), -1)
        kw = {"key_cos": angles.cos().to(device), "key_sin": angles.sin().to(device)}
    scale = head_dim ** -0.5
    decode_attention(q, *sides, rows, offsets, [tokens], scale, **kw)        # compile
    times = []
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        decode_attention(q, *sides, rows, offsets, [tokens], scale, **kw)
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
