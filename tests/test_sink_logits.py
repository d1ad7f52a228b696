"""Learned per-head sink logits (gpt-oss) in every attention path, against a float64 reference written plainly:
the scores, each head's sink logit appended as one more column, the softmax, the column dropped, times V (the sink
takes mass and gives no value). Not the cache's StreamingLLM sink tokens, which the tests turn on beside them.

Kernels first, on random pages; then every backend inside a real runner (tiny models whose layers are given sink
logits): prompt rows in two chunks, one-token decodes alone and batched, full attention, a model's own sliding
window, a soft-cap, GQA (4 query heads over 2 KV heads), with and without the cache's window and sink tokens."""
from __future__ import annotations

import ctypes
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from kvchat import kernels
from kvchat.engine import CacheConfig, Engine, EngineConfig
from kvchat.engine.model.rope import rope_table, rotate
from kvchat.engine.runtime import backends
from kvchat.engine.runtime.attention import softmax_attention
from kvchat.engine.runtime.backends import quant_pages
from kvchat.engine.runtime.backends.base import AttentionBackend, LayerScores
from kvchat.engine.runtime.backends.full_pages import FullPagesC
from kvchat.engine.runtime.backends.quant_pages import QuantPagesC, key_rope
from kvchat.engine.runtime.runner import ModelRunner
from kvchat.kernels import cpu_quant, cpu_step
from kvchat.kernels.formats import page_format
from kvchat.kernels.reference import store_blocks
from tiny_models import random_ids, tiny_family_dir, tiny_model_dir

HQ, HKV, D = 4, 2, 32
C_KERNELS = cpu_quant.available()
KV_KERNELS = C_KERNELS and cpu_quant.kv_kernels_ready(wait=True)
TRITON = kernels.triton_available()
CUDA = torch.cuda.is_available()
needs_c = pytest.mark.skipif(not C_KERNELS, reason="no C compiler for the CPU kernels")
needs_kv = pytest.mark.skipif(not KV_KERNELS, reason="no C compiler for the quantized-KV kernels")
needs_triton = pytest.mark.skipif(not TRITON, reason="triton is not importable here")


def sinks_of(g: torch.Generator, n: int = HQ) -> torch.Tensor:
    """Sink logits around a row's logsumexp here, so that the sink takes a real share of the mass."""
    return 1.0 + 4.0 * torch.rand(n, generator=g)


