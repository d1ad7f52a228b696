"""The GPU path's attention backends: every one-token decode through the Triton paged decode attention
(kernels/triton_attention.py); prompt rows through the torch path the CPU uses (softmax_attention, blocks of
Q_BLOCK queries, so a prompt's bits do not depend on where its chunk started); new quantized blocks through the
Triton store kernel (kernels.store_blocks, which Component.write calls).

Full-precision pages: the kernel reads the rotated rows in place, turning each sequence's sinks by its delta.
Quantized pages (K and V both quantized): the kernel reads the int8 / fp8 / int4 blocks in place, dequantizing and
turning each pre-RoPE key at its effective position as it reads it; the full-precision head block, the tail being
filled and the new token come from a small scratch, and the two parts' softmax states are merged. A layer with
only one side quantized dequantizes its past into a scratch first. A run of decodes of one layout is one call (two
for the quantized split) per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.kernels.triton_attention import QuantPages, attention_partials, decode_attention, merge_partials

from kvchat.engine.model.rope import rotate
from kvchat.engine.runtime.backends.base import LayerScores
from kvchat.engine.runtime.backends.full_pages import FullPagesTorch
from kvchat.engine.runtime.backends.quant_pages import QuantPagesTorch, key_rope, store


@dataclass
class TritonGroup:
    """A run of one-token decodes over full-precision pages, as the kernel reads them (tensors on the device)."""

    q_cos: torch.Tensor                 # [B, D]
    q_sin: torch.Tensor
    n_sink: torch.Tensor | None         # [B] int32, None where no sequence has sinks
    delta_cos: torch.Tensor | None      # [B, D] each sequence's sink rotation (q_cos where it has none, unused)
    delta_sin: torch.Tensor | None
    rows: torch.Tensor                  # every sequence's page rows, one after another
    offsets: torch.Tensor               # [B + 1]
    lengths: list[int]
    new_rows: torch.Tensor              # [B] the new tokens' page rows


def triton_group(steps: list) -> TritonGroup:
    sinks = any(st.n_sink for st in steps)
    lengths = [st.rows.shape[0] for st in steps]
    device = steps[0].q_cos.device
    cat = torch.cat
    return TritonGroup(
        cat([st.q_cos for st in steps]), cat([st.q_sin for st in steps]),
        torch.tensor([st.n_sink for st in steps], dtype=torch.int32, device=device) if sinks else None,
        cat([st.delta_cos if st.n_sink else st.q_cos for st in steps]) if sinks else None,
        cat([st.delta_sin if st.n_sink else st.q_sin for st in steps]) if sinks else None,
        cat([st.rows for st in steps]), torch.tensor([0] + lengths).cumsum(0).to(device), lengths,
        cat([st.rows[-1:] for st in steps]))


def attend_full(kc, vc, q, k, v, grp: TritonGroup, scores: LayerScores) -> torch.Tensor:
    """q [B, Hq, D], k/v [B, Hkv, D] before RoPE, one token per sequence: store the rotated keys and the values,
    then attend every sequence's rows (the new one last) in one kernel call -> float32 [B, Hq, D]."""
    kc.write_rows(rotate(k.float(), grp.q_cos, grp.q_sin), grp.new_rows)
    vc.write_rows(v, grp.new_rows)
    return decode_attention(rotate(q.float(), grp.q_cos, grp.q_sin), kc.flat_pages(), vc.flat_pages(), grp.rows,
                            grp.offsets, grp.lengths, scores.scale, scores.softcap, grp.n_sink, grp.delta_cos,
                            grp.delta_sin, sink_logits=scores.sink_logits)


class _TritonDecodes:
    """Every one-token decode through attend_decodes (a run of them: one kernel call a layer), prompt rows through
    the torch backend beside it in the MRO."""

    def attend(self, layer, q, k, v, st, watch=None):
        if st.one_token_decode:
            return self.attend_decodes(layer, q, k, v, [st], triton_group([st]), watch)
        return super().attend(layer, q, k, v, st, watch)

    def measure(self, layer, q, steps, watch) -> None:
        """A run's mass, where watched: the decode kernel keeps no per-row probabilities, so the rows it attended
        are read again through torch from the pages it left (attend_stored), their output discarded."""
        from kvchat.engine.runtime.backends import attend_stored
        for b, st in enumerate(steps):
            observe = watch.rows(st)
            if observe is not None:
                attend_stored(self.comps[layer], q[b:b + 1], [st], self.scores[layer], observe=observe)

    def prepare_decodes(self, steps):
        return triton_group(steps)


