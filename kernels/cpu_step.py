"""The one-call decode step (decode_layers in cpu_quant.c): every decoder layer of a step in one C call. The layer
table (LayerRow, layer_table), the ways a group of layers attends (PageArrays over full-precision pages, QuantStep
over quantized ones, a Python callback for caches no kernel reads), and the step's recurrent states and per-layer
inputs (step_inputs_t). The library itself is cpu_quant's; call cpu_quant.available() first."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_quant
from .cpu_lib import ATTEND_FN, QLayer, SharedExpert, StepInputs
from .cpu_quant import (_AXES, _FULL, _KINDS, MAX_ATTEND_HEAD_DIM, Mass, _half_rope, _KVComp, _ptr, _sink_logits,
                        kv_kernels_ready)
from .formats import PageFormat


@dataclass(frozen=True, eq=False)
class LayerRow:
    """One decoder layer as layer_table takes it. slots: the parts of (qkv, o, gate_up, down), at most 3 each (o and
    down one; a routed MLP's layer has no gate_up and down); the RMSNorm weights fp32 contiguous. q_norm / k_norm:
    Qwen3's and Gemma's per-head norms [head_dim]; moe: an ExpertTable; post_attn / post_mlp: Gemma's post-norms; act:
    the gate's activation, 0 SiLU, 1 GELU-tanh; mixer: the layer's token mixer is the caller's, called back between
    projections at their own widths (no q / k norms then); gdn: a Gated DeltaNet C runs where the step brings its
    states, (gdn_table, the state's index among the step's, the order o reads its outputs in or None); ple: Gemma 4's
    per-layer input (gate part, projection part, norm); scalar: Gemma 4's layer scalar [1]; shared: a shared expert
    beside the routed MLP (shared_table); gate: Qwen3.5's output gate, its width, between q and k of the projection
    (q | gate | k | v), 0 for none; beside: Gemma 4's routed MLP (moe) beside the dense one (slots' gate_up and
    down), (the dense output's norm, the experts' input norm, their output's norm), post_mlp their sum's norm;
    heads: a mixer C attends itself where the layer's group holds pages (Gemma 4, LayerSpec.own_heads), (head size,
    KV heads, values from keys, values normed, keep, source): keep > 0 the slot its keys and values are kept in for
    layers over its KV, source > 0 the slot this layer (q only) reads; q_norm / k_norm are then its own."""
    slots: list
    norm_attn: torch.Tensor
    norm_mlp: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    moe: object = None
    post_attn: torch.Tensor | None = None
    post_mlp: torch.Tensor | None = None
    act: int = 0
    mixer: bool = False
    gdn: tuple | None = None
    ple: tuple | None = None
    scalar: torch.Tensor | None = None
    shared: SharedExpert | None = None
    gate: int = 0
    beside: tuple | None = None
    heads: tuple | None = None


def layer_table(layers: list[LayerRow]) -> ctypes.Array:
    """The layers as decode_layers reads them (QLayer). The tensors and tables behind the pointers must outlive the
    table."""
    table = (QLayer * len(layers))()
    for t, row in zip(table, layers):
        slots = row.slots
        if row.mixer:                                   # the caller's mixer, between these widths
            t.mix_in, t.mix_out = sum(part.N for part in slots[0]), slots[1][0].K
        if row.gdn is not None:                         # a Gated DeltaNet C can run
            gdn, t.state, order = row.gdn
            t.gdn = ctypes.addressof(gdn)
            if order is not None:
                assert order.dtype == torch.int64 and order.is_contiguous() and order.numel() == t.mix_out
                assert torch.equal(order.sort().values, torch.arange(t.mix_out)), "not a permutation"
                t.mix_order = order.data_ptr()
        if row.ple is not None:
            t.ple[0], t.ple[1], t.ple_norm = row.ple[0], row.ple[1], row.ple[2].data_ptr()
        if row.scalar is not None:
            assert row.scalar.dtype == torch.float32 and row.scalar.numel() == 1
            t.scalar = row.scalar.data_ptr()
        if row.post_attn is not None:
            t.post_attn, t.post_mlp = row.post_attn.data_ptr(), row.post_mlp.data_ptr()
        t.act, t.gate = row.act, row.gate
        if row.heads is not None:                       # its own attention, where its pages are C's
            assert row.mixer
            t.hd, t.kvh, t.vk, t.vnorm, t.keep, t.from_ = row.heads
        if row.q_norm is not None:
            t.q_norm, t.k_norm = row.q_norm.data_ptr(), row.k_norm.data_ptr()
        if row.moe is not None:
            t.moe = ctypes.addressof(row.moe.struct)
            t.shared = None if row.shared is None else ctypes.addressof(row.shared)
            if row.beside is None:
                slots = list(slots[:2]) + [[], []]
            else:                                       # beside the dense MLP: its norms (all three, fp32)
                assert len(row.beside) == 3 and row.post_mlp is not None
                for j, w in enumerate(row.beside):
                    assert w.dtype == torch.float32 and w.is_contiguous()
                    t.beside[j] = w.data_ptr()
        assert len(slots) == 4 and all(1 <= len(p) <= 3 for p in slots[:2]) and len(slots[1]) == 1
        assert (row.moe is not None and row.beside is None) or (all(1 <= len(p) <= 3 for p in slots)
                                                                and len(slots[3]) == 1)
        for i, parts in enumerate(slots):
            t.nparts[i] = len(parts)
            for j, part in enumerate(parts):
                t.lin[i][j] = part
        t.norm_attn, t.norm_mlp = row.norm_attn.data_ptr(), row.norm_mlp.data_ptr()
    table.widths = _widths(table)
    return table


def _widths(table: ctypes.Array) -> list[tuple[int, int]]:
    """Each layer's qkv width as a callback gets it (the gates set aside) and its mixer's output width (0: the
    model's heads), for decode_layers' callbacks: kept by layer_table, read from the structs for a table made
    otherwise (a copy)."""
    known = getattr(table, "widths", None)
    return known if known is not None else [
        (sum(row.lin[0][j].N for j in range(row.nparts[0])) - row.gate, row.mix_out) for row in table]


class _QStep(ctypes.Structure):
    _fields_ = [("B", ctypes.c_int), ("Hq", ctypes.c_int), ("Hkv", ctypes.c_int), ("D", ctypes.c_int),
                ("bs", ctypes.c_int), ("ldq", ctypes.c_int), ("nthreads", ctypes.c_int), ("sm_scale", ctypes.c_float),
                ("comps", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("P", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("n_full", ctypes.c_void_p), ("pos", ctypes.c_void_p),
                ("fill", ctypes.c_void_p), ("cos_h", ctypes.c_void_p), ("sin_h", ctypes.c_void_p),
                ("scratch", ctypes.c_void_p), ("rows_out", ctypes.c_void_p), ("sink_logits", ctypes.c_void_p),
                ("cols", ctypes.c_void_p), ("mcols", ctypes.c_int), ("mass", ctypes.c_void_p)]


@dataclass(frozen=True)
class QuantSeq:
    """One sequence's part of a QuantStep: slots [P] int64 its held past, ascending; table [n] int64 its block
    ids; pos [P + 1] int64 the effective key positions (the new token's last); n_full: its full blocks (slots
    from n_full * block_size on are in the tail); fill: the tail row the new token takes (block_size - 1: the
    token completes its block, which the caller then quantizes, see QuantStep.rows)."""
    slots: torch.Tensor
    table: torch.Tensor
    pos: torch.Tensor
    n_full: int
    fill: int


def kv_comp_static(fmt: PageFormat, data: torch.Tensor, scale, zero, full_dtype) -> tuple:
    """A quantized component's fields for QuantStep that no sequence changes: (data, scale, zero pointers,
    kind, axis, group, full dtype code). Valid until the page tensors are reallocated."""
    for t in (data, scale, zero):
        assert t is None or (t.is_contiguous() and not t.is_cuda)
    return (data.data_ptr(), _ptr(scale), _ptr(zero), _KINDS[fmt.name], _AXES[fmt.scale_axis], fmt.group,
            _FULL[full_dtype])


class QuantStep:
    """A decode step's attention over quantized pages for every layer and sequence, run inside decode_layers by
    the quantized-KV library (attend_quant_layer) without returning to Python: per layer and sequence
    attn_decode_quant, then the new key and value written to the sequence's tail row `fill`, as the Python
    path does it (the same bits), and to rows [layers, B, 2, Hkv, D] as float32, from which the caller
    quantizes the blocks the step completed.

    comps: per layer, per sequence, K then V: (static, head, tail), static from kv_comp_static, head the
    component's full-precision first block of the sequence's table or None, tail its partly filled last block
    ([block_size, Hkv, D], contiguous). sink_logits: per layer its learned sink logits [Hq] or None, or None for
    every layer. Every tensor must stay alive and in place until the step ends (this object keeps references to
    those it is given)."""

    def __init__(self, comps: list[tuple], seqs: list[QuantSeq], block_size: int, hq: int, hkv: int, d: int,
                 cos_h: torch.Tensor, sin_h: torch.Tensor, sm_scale: float,
                 sink_logits: list[torch.Tensor | None] | None = None, mass: Mass | None = None):
        B = len(seqs)
        n_layers = len(comps) // (2 * B)
        assert len(comps) == n_layers * 2 * B and d <= MAX_ATTEND_HEAD_DIM
        for st in seqs:
            assert 0 <= st.fill < block_size and st.pos.shape[0] == st.slots.shape[0] + 1
            assert st.slots.dtype == st.table.dtype == st.pos.dtype == torch.int64
            assert st.slots.is_contiguous() and st.table.is_contiguous() and st.pos.is_contiguous()
        _half_rope(cos_h, sin_h, torch.cat([st.pos for st in seqs]))
        fields = []
        for static, head, tail in comps:
            assert tail.is_contiguous() and tail.shape == (block_size, hkv, d) and (head is None or head.is_contiguous())
            fields.append((*static[:3], _ptr(head), tail.data_ptr(), *static[3:]))
        structs = (_KVComp * len(fields))(*fields)
        max_p = max(st.slots.shape[0] for st in seqs)
        sinks = None
        if sink_logits is not None and any(s is not None for s in sink_logits):
            assert len(sink_logits) == n_layers, f"sink logits for {len(sink_logits)} of {n_layers} layers"
            sink_logits = [_sink_logits(s, hq) for s in sink_logits]
            sinks = (ctypes.c_void_p * n_layers)(*[_ptr(s) for s in sink_logits])
        self._keep = (comps, seqs, cos_h, sin_h, structs, sink_logits, sinks)
        self.scratch = torch.empty(hq * (max_p + 1 + d) + 64 * hq * (d + 2))
        self.rows = torch.empty(n_layers, B, 2, hkv, d)
        ptrs = lambda ts: (ctypes.c_void_p * B)(*[t.data_ptr() for t in ts])
        ints = lambda xs: (ctypes.c_int * B)(*xs)
        self._arrays = (ptrs([st.slots for st in seqs]), ints([st.slots.shape[0] for st in seqs]),
                        ptrs([st.table for st in seqs]), ints([st.n_full for st in seqs]),
                        ptrs([st.pos for st in seqs]), ints([st.fill for st in seqs]))
        slots, P, tables, n_full, pos, fill = self._arrays
        self.struct = _QStep(B, hq, hkv, d, block_size, (hq + 2 * hkv) * d, torch.get_num_threads(), sm_scale,
                             ctypes.addressof(structs), ctypes.addressof(slots), ctypes.addressof(P),
                             ctypes.addressof(tables), ctypes.addressof(n_full), ctypes.addressof(pos),
                             ctypes.addressof(fill), cos_h.data_ptr(), sin_h.data_ptr(), self.scratch.data_ptr(),
                             self.rows.data_ptr(), None if sinks is None else ctypes.addressof(sinks))
        if mass is not None:          # mass.out [layers, B, Hq, mcols]; mass.cols each sequence's rows, one after another
            assert mass.out.shape[:3] == (n_layers, B, hq)
            starts = [0]
            for st in seqs:
                starts.append(starts[-1] + st.slots.shape[0] + 1)
            assert mass.cols.shape[0] == starts[-1]
            cols = (ctypes.c_void_p * B)(*[mass.cols.data_ptr() + 4 * s for s in starts[:-1]])
            self._mass = (mass, cols)
            self.struct.cols, self.struct.mcols, self.struct.mass = ctypes.addressof(cols), mass.out.shape[-1], \
                mass.out.data_ptr()


class PageArrays:
    """decode_layers' page arguments: every layer's K and V page addresses and whether they are bf16, its sink logits
    (gpt-oss) and the layers' one soft-cap (Gemma 2), built once for
    as long as the pages stay where they are (a caller keeps them across steps: 0.1 ms of every step otherwise). The
    pages themselves are not kept (a reset must give them back): whoever keeps these checks that they did not move
    (pages.Component.moves) and holds the components."""

    def __init__(self, pages: list[tuple[torch.Tensor, torch.Tensor]], sink_logits: list | None = None,
                 softcap: float | None = None):
        n = self.n = len(pages)
        self.kp = (ctypes.c_void_p * n)(*[k.data_ptr() for k, _ in pages])
        self.vp = (ctypes.c_void_p * n)(*[v.data_ptr() for _, v in pages])
        self.bf = (ctypes.c_int * n)(*[int(k.dtype == torch.bfloat16) for k, _ in pages])
        # each layer's sink logits [Hq] as the kernel reads them (kept here), or None where no layer has them
        self._sinks = [None if s is None else s.to("cpu", torch.float32).contiguous() for s in sink_logits or ()]
        self.sinks = None if not any(s is not None for s in self._sinks) else \
            (ctypes.c_void_p * n)(*[_ptr(s) for s in self._sinks])
        self.softcap = float(softcap or 0.0)      # every layer's soft-cap of its scores (Gemma 2), 0: none

    def __len__(self) -> int:
        return self.n


def decode_layers(table: ctypes.Array, x: torch.Tensor, eps: float, hq: int, hkv: int, d: int, groups: list,
                  layer_group: list[int] | None = None, layer_index: list[int] | None = None, sm_scale: float = 0.0,
                  mass: Mass | None = None, states: list | None = None, ple: torch.Tensor | None = None) -> None:
    """x [B, H] fp32 contiguous (the embeddings of B sequences' new tokens) becomes the last layer's output, in
    place: each layer's linears (q4_gemv / q8_gemv with RMSNorm, SwiGLU and residual fused) and its attention, the
    same calls in the same order as a step through Python makes, so the same bits.

    Layer l attends through groups[layer_group[l]] (every layer through groups[0] when None) as the group's layer
    layer_index[l] (l when None). A group is one of
      - (pages, args): full-precision pages attended in C, as decode_attend does it: pages a PageArrays of the group's
        layers, args its (cos, sin, sink_cos, sink_sin, n_sink, new_rows, rows, offsets) for the step's sequences;
        sm_scale the scores' scale, the same for every such group;
      - a QuantStep: quantized pages, attended in C by the quantized-KV library;
      - attend(index, qkv [B, n_qkv]) -> [B, Hq, D]: the caller's own path, in Python, for caches no kernel reads. An
        exception it raises stops the step and is raised here.
    mass: each layer's decode_attend mass (Mass.out [layers, B, Hq, mcols]), for the layers over full-precision pages
    (a QuantStep takes its own). states: per Gated DeltaNet state index (layer_table), per sequence, its (tail,
    matrices) before the step and the new (tail, matrices) to write, fp32 contiguous: those layers' mixers then run
    in C; None calls back for them. ple: Gemma 4's per-layer inputs [B, layers, width] fp32 contiguous, for a table
    with them."""
    b, h = x.shape
    assert x.is_contiguous() and x.dtype == torch.float32
    n = len(table)
    assert groups and (layer_group is None or (len(layer_group) == n and all(0 <= g < len(groups) for g in layer_group)))
    assert layer_index is None or len(layer_index) == n
    failure: list[BaseException] = []
    keep = []                                 # the callbacks, alive until the call returns
    structs = []
    top = [n - 1] * len(groups)                 # the last layer index each group is asked for
    if layer_index is not None:
        top = [-1] * len(groups)
        for g, i in zip(layer_group or [0] * n, layer_index):
            top[g] = max(top[g], i)
    for g, group in enumerate(groups):
        if isinstance(group, QuantStep):
            assert kv_kernels_ready() and group.struct.B == b
            fn = ctypes.cast(cpu_quant._kv_lib.attend_quant_layer, ctypes.c_void_p)
            structs.append(_AttnGroup(*(None,) * 11, fn, ctypes.addressof(group.struct), None, 0.0, 1))
        elif callable(group):
            widths = {layer if layer_index is None else layer_index[layer]: (n_in, n_out or hq * d)
                      for layer, (n_in, n_out) in enumerate(_widths(table))
                      if layer_group is None or layer_group[layer] == g}    # the group's index -> its widths
            structs.append(_AttnGroup(*(None,) * 11, ctypes.cast(_callback(group, b, widths, failure, keep),
                                                                 ctypes.c_void_p), None))
        else:
            pages, args = group
            assert isinstance(pages, PageArrays) and top[g] < len(pages)        # C checks for negative ones
            cos, sin, scos, ssin, n_sink, new_rows, rows, offsets = args
            assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[0] == b and offsets.shape[0] == b + 1
            assert n_sink.dtype == torch.int32 and rows.dtype == offsets.dtype == new_rows.dtype == torch.int64
            assert rows.is_contiguous() and offsets.is_contiguous() and new_rows.is_contiguous()
            structs.append(_AttnGroup(*[_ptr(t) for t in args], ctypes.addressof(pages.kp), ctypes.addressof(pages.vp),
                                      ctypes.addressof(pages.bf), None, None,
                                      None if pages.sinks is None else ctypes.addressof(pages.sinks), pages.softcap))
    margs = (None, 0, None)
    if mass is not None:
        assert mass.out.shape[:3] == (n, b, hq)
        margs = (mass.cols.data_ptr(), mass.out.shape[-1], mass.out.data_ptr())
    arr = (_AttnGroup * len(structs))(*structs)
    lgrp = None if layer_group is None else (ctypes.c_int * n)(*layer_group)
    lidx = None if layer_index is None else (ctypes.c_int * n)(*layer_index)
    st = None if states is None and ple is None else _step_inputs(states or [], b, ple, n)
    rc = cpu_quant._lib.decode_layers_grouped(n, ctypes.addressof(table), b, x.data_ptr(), h, float(eps), hq, hkv, d,
                                              len(structs), arr, lgrp, lidx, float(sm_scale), *margs,
                                              None if st is None else ctypes.byref(st))
    if failure:
        raise failure[0]
    if rc == -3:
        raise ValueError("decode_layers: a linear's width does not match the model's (hidden, heads x head_dim or "
                         "intermediate), head_dim is past 256 or a layer's group is out of range: the layer table was "
                         "built from wrong shapes")
    if rc:
        raise MemoryError("decode_layers: out of memory for the step's buffers")


def _step_inputs(states: list, b: int, ple: torch.Tensor | None, layers: int) -> StepInputs:
    """decode_layers' states and per-layer inputs as step_inputs_t: the states in four pointer arrays, entry j * B +
    sequence (the tensors are the caller's, alive through the call)."""
    arrays = [(ctypes.c_void_p * (len(states) * b))() for _ in range(4)]
    for j, per_seq in enumerate(states):
        assert len(per_seq) == b
        for i, tensors in enumerate(per_seq):
            for arr, t in zip(arrays, tensors):
                assert t.dtype == torch.float32 and t.is_contiguous() and not t.is_cuda
                arr[j * b + i] = t.data_ptr()
    if ple is not None:
        assert ple.dtype == torch.float32 and ple.is_contiguous() and tuple(ple.shape[:2]) == (b, layers)
    st = StepInputs(len(states), *(ctypes.cast(a, ctypes.POINTER(ctypes.c_void_p)) for a in arrays),
                    None if ple is None else ple.data_ptr(), layers)
    st.keep = arrays
    return st


class _AttnGroup(ctypes.Structure):
    """attn_group_t (cpu_quant.c): one group's way of attending in a step (decode_layers)."""
    _fields_ = [(name, ctypes.c_void_p) for name in ("cos", "sin", "scos", "ssin", "n_sink", "new_rows", "rows",
                                                     "off", "kp", "vp", "bf16", "attend", "ctx", "sinks")] \
        + [("softcap", ctypes.c_float), ("normed", ctypes.c_int)]


def _callback(attend, b: int, widths: dict, failure: list, keep: list):
    """attend(index, qkv) as attend_fn for decode_layers: its result copied into the kernel's buffer; widths: the
    group's layer index -> its (qkv, output) widths. An exception cannot cross C: kept in failure, the step stops."""

    def call(ctx, layer, qkv_ptr, out_ptr):
        try:
            n_in, n_out = widths[layer]
            qkv = torch.frombuffer((ctypes.c_float * (b * n_in)).from_address(qkv_ptr), dtype=torch.float32)
            out = torch.frombuffer((ctypes.c_float * (b * n_out)).from_address(out_ptr), dtype=torch.float32)
            out.view(b, n_out).copy_(attend(layer, qkv.view(b, n_in)).reshape(b, n_out))
            return 0
        except BaseException as exc:
            failure.append(exc)
            return 1
    fn = ATTEND_FN(call)
    keep.append(fn)
    return fn