def with_sink(scores: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., Hkv, G, N] float64 (-inf where hidden) -> (probabilities [..., N], the sink's mass [...]): the
    sink [Hkv * G] appended as a column, the softmax, the column taken off again."""
    column = sink.double().view(*scores.shape[-3:-1], 1).expand(*scores.shape[:-1], 1)
    p = torch.cat((scores, column), -1).softmax(-1)
    probs, mass = p[..., :-1], p[..., -1]
    assert torch.allclose(mass, 1 - probs.sum(-1), rtol=0, atol=1e-12)
    return probs, mass


def reference(q_rot, k_all, v_all, scale, softcap, sink, hidden=None):
    """q_rot [T, Hq, D], k_all / v_all [N, Hkv, D] (rotated), the T queries last among the keys and causal among
    themselves; hidden [T, N] True where a key lies outside a query's window -> (out [T, Hq, D], mass [T, Hq])."""
    T, N = q_rot.shape[0], k_all.shape[0]
    q = q_rot.double().view(T, HKV, -1, D)
    s = torch.einsum("thgd,nhd->thgn", q, k_all.double()) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    mask = torch.arange(N)[None, :] > (N - T + torch.arange(T))[:, None]
    if hidden is not None:
        mask |= hidden.cpu()
    probs, mass = with_sink(s.masked_fill(mask[:, None, None, :], -math.inf), sink)
    return torch.einsum("thgn,nhd->thgd", probs, v_all.double()).reshape(T, -1, D), mass.reshape(T, -1)


def relative(got, ref) -> float:
    return float((got.double().cpu() - ref.cpu()).abs().max() / ref.abs().max())


# ---- softmax_attention --------------------------------------------------------------------------------------

@pytest.mark.parametrize("P, T", [(37, 1), (20, 45)], ids=["decode", "prompt"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [None, 12])
def test_softmax_attention_takes_sink_logits(P, T, softcap, window):
    """Decode and prompt rows (over two query blocks), soft-capped scores (the sink logit is not capped), a sliding
    window over prompt rows: the float64 reference's output."""
    g = torch.Generator().manual_seed(P + T)
    q = torch.randn(T, HQ, D, generator=g)
    k, v = torch.randn(P + T, HKV, D, generator=g), torch.randn(P + T, HKV, D, generator=g)
    sink = sinks_of(g)
    hidden = None
    if window is not None and T > 1:
        hidden = torch.arange(P + T)[None, :] <= (P + torch.arange(T) - window)[:, None]
    got = softmax_attention(q, k, v, T == 1, 0.3, softcap, hidden, sink_logits=sink)
    want, mass = reference(q, k, v, 0.3, softcap, sink, hidden)
    assert relative(got, want) < 1e-5
    assert 0.05 < float(mass.mean()) < 0.95          # the sink took a real share: the check can fail
    assert relative(softmax_attention(q, k, v, T == 1, 0.3, softcap, hidden), want) > 1e-2


@pytest.mark.parametrize("T", [1, 45])
@pytest.mark.parametrize("very_negative", [-math.inf, -1e4])
def test_softmax_attention_with_a_vanishing_sink_is_todays_bits(T, very_negative):
    g = torch.Generator().manual_seed(T)
    q = torch.randn(T, HQ, D, generator=g)
    k, v = torch.randn(30 + T, HKV, D, generator=g), torch.randn(30 + T, HKV, D, generator=g)
    sink = torch.full((HQ,), very_negative)
    assert torch.equal(softmax_attention(q, k, v, T == 1, 0.2, 4.0, sink_logits=sink),
                       softmax_attention(q, k, v, T == 1, 0.2, 4.0))


# ---- the C kernels on random pages ----------------------------------------------------------------------------

@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_decode_attention_takes_sink_logits(dtype):
    """attn_decode_batch over three sequences cut into 1, 2 and 4 spans (the sink joins their merge once), StreamingLLM
    sink tokens in one of them: its torch reference, and the float64 one."""
    g = torch.Generator().manual_seed(1)
    k_pages = torch.randn(600, HKV, D, generator=g).to(dtype)
    v_pages = torch.randn(600, HKV, D, generator=g).to(dtype)
    lengths, n_sink = [30, 100, 300], [0, 4, 0]
    rows = [torch.randperm(600, generator=g)[:n] for n in lengths]
    q, q_sink = torch.randn(3, HQ, D, generator=g), torch.randn(3, HQ, D, generator=g)
    sink = sinks_of(g)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    args = (q, q_sink, torch.tensor(n_sink, dtype=torch.int32), k_pages, v_pages, torch.cat(rows), offsets, 0.2)
    got = cpu_quant.attn_decode_batch(*args, sink_logits=sink)
    for b in range(3):
        assert relative(got[b], cpu_quant.attn_decode_ref(q[b], q_sink[b], n_sink[b], k_pages, v_pages, rows[b],
                                                           0.2, sink).double()) < 1e-5
        k, v = k_pages[rows[b]].double(), v_pages[rows[b]].double()
        s = torch.cat((torch.einsum("hgd,nhd->hgn", q_sink[b].double().view(HKV, -1, D), k[:n_sink[b]]),
                       torch.einsum("hgd,nhd->hgn", q[b].double().view(HKV, -1, D), k[n_sink[b]:])), -1) * 0.2
        probs, _ = with_sink(s, sink)
        assert relative(got[b], torch.einsum("hgn,nhd->hgd", probs, v).reshape(HQ, D)) < 1e-5
    assert torch.equal(cpu_quant.attn_decode_batch(*args, sink_logits=torch.full((HQ,), -math.inf)),
                       cpu_quant.attn_decode_batch(*args))


def _quant_pages(fmt_name: str, n_blocks: int, bs: int, g, head: bool):
    out = []
    for role in "kv":
        fmt = page_format(fmt_name, role)
        shapes = fmt.shapes(bs, HKV, D)
        pages = {name: torch.zeros(n_blocks, *shape, dtype=dt) for name, (shape, dt) in shapes.items()}
        store_blocks(torch.randn(n_blocks, bs, HKV, D, generator=g), torch.arange(n_blocks), pages["data"],
                     pages.get("scale"), pages.get("zero"), fmt)
        out.append(cpu_quant.QuantPages(fmt, pages["data"], pages["scale"], pages.get("zero"),
                                        torch.randn(bs, HKV, D, generator=g) if head else None,
                                        torch.randn(bs, HKV, D, generator=g)))
    return out


@needs_kv
@pytest.mark.parametrize("fmt_name", ["int8", "int4", "fp8"])
def test_c_quantized_decode_attention_takes_sink_logits(fmt_name):
    """attn_decode_quant (a head block, quantized blocks in a shuffled table, a tail, a gap as a window leaves) against
    its torch reference; -inf sink logits give today's bits."""
    g = torch.Generator().manual_seed(len(fmt_name))
    bs, n_full, tail = 16, 6, 5
    kp, vp = _quant_pages(fmt_name, n_full + 2, bs, g, head=True)
    table = torch.randperm(n_full + 2, generator=g)[:n_full + 1]
    slots = torch.cat((torch.arange(4), torch.arange(20, n_full * bs + tail)))
    cos_h, sin_h = rope_table(1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), 512)
    pos = torch.cat((slots, torch.tensor([n_full * bs + tail])))
    q = torch.randn(HQ, D, generator=g)
    k_new, v_new = torch.randn(HKV, D, generator=g), torch.randn(HKV, D, generator=g)
    args = (q, k_new, v_new, kp, vp, slots, table, n_full, bs, cos_h, sin_h, pos, 0.2)
    sink = sinks_of(g)
    got = cpu_quant.attn_decode_quant(*args, sink_logits=sink)
    assert relative(got, cpu_quant.attn_decode_quant_ref(*args, sink_logits=sink).double()) < 1e-5
    assert relative(got, cpu_quant.attn_decode_quant_ref(*args).double()) > 1e-2
    assert torch.equal(cpu_quant.attn_decode_quant(*args, sink_logits=torch.full((HQ,), -math.inf)),
                       cpu_quant.attn_decode_quant(*args))


@needs_kv
def test_the_one_call_quantized_step_takes_each_layers_sink_logits():
    """QuantStep (attend_quant_layer, the attention of decode_layers' one-call step over quantized pages): per layer
    its own sink logits (none for one of them), the bits of attn_decode_quant with them."""
    g = torch.Generator().manual_seed(5)
    bs, B, n_layers = 16, 2, 3
    cos_h, sin_h = rope_table(1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), 256)
    sinks = [sinks_of(g), None, sinks_of(g)]
    pages = [_quant_pages("int8", 4, bs, g, head=False) for _ in range(n_layers)]
    seqs = []
    for b, n_full in enumerate((2, 3)):
        fill = 4 + b
        slots = torch.arange(n_full * bs + fill)
        pos = torch.cat((slots, slots[-1:] + 1))
        seqs.append(cpu_step.QuantSeq(slots, torch.arange(n_full + 1), pos, n_full, fill))
    # each sequence its own tails (the step writes its new row there): [layer][sequence] (K, V)
    own = [[[replace(p, tail=torch.randn(bs, HKV, D, generator=g)) for p in kv] for _ in range(B)] for kv in pages]
    comps = [(cpu_step.kv_comp_static(p.fmt, p.data, p.scale, p.zero, torch.float32), None, p.tail)
             for layer in own for kv in layer for p in kv]
    step = cpu_step.QuantStep(comps, seqs, bs, HQ, HKV, D, cos_h, sin_h, 0.2, sinks)
    qkv = torch.randn(B, (HQ + 2 * HKV) * D, generator=g)
    for layer in range(n_layers):
        want = [cpu_quant.attn_decode_quant(x[:HQ * D].view(HQ, D), x[HQ * D:(HQ + HKV) * D].view(HKV, D),
                                            x[(HQ + HKV) * D:].view(HKV, D), *own[layer][b], st.slots, st.table,
                                            st.n_full, bs, cos_h, sin_h, st.pos, 0.2, sink_logits=sinks[layer])
                for b, (x, st) in enumerate(zip(qkv, seqs))]
        out = torch.empty(B, HQ * D)
        assert cpu_quant._kv_lib.attend_quant_layer(ctypes.addressof(step.struct), layer, qkv.data_ptr(),
                                                    out.data_ptr()) == 0
        assert torch.equal(out.view(B, HQ, D), torch.stack(want))


