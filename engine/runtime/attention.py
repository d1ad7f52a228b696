"""Attention over the paged cache: one step's metadata per sequence, one path per page kind.

Positions. Every query is rotated at its absolute position (the token's index in the stream) and
full-precision keys are stored rotated at theirs, so no step rotates stored keys again: RoPE
scores depend on position differences only, and a window's kept tokens keep their differences
(StreamingLLM re-positions them as one run). Only the sinks, which stay at their first positions
while the window moves on, see the query at its in-cache position: a second rotation of q
(decode) or of the few sink keys (prefill). Quantized keys are stored before RoPE and rotated as
they are dequantized, at the same effective positions: on the CPU a decode step reads the quantized
pages in place (cpu_quant.attn_decode_quant, cos/sin looked up in a table grown once per model);
prefill, GPUs and mixed full/quantized layers dequantize the held past in torch.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

import kernels
from kernels import cpu_quant

from engine.kv.manager import Reservation
from engine.kv.pages import Component


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor):
    """cos, sin [N, D] (rotate-half layout), angles in float64 so long streams keep exact differences."""
    freqs = positions.double()[:, None] * inv_freq.double()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


_tables: dict[tuple[float, ...], tuple[torch.Tensor, torch.Tensor]] = {}      # by inv_freq's values
_tables_lock = threading.Lock()


def rope_table(inv_freq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [>= n, D/2] float32 of positions 0, 1, ... (one half of rope_cos_sin's rows, the same
    values), kept per inv_freq and grown by doubling, so a decode step looks positions up instead of
    computing a cosine per held token."""
    with _tables_lock:
        key = tuple(inv_freq.tolist())
        cached = _tables.get(key)
        if cached is None or cached[0].shape[0] < n:
            size = max(n, 1024, 2 * cached[0].shape[0] if cached is not None else 0)
            freqs = torch.arange(size, dtype=torch.float64)[:, None] * inv_freq.double().cpu()[None, :]
            cached = _tables[key] = (freqs.cos().float(), freqs.sin().float())
        return cached


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by per-row cos/sin [N, D] (or [1, D]); equals kernels.apply_rope."""
    n, h, d = x.shape
    swapped = x.view(n, h, 2, d // 2).flip(2).view(n, h, d)
    half = d // 2
    folded = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return (x * cos[:, None]).addcmul_(swapped, folded[:, None])


@dataclass
class SeqStep:
    """What every layer needs to attend for one sequence in one step."""

    res: Reservation
    offset: int                   # the sequence's first row in the step's token batch
    rows: torch.Tensor            # [P + T] page rows: held past slots (sinks first), then the new slots
    past_slots: torch.Tensor      # [P] slots of the held past
    n_sink: int                   # leading rows seen with the query at its in-cache position (0: none differ)
    q_cos: torch.Tensor           # [T, D] at the new tokens' absolute positions (queries and new keys)
    q_sin: torch.Tensor
    sink_cos: torch.Tensor | None  # [T, D] at the new tokens' in-cache positions, when n_sink
    sink_sin: torch.Tensor | None
    delta_cos: torch.Tensor | None  # [1, D]: the sinks' extra rotation, when n_sink
    delta_sin: torch.Tensor | None
    key_cos: torch.Tensor | None  # [P + T, D] effective key positions, for keys stored before RoPE
    key_sin: torch.Tensor | None  #   (None until key_rope() computes them from key_pos)
    key_pos: torch.Tensor | None = None   # [P + T] int64 on the CPU: those effective positions
    inv_freq: torch.Tensor | None = None
    kernel_args: tuple | None = None      # the quantized decode kernel's per-step arguments, made by its first layer
    decode: bool = True           # one generated token (False: prompt rows, see softmax_attention)

    @property
    def num_new(self) -> int:
        return self.res.num_new


def plan(res: Reservation, offset: int, inv_freq: torch.Tensor, device, quantized: bool,
         decode: bool | None = None) -> SeqStep:
    seq = res.seq
    bs = seq.block_size
    S, N = res.first_slot, seq.num_tokens
    ws, ns = seq.window()
    slots, _ = kernels.slot_positions(S, ws, ns)
    P, T = slots.numel(), res.num_new
    all_slots = torch.cat((slots, torch.arange(S, S + T)))
    table = torch.tensor(seq.block_table, dtype=torch.long)
    rows = (table[all_slots // bs] * bs + all_slots % bs).to(device)
    delta = N - P                                   # absolute minus in-cache position, for every new token
    sink_end = seq.sink_blocks * bs
    if not delta:
        n_sink = 0
    elif seq.geometry.window is not None:
        n_sink = min(ns, S)            # the sinks come first in rows
    else:                              # a window removed after it slid: the sink blocks keep their positions
        n_sink = min(sink_end, S)
    q_pos = torch.arange(N, N + T)
    q_cos, q_sin = rope_cos_sin(q_pos, inv_freq)
    sink_cos = sink_sin = d_cos = d_sin = key_cos = key_sin = None
    if n_sink:
        sink_cos, sink_sin = rope_cos_sin(q_pos - delta, inv_freq)
        d_cos, d_sin = rope_cos_sin(torch.tensor([delta]), inv_freq)
    if quantized:
        abs_pos = torch.where(slots < sink_end, slots, slots + seq.evicted * bs)
        if n_sink:
            abs_pos[:n_sink] += delta
        key_pos = torch.cat((abs_pos, q_pos))
    else:
        key_pos = None
    dev = lambda t: None if t is None else t.to(device)
    return SeqStep(res, offset, rows, slots, n_sink, dev(q_cos), dev(q_sin), dev(sink_cos), dev(sink_sin),
                   dev(d_cos), dev(d_sin), key_cos, key_sin, key_pos, inv_freq,
                   decode=T == 1 if decode is None else decode)


@dataclass
class DecodeGroup:
    """Several sequences' single decode tokens over the same full-precision pages, attended in one kernel
    call. Their rows are contiguous in the step's batch, from `start`."""

    start: int
    size: int
    q_cos: torch.Tensor           # [B, D]
    q_sin: torch.Tensor
    sink_cos: torch.Tensor | None  # [B, D] (rows of sequences without sinks: q_cos, unused)
    sink_sin: torch.Tensor | None
    n_sink: torch.Tensor          # [B] int32
    rows: torch.Tensor            # every sequence's page rows, one after another (int64)
    offsets: torch.Tensor         # [B + 1] int64
    new_rows: torch.Tensor        # [B] the page rows of the new tokens


