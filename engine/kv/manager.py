"""One KV manager per engine: block ids, sequences and their block tables, the prefix index, the budget.

Past 450 lines on purpose: every rule of the budget (room, release, prefix eviction, forks, truncation) reads the
same running counts; apart, they would drift.

Plain Python, no torch: it decides which blocks hold what; the page store (engine/kv/pages.py)
holds the bytes. Names follow vLLM's v1 KV manager where they apply.

- `BlockPool` (engine/kv/block_pool.py) hands out block ids, counts references, and keeps freed
  prefix blocks as *evictable*. Each KV group (kv/layout.kv_groups, named by its layout's layers) has a pool
  of its own, so its layouts' pages grow to its own blocks only: a sliding layer's pages stay at its window
  while the global layers' grow. A model of one group (every model without windows of its own) has one pool.
- A `Sequence` (engine/kv/sequence.py) is one conversation's (or request's) view in one group: its positioned
  block table, its token count, the hashes of its full blocks.
- `KVCacheManager` reserves slots for a step, commits or rolls them back, forks, truncates, frees,
  matches prefixes, and keeps every sequence's bytes inside one byte budget, releasing the least
  recently used idle sequence first when a step needs room.

Only KVCache (engine/kv/cache.py) calls it, with the page store beside it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvchat.engine.kv.block_pool import BlockPool
from kvchat.engine.kv.layout import KVLayout, WindowGeometry
from kvchat.engine.kv.sequence import Reservation, Sequence


class NoFreeBlocks(RuntimeError):
    """The budget cannot hold the blocks a step needs, even after releasing every idle sequence."""

    def __init__(self, need_bytes: int, free_bytes: int):
        super().__init__(f"need {need_bytes} bytes, {free_bytes} free")
        self.need_bytes, self.free_bytes = need_bytes, free_bytes


@dataclass(frozen=True)
class PoolView:
    """The pool at a glance, for the dashboard and the server's metrics."""

    budget_bytes: int
    held_bytes: int                     # blocks in use and evictable, plus full-precision sides
    free_bytes: int
    evictable_blocks: int
    evictable_bytes: int
    shared_blocks: int                  # blocks referenced by more than one sequence
    blocks_in_use: int
    prefix_queries: int                 # tokens looked up in the prefix index
    prefix_hits: int                    # of those, tokens found
    sequences: tuple[tuple[int, int, int, bool], ...]   # per conversation (seq_id, blocks, bytes, released)