# ---- Triton on random pages (the interpreter without a GPU) ----------------------------------------------------

@needs_triton
@pytest.mark.parametrize("pages", ["fp32", "int8", "int4"])
def test_triton_decode_attention_takes_sink_logits(pages):
    """Two sequences over shared pages (full precision with sink tokens turned, or quantized read in place),
    soft-capped: its torch reference, and the merge of two disjoint parts (as the in-place quantized path merges)
    the same."""
    from kvchat.kernels.triton_attention import (QuantPages, attention_partials, decode_attention,
                                                 decode_attention_ref, merge_partials)
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(3)
    bs, n_blocks = 16, 6
    if pages == "fp32":
        k_pages, v_pages = (torch.randn(n_blocks * bs, HKV, D, generator=g).to(dev) for _ in "kv")
        kw = dict(n_sink=torch.tensor([4, 0], dtype=torch.int32, device=dev),
                  delta_cos=torch.rand(2, D, generator=g).to(dev), delta_sin=torch.rand(2, D, generator=g).to(dev))
    else:
        k_pages, v_pages = (QuantPages(p.data.to(dev), p.scale.to(dev), None if p.zero is None else p.zero.to(dev),
                                       p.fmt) for p in _quant_pages(pages, n_blocks, bs, g, head=False))
    lengths = [40, 23]
    rows = torch.cat([torch.randperm(n_blocks * bs, generator=g)[:n] for n in lengths]).to(dev)
    if pages != "fp32":
        angles = torch.rand(rows.shape[0], D, generator=g) * 6
        kw = dict(key_cos=angles.cos().to(dev), key_sin=angles.sin().to(dev))
    offsets = torch.tensor([0, 40, 63], device=dev)
    q = torch.randn(2, HQ, D, generator=g).to(dev)
    sink = sinks_of(g).to(dev)
    got = decode_attention(q, k_pages, v_pages, rows, offsets, lengths, 0.2, 3.0, sink_logits=sink, **kw)
    want = decode_attention_ref(q, k_pages, v_pages, rows, offsets, lengths, 0.2, 3.0, sink_logits=sink, **kw)
    assert relative(got, want.double()) < 1e-5
    plain = decode_attention_ref(q, k_pages, v_pages, rows, offsets, lengths, 0.2, 3.0, **kw)
    assert relative(got, plain.double()) > 1e-2
    if pages != "fp32":        # each sequence's rows in two parts: 0..19 | 20..39 and 0..10 | 11..22
        halves = []
        for idx in (torch.cat((torch.arange(0, 20), torch.arange(40, 51))), torch.cat((torch.arange(20, 40),
                                                                                       torch.arange(51, 63)))):
            n = [20, int(idx.numel()) - 20]
            idx = idx.to(dev)
            starts = torch.tensor([0, n[0], sum(n)], device=dev)
            halves.append(attention_partials(q, k_pages, v_pages, rows[idx], starts, n, 0.2, 3.0,
                                             key_cos=kw["key_cos"][idx], key_sin=kw["key_sin"][idx]))
        assert relative(merge_partials(*halves, sink_logits=sink), want.double()) < 1e-5
    assert torch.equal(decode_attention(q, k_pages, v_pages, rows, offsets, lengths, 0.2, 3.0,
                                        sink_logits=torch.full((HQ,), -math.inf, device=dev), **kw),
                       decode_attention(q, k_pages, v_pages, rows, offsets, lengths, 0.2, 3.0, **kw))