def decode_group(steps: list[SeqStep]) -> DecodeGroup:
    """steps: consecutive one-token decode steps of sequences sharing one full-precision layout (CPU)."""
    sinks = any(st.n_sink for st in steps)
    cat = torch.cat
    sizes = torch.tensor([0] + [st.rows.shape[0] for st in steps], dtype=torch.long)
    return DecodeGroup(
        steps[0].offset, len(steps), cat([st.q_cos for st in steps]), cat([st.q_sin for st in steps]),
        cat([st.sink_cos if st.n_sink else st.q_cos for st in steps]) if sinks else None,
        cat([st.sink_sin if st.n_sink else st.q_sin for st in steps]) if sinks else None,
        torch.tensor([st.n_sink for st in steps], dtype=torch.int32), cat([st.rows for st in steps]).cpu(),
        sizes.cumsum(0), cat([st.rows[-1:] for st in steps]))


def group_args(grp: DecodeGroup) -> tuple:
    """decode_attend's per-step arguments for a group, as cpu_quant.decode_layers takes them."""
    return grp.q_cos, grp.q_sin, grp.sink_cos, grp.sink_sin, grp.n_sink, grp.new_rows, grp.rows, grp.offsets


def attend_group(kc: Component, vc: Component, q, k, v, grp: DecodeGroup) -> torch.Tensor | None:
    """q [B, Hq, D], k/v [B, Hkv, D] before RoPE, one token per sequence; stores k and v; -> [B, Hq, D], or
    None (nothing stored) where the kernel does not cover these pages. One kernel call rotates, stores and
    attends; a sequence's result does not depend on the others in the group."""
    k_pages, v_pages = kc.flat_pages(), vc.flat_pages()
    if not cpu_quant.can_attend(q, k_pages) or v_pages.dtype != k_pages.dtype:     # e.g. fp32 keys, bf16 values
        return None
    if q.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    cos, sin, sink_cos, sink_sin, n_sink, new_rows, rows, offsets = group_args(grp)
    return cpu_quant.decode_attend(q, k, v, cos, sin, sink_cos, sink_sin, n_sink, k_pages, v_pages,
                                   new_rows, rows, offsets, q.shape[-1] ** -0.5)


