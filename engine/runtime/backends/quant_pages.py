"""Quantized pages (int8, fp8, int4; any layer may keep full precision): keys stored before RoPE and rotated as
they are read, at the step's effective positions; a tail per sequence holds the block being filled. Two
backends: torch (dequantize the held past), and C on the CPU (attn_decode_quant reads the pages in place for a
one-token decode; the whole step, every layer's attention included, in one QuantStep call when no layer keeps
full precision)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.kernels import cpu_quant, cpu_step

from kvchat.engine.kv.pages import Component
from kvchat.engine.model.rope import rope_table, rotate
from kvchat.engine.runtime.attention import prompt_attention
from kvchat.engine.runtime.backends.base import AttentionBackend, LayerScores
from kvchat.engine.runtime.backends.full_pages import score_args, sink_args, attend_torch as attend_full


def key_rope(st) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P + T, D] at the effective key positions (for keys stored before RoPE), computed once per step."""
    if st.key_cos is None:
        cos_h, sin_h = rope_table(st.inv_freq, int(st.key_pos.max()) + 1)
        cos, sin = cos_h[st.key_pos], sin_h[st.key_pos]
        device = st.q_cos.device
        st.key_cos, st.key_sin = torch.cat((cos, cos), -1).to(device), torch.cat((sin, sin), -1).to(device)
    return st.key_cos, st.key_sin


