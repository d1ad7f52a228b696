"""The model runner: owns the forward pass, the KV manager, the page store and the budget.

A step takes (sequence, new token ids) pairs and is three moves: reserve every item's slots and pages
(step_plan.StepReservation), run one forward pass over all of their tokens (the linear layers see one
batch; each sequence attends through its layout's backend, engine/runtime/backends/, or a batch of
one-token decodes of one layout runs in that backend's one kernel call), then commit. Any exception
inside the step (a stop, an error at any layer) rolls every sequence back to exactly where it was.
Session, conversion and serving reach the manager and the page store only through the methods here.
"""
from __future__ import annotations

import threading
import weakref

import torch

from kvchat.engine.runtime.backends import AttentionBackend, LayerScores, StepAttention, backend_for, choice_key
from kvchat.engine.runtime.speculative import StepCosts
from kvchat.engine.runtime.step_plan import StepReservation, decode_first
from kvchat.engine.config import CacheConfig, ConfigError, SpeculativeConfig
from kvchat.engine.kv import convert, saved
from kvchat.engine.kv.layout import MIB, PREFILL_CHUNK, KVLayout, check_cache_for_model, kv_groups, kv_layout
from kvchat.engine.kv.manager import KVCacheManager, NoFreeBlocks, Sequence
from kvchat.engine.kv.pages import PageStore
from kvchat.engine.kv.tier import DEFAULT_TIER_MB as HOST_TIER_MB, PreemptTier
from kvchat.engine.model.transformer import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, dtype_name: str, budget_mb: float):
        self.model = model
        self.dtype_name = dtype_name
        self.device = model.device
        self.inv_freq = model.config.inv_freq().to(self.device)
        self.layer_inv_freq = layer_ropes(model.config, self.device)
        self.scores = tuple(LayerScores(spec.query_scale, spec.attn_softcap, getattr(L, "sinks", None))
                            for spec, L in zip(model.config.layers, model.layers))
        self.store = PageStore(self.device)
        self.manager = KVCacheManager(int(budget_mb * MIB), on_free=self.store.forget_blocks,
                                      on_release=self._releasing)
        self.warm_sessions: weakref.WeakSet = weakref.WeakSet()   # sessions whose cache has a second tier
        self.offloaded = 0                         # conversations saved to the second tier when released
        # a GPU pool's released conversations go to pinned host memory first (engine/kv/tier.py), then to disk
        self.host_tier = PreemptTier(HOST_TIER_MB, "host") if torch.device(self.device).type == "cuda" else None
        self.lock = threading.RLock()     # one step at a time; the app and a server may share an engine
        self.steps = 0
        self.speculation = SpeculativeConfig("off")   # the engine's setting (Engine.set_speculative), read each turn
        self.draft_runner: "ModelRunner | None" = None   # a draft model's runner when speculation uses one
        self.step_costs = StepCosts()             # what a decode step and a verification row cost here
        self._backends: dict[tuple, AttentionBackend] = {}     # by backends.choice_key

    @property
    def config(self):
        """The model's ModelConfig."""
        return self.model.config

    # ---- layouts and sequences --------------------------------------------------------------

    def layout(self, cache: CacheConfig) -> KVLayout:
        return kv_layout(self.model.config, cache, self.dtype_name, str(self.device))

    def set_budget(self, budget_mb: float) -> None:
        """The engine's KV budget; shrinking it releases idle sequences, refused if the rest do not fit."""
        new = int(budget_mb * MIB)
        with self.lock:
            old = self.manager.budget_bytes
            self.manager.budget_bytes = new
            try:
                self.manager._make_room(0, keep=set())
            except NoFreeBlocks:
                self.manager.budget_bytes = old
                raise ConfigError(f"the conversations hold {self.manager.held_bytes / MIB:.1f} MiB, more than a "
                                  f"{budget_mb:g} MiB budget: reset them or choose a larger budget") from None

    def check(self, cache: CacheConfig) -> KVLayout:
        """The layout of a cache mode on this model, or a ConfigError saying what to change."""
        return check_cache_for_model(cache, self.model.config, self.dtype_name, str(self.device))

    def new_sequence(self, cache: CacheConfig) -> Sequence:
        """A conversation holding nothing yet: one sequence per KV group of the model under this cache mode
        (kv/layout.kv_groups), the first standing for all (Sequence.groups)."""
        self.check(cache)
        groups = kv_groups(self.model.config, cache, self.dtype_name, str(self.device))
        members = [self.manager.new_sequence(g.layout, g.geometry) for g in groups]
        return self._joined(members)

    @staticmethod
    def _joined(members: list[Sequence]) -> Sequence:
        if len(members) > 1:
            members[0].groups = members
            for m in members[1:]:
                m.conversation = members[0]
        return members[0]

    def free(self, seq: Sequence) -> int:
        with self.lock:
            freed = 0
            for m in seq.members:
                freed += self.manager.free(m)
                self.store.drop_tails(m.seq_id)
            self.store.shrink(self.manager.high_water)
            return freed

    def close(self, seq: Sequence) -> None:
        with self.lock:
            self.free(seq)
            for m in seq.members:
                self.manager.close(m)
            self.drop_unused_layouts()

    def fork(self, seq: Sequence, num_tokens: int) -> tuple[Sequence, int]:
        """A sequence sharing the first num_tokens tokens of seq; returns (child, tokens shared).

        Quantized partial blocks are shared only while they are still the parent's tail (the
        values are not re-quantized); otherwise the child shares whole blocks and re-reads the rest."""
        with self.lock:
            bs = seq.block_size
            members = seq.members
            if any(m.evicted for m in members):       # a window let blocks go: nothing to share from the start
                return self._joined([self.manager.new_sequence(m.layout, m.geometry) for m in members]), 0
            partial = num_tokens % bs
            quantized = any(m.layout.quantized_components for m in members)
            if partial and quantized and seq.seq_len // bs != num_tokens // bs:
                num_tokens -= partial
            children = []
            for m in members:
                child, n = self.manager.fork(m, num_tokens)
                if m.layout.quantized_components and n % bs:
                    self.store.copy_tail(m.layout, m.seq_id, child.seq_id)
                children.append(child)
            return self._joined(children), n

    def truncate(self, seq: Sequence, n: int) -> None:
        """Take back the last n tokens (exact within a quantized sequence's tail block)."""
        with self.lock:
            bs = seq.block_size
            for m in seq.members:
                g = m.geometry
                # a model window reads the W - 1 tokens before the new end (all of them, while fewer): still held?
                short = g.model_window and max(0, m.num_tokens - n - g.window) < m.evicted * bs
                if n > m.seq_len or (m.evicted and m.seq_len - n < m.sink_blocks * bs) or short:
                    raise ConfigError(f"the cache holds {m.seq_len} tokens since the window moved: it cannot take "
                                      f"back {n}")
                if m.layout.quantized_components and n > m.seq_len % bs:
                    raise ConfigError("a quantized cache can take back tokens of its last, unquantized block only")
            for m in seq.members:
                self.manager.truncate(m, n)

    def draft_room(self, seq: Sequence, most: int) -> int:
        """How many drafts (at most `most`) can follow the next token in one verification step and still be taken back
        exactly: in a quantized group no draft may complete a block (it would be quantized with the block, and a
        quantized value is never re-quantized), so every row stays in the block the next token goes to; in a
        windowed group no row may move the window (a block evicted for a draft would be gone when the draft is)."""
        room = most
        for m in seq.members:
            bs, slot = m.block_size, m.seq_len
            if m.layout.quantized_components:
                room = min(room, bs - 2 - slot % bs)
            g = m.geometry
            if g.window is not None:
                k = 0
                while k < room and not g.num_to_evict(m.num_tokens + k + 2, m.evicted,
                                                      max(len(m.block_table), m.layout.blocks_for(slot + k + 2))):
                    k += 1
                if g.num_to_evict(m.num_tokens + 1, m.evicted, max(len(m.block_table), m.layout.blocks_for(slot + 1))):
                    k = 0
                room = min(room, k)
        return max(0, room)

    def clear_prefix_cache(self) -> int:
        with self.lock:
            freed = self.manager.clear_prefix_cache()
            self.store.shrink(self.manager.high_water)
            return freed

    def match_prefix(self, seq: Sequence, ids: list[int]) -> int:
        """Adopt cached blocks holding the start of ids; returns the tokens that need no forward pass."""
        with self.lock:
            m = self.manager
            if not seq.groups:
                return m.match_prefix(seq, ids)
            # a hit is the shortest hit over the groups (each from the start); the groups holding more give back
            # what the others could not find, and the pool counts the lookup once
            queries, hits = m.prefix_queries, m.prefix_hits
            found = [m.match_prefix(g, ids) for g in seq.groups]
            n = min(found)
            for g, got in zip(seq.groups, found):
                if got > n:
                    m.truncate(g, got - n)
            usable = min(len(ids) - 1, seq.geometry.full_attention_tokens) // seq.block_size
            m.prefix_queries, m.prefix_hits = queries + usable * seq.block_size, hits + n
            return n

    def convert_sequence(self, seq: Sequence, old: CacheConfig, new: CacheConfig) -> Sequence:
        """seq in mode `old` -> a sequence in mode `new` holding the same tokens (see kv/convert.py)."""
        with self.lock:
            groups = kv_groups(self.model.config, new, self.dtype_name, str(self.device))
            members = seq.members
            if [g.layout.layers for g in groups] != [m.layout.layers for m in members]:
                raise ConfigError(f"{new.label()} keeps this model's layers in other groups than {old.label()} (a "
                                  f"window against the layers' own windows): reset the session to switch to it")
            if len(members) == 1:
                return convert.convert_sequence(self.manager, self.store, seq, old, new, groups[0].layout,
                                                groups[0].geometry, self.layer_inv_freq, self.close,
                                                self.drop_unused_layouts)
            children = [convert.convert_sequence(self.manager, self.store, m, old, new, g.layout, g.geometry,
                                                 [self.layer_inv_freq[i] for i in g.layers], self._close_member,
                                                 self.drop_unused_layouts)
                        for m, g in zip(members, groups)]
            return self._joined(children)

    def _releasing(self, seq: Sequence) -> None:
        """The budget releases an idle conversation: a warm one goes to its second tier (the saved file) first; a
        failure there only means it is read again later."""
        for session in list(self.warm_sessions):
            if session.seq is seq:
                try:
                    if session.offload():
                        self.offloaded += 1
                except Exception:  # noqa: BLE001 - the release must go on; the text is still there to read
                    pass

    def import_kv(self, seq: Sequence, groups: list, tensors: dict, extra: set[str] = frozenset(),
                  keep: frozenset[int] = frozenset()) -> None:
        """Fill an empty conversation with saved blocks (engine/kv/saved.py); CacheFileError says why not, the
        conversation then still holds nothing. keep: ids of other sequences the budget must not release for room
        (a server's running requests)."""
        with self.lock:
            members = seq.members
            if any(m.num_tokens or m.block_table for m in members):
                raise saved.CacheFileError("the conversation already holds a cache")
            saved.check_groups(self.store, members, groups, tensors, set(extra))
            try:
                saved.import_groups(self.manager, self.store, members, groups, tensors, keep)
            except NoFreeBlocks as exc:
                raise saved.CacheFileError(f"the saved cache needs {exc.need_bytes / MIB:.1f} MiB, more than the KV "
                                           f"budget has room for now") from None
            except Exception as exc:     # a file that passed every check and still does not fit the pages
                self.free(seq)
                raise saved.CacheFileError(f"the saved cache could not be read into the pages ({exc})") from None

    def _close_member(self, seq: Sequence) -> None:
        """One group's sequence goes (a conversion replaced it)."""
        self.manager.close(seq)
        self.store.drop_tails(seq.seq_id)

    # ---- the pool, read -----------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self.manager.budget_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes the pool's blocks and sides hold."""
        return self.manager.held_bytes

    def free_bytes(self) -> int:
        return self.manager.free_bytes()

    def room_bytes(self, keep: set[int]) -> int:
        """Bytes free once every idle sequence outside `keep` (ids) and every reusable prefix block gave its back."""
        return self.manager.free_bytes() + self.manager.reclaimable_bytes(keep)

    def bytes_needed(self, seq: Sequence, num_new: int) -> int:
        """More bytes num_new tokens take, every group of the conversation; a windowed group of a hybrid model at
        most what it lacks of its peak with a prompt chunk in flight (the session reads a long prompt in chunks,
        and the window lets blocks go between them)."""
        if not seq.groups:
            return self.manager.bytes_needed(seq, num_new)
        total = 0
        for m in seq.members:
            need = self.manager.bytes_needed(m, num_new)
            if m.geometry.window is not None:
                g, layout = m.geometry, m.layout
                peak = g.peak_blocks(min(num_new, PREFILL_CHUNK)) * layout.block_bytes + layout.fixed_bytes
                need = min(need, max(0, peak - self.manager.sequence_bytes(m)))
            total += need
        return total

    def shared_partial(self, seq: Sequence) -> bool:
        """Whether the sequence's last block is partial and shared (its next token copies it first)."""
        return self.manager.shared_partial(seq)

    def sequences(self) -> list[Sequence]:
        """Every live conversation of the pool (a hybrid model's by its first group)."""
        return [s for s in self.manager.sequences.values() if s.conversation is None]

    def pool_view(self):
        """The pool's numbers at one moment (KVCacheManager.view)."""
        return self.manager.view()

    def released_count(self) -> int:
        """Sequences released so far to make room."""
        return len(self.manager.released_log)

    def prefix_counts(self) -> tuple[int, int]:
        """(tokens looked up, tokens found) in the prefix cache since load."""
        return self.manager.prefix_queries, self.manager.prefix_hits

    def components(self, seq: Sequence):
        """The sequence's page components per layer, (K, V): the store's pages of its layout."""
        return self.store.components(seq.layout)

    # ---- one step ------------------------------------------------------------------------------

    def step(self, items: list[tuple[Sequence, list[int]]], all_logits: bool = False,
             hash_ids: bool = True, decode: list[bool] | None = None,
             keep: frozenset[int] = frozenset()) -> list[torch.Tensor]:
        """Feed each sequence its new ids in one forward pass; returns per sequence logits [T, vocab] (all_logits)
        or [1, vocab] (its last token). Raises NoFreeBlocks when the budget cannot take the tokens.

        decode[i]: item i is generated tokens (default: a single token), else prompt tokens. The two kinds
        take different kernels, chosen per row, so that a sequence's numbers never depend on the other
        sequences of the batch: decode items go first in the batch (step_plan.decode_first). A decode item of
        several tokens is a verification (speculative decoding): each of its rows runs as plain decoding would
        run it (step_plan.plan_rows) and it always gets every row's logits [T, vocab]; keep its drafts within
        draft_room, and take the rejected ones back with truncate. keep: ids of other sequences the budget must not
        release for this step's room (a draft model's step beside the conversation it drafts for)."""
        decode = [len(ids) == 1 for _, ids in items] if decode is None else decode
        order = decode_first(items, decode)
        with self.lock:
            reserved = StepReservation(self.manager, self.store, [items[i] for i in order], [decode[i] for i in order],
                                       self.layer_inv_freq, self.device, keep)
            try:
                logits, per_row = self._forward(reserved, all_logits)
            except BaseException:
                reserved.rollback()
                raise
            reserved.commit(hash_ids)
            self.steps += 1
        result = [None] * len(items)
        for j, (i, st) in enumerate(zip(order, reserved.steps)):
            if not per_row:
                result[i] = logits[j:j + 1]
            elif all_logits or st.num_new > 1 and st.decode:
                result[i] = logits[st.offset:st.offset + st.num_new]
            else:
                result[i] = logits[st.offset + st.num_new - 1:st.offset + st.num_new]
        return result

    def _forward(self, reserved: StepReservation, all_logits: bool) -> tuple[torch.Tensor, bool]:
        """The step's logits and whether they are one row per token (else one per item): one kernel call where every
        row is a one-token decode (of one layout: its backend's own step), else the forward with each sequence's
        backend attending."""
        steps = reserved.steps
        x = torch.tensor([t for _, ids in reserved.items for t in ids], dtype=torch.long, device=self.device)
        attention = StepAttention(reserved.layer_steps, lambda st: self.backend(st.res.seq.layout))
        if all(st.one_token_decode for st in attention.steps):        # rows: every token of the step, in order
            logits = (attention.decode(self.model, x) if attention.one_layout_decode
                      else self.model.forward_decode(x, attention=attention))
            if logits is not None:
                return logits, True
        verifying = any(st.decode and st.num_new > 1 for st in steps)
        rows = None if all_logits or verifying else [st.offset + st.num_new - 1 for st in steps]
        num_decode = sum(st.num_new for st in steps if st.decode)
        return self.model.forward(x, attention, all_logits=True, rows=rows, num_decode=num_decode), rows is None

    def backend(self, layout: KVLayout) -> AttentionBackend:
        """The layout's attention backend on this device, chosen on first use (backends.backend_for)."""
        key = choice_key(layout, self.device)
        chosen = self._backends.get(key)
        if chosen is None:
            scores = tuple(self.scores[i] for i in layout.layers) if layout.layers else self.scores
            chosen = self._backends[key] = backend_for(layout, self.store.components(layout), self.device,
                                                       self.model.config.num_heads, scores)
        return chosen

    # ---- numbers ----------------------------------------------------------------------------------

    def layer_bytes(self, seq: Sequence) -> list[tuple[int, int]]:
        """Per model layer (K, V) bytes the conversation holds: each group's blocks at its layout's block bytes
        plus its full-precision head and tail."""
        out = [None] * self.model.config.num_layers
        for m in seq.members:
            layout = m.layout
            n = len(m.block_table)
            side = layout.full_block_bytes * (1 + int(m.has_head)) if m.seq_len else 0
            for j, (bb, fmts) in enumerate(zip(layout.layer_block_bytes, layout.formats)):
                out[layout.layers[j] if layout.layers else j] = tuple(b * n + (side if f.is_quantized else 0)
                                                                      for b, f in zip(bb, fmts))
        return out

    def layer_formats(self, seq: Sequence):
        """Per model layer the conversation's (K, V) page formats."""
        out = [None] * self.model.config.num_layers
        for m in seq.members:
            for j, fmts in enumerate(m.layout.formats):
                out[m.layout.layers[j] if m.layout.layers else j] = fmts
        return out

    def conversation_bytes(self, seq: Sequence) -> int:
        """Bytes the conversation holds, every group."""
        return sum(self.manager.sequence_bytes(m) for m in seq.members)

    def drop_unused_layouts(self) -> None:
        """Page storage of layouts no sequence and no cached block uses any more goes back."""
        in_use = {s.layout for s in self.manager.sequences.values()} | self.manager.layouts_held()
        self.store.drop_unused_layouts(in_use)
        self._backends = {key: b for key, b in self._backends.items() if key[0] in in_use}

    def storage_bytes(self) -> int:
        """Bytes the page store holds (capacity included): what the process really spends on KV."""
        return self.store.layer_bytes()


def layer_ropes(config, device) -> list[torch.Tensor]:
    """Every layer's RoPE table ([head_dim/2]), one tensor per distinct Rope (layers of one rope share it, and a
    step plans once per group and table)."""
    tables, out = {}, []
    for i, spec in enumerate(config.layers):
        if spec.rope not in tables:
            tables[spec.rope] = config.inv_freq(i).to(device)
        out.append(tables[spec.rope])
    return out
