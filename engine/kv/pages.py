"""The bytes of the KV cache: page tensors per (layout, layer, K/V), owned by the engine.

Pages are indexed by block id (ids come from the manager's BlockPool) and grow geometrically, never
by a copy per block. Quantized components keep full-precision blocks beside their pages: a tail
per sequence (the block being filled, quantized once when full and never again) and a head per
block id (a table's first block, the attention sinks' block, which draws most attention).
Full-precision keys are stored rotated at their absolute positions; quantized keys before RoPE
(channel scales fit pre-RoPE keys far better), rotated when they are read.
"""
from __future__ import annotations

from typing import Callable

import torch

from kvchat import kernels
from kvchat.kernels import cpu_step
from kvchat.kernels.formats import FULL_DTYPES, PageFormat

from kvchat.engine.kv.layout import KVLayout


def slot_positions(seq_len: int, window_start: int, num_sinks: int, device=None):
    """Valid slots of a sequence's block table and their in-cache positions (StreamingLLM).

    Slot j is held if j < num_sinks or window_start <= j < seq_len; a sink keeps position j,
    a window slot gets num_sinks + (j - window_start). Without a window: (0, 0) -> positions 0..n-1.
    """
    sink = torch.arange(min(num_sinks, seq_len), device=device)
    win = torch.arange(max(window_start, num_sinks), seq_len, device=device)
    slots = torch.cat((sink, win))
    positions = torch.cat((sink, num_sinks + (win - window_start)))
    return slots, positions