def attend_quantized(kc: Component, vc: Component, q, k, v, st, kernel: bool,
                     scores: LayerScores | None = None, watch=None, prompt_kernel: bool = False) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] before RoPE, a layer with a quantized K or V; -> [T, Hq, D]. Attends over the
    past before writing, since a write may quantize the tail away. kernel: through attn_decode_quant (a one-token
    decode of a layer whose K and V the C kernel reads); prompt_kernel: prompt rows through attn_prompt_quant (the
    pages read in place) where no watch measures them; else through torch."""
    if kernel:
        mass, copies = (None, []) if watch is None else watch.kernel([st])
        out = decode_kernel(q, k, v, st, *kernel_pages(kc, vc, st), None if scores is None else scores.scale,
                            sink_args(scores), mass)
        if copies:
            watch.done(mass, copies)
    elif prompt_kernel and (watch is None or watch.rows(st) is None):
        out = prompt_kernel_attend(q, k, v, st, kc, vc, scores)
    else:
        out = attend_torch(kc, vc, q, k, v, st, scores, watch)
    store(kc, vc, k, v, st)
    return out


def kernel_pages(kc: Component, vc: Component, st) -> list[cpu_quant.QuantPages]:
    """The K and V pages as the C decode kernel reads them."""
    seq = st.res.seq
    n_full = st.res.first_slot // kc.block_size
    out = []
    for c in (kc, vc):
        data, scale, zero = c.tensors()
        head = c.heads.get(seq.block_table[0]) if n_full else None
        out.append(cpu_quant.QuantPages(c.fmt, data, scale, zero, head, c.tails.get(seq.seq_id)))
    return out


@dataclass(frozen=True)
class QuantDecodeArgs:
    """What attn_decode_quant reads of one sequence's step, the same for every layer: made by the first layer."""

    past_slots: torch.Tensor      # [P] int64, the held past's slots
    block_table: torch.Tensor     # int64, the held blocks in slot order
    n_full: int                   # blocks before the tail (quantized, or the head)
    block_size: int
    cos: torch.Tensor             # RoPE tables up to the largest effective key position
    sin: torch.Tensor
    key_pos: torch.Tensor         # [P + 1] effective key positions

    @classmethod
    def of(cls, st, block_size: int) -> "QuantDecodeArgs":
        if st.kernel_args is None:
            cos_h, sin_h = rope_table(st.inv_freq, int(st.key_pos.max()) + 1)
            st.kernel_args = cls(st.past_slots.contiguous(), torch.tensor(st.res.seq.block_table, dtype=torch.long),
                                 st.res.first_slot // block_size, block_size, cos_h, sin_h, st.key_pos.contiguous())
        return st.kernel_args


def decode_kernel(q, k, v, st, kp, vp, scale: float | None = None,
                  sink_logits: torch.Tensor | None = None, mass: cpu_quant.Mass | None = None) -> torch.Tensor:
    a = QuantDecodeArgs.of(st, kp.data.shape[1])
    out = cpu_quant.attn_decode_quant(q[0].float().contiguous(), k[0].float().contiguous(), v[0].float().contiguous(),
                                      kp, vp, a.past_slots, a.block_table, a.n_full, a.block_size, a.cos, a.sin,
                                      a.key_pos, q.shape[-1] ** -0.5 if scale is None else scale,
                                      check=False, sink_logits=sink_logits, mass=mass)
    return out.view(1, *out.shape)


def prompt_kernel_attend(q, k, v, st, kc: Component, vc: Component, scores: LayerScores | None) -> torch.Tensor:
    """attend_torch's result through attn_prompt_quant: the held past read from the pages in place, no gathered
    copy (the same bits: tests/test_prompt_attention.py)."""
    a = QuantDecodeArgs.of(st, kc.block_size)
    kp, vp = kernel_pages(kc, vc, st)
    scale = q.shape[-1] ** -0.5 if scores is None else scores.scale
    return cpu_quant.attn_prompt_quant(rotate(q.float(), st.q_cos, st.q_sin), k, v, kp, vp, a.past_slots,
                                       a.block_table, a.n_full, a.block_size, a.cos, a.sin, a.key_pos, scale,
                                       None if scores is None else scores.softcap, st.outside, sink_args(scores))


def store(kc: Component, vc: Component, k, v, st) -> None:
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


def attend_torch(kc: Component, vc: Component, q, k, v, st, scores: LayerScores | None = None,
                 watch=None) -> torch.Tensor:
    """The torch path (prefill, GPUs, mixed formats; the decode kernel's reference): dequantize the held past."""
    res = st.res
    seq = res.seq
    k_all, v_all = k.float(), v.float()
    if st.past_slots.numel():
        k_all = torch.cat((kc.values(seq.seq_id, seq.block_table, res.first_slot, st.past_slots), k_all))
        v_all = torch.cat((vc.values(seq.seq_id, seq.block_table, res.first_slot, st.past_slots), v_all))
    if not kc.fmt.is_quantized:       # stored rotated: only the sinks and the new keys need turning
        P = st.past_slots.numel()
        if st.n_sink:
            k_all[:st.n_sink] = rotate(k_all[:st.n_sink], st.delta_cos, st.delta_sin)
        k_all[P:] = rotate(k_all[P:], st.q_cos, st.q_sin)
    else:
        k_all = rotate(k_all, *key_rope(st))
    return prompt_attention(rotate(q.float(), st.q_cos, st.q_sin), k_all, v_all, st.decode,
                             *score_args(scores), st.outside, sink_args(scores), None if watch is None else watch.rows(st))


class QuantPagesTorch(AttentionBackend):
    name = "quant-pages-torch"

    def attend(self, layer, q, k, v, st, watch=None):
        kc, vc = self.comps[layer]
        if not (kc.fmt.is_quantized or vc.fmt.is_quantized):      # a layer kept in full precision
            return attend_full(kc, vc, q, k, v, st, self.scores[layer], watch)
        return self._quantized(layer, kc, vc, q, k, v, st, False, watch)

    def _quantized(self, layer, kc, vc, q, k, v, st, kernel: bool, watch=None,
                   prompt_kernel: bool = False) -> torch.Tensor:
        scores = self.scores[layer]
        default = scores.softcap is None and scores.scale == q.shape[-1] ** -0.5 and scores.sink_logits is None
        if default:         # as every Llama layer
            return attend_quantized(kc, vc, q, k, v, st, kernel, None, watch, prompt_kernel)
        return attend_quantized(kc, vc, q, k, v, st, kernel, scores, watch, prompt_kernel)


def kernel_reads(kc: Component, vc: Component) -> bool:
    """Whether the C quantized decode attention reads this layer's K and V (both quantized, in kinds it knows)."""
    query = torch.empty(1, kc.head_dim, device=kc.device)       # only its width and device are read
    return (kc.fmt.is_quantized and vc.fmt.is_quantized
            and cpu_quant.can_attend_quantized(query, kc.fmt, vc.fmt, kc.full_dtype, kc.pages["data"]))


class QuantPagesC(QuantPagesTorch):
    name = "quant-pages-c"

    def __init__(self, layout, comps, num_heads, scores):
        super().__init__(layout, comps, num_heads, scores)
        # layers whose formats the C kernel reads (a layer kept in full precision is not one); none is soft-capped
        self.kernel_layers = [kernel_reads(kc, vc) for kc, vc in comps]
        self.prompt_layers = [ok and cpu_quant.can_attend_prompt_quantized(num_heads, kc.num_heads, kc.head_dim)
                              for ok, (kc, vc) in zip(self.kernel_layers, comps)]

    def attend(self, layer, q, k, v, st, watch=None):
        if not self.kernel_layers[layer]:
            return super().attend(layer, q, k, v, st, watch)
        kc, vc = self.comps[layer]
        return self._quantized(layer, kc, vc, q, k, v, st, st.one_token_decode, watch,
                               not st.one_token_decode and self.prompt_layers[layer])

    def one_call_group(self, steps, prepared, num_heads, mass):
        if not all(self.kernel_layers):          # QuantStep takes no full-precision layers: they call back
            return None
        return quant_step(self.comps, steps, num_heads, self.scores[0].scale, [s.sink_logits for s in self.scores],
                          mass)

    def one_call_done(self, steps, group):
        finish_quant_step(self.comps, steps, group)


def quant_step(comps, steps: list, num_heads: int, scale: float,
               sink_logits: list[torch.Tensor | None] | None = None,
               mass: cpu_quant.Mass | None = None) -> cpu_step.QuantStep:
    """A decode step's attention over quantized pages, every layer and sequence of one layout, for the one-call
    step to run in C (cpu_step.QuantStep; sink_logits: per layer, or None). After the kernel, finish_quant_step
    quantizes the blocks it completed."""
    fields = [[] for _ in comps]
    seqs, key_pos = [], []
    kc = comps[0][0]
    bs = kc.block_size
    for st in steps:
        seq = st.res.seq
        S = st.res.first_slot
        sid, n_full = seq.seq_id, S // bs
        first = seq.block_table[0]
        for l, (kl, vl) in enumerate(comps):
            for c in (kl, vl):
                fields[l].append((c.kernel_static(), c.heads.get(first) if n_full else None, c.tails[sid]))
        seqs.append(cpu_step.QuantSeq(st.past_slots.contiguous(), torch.tensor(seq.block_table, dtype=torch.long),
                                      st.key_pos.contiguous(), n_full, S % bs))
        key_pos.append(int(st.key_pos.max()))
    cos_h, sin_h = rope_table(steps[0].inv_freq, max(key_pos) + 1)
    return cpu_step.QuantStep([f for layer in fields for f in layer], seqs, bs, num_heads, kc.num_heads,
                              kc.head_dim, cos_h, sin_h, scale, sink_logits, mass)


def finish_quant_step(comps, steps: list, quant: cpu_step.QuantStep) -> None:
    """After quant_step's kernel: each token that filled its block's last row quantizes the block (or keeps it as
    the head), from the tail and the token's float32 rows, as store() does on the Python path."""
    bs = comps[0][0].block_size
    for b, st in enumerate(steps):
        S = st.res.first_slot
        if S % bs == bs - 1:
            seq = st.res.seq
            for l, (kc, vc) in enumerate(comps):
                kc.write(seq.seq_id, quant.rows[l, b, 0:1], S, seq.block_table)
                vc.write(seq.seq_id, quant.rows[l, b, 1:2], S, seq.block_table)
