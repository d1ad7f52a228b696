"""The GPU path's attention backends: every one-token decode through the Triton paged decode attention
(kernels/triton_attention.py); prompt rows through the torch path the CPU uses (softmax_attention, blocks of
Q_BLOCK queries, so a prompt's bits do not depend on where its chunk started); new quantized blocks through the
Triton store kernel (kernels.store_blocks, which Component.write calls).

Full-precision pages: the kernel reads the rotated rows in place, turning each sequence's sinks by its delta, and a
run of decodes of one layout is one kernel call per layer. Quantized pages: the held past is dequantized by torch
into a scratch (Component.values, one sequence at a time), and the kernel turns its pre-RoPE keys at their effective
positions as it reads them. Reading int8 / fp8 / int4 pages inside the kernel, as the C kernel does on the CPU,
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


def attend_quantized(kc, vc, q, k, v, st, scores: LayerScores) -> torch.Tensor:
    """One sequence's one-token decode of a layer with a quantized K or V: the past dequantized by torch, the kernel
    turning pre-RoPE keys per row; attends before storing (a store may quantize the tail away) -> [1, Hq, D]."""
    res, seq = st.res, st.res.seq
    k_all, v_all = k.float(), v.float()
    P = st.past_slots.numel()
    if P:
        k_all = torch.cat((kc.values(seq.seq_id, seq.block_table, res.first_slot, st.past_slots), k_all))
        v_all = torch.cat((vc.values(seq.seq_id, seq.block_table, res.first_slot, st.past_slots), v_all))
    n = k_all.shape[0]
    rows, offsets = torch.arange(n, device=k_all.device), torch.tensor([0, n], device=k_all.device)
    q_rot = rotate(q.float(), st.q_cos, st.q_sin)
    if kc.fmt.is_quantized:               # every key before RoPE: turned at its effective position in the kernel
        cos, sin = key_rope(st)
        out = decode_attention(q_rot, k_all, v_all, rows, offsets, [n], scores.scale, scores.softcap,
                               key_cos=cos, key_sin=sin)
    else:                                 # keys stored rotated: the new one turned here, the sinks in the kernel
        k_all[P:] = rotate(k_all[P:], st.q_cos, st.q_sin)
        sink = torch.tensor([st.n_sink], dtype=torch.int32, device=k_all.device)
        out = decode_attention(q_rot, k_all, v_all, rows, offsets, [n], scores.scale, scores.softcap,
                               sink if st.n_sink else None, st.delta_cos, st.delta_sin)
    store(kc, vc, k, v, st)
    return out


class QuantPagesTriton(QuantPagesTorch):
    name = "quant-pages-triton"

    def attend(self, layer, q, k, v, st):
        if not st.one_token_decode:
            return super().attend(layer, q, k, v, st)
        kc, vc = self.comps[layer]
        if not (kc.fmt.is_quantized or vc.fmt.is_quantized):        # a layer kept in full precision
            return attend_full(kc, vc, q, k, v, triton_group([st]), self.scores[layer])
        return attend_quantized(kc, vc, q, k, v, st, self.scores[layer])