# ---- every backend inside a runner ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Folders of the tiny models, made once: a Llama (full attention), Gemma 2 (a sliding window of 16 every other
    layer, query_pre_attn_scalar; with its soft-cap, and without it so that the C kernels take every layer)."""
    root = tmp_path_factory.mktemp("sink-logits")
    return {"llama": tiny_model_dir(root / "llama", hidden=64, heads=HQ, kv_heads=HKV, head_dim=D, layers=2, seed=1),
            "windowed": tiny_family_dir(root / "windowed", "gemma2", attn_logit_softcapping=None),
            "capped": tiny_family_dir(root / "capped", "gemma2")}


_engines: dict = {}


def engine_of(models, name: str, weights: str = "dense") -> Engine:
    key = (name, weights)
    if key not in _engines:
        device = "cuda" if CUDA and name.endswith("gpu") else "cpu"
        _engines[key] = Engine.load(EngineConfig(model=models[name.removesuffix("-gpu")], weights=weights,
                                                 device=device))
    return _engines[key]


def runner_with(engine: Engine, sinks: list | None) -> ModelRunner:
    """A runner of the engine's model whose layers hold these sink logits (the runner reads Layer.sinks once)."""
    layers = engine.model.layers
    try:
        for L, s in zip(layers, sinks or [None] * len(layers)):
            L.sinks = None if s is None else s.to(engine.model.device)
        return ModelRunner(engine.model, engine.runner.dtype_name, 64)
    finally:
        for L in layers:
            L.sinks = None


