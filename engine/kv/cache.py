"""The KV cache's one owner: block ids, the bytes behind them, and the budget they share.

`KVCacheManager` (manager.py) decides which block holds what; `PageStore` (pages.py) holds the bytes. They must move
together (a block reserved needs its pages grown, a block freed takes its full-precision head along, a step undone
restores the quantized tails), so only this class touches either. The runner, the session, conversion, saved caches,
the server's batch and the memory bench all go through it.

Its unit is a positioned block: a conversation's table keeps one entry per block of tokens it has seen, null where a
block has left (the window moved past it, or `drop` let it go), so an entry's index is its position. The per-type rules
of which blocks leave stay in the window geometry of each KV group (full attention, the user's window + sinks, a
model's own sliding window: kv/layout.py); eviction by importance, retrieval and state snapshots plug in here.

A conversation is a `Conversation`: one sequence per KV group of the model (kv/layout.kv_groups); every call here
takes the conversation and does the same to each of its groups. A model with linear-attention layers gives each
conversation a recurrent state (kv/state.py) beside its groups: its bytes and its snapshots' count in the budget
(carried by the first group's sequence), a fork starts from a snapshot, a truncation returns to one.

Past 450 lines on purpose: this is the one owner of blocks, pages, state and budget, and every change to any of them
is a method here; split, the rules of one change would be read across files again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.kv import convert, importance, saved
from kvchat.engine.kv.attention_log import AttentionLog
from kvchat.engine.kv.block_tier import BlockTier
from kvchat.engine.kv.layout import MIB, PREFILL_CHUNK, FullAttention, KVGroup, KVLayout, ReadChosen
from kvchat.engine.kv.manager import KVCacheManager, NoFreeBlocks, PoolView
from kvchat.engine.kv.sequence import Conversation, Reservation, Sequence
from kvchat.engine.kv.state import RecurrentState, StateLayout, StatePoints
from kvchat.engine.kv.tier import DEFAULT_TIER_MB as HOST_TIER_MB, PreemptTier
from kvchat.engine.kv.pages import PageStore


@dataclass(frozen=True)
class Truncation:
    """What taking back the last tokens did: `taken` tokens, or none and `reason` (in the user's words) when the
    cache cannot take them back exactly (a window let their blocks go, or a quantized block already holds them)."""

    taken: int
    reason: str = ""

    def __bool__(self) -> bool:
        return not self.reason


class KVCache:
    def __init__(self, device, budget_bytes: int, on_release: Callable[[Conversation], None] | None = None):
        self.device = device
        self._pages = PageStore(device)
        self._on_release = on_release or (lambda conv: None)
        self._blocks = KVCacheManager(int(budget_bytes), on_free=self._pages.forget_blocks, on_release=self._released)
        self._tiers: dict[int, BlockTier] = {}      # a retrieval conversation's first sequence -> its blocks on disk
        # the second tier: a GPU pool's released conversations go to pinned host memory first, then to disk (the
        # saved-cache file, engine/runtime/warm.py); a CPU pool's go to disk
        self.host_tier = PreemptTier(HOST_TIER_MB, "host") if torch.device(device).type == "cuda" else None
        self.points = StatePoints()        # states at block boundaries, for prefix sharing over a recurrent state
        self._replaced: dict[int, list] = {}        # a conversation's first sequence -> its latest points' keys
        self._blocks.drop_extra = self._drop_extra
        self._spares: dict[int, RecurrentState] = {}     # id(state) -> a state holding a spare (hold_spare)
        self._logs: dict[int, AttentionLog] = {}    # a watched conversation's first sequence -> its attention

    # ---- conversations ---------------------------------------------------------------------------------------

    def open(self, groups: tuple[KVGroup, ...], state: StateLayout | None = None) -> Conversation:
        """A conversation holding nothing yet, one sequence per KV group, and a zero recurrent state of `state`'s
        shape where the model has linear-attention layers (its bytes held from now on; NoFreeBlocks where the budget
        cannot make room for them)."""
        conv = Conversation([self._blocks.new_sequence(g.layout, g.geometry) for g in groups])
        if state is not None:
            try:
                self._blocks.make_room(state.bytes, {m.seq_id for m in conv.members})
            except NoFreeBlocks:
                self.close(conv)
                raise
            conv.state = RecurrentState(state, self.device)
            self.count_state(conv)
        return conv

    def count_state(self, conv: Conversation) -> None:
        """The conversation's state bytes (live, snapshots, a verification's journal) recounted into the budget, as
        its first group carries them: after anything that changed them (a step, a snapshot, a fork)."""
        conv.groups[0].state_bytes = conv.state.bytes if conv.state is not None else 0

    def hold_spare(self, conv: Conversation) -> None:
        """Give the conversation's recurrent state a spare (kv/state.py) where the budget has it free, so its steps
        take their new state without copying it. Nothing is released for it: its bytes are room the budget takes back
        first (drop_extra), and a step without one copies."""
        state = conv.state
        if state is None or state.spare is not None or self._blocks.free_bytes() < state.layout.bytes:
            return
        state.add_spare()
        self._spares[id(state)] = state
        self._blocks.extra_bytes += state.layout.bytes

    @property
    def spare_bytes(self) -> int:
        """Bytes the states' spares hold: in the pool's held bytes, room it takes back first."""
        return sum(state.layout.bytes for state in self._spares.values())

    def _drop_spare(self, state: RecurrentState) -> int:
        if self._spares.pop(id(state), None) is None:
            return 0
        state.spare = None
        self._blocks.extra_bytes -= state.layout.bytes
        return state.layout.bytes

    def _drop_extra(self) -> bool:
        """Room taken back one piece at a time: a state's spare (its steps copy again), then the oldest state point."""
        if self._spares:
            return self._drop_spare(next(iter(self._spares.values()))) > 0
        return self._drop_point()

    def snapshot(self, conv: Conversation) -> bool:
        """Keep a copy of the conversation's recurrent state where it is now (kv/state.py), room permitting: idle
        conversations may be released for it, else its own oldest snapshot goes; False where there is no state or
        no room."""
        state = conv.state
        if state is None or state.position in state.snapshots or state.position != conv.num_tokens:
            return False
        need = state.layout.bytes
        keep = {m.seq_id for m in conv.members}
        try:
            self._blocks.make_room(need, keep)
        except NoFreeBlocks:
            state.drop_oldest()
            self.count_state(conv)
            if self._blocks.free_bytes() < need:
                return False
        state.snapshot()
        self.count_state(conv)
        return True

    def state_positions(self, conv: Conversation) -> list[int]:
        """The token counts the conversation's state can return to (its snapshots and where it is), oldest first."""
        if conv.state is None:
            return []
        return sorted({0, conv.state.position, *conv.state.snapshots})

    def free(self, seq: Conversation) -> int:
        """Every block of the conversation goes back; returns the bytes the pool no longer holds."""
        freed = self._drop_tier(seq)
        log = self._logs.get(seq.members[0].seq_id)
        if log is not None:                 # nothing is cached: nothing was attended
            log.clear()
        if seq.state is not None:
            freed += self._drop_spare(seq.state)
        for m in seq.members:
            freed += self._blocks.free(m)
            self._pages.drop_tails(m.seq_id)
        self._pages.shrink(self._blocks.high_water)
        return freed

    def close(self, seq: Conversation) -> None:
        self._replaced.pop(seq.members[0].seq_id, None)     # its latest point stays, for whoever reads the same
        self._logs.pop(seq.members[0].seq_id, None)
        self.free(seq)
        for m in seq.members:
            self._blocks.close(m)
        self.drop_unused_layouts()

    # ---- the second tier of a retrieval conversation (kv/block_tier.py) ----------------------------------------

    def tier_of(self, seq) -> BlockTier | None:
        """The conversation's blocks on disk, or None."""
        return self._tiers.get(seq.members[0].seq_id)

    def _released(self, conv) -> None:
        """The budget releases an idle conversation: its blocks on disk go with it."""
        self._drop_tier(conv)
        self._on_release(conv)

    def _drop_tier(self, seq) -> int:
        tier = self._tiers.pop(seq.members[0].seq_id, None)
        if tier is None:
            return 0
        held = self._blocks.held_bytes
        if tier.staging is not None:
            self._blocks.close(tier.staging)
        tier.close()
        return held - self._blocks.held_bytes

    def can_spill(self, seq) -> bool:
        """Whether the conversation moves blocks to disk when the budget is full (retrieval, full-precision pages,
        one KV group, a CPU pool), rather than stopping."""
        m = seq.members[0]
        return isinstance(m.geometry, ReadChosen) and not m.layout.quantized_components and len(seq.members) == 1 \
            and torch.device(self.device).type == "cpu"

    def _spill(self, seq: Sequence, short: int, keep: set[int]) -> bool:
        """Room for a retrieval conversation past its budget: its oldest blocks (not the sinks', not the two newest)
        move to its tier until `short` more bytes are free, with the fetch cache's blocks the first time. False
        (nothing moved) where it cannot: another kind of conversation, quantized pages, too few blocks, a full disk."""
        g, layout = seq.geometry, seq.layout
        if not self.can_spill(seq):
            return False
        tier = self._tiers.get(seq.seq_id)
        fresh = tier is None
        if fresh:
            tier = BlockTier(layout, self._pages.components(layout), g.blocks, self.device)
            short += tier.num_slots * layout.block_bytes
        count = -(-short // layout.block_bytes)
        bs = seq.block_size
        held = [p for p, b in enumerate(seq.table) if b is not None]
        slot_of = {p: i for i, p in enumerate(held)}
        chosen = [p for p in held if g.read_sink_blocks <= p < len(seq.table) - 2][:count]
        if len(chosen) < count:
            if fresh:
                tier.close()
            return False
        summ = self._pages.key_summaries(layout)
        ids = torch.tensor([seq.table[p] for p in chosen], dtype=torch.long)
        slots = torch.tensor([slot_of[p] for p in chosen])[:, None] * bs + torch.arange(bs)
        positions = torch.tensor(chosen)[:, None] * bs + torch.arange(bs)
        for j, (kc, _) in enumerate(self._pages.components(layout)):
            summ.make(j, kc, seq.seq_id, seq.block_table, seq.seq_len, ids, slots, positions, None)
        try:
            tier.put(chosen, ids.tolist(), [d[ids] for d in summ.data])
        except OSError:
            if fresh:
                tier.close()
            return False
        for p in chosen:
            self._blocks.drop(seq, p)
        if fresh:
            staging = self._blocks.new_sequence(layout, FullAttention(bs))
            staging.pinned = True
            res = self._blocks.reserve(staging, tier.num_slots * bs, set(keep) | {seq.seq_id})
            self._blocks.commit(res)
            self._pages.reserve(layout, self._blocks.high_water(layout), layout.budget_blocks(self.budget_bytes) + 1)
            tier.staging = staging
            self._tiers[seq.seq_id] = tier
        return True

    # ---- attention, measured (kv/attention_log.py) -----------------------------------------------------------

    def watch(self, seq: Conversation, log: AttentionLog | None) -> None:
        """Measure where the conversation's rows attend from its next step on, into `log` (None: stop); a log
        follows one conversation (the one it was given to last)."""
        self._logs = {k: v for k, v in self._logs.items() if v is not log and k != seq.members[0].seq_id}
        if log is not None:
            self._logs[seq.members[0].seq_id] = log

    def attention_log(self, seq: Conversation) -> AttentionLog | None:
        return self._logs.get(seq.members[0].seq_id)

    def fork(self, seq: Conversation, num_tokens: int) -> tuple[Conversation, int]:
        """A conversation sharing the first num_tokens tokens of seq; returns (child, tokens shared).

        Quantized partial blocks are shared only while they are still the parent's tail (the values are not
        re-quantized); otherwise the child shares whole blocks and re-reads the rest. Nothing is shared once a block
        left (the child's positions would not be the parent's)."""
        bs = seq.block_size
        members = seq.members
        state = seq.state
        if state is not None:          # only as far as a state the child can start from
            num_tokens = state.best_at_most(num_tokens)
        if any(m.evicted for m in members) or (state is not None and num_tokens == 0):
            return self._with_state(Conversation([self._blocks.new_sequence(m.layout, m.geometry)
                                                  for m in members]), seq, 0), 0
        partial = num_tokens % bs
        quantized = any(m.layout.quantized_components for m in members)
        if partial and quantized and seq.seq_len // bs != num_tokens // bs:
            num_tokens -= partial
        children, n = [], 0
        for m in members:
            child, n = self._blocks.fork(m, num_tokens)
            if m.layout.quantized_components and n % bs:
                self._pages.copy_tail(m.layout, m.seq_id, child.seq_id)
            children.append(child)
        child = Conversation(children)
        if state is not None and n != num_tokens:      # a quantized block cut the share short of the state's
            self.free(child)
            n = 0
        return self._with_state(child, seq, n), n

    def _with_state(self, child: Conversation, parent: Conversation, n: int) -> Conversation:
        """The child of a fork gets the parent's state after n tokens (a zero one for n = 0)."""
        if parent.state is not None:
            child.state = (parent.state.copy_at(n) if n else RecurrentState(parent.state.layout, self.device))
            self.count_state(child)
        return child

    def truncate(self, seq: Conversation, n: int) -> Truncation:
        """Take back the last n tokens where that is exact (nothing changes otherwise: the result says why)."""
        bs = seq.block_size
        for m in seq.members:
            g = m.geometry
            # a model window reads the W - 1 tokens before the new end (all of them, while fewer): still held?
            short = g.model_window and max(0, m.num_tokens - n - g.window) < m.evicted * bs
            if n > m.seq_len or None in m.table[(m.num_tokens - n) // bs:] or short:
                return Truncation(0, f"the cache holds {m.seq_len} tokens since the window moved: it cannot take "
                                     f"back {n}")
            if m.layout.quantized_components and n > m.seq_len % bs:
                return Truncation(0, "a quantized cache can take back tokens of its last, unquantized block only")
        state = seq.state
        if state is not None and n and not state.can_return(seq.num_tokens - n):
            return Truncation(0, f"the recurrent state holds no snapshot after token {seq.num_tokens - n:,} (it "
                                 f"keeps {', '.join(f'{p:,}' for p in self.state_positions(seq))})")
        for m in seq.members:
            self._blocks.truncate(m, n)
        if state is not None and n:
            state.restore(seq.num_tokens)
            self.count_state(seq)
        return Truncation(n)

    def drop(self, seq: Conversation, position: int) -> int:
        """The block at table index `position` of every group leaves (its entry becomes null; later blocks keep their
        positions); returns the bytes the pool no longer holds. Only a full block that is not the first can go: the
        first block is the quantized head, the last the one being filled."""
        freed = 0
        for m in seq.members:
            if not 0 < position < len(m.table) - 1 or m.table[position] is None:
                raise ValueError(f"block {position} of {len(m.table)} cannot be dropped")
            freed += self._blocks.drop(m, position)
        self._pages.shrink(self._blocks.high_water)
        return freed

    def evict_unimportant(self, seq: Conversation) -> int:
        """Groups kept by attention (KeepImportant) let their least attended blocks go until they hold their window
        (kv/importance.py, scored from the conversation's attention log); returns the blocks that went. Called after
        each committed step, before anything reads the log's rows as kept (a verification's drafts stay inside a
        block that needs no eviction: ModelRunner.draft_room)."""
        gone = 0
        for m in seq.members:
            g = m.geometry
            if not g.by_importance:
                continue
            n = g.num_to_evict(m.num_tokens, m.evicted, len(m.block_table))
            if not n:
                continue
            scores = importance.block_scores(self._logs.get(seq.members[0].seq_id), m.layout.layers, len(m.table),
                                             m.num_tokens)
            for i in importance.choose(m.table, g.sink_blocks, g.newest_blocks, n, scores):
                self._blocks.drop(m, i)
                gone += 1
        if gone:
            self._pages.shrink(self._blocks.high_water)
        return gone

    def held(self, seq: Conversation) -> list[tuple[int, int]]:
        """(first token position, block id) of every block the conversation's first group holds, in order."""
        bs = seq.block_size
        return [(i * bs, b) for i, b in enumerate(seq.table) if b is not None]

    def match_prefix(self, seq: Conversation, ids: list[int]) -> int:
        """Adopt cached blocks holding the start of ids; returns the tokens that need no forward pass. A conversation
        with a recurrent state adopts them only as far as a state point (publish_state) lets it start from the state
        after them: blocks without that state would be read again anyway."""
        m = self._blocks
        if len(seq.members) == 1 and seq.state is None:
            return m.match_prefix(seq.members[0], ids)
        # a hit is the shortest hit over the groups (each from the start); the groups holding more give back what the
        # others could not find, and the pool counts the lookup once
        queries, hits = m.prefix_queries, m.prefix_hits
        found = [m.match_prefix(g, ids) for g in seq.members]
        n = min(found)
        if seq.state is not None:
            n = self._state_point(seq, n)
        for g, got in zip(seq.members, found):
            if got > n:
                m.truncate(g, got - n)
        usable = min(len(ids) - 1, seq.geometry.full_attention_tokens) // seq.block_size
        m.prefix_queries, m.prefix_hits = queries + usable * seq.block_size, hits + n
        return n

    def _state_point(self, seq: Conversation, n: int) -> int:
        """The most tokens (at most n, adopted blocks) after which a state point is kept: the conversation's state
        becomes that point's, counted in the budget; 0 where there is none."""
        keys = seq.members[0].block_keys
        for blocks in range(n // seq.block_size, 0, -1):
            if self.points.take(keys[blocks - 1], seq.state):
                self.count_state(seq)
                return blocks * seq.block_size
        return 0

    def publish_state(self, seq: Conversation, keep: bool = False) -> bool:
        """Keep the conversation's state as a point others reading the same tokens may start from, where it stands
        at a block boundary its first group has hashed (its key names every token before it), in free room (older
        points give theirs; no block or conversation does). A conversation keeps two points of its own besides those
        kept with `keep` (where its last message began): each step that ends at a block boundary publishes, and the
        one two before goes (a reply fills a block every few tokens; only its latest are worth a state, the one
        before the last because a history sent again may write the reply's last tokens otherwise). False where it
        is not kept."""
        state, first = seq.state, seq.members[0]
        bs = seq.block_size
        if state is None or not seq.num_tokens or seq.num_tokens % bs or state.position != seq.num_tokens \
                or len(first.block_keys) != seq.num_tokens // bs or first.evicted:
            return False
        key = first.block_keys[-1]
        if key not in self.points.points:
            while self._blocks.free_bytes() < state.layout.bytes:      # older points make room, nothing else
                if not self._drop_point():
                    return False
        self._blocks.extra_bytes += self.points.publish(key, state)
        latest = self._replaced.pop(first.seq_id, [])
        if key in latest:
            latest.remove(key)
        if not keep:
            latest.append(key)
        while len(latest) > 2:
            gone = latest.pop(0)
            if gone in self.points.points:
                del self.points.points[gone]
                self._blocks.extra_bytes -= state.layout.bytes
        self._replaced[first.seq_id] = latest
        return True

    def _drop_point(self) -> bool:
        freed = self.points.drop_oldest()
        self._blocks.extra_bytes -= freed
        return freed > 0

    def clear_prefix_cache(self) -> int:
        freed = self.points.clear()
        self._blocks.extra_bytes -= freed
        freed += self._blocks.clear_prefix_cache()
        self._pages.shrink(self._blocks.high_water)
        return freed

    def convert(self, seq: Conversation, old: CacheConfig, new: CacheConfig, groups: tuple[KVGroup, ...],
                layer_inv_freq: list[torch.Tensor]) -> Conversation:
        """seq in mode `old` -> a conversation in mode `new` (whose groups are `groups`) holding the same tokens."""
        members = seq.members
        tier = self.tier_of(seq)
        if tier is not None and tier.records:
            raise ConfigError(f"{len(tier.records)} blocks of this conversation are on disk past the KV budget and "
                              f"only {old.label()} reads them: reset the session to switch the cache mode")
        if [g.layout.layers for g in groups] != [m.layout.layers for m in members]:
            raise ConfigError(f"{new.label()} keeps this model's layers in other groups than {old.label()} (a "
                              f"window against the layers' own windows): reset the session to switch to it")
        state = seq.state                  # the same under every mode (modes apply to attention layers): it moves over
        close = self._close_one if len(members) == 1 else self._close_member
        out = Conversation([convert.convert_sequence(self, m, old, new, g.layout, g.geometry,
                                                     [layer_inv_freq[i] for i in g.layers], close,
                                                     self.drop_unused_layouts)
                            for m, g in zip(members, groups)])
        if state is not None:
            seq.state, out.state = None, state
            seq.groups[0].state_bytes = 0
            self.count_state(out)
        return out

    def _close_one(self, seq: Sequence) -> None:
        """The only group's sequence goes (a conversion replaced it): its pages shrink, their layout may go."""
        self._close_member(seq)
        self._pages.shrink(self._blocks.high_water)
        self.drop_unused_layouts()

    def _close_member(self, seq: Sequence) -> None:
        """One group's sequence goes (a conversion replaced it)."""
        self._blocks.close(seq)
        self._pages.drop_tails(seq.seq_id)

    # ---- saved caches ------------------------------------------------------------------------------------------

    def export(self, seq: Conversation) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """(per KV group its metadata, the tensors) of the conversation's blocks, byte for byte as stored, on the
        host (engine/kv/saved.py writes them to a file; the server's preemption tier keeps them in memory), with the
        recurrent state after the conversation's tokens where the model keeps one."""
        tier = self.tier_of(seq)
        if tier is not None and tier.records:
            raise saved.CacheFileError(f"{len(tier.records)} blocks of this conversation are on disk past the KV "
                                       f"budget: it is not saved (it is read again when reopened)")
        metas, tensors = saved.export_groups(self, seq)
        if seq.state is not None:
            tensors.update(seq.state.export())
        return metas, tensors

    def import_(self, seq: Conversation, groups: list, tensors: dict, extra: set[str] = frozenset(),
                keep: frozenset[int] = frozenset()) -> None:
        """Fill an empty conversation with exported blocks under new ids; CacheFileError says why not, and the
        conversation then still holds nothing. keep: ids of other sequences the budget must not release for room."""
        members = seq.members
        if any(m.num_tokens or m.table for m in members):
            raise saved.CacheFileError("the conversation already holds a cache")
        state_names = {n for n in tensors if n.startswith("state.")} if seq.state is not None else set()
        if seq.state is not None and {"state.conv", "state.matrices"} - state_names:
            raise saved.CacheFileError("the saved cache holds no recurrent state for this model's linear-attention "
                                       "layers (saved by another model, or damaged)")
        saved.check_groups(self, members, groups, tensors, set(extra) | state_names)
        try:
            saved.import_groups(self, members, groups, tensors, keep)
        except NoFreeBlocks as exc:
            raise saved.CacheFileError(f"the saved cache needs {exc.need_bytes / MIB:.1f} MiB, more than the KV "
                                       f"budget has room for now") from None
        except Exception as exc:     # a file that passed every check and still does not fit the pages
            self.free(seq)
            raise saved.CacheFileError(f"the saved cache could not be read into the pages ({exc})") from None
        if seq.state is not None:
            try:
                seq.state.load(tensors, seq.num_tokens)
            except ValueError as exc:
                self.free(seq)
                raise saved.CacheFileError(f"the saved recurrent state does not fit this model: {exc}") from None
            self.count_state(seq)

    # ---- one step: reserve, then commit or roll back ---------------------------------------------------------

    def reserve(self, seq: Sequence, num_new: int, keep: set[int]) -> Reservation:
        """Slots and pages for num_new more tokens of one group's sequence, with what undoing them needs (the
        quantized tails before, a head block the step would start). Raises NoFreeBlocks when the budget cannot take
        them even after releasing every idle conversation outside `keep`."""
        pages, layout = self._pages, seq.layout
        res = self.reserve_blocks(seq, num_new, keep)
        try:
            if res.copied:
                pages.copy_block(layout, res.copied[1], res.copied[2])
            if layout.quantized_components:
                head_new = res.first_slot < seq.block_size <= res.first_slot + num_new
                res.undo = (pages.snapshot_tails(layout, seq.seq_id), seq.block_table[0] if head_new else None)
                pages.open_tails(layout, seq.seq_id)
        except BaseException:
            self.rollback(res)
            raise
        return res

    def reserve_blocks(self, seq: Sequence, num_new: int, keep: set[int]) -> Reservation:
        """Blocks for num_new more tokens, with the pages grown to hold them; nothing about the tails (a conversion
        or an import writes every row itself)."""
        try:
            res = self._blocks.reserve(seq, num_new, keep)
        except NoFreeBlocks as exc:         # a retrieval conversation moves its oldest blocks to disk instead
            if not self._spill(seq, exc.need_bytes - exc.free_bytes, keep):
                raise
            res = self._blocks.reserve(seq, num_new, keep)
        try:
            layout = seq.layout     # the pages reach the group's highest block id, never past what the budget holds
            self._pages.reserve(layout, self._blocks.high_water(layout),
                                layout.budget_blocks(self._blocks.budget_bytes) + 1)
        except BaseException:
            self._blocks.rollback(res)
            raise
        return res

    def new_group(self, layout: KVLayout, geometry, sink_blocks: int) -> Sequence:
        """One KV group's empty sequence whose sinks stay where an earlier one kept them (a conversion)."""
        return self._blocks.new_sequence(layout, geometry, sink_blocks)

    def apply_window(self, seq: Sequence, geometry) -> int:
        """A new window on one group's sequence (live switch): blocks it no longer keeps go back; returns how many."""
        return self._blocks.apply_window(seq, geometry)

    def room_for(self, seq: Sequence) -> int:
        """Bytes a replacement of one group's sequence could take: free, reclaimable, and its own."""
        m = self._blocks
        return m.free_bytes() + m.reclaimable_bytes({seq.seq_id}) + m.sequence_bytes(seq)

    def rollback(self, res: Reservation) -> None:
        if res.undo is not None:
            self._pages.restore_tails(res.seq.layout, res.seq.seq_id, *res.undo)
        self._blocks.rollback(res)

    def commit(self, res: Reservation, token_ids: list[int] | None) -> None:
        self._blocks.commit(res, token_ids)

    def adopt(self, res: Reservation, num_tokens: int, evicted: int, holes: list[int] | None = None) -> None:
        """A sequence whose pages were written directly takes its tokens (bench/memory.py fills pages so); holes:
        the table positions that left, where they are not one run after the sinks (kept by attention)."""
        self._blocks.adopt(res, num_tokens, evicted, holes)

    # ---- the budget --------------------------------------------------------------------------------------------

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget; shrinking it releases idle conversations, NoFreeBlocks (and the old budget back) when the
        rest do not fit."""
        m = self._blocks
        old, m.budget_bytes = m.budget_bytes, int(budget_bytes)
        try:
            m.make_room(0, keep=set())
        except NoFreeBlocks:
            m.budget_bytes = old
            raise

    @property
    def budget_bytes(self) -> int:
        return self._blocks.budget_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes the pool's blocks and full-precision sides hold."""
        return self._blocks.held_bytes

    def free_bytes(self) -> int:
        return self._blocks.free_bytes()

    def room_bytes(self, keep: set[int]) -> int:
        """Bytes free once every idle sequence outside `keep` (ids) and every reusable prefix block gave its back."""
        return self._blocks.free_bytes() + self._blocks.reclaimable_bytes(keep)

    def bytes_needed(self, seq: Conversation, num_new: int) -> int:
        """More bytes num_new tokens take, every group of the conversation; a windowed group of a hybrid model at
        most what it lacks of its peak with a prompt chunk in flight (a long prompt is read in chunks, and the
        window lets blocks go between them)."""
        if len(seq.members) == 1:
            return self._blocks.bytes_needed(seq.members[0], num_new)
        total = 0
        for m in seq.members:
            need = self._blocks.bytes_needed(m, num_new)
            if m.geometry.window is not None:
                g, layout = m.geometry, m.layout
                peak = g.peak_blocks(min(num_new, PREFILL_CHUNK)) * layout.block_bytes + layout.fixed_bytes
                need = min(need, max(0, peak - self._blocks.sequence_bytes(m)))
            total += need
        return total

    def shared_partial(self, seq: Conversation) -> bool:
        """Whether the sequence's last block is partial and shared (its next token copies it first)."""
        return self._blocks.shared_partial(seq)

    # ---- read ----------------------------------------------------------------------------------------------------

    def sequences(self) -> list[Conversation]:
        """Every live conversation (a hybrid model's by its first group)."""
        return [s.conversation or s for s in self._blocks.sequences.values() if s.members[0] is s and not s.pinned]

    def view(self) -> PoolView:
        return self._blocks.view()

    @property
    def released_log(self) -> list[int]:
        """Ids of the conversations released for room, newest last."""
        return self._blocks.released_log

    def prefix_counts(self) -> tuple[int, int]:
        """(tokens looked up, tokens found) in the prefix cache since load."""
        return self._blocks.prefix_queries, self._blocks.prefix_hits

    def evictable_ids(self) -> list[int]:
        """Free blocks kept for prefix reuse, of a model of one KV group."""
        return list(self._blocks.pool.evictable_ids())

    def blocks_in_use(self) -> int:
        return sum(p.num_in_use for p in self._blocks.pools.values())

    def components(self, layout: KVLayout):
        """The layout's page components per layer, (K, V)."""
        return self._pages.components(layout)

    def key_summaries(self, layout: KVLayout):
        """A retrieval layout's key summaries (pages.KeySummaries), by block id like its pages."""
        return self._pages.key_summaries(layout)

    def layouts(self) -> dict:
        """The layouts whose pages exist, with their components."""
        return self._pages.layouts

    def layer_bytes(self, seq: Conversation, num_layers: int) -> list[tuple[int, int]]:
        """Per model layer (K, V) bytes the conversation holds: each group's blocks at its layout's block bytes plus
        its full-precision head and tail."""
        out = [(0, 0)] * num_layers            # a linear-attention layer holds no K or V (its state: kv/state.py)
        for m in seq.members:
            layout = m.layout
            n = len(m.block_table)
            sides = (1 + int(m.has_head)) if m.seq_len else 0
            for j, (bb, fmts) in enumerate(zip(layout.layer_block_bytes, layout.formats)):
                side = layout.layer_full_block_bytes(j) * sides
                out[layout.layers[j] if layout.layers else j] = tuple(b * n + (side if f.is_quantized else 0)
                                                                      for b, f in zip(bb, fmts))
        return out

    def conversation_bytes(self, seq: Conversation) -> int:
        """Bytes the conversation holds, every group."""
        return sum(self._blocks.sequence_bytes(m) for m in seq.members)

    def layouts_in_use(self) -> set[KVLayout]:
        return {s.layout for s in self._blocks.sequences.values()} | self._blocks.layouts_held()

    def drop_unused_layouts(self) -> None:
        """Page storage of layouts no sequence and no cached block uses any more goes back."""
        self._pages.drop_unused_layouts(self.layouts_in_use())

    def storage_bytes(self) -> int:
        """Bytes the pages hold (capacity included): what the process really spends on KV."""
        return self._pages.layer_bytes()

    def check(self) -> None:
        """The books agree (tests call this): reference counts match the tables, bytes match a recount, every
        positioned table is as long as its tokens need."""
        self._blocks.check()
        for s in self._blocks.sequences.values():
            assert len(s.table) == s.layout.blocks_for(s.num_tokens), f"sequence {s.seq_id}'s table lost its length"

