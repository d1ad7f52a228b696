"""Live switch of a conversation's cache mode: convert the blocks held, never run the model again.

KVCache.convert calls this with itself (under the runner's step lock); only the cache's methods are used: a new
window is applied in place (stored keys carry
absolute positions, so a window changes which blocks are kept, not what they hold); a new layout
reads the held slots, gives the old blocks back, reserves blocks in the new layout and writes
them there. Components whose format does not change keep their pages byte for byte (a stored
value is never re-quantized); the others are dequantized and written in the new format.
"""
from __future__ import annotations

from typing import Callable

import torch

from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.kv.layout import MIB, KVLayout, WindowGeometry
from kvchat.engine.kv.manager import NoFreeBlocks
from kvchat.engine.kv.pages import page_rows
from kvchat.engine.kv.sequence import Sequence
from kvchat.engine.model.rope import rope_cos_sin, rotate


def convert_sequence(m, seq: Sequence, old: CacheConfig, new: CacheConfig,
                     layout: KVLayout, geometry: WindowGeometry, inv_freq: list[torch.Tensor],
                     close: Callable[[Sequence], None],
                     drop_unused_layouts: Callable[[], None]) -> Sequence:
    """seq (one KV group's sequence) in mode `old` -> a sequence in mode `new` (whose layout and geometry for the
    group are `layout` and `geometry`) holding the same tokens (seq
    itself when the layout stays); inv_freq: the RoPE table of each of the layout's layers. close(seq) gives a
    sequence back to the cache; drop_unused_layouts lets the cache free the pages of layouts nobody uses any
    more. m: the KVCache."""
    if new.block_size != old.block_size and seq.evicted:
        raise ConfigError(f"the window has already dropped {seq.evicted * seq.block_size} tokens, so the block size "
                          f"cannot change now: reset the session first")
    if seq.evicted and geometry.window is not None and not geometry.by_importance and _scattered(seq):
        raise ConfigError("attention chose which blocks left this conversation, so a sliding window cannot take it "
                          "over: keep 'Keep what matters' on, remove the window, or reset the session")
    if seq.evicted and new.window is not None and geometry.sink_blocks != seq.sink_blocks:
        raise ConfigError(f"the window has already evicted tokens around {old.sinks} sinks; changing the number "
                          f"of sinks now needs a reset")
    if layout.budget_blocks(m.budget_bytes) < 1:
        raise ConfigError(f"a KV budget of {m.budget_bytes / MIB:g} MiB does not hold even one block of "
                          f"{new.block_size} tokens in {new.label()}: raise the budget")
    if layout.block_size == seq.layout.block_size:
        m.apply_window(seq, geometry)     # first drop what the new window does not keep
    if layout == seq.layout:
        return seq
    return _relayout(m, seq, layout, geometry, new, inv_freq, close, drop_unused_layouts)


def _scattered(seq: Sequence) -> bool:
    """Whether the blocks that left are other than one run right after the sink blocks (as a window lets go)."""
    holes = [i for i, b in enumerate(seq.table) if b is None]
    return holes != list(range(seq.sink_blocks, seq.sink_blocks + len(holes)))


def _relayout(m, seq: Sequence, layout: KVLayout, geometry: WindowGeometry,
              new: CacheConfig, inv_freq: list[torch.Tensor], close, drop_unused_layouts) -> Sequence:
    n = seq.seq_len
    need = layout.blocks_for(n) * layout.block_bytes + layout.side_bytes(n, n >= layout.block_size)
    room = m.room_for(seq)
    if need > room:
        raise ConfigError(f"the conversation holds {seq.tokens_held} tokens, which need {need / MIB:.1f} MiB in "
                          f"{new.label()}, more than the {m.budget_bytes / MIB:g} MiB budget allows: raise the budget, "
                          f"use a window or a smaller format, or reset the session")
    old_comps = m.components(seq.layout)
    new_layout_comps = m.components(layout)
    same_blocks = layout.block_size == seq.layout.block_size
    slots = torch.arange(n)
    abs_pos = seq.positions(slots)
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}      # cos, sin per RoPE table (by identity)
    # read everything the new layout needs before the old blocks go back
    carried = []
    for layer, ((okc, ovc), (nkc, nvc)) in enumerate(zip(old_comps, new_layout_comps)):
        pair = []
        for role, oc, nc in (("k", okc, nkc), ("v", ovc, nvc)):
            if same_blocks and oc.fmt == nc.fmt:
                pair.append(("copy", oc.copy_out(seq.seq_id, seq.block_table)))
            else:
                values = oc.values(seq.seq_id, seq.block_table, seq.seq_len, slots)
                if role == "k" and oc.fmt.is_quantized != nc.fmt.is_quantized:
                    if id(inv_freq[layer]) not in tables:
                        cos, sin = rope_cos_sin(abs_pos, inv_freq[layer].cpu())
                        tables[id(inv_freq[layer])] = cos.to(m.device), sin.to(m.device)
                    cos, sin = tables[id(inv_freq[layer])]
                    # full precision holds keys rotated at their absolute positions, quantized pages before RoPE
                    values = rotate(values, cos, sin) if nc.fmt.is_quantized is False else rotate(values, cos, -sin)
                pair.append(("write", values))
        carried.append(pair)
    num_tokens, evicted, sink_blocks, keep_head = seq.num_tokens, seq.evicted, seq.sink_blocks, seq.has_head
    holes = [i for i, b in enumerate(seq.table) if b is None]
    child = m.new_group(layout, geometry, sink_blocks)     # registered first, so its layout's pages stay
    close(seq)
    try:
        res = m.reserve_blocks(child, n, set())
    except NoFreeBlocks:       # checked above; only a race with another step could get here
        raise ConfigError("the budget filled while converting: reset the session") from None
    new_layout_comps = m.components(layout)
    rows = page_rows(child.block_table, slots, layout.block_size, m.device)
    for (nkc, nvc), pair in zip(new_layout_comps, carried):
        for nc, (how, payload) in zip((nkc, nvc), pair):
            if how == "copy":
                nc.copy_in(child.seq_id, child.block_table, payload)
            elif nc.fmt.is_quantized:
                if n:
                    nc.write(child.seq_id, payload, 0, child.block_table, keep_head=keep_head or evicted == 0)
            else:
                nc.write_rows(payload, rows)
    m.adopt(res, num_tokens, evicted, holes)
    drop_unused_layouts()
    return child