def key_rope(st: SeqStep) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P + T, D] at the effective key positions (for keys stored before RoPE), computed once per step."""
    if st.key_cos is None:
        cos_h, sin_h = rope_table(st.inv_freq, int(st.key_pos.max()) + 1)
        cos, sin = cos_h[st.key_pos], sin_h[st.key_pos]
        device = st.q_cos.device
        st.key_cos, st.key_sin = torch.cat((cos, cos), -1).to(device), torch.cat((sin, sin), -1).to(device)
    return st.key_cos, st.key_sin


def attend(kc: Component, vc: Component, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, st: SeqStep) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] before RoPE, for one sequence; stores k and v; -> [T, Hq, D]."""
    if not (kc.fmt.is_quantized or vc.fmt.is_quantized):
        return _attend_full(kc, vc, q, k, v, st)
    return _attend_quantized(kc, vc, q, k, v, st)


def _attend_full(kc: Component, vc: Component, q, k, v, st: SeqStep) -> torch.Tensor:
    """Full-precision pages: store the rotated keys, then read every held row once."""
    T = q.shape[0]
    new_rows = st.rows[st.rows.shape[0] - T:]
    q32 = q.float()
    kc.write_rows(rotate(k.float(), st.q_cos, st.q_sin), new_rows)
    vc.write_rows(v, new_rows)
    k_pages, v_pages = kc.flat_pages(), vc.flat_pages()
    q_rot = rotate(q32, st.q_cos, st.q_sin)
    k_all = k_pages.index_select(0, st.rows).float()
    v_all = v_pages.index_select(0, st.rows).float()
    if st.n_sink:
        k_all[:st.n_sink] = rotate(k_all[:st.n_sink], st.delta_cos, st.delta_sin)
    return softmax_attention(q_rot, k_all, v_all, st.decode)


def _attend_quantized(kc: Component, vc: Component, q, k, v, st: SeqStep) -> torch.Tensor:
    """Quantized pages: attend over the past before writing, since a write may quantize the tail away."""
    pages = _kernel_pages(kc, vc, q, st) if q.shape[0] == 1 and st.decode else None
    out = _decode_kernel(q, k, v, st, *pages) if pages else _quantized_torch(kc, vc, q, k, v, st)
    _store(kc, vc, k, v, st)
    return out


def _kernel_pages(kc: Component, vc: Component, q, st: SeqStep):
    """The K and V pages as the C decode kernel reads them, or None where it does not apply (mixed full and
    quantized formats, a GPU, a missing tail)."""
    if not (kc.fmt.is_quantized and vc.fmt.is_quantized and st.key_pos is not None
            and cpu_quant.can_attend_quantized(q, kc.fmt, vc.fmt, kc.full_dtype, kc.pages["data"])):
        return None
    seq = st.res.seq
    S, bs = st.res.first_slot, kc.block_size
    n_full = S // bs
    out = []
    for c in (kc, vc):
        data, scale, zero = c.tensors()
        head = c.heads.get(seq.block_table[0]) if n_full else None
        tail = c.tails.get(seq.seq_id)
        if S > n_full * bs and tail is None:
            return None
        out.append(cpu_quant.QuantPages(c.fmt, data, scale, zero, head, tail))
    return out


