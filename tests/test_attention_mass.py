"""Attention mass measured in the C kernels (cpu_quant.Mass): each head's softmax probability of every attended row,
summed per column, the learned sink's share in the last column, against a float64 reference written plainly; and
measuring changes no output bit."""
from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from kvchat.engine.model.rope import rope_table, rotate
from kvchat.kernels import cpu_quant, cpu_step
from test_sink_logits import HKV, HQ, D, _quant_pages, needs_c, needs_kv, sinks_of, with_sink


def column_sums(probs: torch.Tensor, cols: torch.Tensor, mcols: int, sink: torch.Tensor | None) -> torch.Tensor:
    """probs [Hkv, G, N] float64, cols [N] -> [Hq, mcols]: summed per column, the sink's share last."""
    out = torch.zeros(HQ, mcols, dtype=torch.float64)
    out[:, :-1].index_add_(1, cols.long(), probs.reshape(HQ, -1))
    out[:, -1] = 1 - probs.reshape(HQ, -1).sum(-1) if sink is not None else 0
    return out


@needs_c
@pytest.mark.parametrize("sinks", [False, True])
def test_c_decode_attention_measures_mass_per_column(sinks):
    """attn_decode_batch over sequences cut into 1, 2 and 4 spans, sink tokens in one: per column the float64
    probabilities' sums; each row with its sink column sums to 1; the output is the unmeasured call's, bit for bit."""
    g = torch.Generator().manual_seed(3)
    k_pages, v_pages = torch.randn(600, HKV, D, generator=g), torch.randn(600, HKV, D, generator=g)
    lengths, n_sink = [30, 100, 300], [0, 4, 0]
    rows = [torch.randperm(600, generator=g)[:n] for n in lengths]
    cols = [torch.sort(torch.randint(0, 25, (n,), generator=g)).values.int() for n in lengths]
    q, q_sink = torch.randn(3, HQ, D, generator=g), torch.randn(3, HQ, D, generator=g)
    sink = sinks_of(g) if sinks else None
    mass = cpu_quant.Mass(torch.cat(cols), torch.full((3, HQ, 26), 7.0))
    offsets = torch.tensor([0] + lengths).cumsum(0)
    call = lambda m: cpu_quant.attn_decode_batch(q, q_sink, torch.tensor(n_sink, dtype=torch.int32), k_pages, v_pages, torch.cat(rows), offsets, 0.2,
                                                 sink_logits=sink, mass=m)
    assert torch.equal(call(mass), call(None))
    for b in range(3):
        k = k_pages[rows[b]].double()
        s = torch.cat((torch.einsum("hgd,nhd->hgn", q_sink[b].double().view(HKV, -1, D), k[:n_sink[b]]),
                       torch.einsum("hgd,nhd->hgn", q[b].double().view(HKV, -1, D), k[n_sink[b]:])), -1) * 0.2
        probs = with_sink(s, sink)[0] if sinks else s.softmax(-1)
        want = column_sums(probs, cols[b], 26, sink)
        assert (mass.out[b].double() - want).abs().max() < 1e-6
        assert (mass.out[b].sum(-1) - 1).abs().max() < 1e-5


