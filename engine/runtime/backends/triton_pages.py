"""The GPU path's attention backends: every one-token decode through the Triton paged decode attention
(kernels/triton_attention.py); prompt rows through the torch path the CPU uses (softmax_attention, blocks of
Q_BLOCK queries, so a prompt's bits do not depend on where its chunk started); new quantized blocks through the
Triton store kernel (kernels.store_blocks, which Component.write calls).

Full-precision pages: the kernel reads the rotated rows in place, turning each sequence's sinks by its delta, and a
run of decodes of one layout is one kernel call per layer. Quantized pages: the held past is dequantized by torch
into a scratch (Component.values, one sequence at a time), and the kernel turns its pre-RoPE keys at their effective
positions as it reads them; a run of decodes is one kernel call per layer there too. Reading int8 / fp8 / int4 pages inside the kernel, as the C kernel does on the CPU,
would save that scratch's round trip through memory; it is the next step for this backend, not done here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton_attention import decode_attention

from engine.model.rope import rotate
from engine.runtime.backends.base import LayerScores
from engine.runtime.backends.full_pages import FullPagesTorch
from engine.runtime.backends.quant_pages import QuantPagesTorch, key_rope, store


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
                            grp.delta_sin)


class FullPagesTriton(FullPagesTorch):
    name = "full-pages-triton"

    def attend(self, layer, q, k, v, st):
        if st.one_token_decode:
            return self.attend_decodes(layer, q, k, v, [st], triton_group([st]))
        return super().attend(layer, q, k, v, st)

    def prepare_decodes(self, steps):
        return triton_group(steps)

    def attend_decodes(self, layer, q, k, v, steps, grp: TritonGroup):
        kc, vc = self.comps[layer]
        return attend_full(kc, vc, q, k, v, grp, self.scores[layer])


def attend_quantized(kc, vc, q, k, v, steps: list, scores: LayerScores) -> torch.Tensor:
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
    grp = triton_group(steps)
    q_rot = rotate(q.float(), grp.q_cos, grp.q_sin)
    if kc.fmt.is_quantized:
        out = decode_attention(q_rot, k_all, v_all, rows, offsets, lengths, scores.scale, scores.softcap,
                               key_cos=torch.cat(cos), key_sin=torch.cat(sin))
    else:
        out = decode_attention(q_rot, k_all, v_all, rows, offsets, lengths, scores.scale, scores.softcap,
                               grp.n_sink, grp.delta_cos, grp.delta_sin)
    for i, st in enumerate(steps):
        store(kc, vc, k[i:i + 1], v[i:i + 1], st)
    return out


class QuantPagesTriton(QuantPagesTorch):
    name = "quant-pages-triton"

    def attend(self, layer, q, k, v, st):
        if st.one_token_decode:
            return self.attend_decodes(layer, q, k, v, [st], triton_group([st]))
        return super().attend(layer, q, k, v, st)

    def prepare_decodes(self, steps):
        return triton_group(steps)

    def attend_decodes(self, layer, q, k, v, steps, grp: TritonGroup):
        kc, vc = self.comps[layer]
        if not (kc.fmt.is_quantized or vc.fmt.is_quantized):        # a layer kept in full precision
            return attend_full(kc, vc, q, k, v, grp, self.scores[layer])
        return attend_quantized(kc, vc, q, k, v, steps, self.scores[layer])
