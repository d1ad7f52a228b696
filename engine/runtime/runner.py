"""The model runner: owns the forward pass and the KV cache (engine/kv/cache.py: blocks, pages, the budget).

A step takes (sequence, new token ids) pairs and is three moves: reserve every item's slots and pages
(step_plan.StepReservation), run one forward pass over all of their tokens (the linear layers see one
batch; each sequence attends through its layout's backend, engine/runtime/backends/, or a batch of
one-token decodes of one layout runs in that backend's one kernel call), then commit. Any exception
inside the step (a stop, an error at any layer) rolls every sequence back to exactly where it was.
The session and the server reach the cache through the methods here, which take the step lock.
"""
from __future__ import annotations

import threading
import weakref

import torch

from kvchat.engine.runtime.backends import AttentionBackend, LayerScores, StepAttention, backend_for, choice_key
from kvchat.engine.runtime.retrieval import BlockChooser
from kvchat.engine.runtime.speculative import StepCosts
from kvchat.engine.runtime.step_mass import StepMass
from kvchat.engine.runtime.step_plan import StepReservation, decode_first
from kvchat.engine.config import CacheConfig, ConfigError, SpeculativeConfig
from kvchat.engine.kv.attention_log import AttentionLog
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.layout import MIB, KVLayout, check_cache_for_model, kv_groups, kv_layout
from kvchat.engine.kv.manager import NoFreeBlocks
from kvchat.engine.kv.sequence import Conversation
from kvchat.engine.kv.window import ReadChosen
from kvchat.engine.kv.state import StateLayout
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
        self.cache = KVCache(self.device, int(budget_mb * MIB), on_release=self._releasing)
        self.state_layout = StateLayout.of(model.config)     # linear-attention layers' state, or None
        self.warm_sessions: weakref.WeakSet = weakref.WeakSet()   # sessions whose cache has a second tier
        self.offloaded = 0                         # conversations saved to the second tier when released
        self.lock = threading.RLock()     # one step at a time; the app and a server may share an engine
        self.steps = 0
        self.last_chooser = None          # the last step's retrieval.BlockChooser (blocks read), or None
        self.blocks_read: dict[int, list[int]] = {}   # a conversation's first seq id -> its last token's reads
        self.tokens_read = 0              # tokens through the forward pass, every step (tests count re-reads with it)
        self.speculation = SpeculativeConfig("off")   # the engine's setting (Engine.set_speculative), read each turn
        self.draft_runner: "ModelRunner | None" = None   # a draft model's runner when speculation uses one
        self.step_costs = StepCosts()             # what a decode step and a verification row cost here
        self._backends: dict[tuple, AttentionBackend] = {}     # by backends.choice_key

    @property
    def host_tier(self):
        """Where a GPU pool's released conversations go first (KVCache.host_tier), or None."""
        return self.cache.host_tier

    @property
    def config(self):
        """The model's ModelConfig."""
        return self.model.config

    # ---- layouts and sequences --------------------------------------------------------------

    def layout(self, cache: CacheConfig) -> KVLayout:
        return kv_layout(self.model.config, cache, self.dtype_name, str(self.device))

    def set_budget(self, budget_mb: float) -> None:
        """The engine's KV budget; shrinking it releases idle sequences, refused if the rest do not fit."""
        with self.lock:
            try:
                self.cache.set_budget(int(budget_mb * MIB))
            except NoFreeBlocks:
                raise ConfigError(f"the conversations hold {self.cache.held_bytes / MIB:.1f} MiB, more than a "
                                  f"{budget_mb:g} MiB budget: reset them or choose a larger budget") from None

    def check(self, cache: CacheConfig) -> KVLayout:
        """The layout of a cache mode on this model, or a ConfigError saying what to change."""
        return check_cache_for_model(cache, self.model.config, self.dtype_name, str(self.device))

    def groups(self, cache: CacheConfig):
        """The model's KV groups under a cache mode (kv/layout.kv_groups)."""
        return kv_groups(self.model.config, cache, self.dtype_name, str(self.device))

    # the conversation's cache, under the step lock (KVCache says what each does)

    def new_sequence(self, cache: CacheConfig) -> Conversation:
        self.check(cache)
        with self.lock:
            return self.cache.open(self.groups(cache), self.state_layout)

    def free(self, seq: Conversation) -> int:
        with self.lock:
            return self.cache.free(seq)

    def close(self, seq: Conversation) -> None:
        with self.lock:
            self.blocks_read.pop(seq.members[0].seq_id, None)
            self.cache.close(seq)
            self._backends = {key: b for key, b in self._backends.items() if key[0] in self.cache.layouts_in_use()}

    def fork(self, seq: Conversation, num_tokens: int) -> tuple[Conversation, int]:
        with self.lock:
            return self.cache.fork(seq, num_tokens)

    def truncate(self, seq: Conversation, n: int) -> None:
        """Take back the last n tokens; ConfigError where the cache cannot do it exactly (KVCache.truncate)."""
        with self.lock:
            done = self.cache.truncate(seq, n)
        if not done:
            raise ConfigError(done.reason)

    def snapshot(self, seq: Conversation) -> bool:
        """Keep the conversation's recurrent state where it is now (KVCache.snapshot); False without one or room."""
        with self.lock:
            return self.cache.snapshot(seq)

    def state_return(self, seq: Conversation, target: int) -> int | None:
        """The latest token count <= target the conversation's recurrent state can return to (a snapshot), or None:
        no state, or no snapshot before target."""
        return None if seq.state is None else seq.state.best_at_most(target)

    def match_prefix(self, seq: Conversation, ids: list[int]) -> int:
        with self.lock:
            return self.cache.match_prefix(seq, ids)

    def clear_prefix_cache(self) -> int:
        with self.lock:
            return self.cache.clear_prefix_cache()

    def convert_sequence(self, seq: Conversation, old: CacheConfig, new: CacheConfig) -> Conversation:
        with self.lock:
            return self.cache.convert(seq, old, new, self.groups(new), self.layer_inv_freq)

    def import_kv(self, seq: Conversation, groups: list, tensors: dict, extra: set[str] = frozenset(),
                  keep: frozenset[int] = frozenset()) -> None:
        with self.lock:
            self.cache.import_(seq, groups, tensors, extra, keep)

    def export_kv(self, seq: Conversation) -> tuple[list[dict], dict[str, torch.Tensor]]:
        with self.lock:
            return self.cache.export(seq)

    def draft_room(self, seq: Conversation, most: int) -> int:
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
            if isinstance(g, ReadChosen):       # rows span two blocks at most: each row's newest two blocks hold
                room = min(room, bs - 1)        # the rest of the step's rows, so every summary it reads is plain's
            if g.window is not None:
                k = 0
                while k < room and not g.num_to_evict(m.num_tokens + k + 2, m.evicted,
                                                      max(len(m.block_table), m.layout.blocks_for(slot + k + 2))):
                    k += 1
                if g.num_to_evict(m.num_tokens + 1, m.evicted, max(len(m.block_table), m.layout.blocks_for(slot + 1))):
                    k = 0
                room = min(room, k)
        return max(0, room)

    def _releasing(self, seq: Conversation) -> None:
        """The budget releases an idle conversation: a warm one goes to its second tier (the saved file) first; a
        failure there only means it is read again later."""
        for session in list(self.warm_sessions):
            if session.seq is seq:
                try:
                    if session.offload():
                        self.offloaded += 1
                except Exception:  # noqa: BLE001 - the release must go on; the text is still there to read
                    pass

    # ---- the pool, read -----------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self.cache.budget_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes the pool's blocks and sides hold."""
        return self.cache.held_bytes

    def free_bytes(self) -> int:
        return self.cache.free_bytes()

    def room_bytes(self, keep: set[int]) -> int:
        return self.cache.room_bytes(keep)

    def bytes_needed(self, seq: Conversation, num_new: int) -> int:
        return self.cache.bytes_needed(seq, num_new)

    def shared_partial(self, seq: Conversation) -> bool:
        return self.cache.shared_partial(seq)

    def sequences(self) -> list[Conversation]:
        return self.cache.sequences()

    def pool_view(self):
        """The pool's numbers at one moment (KVCacheManager.view)."""
        return self.cache.view()

    def released_count(self) -> int:
        """Sequences released so far to make room."""
        return len(self.cache.released_log)

    def prefix_counts(self) -> tuple[int, int]:
        return self.cache.prefix_counts()

    def components(self, seq: Conversation):
        """The sequence's page components per layer, (K, V): the pages of its layout."""
        return self.cache.components(seq.layout)

    # ---- one step ------------------------------------------------------------------------------

    def step(self, items: list[tuple[Conversation, list[int]]], all_logits: bool = False,
             hash_ids: bool = True, decode: list[bool] | None = None,
             keep: frozenset[int] = frozenset(), reading: frozenset[int] = frozenset()) -> list[torch.Tensor]:
        """Feed each sequence its new ids in one forward pass; returns per sequence logits [T, vocab] (all_logits)
        or [1, vocab] (its last token). Raises NoFreeBlocks when the budget cannot take the tokens.

        decode[i]: item i is generated tokens (default: a single token), else prompt tokens. The two kinds
        take different kernels, chosen per row, so that a sequence's numbers never depend on the other
        sequences of the batch: decode items go first in the batch (step_plan.decode_first). A decode item of
        several tokens is a verification (speculative decoding): each of its rows runs as plain decoding would
        run it (step_plan.plan_rows) and it always gets every row's logits [T, vocab]; keep its drafts within
        draft_room, and take the rejected ones back with truncate. keep: ids of other sequences the budget must not
        release for this step's room (a draft model's step beside the conversation it drafts for). reading: ids of
        conversations whose prompt goes on after this step: one kept by attention lets blocks go only once its prompt
        is read whole (SnapKV scores from the prompt's last rows, the question among them; settle() when the budget
        cannot wait)."""
        decode = [len(ids) == 1 for _, ids in items] if decode is None else decode
        order = decode_first(items, decode)
        with self.lock:
            reserved = StepReservation(self.cache, [items[i] for i in order], [decode[i] for i in order],
                                       self.layer_inv_freq, self.device, keep, self.model.config.kv_sources)
            mass = self._watched(reserved)
            if self.state_layout is not None and self.model.states_in_c():
                for seq, _ in reserved.items:       # the step's new state written apart, taken without a copy
                    self.cache.hold_spare(seq)
            try:
                logits, per_row, attention = self._forward(reserved, all_logits, mass)
            except BaseException:
                reserved.rollback()
                for seq, _ in reserved.items:
                    if (log := self.cache.attention_log(seq)) is not None:
                        log.drop()
                raise
            reserved.commit(hash_ids)
            attention.commit_states()
            if attention.chooser is not None:       # what each retrieval conversation's token read
                self.blocks_read.update(attention.chooser.per_conversation)
            for seq, _ in reserved.items:       # a window kept by attention lets the least attended go
                if seq.seq_id not in reading and any(m.geometry.by_importance for m in seq.members):
                    self.cache.evict_unimportant(seq)
            if self.state_layout is not None:
                for seq, _ in items:
                    self.cache.count_state(seq)
                    if hash_ids:            # at a block boundary: a point others may start from
                        self.cache.publish_state(seq)
            self.steps += 1
            self.tokens_read += sum(len(ids) for _, ids in items)
        return item_logits(order, reserved.steps, logits, per_row, all_logits)

    def settle(self, seq: Conversation) -> int:
        """A conversation kept by attention lets its least attended blocks go now, mid-prompt (the budget cannot
        hold the prompt whole); returns the blocks that went (0: nothing to let go)."""
        with self.lock:
            if not any(m.geometry.by_importance for m in seq.members):
                return 0
            return self.cache.evict_unimportant(seq)

    def _watched(self, reserved: StepReservation) -> StepMass | None:
        """The step's attention measure, where a conversation of it is watched (KVCache.watch), else None."""
        c = self.model.config
        for seq, _ in reserved.items:       # a window kept by attention needs the measure: its own log if unwatched
            if self.cache.attention_log(seq) is None and any(m.geometry.by_importance for m in seq.members):
                self.cache.watch(seq, AttentionLog(c.num_layers, c.num_heads, seq.block_size))
        logs = {i: log for i, (seq, _) in enumerate(reserved.items)
                if (log := self.cache.attention_log(seq)) is not None}
        return StepMass(logs, reserved.items, reserved.steps, reserved.layer_steps) if logs else None

    def _forward(self, reserved: StepReservation, all_logits: bool,
                 mass: StepMass | None = None) -> tuple[torch.Tensor, bool, StepAttention]:
        """The step's logits and whether they are one row per token (else one per item): one kernel call where every
        row is a one-token decode (of one layout: its backend's own step), else the forward with each sequence's
        backend attending."""
        steps = reserved.steps
        x = torch.tensor([t for _, ids in reserved.items for t in ids], dtype=torch.long, device=self.device)
        items = [(seq, st.offset, st.num_new, st.decode) for (seq, _), st in zip(reserved.items, steps)]
        chooser = (BlockChooser(self.cache) if any(BlockChooser.applies(st) for steps in reserved.layer_steps
                                                   for st in steps) else None)
        attention = StepAttention(reserved.layer_steps, lambda st: self.backend(st.res.seq.layout),
                                  items if self.state_layout is not None else None, self.model.config.kv_sources, mass,
                                  chooser)
        self.last_chooser = chooser
        if all(st.one_token_decode for st in attention.steps):        # rows: every token of the step, in order
            logits = attention.decode(self.model, x)
            if logits is None:                          # the layers' attention through Python
                logits = self.model.forward_decode(x, attention=attention)
            if logits is not None:
                return logits, True, attention
        verifying = any(st.decode and st.num_new > 1 for st in steps)
        rows = None if all_logits or verifying else [st.offset + st.num_new - 1 for st in steps]
        num_decode = sum(st.num_new for st in steps if st.decode)
        return (self.model.forward(x, attention, all_logits=True, rows=rows, num_decode=num_decode), rows is None,
                attention)

    def backend(self, layout: KVLayout) -> AttentionBackend:
        """The layout's attention backend on this device, chosen on first use (backends.backend_for)."""
        key = choice_key(layout, self.device)
        chosen = self._backends.get(key)
        if chosen is None:
            scores = tuple(self.scores[i] for i in layout.layers) if layout.layers else self.scores
            chosen = self._backends[key] = backend_for(layout, self.cache.components(layout), self.device,
                                                       self.model.config.num_heads, scores)
        return chosen

    # ---- numbers ----------------------------------------------------------------------------------

    def layer_bytes(self, seq: Conversation) -> list[tuple[int, int]]:
        """Per model layer (K, V) bytes the conversation holds (KVCache.layer_bytes)."""
        return self.cache.layer_bytes(seq, self.model.config.num_layers)

    def layer_formats(self, seq: Conversation):
        """Per model layer the conversation's (K, V) page formats; None for a linear-attention layer (no KV)."""
        out = [None] * self.model.config.num_layers
        for m in seq.members:
            for j, fmts in enumerate(m.layout.formats):
                out[m.layout.layers[j] if m.layout.layers else j] = fmts
        return out

    def conversation_bytes(self, seq: Conversation) -> int:
        """Bytes the conversation holds, every group."""
        return self.cache.conversation_bytes(seq)

    def drop_unused_layouts(self) -> None:
        """Page storage of layouts no sequence and no cached block uses any more goes back."""
        self.cache.drop_unused_layouts()
        in_use = self.cache.layouts_in_use()
        self._backends = {key: b for key, b in self._backends.items() if key[0] in in_use}

    def storage_bytes(self) -> int:
        """Bytes the pages hold (capacity included): what the process really spends on KV."""
        return self.cache.storage_bytes()


def item_logits(order: list[int], steps: list, logits: torch.Tensor, per_row: bool, all_logits: bool) -> list:
    """Each item's logits in the caller's order: one row per item (per_row False), else its rows, all of them where
    asked for or for a verification, its last otherwise."""
    result = [None] * len(order)
    for j, (i, st) in enumerate(zip(order, steps)):
        if not per_row:
            result[i] = logits[j:j + 1]
        elif all_logits or st.num_new > 1 and st.decode:
            result[i] = logits[st.offset:st.offset + st.num_new]
        else:
            result[i] = logits[st.offset + st.num_new - 1:st.offset + st.num_new]
    return result


def layer_ropes(config, device) -> list[torch.Tensor]:
    """Every layer's RoPE table ([head_dim/2]), one tensor per distinct Rope (layers of one rope share it, and a
    step plans once per group and table)."""
    tables, out = {}, []
    for i, spec in enumerate(config.layers):
        if spec.rope not in tables:
            tables[spec.rope] = config.inv_freq(i).to(device)
        out.append(tables[spec.rope])
    return out