class Checked:
    """Every layer's attention of every step, against the float64 reference on the keys and values the step reads
    (gathered before the backend writes: a quantized tail may be gone after), with the layer's sink logits."""

    def __init__(self, monkeypatch, sinks: list):
        self.errors, self.masses, self.backends, self.calls = [], [], set(), Counter()
        real = backends.StepAttention.__call__

        def checked(att, layer, q, k, v):
            todo = []
            for i, j, backend, _, steps in att.layer_runs[layer]:
                kc, vc = backend.comps[backend.local_layer(layer)]
                for st in steps[i:j]:
                    sl = slice(st.offset, st.offset + st.num_new)
                    todo.append((sl, st, backend.scores[backend.local_layer(layer)], gather(kc, vc, k[sl], v[sl], st)))
                self.backends.add(type(backend).__name__)
            out = real(att, layer, q, k, v)
            for sl, st, scores, (k_all, v_all) in todo:
                assert scores.sink_logits is not None and torch.equal(scores.sink_logits.cpu(), sinks[layer])
                q_rot = rotate(q[sl].double(), st.q_cos.double(), st.q_sin.double())
                want, mass = reference(q_rot.cpu(), k_all, v_all, scores.scale, scores.softcap, sinks[layer],
                                       st.outside)
                self.errors.append(relative(out[sl], want))
                self.masses.append(float(mass.mean()))
            return out
        monkeypatch.setattr(backends.StepAttention, "__call__", checked)
        for module, name in ((cpu_quant, "decode_attend"), (cpu_quant, "attn_decode_quant")):
            self._count(monkeypatch, module, name)
        if TRITON:
            from kvchat.engine.runtime.backends import triton_pages
            for name in ("decode_attention", "merge_partials"):
                self._count(monkeypatch, triton_pages, name)

    def _count(self, monkeypatch, module, name):
        real = getattr(module, name)

        def counted(*args, **kw):
            if kw.get("sink_logits") is not None:
                self.calls[name] += 1
            return real(*args, **kw)
        monkeypatch.setattr(module, name, counted)


