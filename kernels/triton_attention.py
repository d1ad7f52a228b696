"""Triton paged decode attention: the GPU twin of `reference.paged_decode_attention`.

One program owns one (sequence, KV head, split): it packs the query heads of its GQA group into
the rows of a tile, so each K/V page is read once per KV head, not once per query head. Pages are
dequantized and keys rotated (rotate-half RoPE at their in-cache position) in registers. Long
contexts are cut into splits (flash-decoding); a second small kernel merges them by their lse.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import PageFormat

_LOG2E = 1.4426950408889634   # scores in log2 units let the loop use exp2
_AXIS = {"none": 0, "channel": 1, "token": 2, "group": 3}


@triton.jit
def _load_kv(data_ptr, scale_ptr, zero_ptr, page, off, head, d, mask, num_heads,
             BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
             IS_INT4: tl.constexpr, AXIS: tl.constexpr, ASYM: tl.constexpr, GROUP: tl.constexpr):
    # page, off: [T] page id (int64) and offset of each token; d: [C] channels -> [T, C] float32
    row = (page * BLOCK_SIZE + off) * num_heads + head          # row in the [*, D'] view of the pages
    m2 = mask[:, None]
    if IS_INT4:
        byte = tl.load(data_ptr + row[:, None] * (HEAD_DIM // 2) + (d // 2)[None, :], mask=m2, other=0)
        x = ((byte.to(tl.int32) >> ((d % 2) * 4)[None, :]) & 0xF).to(tl.float32)
    else:
        x = tl.load(data_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=m2, other=0.0).to(tl.float32)
    if AXIS != 0:
        if AXIS == 1:    # per channel over the block: scale [num_blocks, H, D]
            sidx = (page * num_heads + head)[:, None] * HEAD_DIM + d[None, :]
        elif AXIS == 2:  # per token: scale [num_blocks, bs, H]
            sidx = row[:, None]
        else:            # groups of channels: scale [num_blocks, bs, H, D // GROUP]
            sidx = row[:, None] * (HEAD_DIM // GROUP) + (d // GROUP)[None, :]
        if scale_ptr.dtype.element_ty == tl.uint8:    # fp8: power-of-two scale as an exponent byte
            code = tl.load(scale_ptr + sidx, mask=m2, other=0).to(tl.int32)
            x = x * (code << 23).to(tl.float32, bitcast=True)
        else:
            x = x * tl.load(scale_ptr + sidx, mask=m2, other=0.0).to(tl.float32)
        if ASYM:
            x = x + tl.load(zero_ptr + sidx, mask=m2, other=0.0).to(tl.float32)
    return x


@triton.jit
def _decode_kernel(q_ptr, k_data, k_scale, k_zero, v_data, v_scale, v_zero,
                   block_tables, seq_lens, window_starts, num_sinks, inv_freq,
                   out_ptr, lse_ptr, qk_scale, num_kv_heads, stride_qb, stride_qh, stride_bt,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   K_INT4: tl.constexpr, K_AXIS: tl.constexpr, K_ASYM: tl.constexpr, K_GROUP: tl.constexpr,
                   V_INT4: tl.constexpr, V_AXIS: tl.constexpr, V_ASYM: tl.constexpr, V_GROUP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2

    # Held slots, as in reference.slot_positions: sinks [0, n_sink), then window [lo, seq_len).
    # The loop runs over the compacted index i, so evicted slots cost nothing.
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    ws = tl.load(window_starts + b).to(tl.int32)
    ns = tl.load(num_sinks + b).to(tl.int32)
    n_sink = tl.minimum(ns, seq_len)
    lo = tl.maximum(ws, ns)
    n_valid = n_sink + tl.maximum(seq_len - lo, 0)
    chunk = tl.cdiv(tl.cdiv(n_valid, NUM_SPLITS), TILE) * TILE
    start = split * chunk
    end = tl.minimum(start + chunk, n_valid)

    g = tl.arange(0, GROUP_PAD)
    gmask = g < GROUP
    qh = h * GROUP + g                                          # query heads of this KV head
    dh = tl.arange(0, HALF)
    dv = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + b * stride_qb + qh[:, None] * stride_qh
    # Scores are kept in log2 units so the loop can use exp2.
    q1 = tl.load(q_rows + dh[None, :], mask=gmask[:, None], other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(q_rows + HALF + dh[None, :], mask=gmask[:, None], other=0.0).to(tl.float32) * qk_scale
    inv = tl.load(inv_freq + dh).to(tl.float32)
    # RoPE by angle addition: cos/sin of j * inv_freq for the offsets j inside a tile are computed
    # once; each tile then needs cos/sin of its base angle only ([HALF], not [TILE, HALF]), which
    # keeps transcendentals from becoming the bottleneck of a memory-bound kernel (int4 above all).
    j_angle = tl.arange(0, TILE).to(tl.float32)[:, None] * inv[None, :]
    cos_j = tl.cos(j_angle)
    sin_j = tl.sin(j_angle)
    # A window slot's position is its compacted index plus this shift; a sink's is its index.
    shift = ns + lo - ws - n_sink

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for t0 in range(start, end, TILE):
        i = t0 + tl.arange(0, TILE)
        valid = i < end
        is_sink = i < n_sink
        slot = tl.where(is_sink, i, lo + i - n_sink)
        page = tl.load(block_tables + b * stride_bt + slot // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = slot % BLOCK_SIZE

        k1 = _load_kv(k_data, k_scale, k_zero, page, off, h, dh, valid, num_kv_heads,
                      BLOCK_SIZE, HEAD_DIM, K_INT4, K_AXIS, K_ASYM, K_GROUP)
        k2 = _load_kv(k_data, k_scale, k_zero, page, off, h, dh + HALF, valid, num_kv_heads,
                      BLOCK_SIZE, HEAD_DIM, K_INT4, K_AXIS, K_ASYM, K_GROUP)
        base_sink = t0 * inv                                    # [HALF]
        base_win = (t0 + shift) * inv
        cb = tl.where(is_sink[:, None], tl.cos(base_sink)[None, :], tl.cos(base_win)[None, :])
        sb = tl.where(is_sink[:, None], tl.sin(base_sink)[None, :], tl.sin(base_win)[None, :])
        cos = cb * cos_j - sb * sin_j                           # [TILE, HALF]; both halves share it
        sin = sb * cos_j + cb * sin_j
        kr1 = k1 * cos - k2 * sin
        kr2 = k2 * cos + k1 * sin
        scores = tl.dot(q1, tl.trans(kr1), input_precision="ieee")
        scores += tl.dot(q2, tl.trans(kr2), input_precision="ieee")   # [GROUP_PAD, TILE]
        scores = tl.where(valid[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # an all-masked row must not give nan
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv(v_data, v_scale, v_zero, page, off, h, dv, valid, num_kv_heads,
                     BLOCK_SIZE, HEAD_DIM, V_INT4, V_AXIS, V_ASYM, V_GROUP)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    has = l_i > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))  # ln 2: back to natural log
    # out [B, Hq, NUM_SPLITS, D], lse [B, Hq, NUM_SPLITS]; with one split these are the results.
    row = (b * num_kv_heads * GROUP + qh) * NUM_SPLITS + split
    tl.store(out_ptr + row[:, None] * HEAD_DIM + dv[None, :], out, mask=gmask[:, None])
    tl.store(lse_ptr + row, lse, mask=gmask)


@triton.jit
def _merge_splits_kernel(part_out, part_lse, out_ptr, lse_ptr,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    row = tl.program_id(0)                                      # b * Hq + head
    s = tl.arange(0, SPLITS_PAD)
    smask = s < NUM_SPLITS
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(part_lse + row * NUM_SPLITS + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)                                    # [SPLITS_PAD]; empty splits weigh 0
    total = tl.sum(w, 0)
    o = tl.load(part_out + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    tl.store(out_ptr + row * HEAD_DIM + d, tl.sum(o * w[:, None], 0) / tl.maximum(total, 1e-30))
    tl.store(lse_ptr + row, tl.where(total > 0.0, m_safe + tl.log(tl.maximum(total, 1e-30)), float("-inf")))


def _fmt_args(fmt: PageFormat) -> tuple[bool, int, bool, int]:
    if fmt.name == "int4":
        assert not fmt.symmetric, "int4 pages are asymmetric (scale + zero point)"
    return fmt.name == "int4", _AXIS[fmt.scale_axis], fmt.is_quantized and not fmt.symmetric, fmt.group


def _check_pages(name: str, data, scale, zero, fmt: PageFormat) -> None:
    # The kernel computes page offsets from shapes, so pages must be dense.
    for t in (data, scale, zero):
        assert t is None or t.is_contiguous(), f"{name} page tensors must be contiguous"
    assert (scale is not None) == fmt.is_quantized, f"{name}: scale pages do not match {fmt.label}"
    assert (zero is not None) == (fmt.is_quantized and not fmt.symmetric), f"{name}: zero pages do not match {fmt.label}"


def _num_splits(q: torch.Tensor, batch: int, num_kv_heads: int, max_ctx: int) -> int:
    if q.device.type != "cuda":
        return 1
    # Enough programs to fill every SM about twice, but no split shorter than 256 tokens.
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    want = triton.cdiv(2 * sms, batch * num_kv_heads)
    return max(1, min(want, triton.cdiv(max_ctx, 256), 64))


def decode(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, block_tables, seq_lens, window_starts,
           num_sinks, inv_freq, sm_scale: float, k_fmt: PageFormat, v_fmt: PageFormat,
           num_splits: int | None = None, tile: int | None = None):
    """`paged_decode_attention` with the split count and token tile exposed for tests and tuning."""
    B, Hq, D = q.shape
    num_blocks, block_size, Hkv = k_data.shape[:3]
    assert Hq % Hkv == 0 and D % 2 == 0 and D & (D - 1) == 0, (Hq, Hkv, D)
    assert v_data.shape[:3] == k_data.shape[:3]
    assert block_tables.dim() == 2 and block_tables.shape[0] == B
    _check_pages("K", k_data, k_scale, k_zero, k_fmt)
    _check_pages("V", v_data, v_scale, v_zero, v_fmt)
    for t in (block_tables, seq_lens, window_starts, num_sinks, inv_freq):
        assert t.device == q.device, "all tensors must be on the query's device"
    assert q.stride(-1) == 1 and block_tables.stride(-1) == 1
    group = Hq // Hkv
    if num_splits is None:
        num_splits = _num_splits(q, B, Hkv, block_tables.shape[1] * block_size)
    tile = tile or 64
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    if num_splits == 1:
        part_out, part_lse = out, lse
    else:
        part_out = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    k_int4, k_axis, k_asym, k_group = _fmt_args(k_fmt)
    v_int4, v_axis, v_asym, v_group = _fmt_args(v_fmt)
    _decode_kernel[(B, Hkv, num_splits)](
        q, k_data, k_data if k_scale is None else k_scale, k_data if k_zero is None else k_zero,
        v_data, v_data if v_scale is None else v_scale, v_data if v_zero is None else v_zero,
        block_tables, seq_lens, window_starts, num_sinks, inv_freq,
        part_out, part_lse, float(sm_scale) * _LOG2E, Hkv, q.stride(0), q.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D,
        BLOCK_SIZE=block_size, TILE=tile, NUM_SPLITS=num_splits,
        K_INT4=k_int4, K_AXIS=k_axis, K_ASYM=k_asym, K_GROUP=k_group,
        V_INT4=v_int4, V_AXIS=v_axis, V_ASYM=v_asym, V_GROUP=v_group,
        num_warps=8 if tile * D >= 8192 else 4,   # spread the dequantized [TILE, D] tiles over more threads
    )
    if num_splits > 1:
        _merge_splits_kernel[(B * Hq,)](part_out, part_lse, out, lse, NUM_SPLITS=num_splits,
                                        SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=D)
    return out, lse


def paged_decode_attention(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero,
                           block_tables, seq_lens, window_starts, num_sinks,
                           inv_freq, sm_scale: float, k_fmt: PageFormat, v_fmt: PageFormat):
    """Triton twin of `reference.paged_decode_attention`: q [B, Hq, D] -> out [B, Hq, D], lse [B, Hq] fp32."""
    return decode(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, block_tables, seq_lens,
                  window_starts, num_sinks, inv_freq, sm_scale, k_fmt, v_fmt)