def page_rows(block_table: list[int], slots: torch.Tensor, block_size: int, device) -> torch.Tensor:
    """slots [N] int64 of a sequence -> their rows [N] in flat pages (row = block id * block_size + offset)."""
    table = torch.tensor(block_table, dtype=torch.long)
    return (table[slots // block_size] * block_size + slots % block_size).to(device)


def first_rows(block_table: list[int], n: int, block_size: int, device) -> torch.Tensor:
    """page_rows of slots 0 .. n - 1 (a sequence read whole) in four tensor ops instead of eight."""
    assert len(block_table) * block_size >= n, (len(block_table), n)
    table = torch.tensor(block_table, dtype=torch.long)
    return (table[:, None] * block_size + torch.arange(block_size)).view(-1)[:n].to(device)


class Component:
    """One layer's K or V pages in one format."""

    moves = 0       # pages reallocated anywhere so far: a caller keeping page addresses across steps checks it

    def __init__(self, fmt: PageFormat, block_size: int, num_heads: int, head_dim: int, full_dtype, device):
        self.fmt = fmt
        self.block_size, self.num_heads, self.head_dim = block_size, num_heads, head_dim
        self.shapes = fmt.shapes(block_size, num_heads, head_dim)
        self.pages = {name: torch.empty((0, *shape), dtype=dtype, device=device) for name, (shape, dtype) in self.shapes.items()}
        self.full_dtype, self.device = full_dtype, device
        self.tails: dict[int, torch.Tensor] = {}       # seq id -> [bs, H, D], quantized formats only
        self.heads: dict[int, torch.Tensor] = {}       # block id -> [bs, H, D], quantized formats only
        self._kernel_static = None                     # cpu_step.kv_comp_static, until the pages move
        self._flat: tuple[torch.Tensor, torch.Tensor] | None = None     # (pages["data"], its flat_pages view)

    @property
    def capacity(self) -> int:
        return self.pages["data"].shape[0]

    def reserve(self, num_blocks: int, limit: int) -> None:
        """Room for ids below num_blocks: grow by doubling (at most to limit), copying once per doubling; a first
        allocation leaves an eighth more, so the message after a restored or freshly read chat does not copy every
        page at once (measured: 19 ms of a 4,176-token resume on the default model)."""
        cap = self.capacity
        if num_blocks <= cap:
            return
        new_cap = min(max(num_blocks + (num_blocks // 8 if cap == 0 else 0), 2 * cap, 4), max(limit, num_blocks))
        self._realloc(new_cap)

    def shrink(self, num_blocks: int) -> None:
        """Give memory back once most of it is unused (after a reset or a release)."""
        if num_blocks <= self.capacity // 4 or num_blocks == 0:
            self._realloc(num_blocks)

    def _realloc(self, cap: int) -> None:
        self._kernel_static = self._flat = None        # nothing may keep the old pages alive (a reset gives them back)
        for name, t in self.pages.items():
            new = torch.empty((cap, *t.shape[1:]), dtype=t.dtype, device=t.device)
            n = min(cap, t.shape[0])
            if n:
                new[:n] = t[:n]
            self.pages[name] = new
        Component.moves += 1        # after the new pages are in place: whoever sees the count sees them

    @property
    def nbytes(self) -> int:
        """Bytes held: the page storage's capacity plus full-precision heads and tails."""
        total = sum(t.numel() * t.element_size() for t in self.pages.values())
        return total + sum(t.numel() * t.element_size() for t in (*self.tails.values(), *self.heads.values()))

    def flat_pages(self) -> torch.Tensor:
        """Full-precision pages as rows of [H, D]: row = block id * block_size + offset (one view while the pages
        stay where they are: every decode step asks every layer)."""
        data = self.pages["data"]
        if self._flat is None or self._flat[0] is not data:
            self._flat = (data, data.view(-1, self.num_heads, self.head_dim))
        return self._flat[1]

    def tensors(self):
        return self.pages["data"], self.pages.get("scale"), self.pages.get("zero")

    def kernel_static(self) -> tuple:
        """Quantized: the pages as cpu_step.QuantStep reads them (kv_comp_static), kept until they move."""
        if self._kernel_static is None:
            self._kernel_static = cpu_step.kv_comp_static(self.fmt, *self.tensors(), self.full_dtype)
        return self._kernel_static

    # ---- writes ---------------------------------------------------------------------------

    def write_rows(self, x: torch.Tensor, rows: torch.Tensor) -> None:
        """Full precision: x [T, H, D] into page rows."""
        flat = self.flat_pages()
        flat.index_copy_(0, rows, x.to(flat.dtype))

    def open_tail(self, seq_id: int) -> torch.Tensor:
        """Quantized: the sequence's tail [bs, H, D], zeros where it has none yet."""
        tail = self.tails.get(seq_id)
        if tail is None:
            tail = self.tails[seq_id] = torch.zeros(self.block_size, self.num_heads, self.head_dim,
                                                    dtype=self.full_dtype, device=self.device)
        return tail

    def write(self, seq_id: int, x: torch.Tensor, first_slot: int, table: list[int], keep_head: bool = True) -> None:
        """Quantized: x [T, H, D] (before RoPE) at slots first_slot.. of the table; full blocks are quantized."""
        bs = self.block_size
        tail = self.open_tail(seq_id)
        start = (first_slot // bs) * bs
        filled = first_slot - start
        seq = torch.cat((tail[:filled].to(x.dtype), x)) if filled else x
        n_full = seq.shape[0] // bs
        first = start // bs
        skip = int(first == 0 and keep_head)
        if n_full and skip:
            self.heads[table[0]] = seq[:bs].to(self.full_dtype).clone()
        if n_full > skip:
            ids = torch.tensor(table[first + skip:first + n_full], dtype=torch.long, device=x.device)
            src = seq[skip * bs:n_full * bs].reshape(n_full - skip, bs, self.num_heads, self.head_dim)
            kernels.store_blocks(src.float(), ids, *self.tensors(), self.fmt)
        rest = seq[n_full * bs:]
        new_tail = torch.zeros_like(tail)
        new_tail[:rest.shape[0]] = rest.to(tail.dtype)
        self.tails[seq_id] = new_tail          # a new tensor: a snapshot of the old one stays valid

    # ---- reads ----------------------------------------------------------------------------

    def values(self, seq_id: int, table: list[int], seq_len: int, slots: torch.Tensor) -> torch.Tensor:
        """Float32 values [len(slots), H, D] of a sequence's slots as stored (full-precision keys stay rotated,
        quantized ones are before RoPE)."""
        if self.fmt.is_quantized:
            return self.read_slots(seq_id, table, seq_len, slots)
        return self.flat_pages().index_select(0, page_rows(table, slots, self.block_size, self.device)).float()

    def copy_out(self, seq_id: int, table: list[int]) -> dict:
        """A sequence's stored blocks, tail and head, byte for byte (for copy_in under new block ids)."""
        ids = torch.tensor(table, dtype=torch.long, device=self.device)
        out = {name: t.index_select(0, ids) for name, t in self.pages.items()}
        out["tail"] = self.tails.get(seq_id)
        out["head"] = self.heads.get(table[0]) if table else None
        return out

    def copy_in(self, seq_id: int, table: list[int], saved: dict) -> None:
        ids = torch.tensor(table, dtype=torch.long, device=self.device)
        for name, t in self.pages.items():
            src = saved[name]
            if t.dtype.is_floating_point and t.element_size() == 1:   # no CPU index_copy_ for fp8: copy its bytes
                t, src = t.view(torch.uint8), src.view(torch.uint8)
            t.index_copy_(0, ids, src)
        if saved["tail"] is not None:
            self.tails[seq_id] = saved["tail"]
        if saved["head"] is not None and table:
            self.heads[table[0]] = saved["head"]

    def read_slots(self, seq_id: int, table: list[int], seq_len: int, slots: torch.Tensor) -> torch.Tensor:
        """Quantized: float32 values [len(slots), H, D] (before RoPE) of the chosen slots (< seq_len)."""
        bs = self.block_size
        n_full = seq_len // bs
        parts = []
        head = self.heads.get(table[0]) if table else None
        if head is not None and n_full:
            parts.append(head.float())
        skip = int(head is not None)
        if n_full > skip:
            ids = torch.tensor(table[skip:n_full], dtype=torch.long, device=self.device)
            data, scale, zero = self.tensors()
            pages = kernels.dequantize(data[ids], None if scale is None else scale[ids],
                                       None if zero is None else zero[ids], self.fmt)
            parts.append(pages.flatten(0, 1))
        if seq_len > n_full * bs:
            parts.append(self.tails[seq_id][:seq_len - n_full * bs].float())
        if not parts:
            return torch.empty(0, self.num_heads, self.head_dim, device=self.device)
        return torch.cat(parts).index_select(0, slots.to(self.device))


class KeySummaries:
    """A retrieval layout's key summaries (KVLayout.summary), by block id like its pages: per layer [blocks, KV heads,
    2 * head_dim] bf16, each channel's max over the block's (rotated) keys, then its min (Quest's page metadata), and
    which (block, layer) pairs are made: a block is summarized from its pages the first time it is ranked
    (engine/runtime/retrieval.py), and forgotten when its id is freed."""

    def __init__(self, layout: KVLayout, device):
        self.data = [torch.empty((0, h, 2 * d), dtype=torch.bfloat16, device=device)
                     for h, d in map(layout.layer_shape, range(layout.num_layers))]
        self.made = torch.zeros((0, layout.num_layers), dtype=torch.bool)

    @property
    def capacity(self) -> int:
        return self.made.shape[0]

    def reserve(self, num_blocks: int, limit: int) -> None:
        cap = self.capacity
        if num_blocks > cap:
            self._realloc(min(max(num_blocks, 2 * cap, 4), max(limit, num_blocks)))

    def shrink(self, num_blocks: int) -> None:
        if num_blocks <= self.capacity // 4 or num_blocks == 0:
            self._realloc(num_blocks)

    def _realloc(self, cap: int) -> None:
        n = min(cap, self.capacity)
        for j, t in enumerate(self.data):
            new = torch.empty((cap, *t.shape[1:]), dtype=t.dtype, device=t.device)
            new[:n] = t[:n]
            self.data[j] = new
        made = torch.zeros((cap, self.made.shape[1]), dtype=torch.bool)
        made[:n] = self.made[:n]
        self.made = made

    def make(self, layer: int, kc: "Component", seq_id: int, block_table: list[int], seq_len: int,
             ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, inv_freq) -> None:
        """Summarize blocks `ids` of layer `layer` where not made yet: slots [m, bs] and positions [m, bs] of their
        rows in the sequence's held order and in the stream (quantized keys are rotated at those positions, as
        attention reads them; full-precision ones are stored rotated)."""
        missing = (~self.made[ids, layer]).nonzero().flatten()
        if not missing.numel():
            return
        m, bs = missing.numel(), slots.shape[1]
        keys = kc.values(seq_id, block_table, seq_len, slots[missing].flatten())        # [m * bs, H, D] float32
        if kc.fmt.is_quantized:
            from kvchat.engine.model.rope import rope_cos_sin, rotate
            cos, sin = rope_cos_sin(positions[missing].flatten(), inv_freq.cpu())
            keys = rotate(keys, cos.to(keys.device), sin.to(keys.device))
        keys = keys.view(m, bs, *keys.shape[1:])
        block_ids = ids[missing]
        self.data[layer][block_ids] = torch.cat((keys.amax(1), keys.amin(1)), -1).to(torch.bfloat16)
        self.made[block_ids, layer] = True

    def forget(self, ids: list[int]) -> None:
        ids = [b for b in ids if b < self.capacity]
        if ids:
            self.made[ids] = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data)


class PageStore:
    """Every layout's components, created on first use; the engine holds one."""

    def __init__(self, device):
        self.device = device
        self.layouts: dict[KVLayout, list[tuple[Component, Component]]] = {}
        self.summaries: dict[KVLayout, KeySummaries] = {}      # retrieval layouts' key summaries
        self._room: dict[KVLayout, int] = {}        # block ids every page of the layout holds now (reserve's)

    def key_summaries(self, layout: KVLayout) -> KeySummaries:
        got = self.summaries.get(layout)
        if got is None:
            got = self.summaries[layout] = KeySummaries(layout, self.device)
        return got

    def components(self, layout: KVLayout) -> list[tuple[Component, Component]]:
        comps = self.layouts.get(layout)
        if comps is None:
            dtype = FULL_DTYPES[layout.full_dtype]
            comps = [tuple(Component(f, layout.block_size, *layout.layer_shape(j), dtype, self.device)
                           for f in pair) for j, pair in enumerate(layout.formats)]
            self.layouts[layout] = comps
        return comps

    def reserve(self, layout: KVLayout, high_water: int, limit: int) -> None:
        """Room in every page of the layout for block ids below high_water (a step's, mostly there already: one
        comparison then instead of one per component, 56 on a 28-layer model)."""
        if high_water <= self._room.get(layout, 0):
            return
        comps = self.components(layout)
        for pair in comps:
            for c in pair:
                c.reserve(high_water, limit)
        if layout.summary:
            self.key_summaries(layout).reserve(high_water, limit)
        caps = [c.capacity for pair in comps for c in pair]
        self._room[layout] = min(caps + ([self.key_summaries(layout).capacity] if layout.summary else []))

    def shrink(self, high_water: Callable[[KVLayout], int]) -> None:
        """high_water(layout): one past the highest block id of the layout's KV group (each group has its ids)."""
        self._room.clear()
        for layout, comps in self.layouts.items():
            top = high_water(layout)
            for pair in comps:
                for c in pair:
                    c.shrink(top)
            if layout in self.summaries:
                self.summaries[layout].shrink(top)

    def forget_blocks(self, layers: tuple[int, ...], ids: list[int]) -> None:
        """ids of the KV group of these layers (KVLayout.layers) hold nothing now: their heads go."""
        for layout, comps in self.layouts.items():
            if layout.layers != layers:
                continue
            if layout in self.summaries:
                self.summaries[layout].forget(ids)
            for pair in comps:
                for c in pair:
                    if c.heads:
                        for b in ids:
                            c.heads.pop(b, None)

    def drop_tails(self, seq_id: int) -> None:
        for comps in self.layouts.values():
            for pair in comps:
                for c in pair:
                    c.tails.pop(seq_id, None)

    def snapshot_tails(self, layout: KVLayout, seq_id: int) -> list:
        """The sequence's tails before a step (writes replace tail tensors, so references are a snapshot)."""
        return [tuple(c.tails.get(seq_id) for c in pair) for pair in self.components(layout)]

    def open_tails(self, layout: KVLayout, seq_id: int) -> None:
        """Every quantized component's tail of the sequence exists (zeros where new; a snapshot taken before
        restores its absence), so a decode step's kernels always have a tail to write into."""
        for pair in self.components(layout):
            for c in pair:
                if c.fmt.is_quantized:
                    c.open_tail(seq_id)

    def restore_tails(self, layout: KVLayout, seq_id: int, snapshot: list, head_block: int | None) -> None:
        for pair, saved in zip(self.components(layout), snapshot):
            for c, t in zip(pair, saved):
                if t is None:
                    c.tails.pop(seq_id, None)
                else:
                    c.tails[seq_id] = t
                if head_block is not None:
                    c.heads.pop(head_block, None)

    def copy_block(self, layout: KVLayout, src: int, dst: int) -> None:
        """Copy-on-write of a shared partial block: its full-precision rows (quantized partial blocks live in tails)."""
        for pair in self.components(layout):
            for c in pair:
                if not c.fmt.is_quantized:
                    c.pages["data"][dst] = c.pages["data"][src]

    def copy_tail(self, layout: KVLayout, src_seq: int, dst_seq: int) -> None:
        for pair in self.components(layout):
            for c in pair:
                if src_seq in c.tails:
                    c.tails[dst_seq] = c.tails[src_seq].clone()

    def layer_bytes(self) -> int:
        return (sum(c.nbytes for comps in self.layouts.values() for pair in comps for c in pair)
                + sum(s.nbytes for s in self.summaries.values()))

    def drop_unused_layouts(self, in_use: set[KVLayout]) -> None:
        for layout in [l for l in self.layouts if l not in in_use]:
            del self.layouts[layout]
            self.summaries.pop(layout, None)
            self._room.pop(layout, None)