@needs_kv
@pytest.mark.parametrize("fmt_name", ["int8", "int4"])
def test_c_quantized_decode_attention_measures_mass_per_block(fmt_name):
    """attn_decode_quant over a head block, quantized blocks, a tail and a window's gap: per block of positions, the
    reference's probabilities summed (sink logits on); the output unchanged by measuring."""
    g = torch.Generator().manual_seed(11)
    bs, n_full, tail = 16, 6, 5
    kp, vp = _quant_pages(fmt_name, n_full + 2, bs, g, head=True)
    table = torch.randperm(n_full + 2, generator=g)[:n_full + 1]
    slots = torch.cat((torch.arange(4), torch.arange(40, n_full * bs + tail)))
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    cos_h, sin_h = rope_table(inv, 512)
    pos = torch.cat((slots, torch.tensor([n_full * bs + tail])))
    q = torch.randn(HQ, D, generator=g)
    k_new, v_new = torch.randn(HKV, D, generator=g), torch.randn(HKV, D, generator=g)
    args = (q, k_new, v_new, kp, vp, slots, table, n_full, bs, cos_h, sin_h, pos, 0.2)
    sink = sinks_of(g)
    cols = (pos // bs).int()
    mass = cpu_quant.Mass(cols, torch.zeros(1, HQ, n_full + 2))
    assert torch.equal(cpu_quant.attn_decode_quant(*args, sink_logits=sink, mass=mass),
                       cpu_quant.attn_decode_quant(*args, sink_logits=sink))
    # the reference: the dequantized rows, rotated at their positions, softmax with the sink column
    k = torch.cat((cpu_quant._rows_ref(kp, slots, table, n_full, bs), k_new[None])).double()
    cos, sin = cos_h[pos], sin_h[pos]
    k_rot = rotate(k, torch.cat((cos, cos), -1).double(), torch.cat((sin, sin), -1).double())
    q_rot = rotate(q.double()[None], torch.cat((cos, cos), -1).double()[-1:], torch.cat((sin, sin), -1).double()[-1:])
    scores = torch.einsum("hgd,nhd->hgn", q_rot.view(HKV, -1, D), k_rot) * 0.2
    want = column_sums(with_sink(scores, sink)[0], cols, n_full + 2, sink)
    assert (mass.out[0].double() - want).abs().max() < 1e-5
    assert mass.out[0, :, 1:2].sum() == 0          # positions 16-31: the window's gap holds nothing


@needs_kv
def test_the_one_call_quantized_step_measures_each_layers_mass():
    """QuantStep's mass [layers, B, Hq, mcols]: per layer and sequence, attn_decode_quant's own measure."""
    g = torch.Generator().manual_seed(7)
    bs, B, n_layers = 16, 2, 2
    cos_h, sin_h = rope_table(1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), 256)
    pages = [_quant_pages("int8", 4, bs, g, head=False) for _ in range(n_layers)]
    seqs, cols = [], []
    for b, n_full in enumerate((2, 3)):
        fill = 4 + b
        slots = torch.arange(n_full * bs + fill)
        pos = torch.cat((slots, slots[-1:] + 1))
        seqs.append(cpu_step.QuantSeq(slots, torch.arange(n_full + 1), pos, n_full, fill))
        cols.append((pos // bs).int())
    own = [[[replace(p, tail=torch.randn(bs, HKV, D, generator=g)) for p in kv] for _ in range(B)] for kv in pages]
    comps = [(cpu_step.kv_comp_static(p.fmt, p.data, p.scale, p.zero, torch.float32), None, p.tail)
             for layer in own for kv in layer for p in kv]
    mass = cpu_quant.Mass(torch.cat(cols), torch.zeros(n_layers, B, HQ, 5))
    step = cpu_step.QuantStep(comps, seqs, bs, HQ, HKV, D, cos_h, sin_h, 0.2, None, mass)
    qkv = torch.randn(B, (HQ + 2 * HKV) * D, generator=g)
    out = torch.empty(B, HQ * D)
    for layer in range(n_layers):
        want = []
        for b, (x, st) in enumerate(zip(qkv, seqs)):
            one = cpu_quant.Mass(cols[b], torch.zeros(1, HQ, 5))
            cpu_quant.attn_decode_quant(x[:HQ * D].view(HQ, D), x[HQ * D:(HQ + HKV) * D].view(HKV, D),
                                        x[(HQ + HKV) * D:].view(HKV, D), *own[layer][b], st.slots, st.table,
                                        st.n_full, bs, cos_h, sin_h, st.pos, 0.2, mass=one)
            want.append(one.out[0])
        assert cpu_quant._kv_lib.attend_quant_layer(ctypes.addressof(step.struct), layer, qkv.data_ptr(),
                                                    out.data_ptr()) == 0
        assert torch.equal(mass.out[layer], torch.stack(want))