def gather(kc, vc, k, v, st) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (rotated, at their effective positions) and values, float64 on the CPU, that a sequence's rows of a
    step attend: the held past as stored, then the new rows."""
    seq, P = st.res.seq, st.past_slots.numel()
    k_all = torch.cat((kc.values(seq.seq_id, seq.block_table, st.res.first_slot, st.past_slots), k.float())).double()
    v_all = torch.cat((vc.values(seq.seq_id, seq.block_table, st.res.first_slot, st.past_slots), v.float())).double()
    if kc.fmt.is_quantized:                 # stored before RoPE: each key at its effective position
        cos, sin = key_rope(st)
        k_all = rotate(k_all, cos.double(), sin.double())
    else:                                   # stored rotated: the StreamingLLM sink tokens turned by the delta
        if st.n_sink:
            k_all[:st.n_sink] = rotate(k_all[:st.n_sink], st.delta_cos.double(), st.delta_sin.double())
        k_all[P:] = rotate(k_all[P:], st.q_cos.double(), st.q_sin.double())
    return k_all.cpu(), v_all.cpu()


def drive(runner: ModelRunner, cache: CacheConfig, ids: list[int]) -> list[torch.Tensor]:
    """Prompt rows in two chunks (40 then 12: the second attends a held past), three one-token decodes, then a decode
    of two sequences in one step -> every step's last logits."""
    seqs = [runner.new_sequence(cache) for _ in range(2)]
    try:
        out = [runner.step([(seqs[0], ids[:40])])[0][-1], runner.step([(seqs[0], ids[40:52])])[0][-1]]
        out += [runner.step([(seqs[0], [t])])[0][-1] for t in ids[52:55]]
        out.append(runner.step([(seqs[1], ids[:20])])[0][-1])
        both = runner.step([(seqs[0], [ids[55]]), (seqs[1], [ids[20]])])
        return [o.float().cpu() for o in out + [both[0][-1], both[1][-1]]]
    finally:
        for s in seqs:
            runner.close(s)


CPU_BACKENDS = {      # backend name -> (the cache's formats, the kernel call it must make with sink logits or None)
    "full-torch": (("fp32", "fp32"), None), "full-c": (("fp32", "fp32"), "decode_attend"),
    "quant-torch": (("int8", "int8"), None), "quant-c-int8": (("int8", "int8"), "attn_decode_quant"),
    "quant-c-int4": (("int4", "int4"), "attn_decode_quant"), "quant-c-fp8": (("fp8", "fp8"), "attn_decode_quant"),
}
EXPECTED = {"full-torch": "FullPagesTorch", "full-c": "FullPagesC", "quant-torch": "QuantPagesTorch"}


def cpu_case(monkeypatch, backend: str, window: int | None) -> CacheConfig:
    if backend.endswith("-c") or "-c-" in backend:
        if not (KV_KERNELS if backend.startswith("quant") else C_KERNELS):
            pytest.skip("no C compiler for the CPU kernels")
    else:                    # the torch backends, where the C kernels would be chosen
        monkeypatch.setattr(backends, "kernel_covers", lambda *a: False)
        monkeypatch.setattr(backends, "kernel_reads", lambda *a: False)
    (k_format, v_format), _ = CPU_BACKENDS[backend]
    return CacheConfig(k_format=k_format, v_format=v_format, window=window, sinks=4 if window else 0)


@pytest.mark.parametrize("backend", list(CPU_BACKENDS))
@pytest.mark.parametrize("model, window", [("llama", None), ("llama", 32), ("windowed", None), ("capped", None)],
                         ids=["full-attention", "streaming-window-and-sink-tokens", "model-window", "soft-capped"])
