"""One step's plan: the order of its items, every item's reservation (committed or rolled back together) and what
each sequence's attention needs in every layer.

Positions. Every query is rotated at its absolute position (the token's index in the stream) and
full-precision keys are stored rotated at theirs, so no step rotates stored keys again: RoPE
scores depend on position differences only, and a window's kept tokens keep their differences
(StreamingLLM re-positions them as one run). Only the sinks, which stay at their first positions
while the window moves on, see the query at its in-cache position: a second rotation of q
(decode) or of the few sink keys (prefill). Quantized keys are stored before RoPE and rotated as
they are read, at the same effective positions (key_pos).

Layers. A hybrid model's conversation has a sequence per KV group (kv/layout.kv_groups), and every
item gets a SeqStep per (group, RoPE) pair of its layers: a group keeping the layers' own window W
reads the keys at p - W < k <= p for the query at absolute position p (the W - 1 newest past keys
for a decode row; a mask for prompt rows), with no sinks and no re-positioning. Every other model
has one group and one RoPE: one SeqStep per item, as before.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvchat.engine.kv.layout import KVLayout, sinks_at_first_positions
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.sequence import Reservation, Sequence
from kvchat.engine.kv.pages import first_rows, page_rows, slot_positions
from kvchat.engine.model.rope import rope_rows


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
    key_sin: torch.Tensor | None  #   (None until a backend computes them from key_pos)
    key_pos: torch.Tensor | None = None   # [P + T] int64 on the CPU: those effective positions
    inv_freq: torch.Tensor | None = None
    # the backend's per-step kernel arguments, made by its first layer and shared by the rest: a quant_pages.
    # QuantDecodeArgs on the CPU, a triton_pages.PastSplit on the GPU path (one backend reads a step)
    kernel_args: object | None = None
    decode: bool = True           # one generated token (False: prompt rows, see softmax_attention)
    outside: torch.Tensor | None = None   # [T, P + T] bool: keys outside a prompt row's own window (or None)
    past_positions: torch.Tensor | None = None  # [P] the past rows' token positions where not past_slots' (retrieval)

    @property
    def num_new(self) -> int:
        return self.res.num_new

    @property
    def one_token_decode(self) -> bool:
        return self.decode and self.res.num_new == 1


def plan(res: Reservation, offset: int, inv_freq: torch.Tensor, device, quantized: bool,
         decode: bool | None = None, window: int | None = None) -> SeqStep:
    """window: the layers' own sliding window W where their group keeps it (the query at p reads keys
    p - W < k <= p), else None: the sequence's geometry (all of it, or the user's window and sinks)."""
    seq = res.seq
    bs = seq.block_size
    S, N = res.first_slot, seq.num_tokens
    rows = None
    if window is None:
        ws, ns = seq.window()
        if ws == ns == 0:       # held whole: slots 0 .. S - 1 (what slot_positions gives, in fewer ops)
            slots = torch.arange(S)
            rows = first_rows(seq.block_table, S + res.num_new, bs, device)
        else:
            slots, _ = slot_positions(S, ws, ns)
    else:       # the W - 1 newest past tokens, at their absolute positions
        start_abs = max(0, N - (window - 1))
        moved = seq.evicted and start_abs >= (seq.sink_blocks + seq.evicted) * bs
        slots, ns = torch.arange(start_abs - seq.evicted * bs if moved else start_abs, S), 0
    P, T = slots.numel(), res.num_new
    if rows is None:
        rows = page_rows(seq.block_table, torch.cat((slots, torch.arange(S, S + T))), bs, device)
    delta = N - P                                   # absolute minus in-cache position, for every new token
    n_sink = 0 if window is not None else sinks_at_first_positions(delta, S, seq.geometry.window, ns,
                                                                    seq.sink_blocks, bs)
    q_pos = torch.arange(N, N + T)
    q_cos, q_sin = rope_rows(N, T, inv_freq)
    sink_cos = sink_sin = d_cos = d_sin = key_cos = key_sin = None
    if n_sink:
        sink_cos, sink_sin = rope_rows(N - delta, T, inv_freq)
        d_cos, d_sin = rope_rows(delta, 1, inv_freq)
    abs_pos = seq.positions(slots) if quantized or window else None
    if quantized:
        if n_sink:
            abs_pos[:n_sink] += delta
        key_pos = torch.cat((abs_pos, q_pos))
    else:
        key_pos = None
    decode = T == 1 if decode is None else decode
    outside = None
    if window is not None and T > 1:
        outside = torch.cat((abs_pos, q_pos))[None, :] <= (q_pos - window)[:, None]
    dev = lambda t: None if t is None else t.to(device)
    return SeqStep(res, offset, rows, slots, n_sink, dev(q_cos), dev(q_sin), dev(sink_cos), dev(sink_sin),
                   dev(d_cos), dev(d_sin), key_cos, key_sin, key_pos, inv_freq, decode=decode, outside=dev(outside))


def plan_rows(res: Reservation, offset: int, inv_freq: torch.Tensor, device, quantized: bool,
              window: int | None = None) -> list[SeqStep]:
    """A verification item (speculative decoding: several generated tokens in one step) as one one-token decode per
    row: row i is planned as plain decoding would plan it after rows 0..i-1 committed (its slot, the sequence at N + i
    tokens, the same block table), so its numbers are plain decoding's, bit for bit. Exact while no row but the
    first completes a quantized block and no row moves a window (ModelRunner.draft_room keeps drafts inside that)."""
    seq, out = res.seq, []
    for i in range(res.num_new):
        view = replace(seq, num_tokens=seq.num_tokens + i)      # the same block table and ids, i tokens on
        row = Reservation(view, 1, res.first_slot + i, [])
        out.append(plan(row, offset + i, inv_freq, device, quantized, True, window))
    return out


@dataclass
class ItemStep:
    """A verification item's place in the step's batch (its rows are planned one by one, plan_rows)."""

    res: Reservation
    offset: int
    decode: bool = True

    @property
    def num_new(self) -> int:
        return self.res.num_new

    @property
    def one_token_decode(self) -> bool:
        return False


def decode_first(items: list[tuple[Sequence, list[int]]], decode: list[bool]) -> list[int]:
    """The batch order of a step's items: decode items first, those of one layout together (one kernel call
    attends them all); a stable sort, so each kind keeps the caller's order."""
    layouts: dict[KVLayout, int] = {}
    for seq, _ in items:
        layouts.setdefault(seq.layout, len(layouts))
    return sorted(range(len(items)), key=lambda i: (not decode[i], layouts[items[i][0].layout]))