class FullPagesTriton(_TritonDecodes, FullPagesTorch):
    name = "full-pages-triton"

    def attend_decodes(self, layer, q, k, v, steps, grp: TritonGroup, watch=None):
        kc, vc = self.comps[layer]
        out = attend_full(kc, vc, q, k, v, grp, self.scores[layer])
        if watch is not None:
            self.measure(layer, q, steps, watch)
        return out


@dataclass
class PastSplit:
    """One sequence's held past split for a step, the same for every layer: the slots in quantized blocks (read in
    place as page rows) and the rest, in the full-precision head block and the tail being filled (read from a
    scratch); with each part's index into the step's key positions."""

    quant_idx: torch.Tensor       # positions in past_slots of the quantized rows
    quant_rows: torch.Tensor      # their page rows (block id * bs + slot)
    other_idx: torch.Tensor       # positions in past_slots of the head / tail rows
    other_at: torch.Tensor        # their rows in cat(head, tail)
    has_head: bool


def past_split(st, bs: int, has_head: bool) -> PastSplit:
    if st.kernel_args is None:            # once per step, shared by the layers (the field the CPU's kernel uses)
        slots = st.past_slots.cpu()
        n_full = st.res.first_slot // bs
        skip = int(has_head and n_full > 0)
        block = slots // bs
        quant = (block >= skip) & (block < n_full)
        q_idx, o_idx = quant.nonzero()[:, 0], (~quant).nonzero()[:, 0]
        table = torch.tensor(st.res.seq.block_table, dtype=torch.long)
        o_slots = slots[o_idx]
        st.kernel_args = PastSplit(q_idx, table[block[q_idx]] * bs + slots[q_idx] % bs, o_idx,
                                   torch.where(o_slots < skip * bs, o_slots, o_slots - n_full * bs + skip * bs),
                                   bool(skip))
    return st.kernel_args


def attend_in_place(kc, vc, q, k, v, steps: list, grp: TritonGroup, scores: LayerScores) -> torch.Tensor:
    """A run of one-token decodes of a layer whose K and V are both quantized: the quantized blocks read in place by
    the kernel (QuantPages), the head block, the tail and the new token from a small scratch; each key turned at its
    effective position in the kernel; the two parts' softmax states merged. Attends before storing."""
    device = q.device
    bs = kc.block_size
    data_k, scale_k, zero_k = kc.tensors()
    data_v, scale_v, zero_v = vc.tensors()
    q_rows, q_cos, q_sin, q_len = [], [], [], []
    o_k, o_v, o_cos, o_sin, o_len = [], [], [], [], []
    for i, st in enumerate(steps):
        seq = st.res.seq
        first = seq.block_table[0] if seq.block_table else None
        head_k, head_v = kc.heads.get(first), vc.heads.get(first)
        split = past_split(st, bs, head_k is not None)
        cos, sin = key_rope(st)
        P = st.past_slots.numel()
        q_rows.append(split.quant_rows)
        q_cos.append(cos[split.quant_idx.to(cos.device)])
        q_sin.append(sin[split.quant_idx.to(sin.device)])
        q_len.append(split.quant_rows.numel())
        fp_k = [head_k.float()] if split.has_head else []
        fp_v = [head_v.float()] if split.has_head else []
        at = split.other_at.to(device)
        if split.other_idx.numel():
            k_o = torch.cat(fp_k + [kc.open_tail(seq.seq_id).float()]).index_select(0, at)
            v_o = torch.cat(fp_v + [vc.open_tail(seq.seq_id).float()]).index_select(0, at)
        else:
            k_o = v_o = k.new_zeros(0, *k.shape[1:], dtype=torch.float32)
        o_k.append(torch.cat((k_o, k[i:i + 1].float())))
        o_v.append(torch.cat((v_o, v[i:i + 1].float())))
        idx = torch.cat((split.other_idx, torch.tensor([P]))).to(cos.device)
        o_cos.append(cos[idx])
        o_sin.append(sin[idx])
        o_len.append(idx.numel())
    q_rot = rotate(q.float(), grp.q_cos, grp.q_sin)
    offsets = lambda n: torch.tensor([0] + n).cumsum(0).to(device)        # noqa: E731
    parts = [attention_partials(q_rot, torch.cat(o_k), torch.cat(o_v), torch.arange(sum(o_len), device=device),
                                offsets(o_len), o_len, scores.scale, scores.softcap, key_cos=torch.cat(o_cos),
                                key_sin=torch.cat(o_sin))]
    if sum(q_len):
        parts.append(attention_partials(q_rot, QuantPages(data_k, scale_k, zero_k, kc.fmt),
                                        QuantPages(data_v, scale_v, zero_v, vc.fmt), torch.cat(q_rows).to(device),
                                        offsets(q_len), q_len, scores.scale, scores.softcap, key_cos=torch.cat(q_cos),
                                        key_sin=torch.cat(q_sin)))
    out = merge_partials(*parts, sink_logits=scores.sink_logits)
    for i, st in enumerate(steps):
        store(kc, vc, k[i:i + 1], v[i:i + 1], st)
    return out