def test_cpu_backends_take_sink_logits(models, monkeypatch, backend, model, window):
    """Every layer of every step within 1e-4 of the float64 reference's largest output (quantized pages: the values
    as stored), the sinks taking a real share of the mass, the backend's kernel called with the sink logits (a
    soft-capped model's quantized pages are given the torch backend; its full-precision pages cap in decode_attend)."""
    cache = cpu_case(monkeypatch, backend, window)
    engine = engine_of(models, model)
    g = torch.Generator().manual_seed(len(backend) + len(model))
    sinks = [sinks_of(g) for _ in engine.model.layers]
    check = Checked(monkeypatch, sinks)
    drive(runner_with(engine, sinks), cache, random_ids(engine, 60, seed=2))
    assert len(check.errors) >= 7 * len(sinks) and max(check.errors) < 1e-4, max(check.errors)
    assert 0.05 < sum(check.masses) / len(check.masses) < 0.95
    want = EXPECTED.get(backend, "QuantPagesC")
    capped_quant = model == "capped" and backend.startswith("quant")
    if capped_quant:             # the quantized pages' C kernels do not cap scores: torch for the whole layout
        want = "QuantPagesTorch"
    assert check.backends == {want}, check.backends
    kernel = CPU_BACKENDS[backend][1]
    if kernel is not None and not capped_quant:
        assert check.calls[kernel] >= 3 * len(sinks), check.calls


TRITON_CASES = {"full": ("fp32", "fp32"), "quantized": ("int8", "int8"), "int4": ("int4", "int4"),
                "one-side-quantized": ("fp32", "int8")}


@needs_triton
@pytest.mark.parametrize("formats", list(TRITON_CASES))
@pytest.mark.parametrize("model, window", [("llama", None), ("llama", 32), ("capped", None)],
                         ids=["full-attention", "streaming-window-and-sink-tokens", "soft-capped-model-window"])
def test_triton_backends_take_sink_logits(models, monkeypatch, formats, model, window):
    """The GPU path (under triton's interpreter without a GPU): decodes through the Triton kernels with the sink
    logits folded into the merge, prompt rows through softmax_attention, each within 1e-4 of the reference."""
    if not CUDA:
        monkeypatch.setenv("KVCHAT_GPU_PATH", "interpret")
        assert kernels.gpu_path("cpu"), "TRITON_INTERPRET=1 must be set before triton is imported (conftest)"
    engine = engine_of(models, model + "-gpu")
    k_format, v_format = TRITON_CASES[formats]
    cache = CacheConfig(k_format=k_format, v_format=v_format, window=window, sinks=4 if window else 0)
    g = torch.Generator().manual_seed(len(formats))
    sinks = [sinks_of(g) for _ in engine.model.layers]
    check = Checked(monkeypatch, sinks)
    drive(runner_with(engine, sinks), cache, random_ids(engine, 60, seed=3))
    assert max(check.errors) < 1e-4, max(check.errors)
    assert check.backends == {"FullPagesTriton" if formats == "full" else "QuantPagesTriton"}, check.backends
    kernel = "merge_partials" if formats in ("quantized", "int4") else "decode_attention"
    assert check.calls[kernel] >= 3 * len(sinks), check.calls


@pytest.mark.parametrize("backend", ["full-torch", "full-c", "quant-torch", "quant-c-int8", "triton-full",
                                     "triton-quantized"])
@pytest.mark.parametrize("very_negative", [-math.inf, -1e4])
def test_vanishing_sink_logits_give_todays_logits(models, monkeypatch, backend, very_negative):
    """Sink logits of -inf (or -1e4) on every layer: the same logits, bit for bit, as a model without them."""
    if backend.startswith("triton"):
        if not TRITON:
            pytest.skip("triton is not importable here")
        if not CUDA:
            monkeypatch.setenv("KVCHAT_GPU_PATH", "interpret")
        engine = engine_of(models, "llama-gpu")
        cache = CacheConfig(k_format="int8" if backend.endswith("quantized") else "fp32",
                            v_format="int8" if backend.endswith("quantized") else "fp32", window=32, sinks=4)
    else:
        cache = cpu_case(monkeypatch, backend, 32)
        engine = engine_of(models, "llama")
    ids = random_ids(engine, 60, seed=4)
    today = drive(runner_with(engine, None), cache, ids)
    vanishing = drive(runner_with(engine, [torch.full((HQ,), very_negative)] * len(engine.model.layers)), cache, ids)
    assert all(torch.equal(a, b) for a, b in zip(today, vanishing))