def quant_step(comps: list, steps: list[SeqStep], num_heads: int) -> cpu_quant.QuantStep | None:
    """A decode step's attention over quantized pages, every layer and sequence, for the one-call step to run in
    C (cpu_quant.QuantStep): comps[i] the (K, V) components per layer of steps[i]'s layout. None where it does
    not apply: a prompt row, full-precision or mixed formats, a GPU, a missing tail. After the kernel,
    finish_quant_step quantizes the blocks the step completed."""
    seqs, fields = [], [[] for _ in comps[0]]
    key_pos = []
    for st, layers in zip(steps, comps):
        kc, vc = layers[0]
        bs, S = kc.block_size, st.res.first_slot
        if not (st.decode and st.num_new == 1 and st.key_pos is not None and bs == comps[0][0][0].block_size
                and kc.fmt.is_quantized and vc.fmt.is_quantized
                and cpu_quant.can_attend_quantized(st.q_cos, kc.fmt, vc.fmt, kc.full_dtype, kc.pages["data"])):
            return None
        seq = st.res.seq
        sid, n_full = seq.seq_id, S // bs
        first = seq.block_table[0]
        for l, (kc, vc) in enumerate(layers):
            if not (kc.fmt.is_quantized and vc.fmt.is_quantized):   # full-precision layers beside quantized ones
                return None
            for c in (kc, vc):
                tail = c.tails.get(sid)
                if tail is None:
                    return None
                fields[l].append((c.kernel_static(), c.heads.get(first) if n_full else None, tail))
        seqs.append(cpu_quant.QuantSeq(st.past_slots.contiguous(), torch.tensor(seq.block_table, dtype=torch.long),
                                       st.key_pos.contiguous(), n_full, S % bs))
        key_pos.append(int(st.key_pos.max()))
    cos_h, sin_h = rope_table(steps[0].inv_freq, max(key_pos) + 1)
    kc = comps[0][0][0]
    return cpu_quant.QuantStep([f for layer in fields for f in layer], seqs, kc.block_size, num_heads, kc.num_heads,
                               kc.head_dim, cos_h, sin_h, kc.head_dim ** -0.5)


def finish_quant_step(comps: list, steps: list[SeqStep], quant: cpu_quant.QuantStep) -> None:
    """After quant_step's kernel: each token that filled its block's last row quantizes the block (or keeps it as
    the head), from the tail and the token's float32 rows, as _store does on the Python path."""
    for b, (st, layers) in enumerate(zip(steps, comps)):
        S, bs = st.res.first_slot, layers[0][0].block_size
        if S % bs == bs - 1:
            seq = st.res.seq
            for l, (kc, vc) in enumerate(layers):
                kc.write(seq.seq_id, quant.rows[l, b, 0:1], S, seq.block_table)
                vc.write(seq.seq_id, quant.rows[l, b, 1:2], S, seq.block_table)