def attend_quantized(kc, vc, q, k, v, steps: list, grp: TritonGroup, scores: LayerScores) -> torch.Tensor:
    """A run of one-token decodes (one per sequence of `steps`) of a layer with a quantized K or V, in one kernel
    call: each sequence's past dequantized by torch into one scratch, the new token last; pre-RoPE keys turned per
    row in the kernel (stored-rotated ones: the new key turned here, the sinks in the kernel). Attends before
    storing, since a store may quantize a tail away -> float32 [B, Hq, D]."""
    ks, vs, cos, sin, lengths = [], [], [], [], []
    for i, st in enumerate(steps):
        res, seq = st.res, st.res.seq
        k_new, v_new = k[i:i + 1].float(), v[i:i + 1].float()
        if not kc.fmt.is_quantized:
            k_new = rotate(k_new, st.q_cos, st.q_sin)
        if st.past_slots.numel():
            k_new = torch.cat((kc.values(seq.seq_id, seq.block_table, res.first_slot, st.past_slots), k_new))
            v_new = torch.cat((vc.values(seq.seq_id, seq.block_table, res.first_slot, st.past_slots), v_new))
        ks.append(k_new)
        vs.append(v_new)
        lengths.append(k_new.shape[0])
        if kc.fmt.is_quantized:
            c, s_ = key_rope(st)
            cos.append(c)
            sin.append(s_)
    k_all, v_all = torch.cat(ks), torch.cat(vs)
    device = k_all.device
    rows = torch.arange(k_all.shape[0], device=device)
    offsets = torch.tensor([0] + lengths).cumsum(0).to(device)
    q_rot = rotate(q.float(), grp.q_cos, grp.q_sin)
    if kc.fmt.is_quantized:
        out = decode_attention(q_rot, k_all, v_all, rows, offsets, lengths, scores.scale, scores.softcap,
                               key_cos=torch.cat(cos), key_sin=torch.cat(sin), sink_logits=scores.sink_logits)
    else:
        out = decode_attention(q_rot, k_all, v_all, rows, offsets, lengths, scores.scale, scores.softcap,
                               grp.n_sink, grp.delta_cos, grp.delta_sin, sink_logits=scores.sink_logits)
    for i, st in enumerate(steps):
        store(kc, vc, k[i:i + 1], v[i:i + 1], st)
    return out


class QuantPagesTriton(_TritonDecodes, QuantPagesTorch):
    name = "quant-pages-triton"

    def attend_decodes(self, layer, q, k, v, steps, grp: TritonGroup, watch=None):
        kc, vc = self.comps[layer]
        if not (kc.fmt.is_quantized or vc.fmt.is_quantized):        # a layer kept in full precision
            out = attend_full(kc, vc, q, k, v, grp, self.scores[layer])
        elif kc.fmt.is_quantized and vc.fmt.is_quantized:
            out = attend_in_place(kc, vc, q, k, v, steps, grp, self.scores[layer])
        else:
            out = attend_quantized(kc, vc, q, k, v, steps, grp, self.scores[layer])     # one side quantized: a scratch
        if watch is not None:
            self.measure(layer, q, steps, watch)
        return out