@needs_c
def test_the_one_call_step_reads_sink_logits_over_full_precision_pages(models, monkeypatch):
    """Packed weights over fp32 pages: decode steps in one call, each layer's sink logits read inside decode_layers
    (the group's PageArrays carry them), give the logits of the same steps attended layer by layer through
    decode_attend (each checked against the reference)."""
    engine = engine_of(models, "llama", "int8")
    assert engine.model.kernel_layers() is not None
    g = torch.Generator().manual_seed(9)
    sinks = [sinks_of(g) for _ in engine.model.layers]
    cache, ids = CacheConfig(k_format="fp32", v_format="fp32"), random_ids(engine, 60, seed=5)
    groups = []
    real = FullPagesC.one_call_group

    def kept(self, *args):
        groups.append(real(self, *args))
        return groups[-1]
    monkeypatch.setattr(FullPagesC, "one_call_group", kept)
    one_call = drive(runner_with(engine, sinks), cache, ids)
    assert groups and all(grp is not None and grp[0].sinks is not None for grp in groups)
    monkeypatch.setattr(FullPagesC, "one_call_group", AttentionBackend.one_call_group)
    check = Checked(monkeypatch, sinks)
    by_layer = drive(runner_with(engine, sinks), cache, ids)
    assert max(check.errors) < 1e-4 and check.backends == {"FullPagesC"}
    assert check.calls["decode_attend"] >= 4 * len(sinks)
    assert all(torch.equal(a, b) for a, b in zip(one_call, by_layer))


@needs_kv
def test_the_one_call_quantized_step_gives_the_layer_by_layer_logits(models, monkeypatch):
    """Packed weights over int8 pages: decode steps in one call with each layer's sink logits inside the C step
    (QuantStep) give the logits of the same steps attended layer by layer (each checked against the reference)."""
    engine = engine_of(models, "llama", "int8")
    g = torch.Generator().manual_seed(11)
    sinks = [sinks_of(g) for _ in engine.model.layers]
    cache, ids = CacheConfig(k_format="int8", v_format="int8"), random_ids(engine, 60, seed=6)
    steps = Counter()
    real = quant_pages.quant_step

    def counted(comps, st, num_heads, scale, sink_logits=None, mass=None):
        steps["with sink logits"] += all(s is not None for s in sink_logits)
        return real(comps, st, num_heads, scale, sink_logits, mass)
    monkeypatch.setattr(quant_pages, "quant_step", counted)
    one_call = drive(runner_with(engine, sinks), cache, ids)
    assert steps["with sink logits"] == 4
    monkeypatch.setattr(QuantPagesC, "one_call_group", AttentionBackend.one_call_group)
    check = Checked(monkeypatch, sinks)
    by_layer = drive(runner_with(engine, sinks), cache, ids)
    assert max(check.errors) < 1e-4 and check.calls["attn_decode_quant"] >= 4 * len(sinks)
    assert all(torch.equal(a, b) for a, b in zip(one_call, by_layer))


def test_the_runner_reads_each_layers_sink_logits(models):
    """ModelRunner's LayerScores carry Layer.sinks (None for a model without them)."""
    engine = engine_of(models, "llama")
    sinks = [torch.arange(HQ, dtype=torch.float32) + i for i in range(len(engine.model.layers))]
    runner = runner_with(engine, sinks)
    assert all(isinstance(s, LayerScores) and torch.equal(s.sink_logits, w) for s, w in zip(runner.scores, sinks))
    assert all(s.sink_logits is None for s in engine.runner.scores)