def _decode_kernel(q, k, v, st: SeqStep, kp, vp) -> torch.Tensor:
    prep = st.kernel_args
    if prep is None:          # once per step, shared by the layers
        seq, bs = st.res.seq, kp.data.shape[1]
        cos_h, sin_h = rope_table(st.inv_freq, int(st.key_pos.max()) + 1)
        prep = st.kernel_args = (st.past_slots.contiguous(), torch.tensor(seq.block_table, dtype=torch.long),
                                 st.res.first_slot // bs, bs, cos_h, sin_h, st.key_pos.contiguous(), q.shape[-1] ** -0.5)
    out = cpu_quant.attn_decode_quant(q[0].float().contiguous(), k[0].float().contiguous(), v[0].float().contiguous(),
                                      kp, vp, *prep, check=False)
    return out.view(1, *out.shape)


def _store(kc: Component, vc: Component, k, v, st: SeqStep) -> None:
    res, T = st.res, k.shape[0]
    seq = res.seq
    new_rows = st.rows[st.rows.shape[0] - T:]
    for comp, x in ((kc, k), (vc, v)):
        if comp.fmt.is_quantized:
            comp.write(seq.seq_id, x, res.first_slot, seq.block_table)
        elif comp is kc:
            comp.write_rows(rotate(x.float(), st.q_cos, st.q_sin), new_rows)
        else:
            comp.write_rows(x, new_rows)


def _quantized_torch(kc: Component, vc: Component, q, k, v, st: SeqStep) -> torch.Tensor:
    """The torch path (prefill, GPUs, mixed formats; the decode kernel's reference): dequantize the held past."""
    res = st.res
    seq = res.seq
    k_all, v_all = k.float(), v.float()
    if st.past_slots.numel():
        k_all = torch.cat((_read(kc, seq, res.first_slot, st.past_slots), k_all))
        v_all = torch.cat((_read(vc, seq, res.first_slot, st.past_slots), v_all))
    if not kc.fmt.is_quantized:       # stored rotated: only the sinks and the new keys need turning
        P = st.past_slots.numel()
        if st.n_sink:
            k_all[:st.n_sink] = rotate(k_all[:st.n_sink], st.delta_cos, st.delta_sin)
        k_all[P:] = rotate(k_all[P:], st.q_cos, st.q_sin)
    else:
        k_all = rotate(k_all, *key_rope(st))
    return softmax_attention(rotate(q.float(), st.q_cos, st.q_sin), k_all, v_all, st.decode)


def _read(comp: Component, seq, seq_len: int, slots: torch.Tensor) -> torch.Tensor:
    if comp.fmt.is_quantized:
        return comp.read_slots(seq.seq_id, seq.block_table, seq_len, slots)
    bs = comp.block_size
    table = torch.tensor(seq.block_table, dtype=torch.long)
    rows = (table[slots // bs] * bs + slots % bs).to(comp.device)
    return comp.flat_pages().index_select(0, rows).float()


Q_BLOCK = 32        # query rows per block of prompt attention


def softmax_attention(q_rot: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, decode: bool = True) -> torch.Tensor:
    """The one softmax attention (besides the kernels' references): q [T, Hq, D] rotated, k/v [P + T, Hkv, D]
    with the new tokens last (causal among themselves) -> [T, Hq, D].

    Prompt rows go in blocks of Q_BLOCK queries aligned to multiples of Q_BLOCK positions, each block
    padded to Q_BLOCK rows and reading the keys up to its block's end: a row's result then depends only
    on its position and the keys, not on where its chunk started (a prompt whose start came from the
    prefix cache gives the same bits as one read whole)."""
    T, D = q_rot.shape[0], q_rot.shape[-1]
    Hkv = k_all.shape[1]
    if T == 1 and decode:     # one query: two batched matmuls beat SDPA's GQA expansion on small heads
        scores = torch.bmm(q_rot[0].view(Hkv, -1, D), k_all.permute(1, 2, 0)) * D ** -0.5
        return torch.bmm(scores.softmax(-1), v_all.transpose(0, 1)).reshape(1, -1, D)
    N, Hq = k_all.shape[0], q_rot.shape[1]
    G, P = Hq // Hkv, N - T
    out = q_rot.new_empty(T, Hq, D)
    k_t, v_t = k_all.permute(1, 2, 0), v_all.transpose(0, 1)         # [Hkv, D, N], [Hkv, N, D]
    offsets = torch.arange(Q_BLOCK, device=q_rot.device)
    start = P
    while start < N:
        block_end = (start // Q_BLOCK + 1) * Q_BLOCK
        end = min(N, block_end)
        qb = q_rot[start - P:end - P]
        if end - start < Q_BLOCK:
            qb = torch.cat((qb, qb.new_zeros(Q_BLOCK - (end - start), Hq, D)))
        qg = qb.view(Q_BLOCK, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * Q_BLOCK, D)
        scores = torch.bmm(qg, k_t[:, :, :end]) * D ** -0.5
        future = torch.arange(end, device=q_rot.device)[None, :] > (start + offsets)[:, None]
        scores = scores.view(Hkv, G, Q_BLOCK, end).masked_fill_(future, float("-inf"))
        o = torch.bmm(scores.softmax(-1).view(Hkv, G * Q_BLOCK, end), v_t[:, :end])
        out[start - P:end - P] = o.view(Hkv, G, Q_BLOCK, D).permute(2, 0, 1, 3).reshape(Q_BLOCK, Hq, D)[:end - start]
        start = end
    return out


def sm_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