class KVCacheManager:
    def __init__(self, budget_bytes: int, on_free=None, on_release=None):
        # one block-id space per KV group, by its layout's layers (() for a model of one group: the whole layout)
        self._free_clock = itertools.count()                # the pools' shared order of freed prefix blocks
        self.pools: dict[tuple[int, ...], BlockPool] = {(): BlockPool(self._free_clock)}
        self.block_layouts: dict[tuple[int, ...], dict[int, KVLayout]] = {(): {}}   # id -> the layout whose pages hold it
        self.budget_bytes = int(budget_bytes)
        self.sequences: dict[int, Sequence] = {}
        self._block_bytes_held = 0                          # bytes of the blocks in block_layouts
        self.extra_bytes = 0        # kept beside blocks and sequences, room's to take (kv/state.StatePoints) ...
        self.drop_extra = lambda: False     # ... one piece at a time; False when none is left
        self._on_free = on_free or (lambda layers, ids: None)   # page store hook: these ids of a group hold nothing now
        self._on_release = on_release or (lambda seq: None)     # a conversation is about to be released for room
        self._clock = itertools.count(1)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.released_log: list[int] = []                   # seq ids released for room, newest last

    # ---- block-id spaces ------------------------------------------------------------------

    @property
    def pool(self) -> BlockPool:
        """The pool of a model of one KV group (the whole layout)."""
        return self.pools[()]

    @property
    def block_layout(self) -> dict[int, KVLayout]:
        """The layouts of the one-group pool's blocks."""
        return self.block_layouts[()]

    def pool_of(self, seq: Sequence) -> BlockPool:
        return self.pools[seq.layout.layers]

    def high_water(self, layout: KVLayout) -> int:
        """One past the highest id in use or evictable in the layout's group: the length its pages need."""
        pool = self.pools.get(layout.layers)
        return pool.high_water if pool is not None else 0

    def layouts_held(self) -> set[KVLayout]:
        """Layouts whose pages hold a block in use or kept for reuse."""
        return {layout for held in self.block_layouts.values() for layout in held.values()}

    def _space(self, layers: tuple[int, ...]) -> BlockPool:
        pool = self.pools.get(layers)
        if pool is None:
            pool = self.pools[layers] = BlockPool(self._free_clock)
            self.block_layouts[layers] = {}
        return pool

    # ---- bytes --------------------------------------------------------------------------

    @property
    def held_bytes(self) -> int:
        """Bytes of every block in use or kept for reuse, plus the sequences' full-precision sides."""
        return (self._block_bytes_held + self.extra_bytes
                + sum(s.side_bytes + s.state_bytes for s in self.sequences.values()))

    def recount(self) -> int:
        """held block bytes counted from scratch (check() compares it with the running count)."""
        return sum(self.block_layouts[k][b].block_bytes for k, pool in self.pools.items()
                   for b, r in enumerate(pool.ref_cnt) if r or b in pool.block_hash)

    def evictable_bytes(self) -> int:
        return sum(self.block_layouts[k][b].block_bytes for k, pool in self.pools.items()
                   for b in pool.evictable_ids())

    def sequence_bytes(self, seq: Sequence) -> int:
        return len(seq.block_table) * seq.layout.block_bytes + seq.side_bytes + seq.state_bytes

    # ---- sequences ----------------------------------------------------------------------

    def new_sequence(self, layout: KVLayout, geometry: WindowGeometry, sink_blocks: int | None = None) -> Sequence:
        """A sequence holding nothing yet; sink_blocks: where a converted sequence's sinks already are (they stay
        at the blocks they were kept in, whatever the new window says), else the geometry's."""
        seq = Sequence(layout, geometry, geometry.sink_blocks if sink_blocks is None else sink_blocks)
        self._space(layout.layers)
        seq.last_used = next(self._clock)
        self.sequences[seq.seq_id] = seq
        return seq

    def free(self, seq: Sequence) -> int:
        """Drop the sequence's reference to each of its blocks; returns the bytes the pool no longer holds (the fall
        of held_bytes): a block another sequence shares, or a hashed one kept for prefix reuse, is still held."""
        held = self._block_bytes_held + seq.side_bytes + seq.state_bytes
        self._free_ids(seq, reversed(seq.block_table))     # the tail of a prefix is evicted before its head
        seq.table.clear()
        seq.num_tokens = 0
        seq.token_ids.clear()
        seq.block_keys.clear()
        state = getattr(seq.conversation, "state", None)
        if state is not None and seq.state_bytes:           # back to no token read: no snapshot is of use now
            state.reset()
            seq.state_bytes = state.bytes
        return held - self._block_bytes_held - seq.side_bytes - seq.state_bytes

    def close(self, seq: Sequence) -> None:
        self.free(seq)
        seq.closed = True
        self.sequences.pop(seq.seq_id, None)

    def _free_ids(self, seq: Sequence, ids) -> None:
        """Drop one reference to each of ids, blocks of seq's group."""
        pool = self.pool_of(seq)
        gone = [b for b in ids if pool.free(b) and b not in pool.block_hash]
        self._forget(seq.layout.layers, gone)

    def _forget(self, layers: tuple[int, ...], ids: list[int]) -> None:
        held = self.block_layouts[layers]
        for b in ids:
            layout = held.pop(b, None)
            if layout is not None:
                self._block_bytes_held -= layout.block_bytes
        if ids:
            self._on_free(layers, ids)

    def _evict_oldest(self) -> bool:
        """Forget the least recently freed prefix block of every group's pool; False when none is evictable."""
        ticks = [(t, k) for k, pool in self.pools.items() if (t := pool.oldest_freed()) is not None]
        if not ticks:
            return False
        layers = min(ticks)[1]
        self._forget(layers, [self.pools[layers].evict_oldest()])
        return True

    # ---- room ---------------------------------------------------------------------------

    def free_bytes(self) -> int:
        return self.budget_bytes - self.held_bytes

    def _whole(self, keep) -> set[int]:
        """keep (sequence ids) with every group of their conversations: a conversation is kept or released whole."""
        out = set(keep)
        for sid in keep:
            seq = self.sequences.get(sid)
            if seq is not None:
                out.update(m.seq_id for m in seq.members)
        return out

    def reclaimable_bytes(self, keep: set[int]) -> int:
        """Bytes that could be made free: evictable prefix blocks and idle sequences' own blocks."""
        keep = self._whole(keep)
        total = self.evictable_bytes() + self.extra_bytes
        for s in self.sequences.values():
            if s.seq_id not in keep and s.block_table and not s.pinned:
                ref = self.pool_of(s).ref_cnt
                total += sum(s.layout.block_bytes for b in s.block_table if ref[b] == 1) + s.side_bytes
        return total

    def make_room(self, need: int, keep: set[int]) -> None:
        """Free bytes until `need` more fit: oldest evictable prefix blocks, then least recently used idle sequences."""
        keep = self._whole(keep)
        while self.free_bytes() < need:
            if self._evict_oldest() or self.drop_extra():
                continue
            idle = [s for s in self.sequences.values() if s.seq_id not in keep and s.block_table and not s.pinned]
            if not idle:
                raise NoFreeBlocks(need, self.free_bytes())
            victim = min(idle, key=lambda s: s.last_used)
            members = victim.members
            victim = victim.conversation or victim
            self._on_release(victim)            # its blocks may go to a second tier first
            for member in members:              # a conversation goes whole, every group together
                self.free(member)
                member.released = True
            self.released_log.append(members[0].seq_id)

    def _allocate(self, layout: KVLayout, n: int) -> list[int]:
        pool, held = self.pools[layout.layers], self.block_layouts[layout.layers]
        ids = [pool.allocate() for _ in range(n)]
        for b in ids:
            held[b] = layout
        self._block_bytes_held += n * layout.block_bytes
        return ids

    # ---- one step: reserve, then commit or roll back -------------------------------------

    def bytes_needed(self, seq: Sequence, num_new: int) -> int:
        """More bytes num_new tokens take: new blocks, a shared partial block's copy, a head/tail that appears."""
        layout, n = seq.layout, seq.seq_len + num_new
        blocks = (max(0, layout.blocks_for(seq.num_tokens + num_new) - len(seq.table))
                  + int(num_new > 0 and self.shared_partial(seq)))
        side_after = layout.side_bytes(n, seq.has_head or n >= layout.block_size)
        return blocks * layout.block_bytes + max(0, side_after - seq.side_bytes)

    def reserve(self, seq: Sequence, num_new: int, keep: set[int] = frozenset()) -> Reservation:
        """Blocks for num_new more tokens (a shared partial block is copied on write). Nothing else changes
        until commit; rollback undoes this exactly. Raises NoFreeBlocks when even releasing idle
        sequences leaves too little room."""
        seq.last_used = next(self._clock)
        seq.released = False
        layout = seq.layout
        keep = set(keep) | {seq.seq_id}
        first = seq.seq_len
        need_blocks = max(0, layout.blocks_for(seq.num_tokens + num_new) - len(seq.table))
        partial = num_new > 0 and self.shared_partial(seq)
        self.make_room(self.bytes_needed(seq, num_new), keep)
        res = Reservation(seq, num_new, first, self._allocate(layout, need_blocks))
        if partial:
            i = len(seq.table) - 1
            old, (new,) = seq.table[i], self._allocate(layout, 1)
            seq.table[i] = new
            res.copied = (i, old, new)
        seq.table.extend(res.new_blocks)
        return res

    def rollback(self, res: Reservation) -> None:
        seq = res.seq
        del seq.table[len(seq.table) - len(res.new_blocks):]
        ids = list(res.new_blocks)
        if res.copied:
            i, old, new = res.copied
            seq.table[i] = old
            ids.append(new)
        self._free_ids(seq, ids)

    def commit(self, res: Reservation, token_ids: list[int] | None = None) -> int:
        """Count the step's tokens, index its newly full blocks, and let blocks that left the window go.

        Returns the number of blocks evicted by the window."""
        seq = res.seq
        if res.copied:
            self._free_ids(seq, [res.copied[1]])
        seq.num_tokens += res.num_new
        hashing = (token_ids is not None and (seq.evicted == 0 or seq.geometry.model_window)
                   and len(seq.token_ids) == seq.num_tokens - res.num_new)
        if hashing:
            seq.token_ids.extend(token_ids)
            self._index_full_blocks(seq)
        else:
            seq.token_ids.clear()
            seq.block_keys.clear()
        return self._evict_window(seq)

    def drop(self, seq: Sequence, position: int) -> int:
        """The block at table index `position` leaves (its entry null, later blocks keep their positions); returns
        the bytes the pool no longer holds. The blocks computed after it attend without it, so they are not what full
        attention computes: nothing more of the sequence is indexed for prefix reuse."""
        held = self._block_bytes_held
        gone, seq.table[position] = seq.table[position], None
        seq.token_ids.clear()
        seq.block_keys.clear()
        self._free_ids(seq, [gone])
        return held - self._block_bytes_held

    def _index_full_blocks(self, seq: Sequence) -> None:
        bs = seq.block_size
        while (len(seq.block_keys) + 1) * bs <= min(seq.num_tokens, seq.geometry.full_attention_tokens):
            i = len(seq.block_keys)
            parent = hash(seq.block_keys[-1]) if seq.block_keys else 0
            key = (parent, seq.layout, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            seq.block_keys.append(key)
            if seq.table[i] is not None:        # a model window's block may have left already: its key stays
                self.pool_of(seq).cache(seq.table[i], key)

    def apply_window(self, seq: Sequence, geometry: WindowGeometry) -> int:
        """A new window on a sequence (live switch): blocks it no longer keeps go back; returns how many."""
        if seq.evicted and geometry.window is not None and geometry.sink_blocks != seq.sink_blocks:
            raise ValueError("sink blocks cannot change once the window has evicted tokens")
        if geometry != seq.geometry:      # blocks from now on are computed under another window: index no more
            seq.token_ids.clear()
            seq.block_keys.clear()
        seq.geometry = geometry
        if not seq.evicted:
            seq.sink_blocks = geometry.sink_blocks
        return self._evict_window(seq)

    def adopt(self, res: Reservation, num_tokens: int, evicted: int, holes: list[int] | None = None) -> None:
        """A converted sequence takes its tokens without a forward pass (its blocks were written directly): the
        `evicted` blocks that had left stand as null entries after its sink blocks, where the window let them go."""
        seq = res.seq
        seq.num_tokens = num_tokens
        if holes:                           # null entries where the old table had them (kept by attention)
            held, gone = iter(seq.table), set(holes)
            seq.table[:] = [None if i in gone else next(held) for i in range(len(seq.table) + len(holes))]
            return
        seq.table[seq.sink_blocks:seq.sink_blocks] = [None] * evicted

    def _evict_window(self, seq: Sequence) -> int:
        g, bs = seq.geometry, seq.block_size
        if g.window is None or g.by_importance:     # importance: the cache chooses (KVCache.evict_unimportant)
            return 0
        # a block after the sinks leaves once every token in it is older than the window; at least one block past
        # the sinks stays held (the newest), whatever else dropped before
        start = max(g.sinks, seq.num_tokens - g.window)
        held = len(seq.table) - seq.evicted
        gone = []
        for i in range(seq.sink_blocks, len(seq.table)):
            if (i + 1) * bs > start or held - len(gone) <= g.sink_blocks + 1:
                break
            if seq.table[i] is not None:
                gone.append(seq.table[i])
                seq.table[i] = None
        n = len(gone)
        if n:
            if not seq.geometry.model_window:   # positions past the sinks moved: nothing more is indexed
                seq.token_ids.clear()
                seq.block_keys.clear()
            self._free_ids(seq, gone)
        return n

    # ---- prefix caching, fork, truncate ---------------------------------------------------

    def match_prefix(self, seq: Sequence, token_ids: list[int]) -> int:
        """Adopt cached full blocks holding the start of token_ids (an empty sequence only); returns tokens adopted.

        The last token is always left to compute, so its logits come from a forward pass."""
        assert not seq.block_table and seq.num_tokens == 0
        bs = seq.block_size
        usable = (min(len(token_ids) - 1, seq.geometry.full_attention_tokens)) // bs
        self.prefix_queries += usable * bs
        parent, pool = 0, self.pool_of(seq)
        for i in range(usable):
            key = (parent, seq.layout, tuple(token_ids[i * bs:(i + 1) * bs]))
            block_id = pool.lookup(key)
            if block_id is None:
                break
            pool.touch(block_id)
            seq.table.append(block_id)
            seq.block_keys.append(key)
            parent = hash(key)
        n = len(seq.table) * bs
        seq.num_tokens = n
        seq.token_ids = list(token_ids[:n])
        self.prefix_hits += n
        return n

    def fork(self, seq: Sequence, num_tokens: int) -> tuple[Sequence, int]:
        """A new sequence sharing seq's first num_tokens tokens by reference.

        Returns (child, tokens shared). Full blocks are shared; the partial block is shared too and
        copied when the child first writes (the page store copies its rows). A window that evicted
        blocks cannot be forked."""
        assert 0 <= num_tokens <= seq.num_tokens and seq.evicted == 0
        child = self.new_sequence(seq.layout, seq.geometry)
        blocks = seq.block_table[:seq.layout.blocks_for(num_tokens)]
        pool = self.pool_of(seq)
        for b in blocks:
            pool.touch(b)
        child.table = list(blocks)
        child.num_tokens = num_tokens
        if len(seq.token_ids) >= num_tokens:
            child.token_ids = seq.token_ids[:num_tokens]
            child.block_keys = seq.block_keys[:num_tokens // seq.block_size]
        return child, num_tokens

    def truncate(self, seq: Sequence, n: int) -> list[int]:
        """Take back the last n committed tokens (rejected drafts, an edited turn). Returns block ids dropped."""
        assert 0 <= n <= seq.seq_len, f"cannot take back {n} of {seq.seq_len} tokens"
        keep = seq.layout.blocks_for(seq.num_tokens - n)
        assert None not in seq.table[(seq.num_tokens - n) // seq.block_size:], "cannot take back into blocks that left"
        seq.num_tokens -= n
        dropped = seq.table[keep:]
        del seq.table[keep:]
        self._free_ids(seq, reversed(dropped))
        del seq.token_ids[seq.num_tokens:]
        del seq.block_keys[seq.num_tokens // seq.block_size:]
        if seq.num_tokens % seq.block_size:     # a full block is partial again: new tokens will overwrite its rows
            self.pool_of(seq).uncache(seq.table[-1])
        return dropped

    def shared_partial(self, seq: Sequence) -> bool:
        return bool(seq.num_tokens % seq.block_size) and self.pool_of(seq).ref_cnt[seq.table[-1]] > 1

    def clear_prefix_cache(self) -> int:
        """Free every evictable prefix block; returns the bytes freed."""
        total = 0
        for layers, pool in self.pools.items():
            freed = pool.clear_cache()
            total += sum(self.block_layouts[layers][b].block_bytes for b in freed)
            self._forget(layers, freed)
        for s in self.sequences.values():
            s.block_keys.clear()
            s.token_ids.clear()
        return total

    # ---- views ----------------------------------------------------------------------------

    def view(self) -> PoolView:
        held = self.held_bytes
        ev = self.evictable_bytes()
        # a conversation of several groups once, by its first group's id
        seqs = tuple((s.seq_id, sum(len(m.block_table) for m in s.members), sum(map(self.sequence_bytes, s.members)),
                      s.released) for s in self.sequences.values() if s.members[0] is s)
        pools = self.pools.values()
        return PoolView(self.budget_bytes, held, self.budget_bytes - held, sum(p.num_evictable for p in pools), ev,
                        sum(1 for p in pools for r in p.ref_cnt if r > 1), sum(p.num_in_use for p in pools),
                        self.prefix_queries, self.prefix_hits, seqs)

    def check(self) -> None:
        """Invariants (tests call this): reference counts match the tables, no id is both free and used."""
        counts: dict[tuple, int] = {}
        for s in self.sequences.values():
            for b in s.block_table:
                counts[s.layout.layers, b] = counts.get((s.layout.layers, b), 0) + 1
        for layers, pool in self.pools.items():
            for b, r in enumerate(pool.ref_cnt):
                n = counts.get((layers, b), 0)
                assert r >= 0, f"block {b} has a negative count"
                assert r == n, f"block {b} of group {layers}: {r} references, {n} in tables"
                if r == 0:
                    assert (b in pool._evictable) != (b in pool._free), f"block {b} lost"
                else:
                    assert self.block_layouts[layers][b].layers == layers, f"block {b} is in another group's pages"
            assert len(set(pool._free)) == len(pool._free), "an id is twice in the free heap"
        assert self.recount() == self._block_bytes_held, "the running count of held bytes drifted"
        assert self.held_bytes <= self.budget_bytes, "held bytes above the budget"