class StepReservation:
    """Every item's slots, pages and tail snapshot for one step, taken in batch order, in every KV group of its
    conversation: commit() adds the tokens to their sequences, rollback() leaves every sequence and page exactly as
    before. A failure while reserving rolls back what was taken and raises (NoFreeBlocks when the budget cannot
    take the tokens).

    steps[i] is item i's plan in its first group with the first layer's RoPE (offsets, rows, logits: what the runner
    reads); layer_steps[l] the plans layer l attends with (its group's sequence, its RoPE, its window), one per item,
    or one per row of a verification item (a decode item of several tokens, plan_rows), in batch order; a layer that
    reads another layer's KV (sources: layer -> source) shares its source's list."""

    def __init__(self, cache: KVCache, items: list[tuple[Sequence, list[int]]],
                 decode: list[bool], layer_rope: list[torch.Tensor], device, keep: frozenset[int] = frozenset(),
                 sources: dict[int, int] | None = None):
        self.cache, self.items = cache, items
        self.reservations: list[tuple[Reservation, list[int]]] = []
        self.layer_rope = layer_rope
        self.layer_steps: list[list[SeqStep]] = [[] for _ in layer_rope]   # [layer][item]
        self.steps: list[SeqStep] = []
        keep = {m.seq_id for s, _ in items for m in s.members} | set(keep)     # none of them is released for room
        try:
            offset = 0
            for (seq, ids), dec in zip(items, decode):
                plans = {}
                for member in seq.members:
                    self._reserve(member, ids, dec, keep, offset, device, plans)
                for layer, steps in enumerate(self.layer_steps):
                    if layer not in plans:          # a linear-attention layer: no KV, the state's (StepAttention)
                        continue
                    if isinstance(plans[layer], list):
                        steps.extend(plans[layer])
                    else:
                        steps.append(plans[layer])
                first = next(iter(plans.values()))
                self.steps.append(ItemStep(self.reservations[-len(seq.members)][0], offset)
                                  if isinstance(first, list) else first)
                offset += len(ids)
        except BaseException:
            self.rollback()
            raise
        for layer, source in (sources or {}).items():   # a layer over another's KV attends with the source's plans
            self.layer_steps[layer] = self.layer_steps[source]

    def _reserve(self, seq: Sequence, ids: list[int], decode: bool, keep: set[int], offset: int, device,
                 plans: dict[int, SeqStep]):
        res = self.cache.reserve(seq, len(ids), keep)
        self.reservations.append((res, ids))
        quantized = seq.layout.quantized_components > 0
        g = seq.geometry
        window = g.window + 1 if g.model_window else None        # W - 1 past keys: the layer's own window W
        by_rope: dict[int, SeqStep | list[SeqStep]] = {}
        rows = decode and len(ids) > 1            # a verification item: one plan per row
        for layer in seq.layout.layers or range(len(self.layer_rope)):
            inv = self.layer_rope[layer]
            if id(inv) not in by_rope:
                by_rope[id(inv)] = (plan_rows(res, offset, inv, device, quantized, window) if rows
                                    else plan(res, offset, inv, device, quantized, decode, window))
            plans[layer] = by_rope[id(inv)]

    def rollback(self) -> None:
        for res, _ in reversed(self.reservations):
            self.cache.rollback(res)

    def commit(self, hash_ids: bool) -> None:
        for res, ids in self.reservations:
            self.cache.commit(res, ids if hash_ids else None)
