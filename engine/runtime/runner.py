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

import torch

from engine.runtime.backends import AttentionBackend, StepAttention, backend_for, choice_key
from engine.runtime.step_plan import StepReservation, decode_first
from engine.config import CacheConfig, ConfigError
from engine.kv import convert
from engine.kv.layout import MIB, KVLayout, WindowGeometry, check_cache_for_model, kv_layout
from engine.kv.manager import KVCacheManager, NoFreeBlocks, Sequence
from engine.kv.pages import PageStore
from engine.model.transformer import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, dtype_name: str, budget_mb: float):
        self.model = model
        self.dtype_name = dtype_name
        self.device = model.device
        self.inv_freq = model.config.inv_freq().to(self.device)
        self.store = PageStore(self.device)
        self.manager = KVCacheManager(int(budget_mb * MIB), on_free=self.store.forget_blocks)
        self.lock = threading.RLock()     # one step at a time; the app and a server may share an engine
        self.steps = 0
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
        return self.manager.new_sequence(self.check(cache), WindowGeometry.of(cache))

    def free(self, seq: Sequence) -> int:
        with self.lock:
            freed = self.manager.free(seq)
            self.store.drop_tails(seq.seq_id)
            self.store.shrink(self.manager.pool.high_water)
            return freed

    def close(self, seq: Sequence) -> None:
        with self.lock:
            self.free(seq)
            self.manager.close(seq)
            self.drop_unused_layouts()

    def fork(self, seq: Sequence, num_tokens: int) -> tuple[Sequence, int]:
        """A sequence sharing the first num_tokens tokens of seq; returns (child, tokens shared).

        Quantized partial blocks are shared only while they are still the parent's tail (the
        values are not re-quantized); otherwise the child shares whole blocks and re-reads the rest."""
        with self.lock:
            bs = seq.block_size
            if seq.evicted:
                return self.manager.new_sequence(seq.layout, seq.geometry), 0
            partial = num_tokens % bs
            quantized = seq.layout.quantized_components > 0
            if partial and quantized and seq.seq_len // bs != num_tokens // bs:
                num_tokens -= partial
            child, n = self.manager.fork(seq, num_tokens)
            if quantized and n % bs:
                self.store.copy_tail(seq.layout, seq.seq_id, child.seq_id)
            return child, n

    def truncate(self, seq: Sequence, n: int) -> None:
        """Take back the last n tokens (exact within a quantized sequence's tail block)."""
        with self.lock:
            bs = seq.block_size
            if n > seq.seq_len or (seq.evicted and seq.seq_len - n < seq.sink_blocks * bs):
                raise ConfigError(f"the cache holds {seq.seq_len} tokens since the window moved: it cannot take "
                                  f"back {n}")
            if seq.layout.quantized_components and n > seq.seq_len % bs:
                raise ConfigError("a quantized cache can take back tokens of its last, unquantized block only")
            self.manager.truncate(seq, n)

    def clear_prefix_cache(self) -> int:
        with self.lock:
            freed = self.manager.clear_prefix_cache()
            self.store.shrink(self.manager.pool.high_water)
            return freed

    def match_prefix(self, seq: Sequence, ids: list[int]) -> int:
        """Adopt cached blocks holding the start of ids; returns the tokens that need no forward pass."""
        with self.lock:
            return self.manager.match_prefix(seq, ids)

    def convert_sequence(self, seq: Sequence, old: CacheConfig, new: CacheConfig) -> Sequence:
        """seq in mode `old` -> a sequence in mode `new` holding the same tokens (see kv/convert.py)."""
        with self.lock:
            return convert.convert_sequence(self.manager, self.store, seq, old, new, self.layout(new),
                                            self.inv_freq, self.close, self.drop_unused_layouts)

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
        return self.manager.bytes_needed(seq, num_new)

    def shared_partial(self, seq: Sequence) -> bool:
        """Whether the sequence's last block is partial and shared (its next token copies it first)."""
        return self.manager.shared_partial(seq)

    def sequences(self) -> list[Sequence]:
        """Every live sequence of the pool."""
        return list(self.manager.sequences.values())

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
             hash_ids: bool = True, decode: list[bool] | None = None) -> list[torch.Tensor]:
        """Feed each sequence its new ids in one forward pass; returns per sequence logits [T, vocab] (all_logits)
        or [1, vocab] (its last token). Raises NoFreeBlocks when the budget cannot take the tokens.

        decode[i]: item i is generated tokens (default: a single token), else prompt tokens. The two kinds
        take different kernels, chosen per row, so that a sequence's numbers never depend on the other
        sequences of the batch: decode items go first in the batch (step_plan.decode_first)."""
        decode = [len(ids) == 1 for _, ids in items] if decode is None else decode
        order = decode_first(items, decode)
        with self.lock:
            reserved = StepReservation(self.manager, self.store, [items[i] for i in order], [decode[i] for i in order],
                                       self.inv_freq, self.device)
            try:
                logits = self._forward(reserved, all_logits)
            except BaseException:
                reserved.rollback()
                raise
            reserved.commit(hash_ids)
            self.steps += 1
        result = [None] * len(items)
        for j, (i, st) in enumerate(zip(order, reserved.steps)):
            result[i] = logits[st.offset:st.offset + st.num_new] if all_logits else logits[j:j + 1]
        return result

    def _forward(self, reserved: StepReservation, all_logits: bool) -> torch.Tensor:
        """The step's logits: one kernel call where every item is a one-token decode (of one layout: its backend's
        own step), else the forward with each sequence's backend attending."""
        steps = reserved.steps
        x = torch.tensor([t for _, ids in reserved.items for t in ids], dtype=torch.long, device=self.device)
        attention = StepAttention(steps, [self.backend(st.res.seq.layout) for st in steps])
        logits = None
        if not all_logits and all(st.one_token_decode for st in steps):
            logits = (attention.decode(self.model, x) if attention.one_layout_decode
                      else self.model.forward_decode(x, attention=attention))
        if logits is None:
            rows = None if all_logits else [st.offset + st.num_new - 1 for st in steps]
            num_decode = sum(st.num_new for st in steps if st.decode)
            logits = self.model.forward(x, attention, all_logits=True, rows=rows, num_decode=num_decode)
        return logits

    def backend(self, layout: KVLayout) -> AttentionBackend:
        """The layout's attention backend on this device, chosen on first use (backends.backend_for)."""
        key = choice_key(layout, self.device)
        chosen = self._backends.get(key)
        if chosen is None:
            chosen = self._backends[key] = backend_for(layout, self.store.components(layout), self.device,
                                                       self.model.config.num_heads)
        return chosen

    # ---- numbers ----------------------------------------------------------------------------------

    def layer_bytes(self, seq: Sequence) -> list[tuple[int, int]]:
        """Per layer (K, V) bytes the sequence holds: its blocks at the layout's block bytes plus its
        full-precision head and tail."""
        layout = seq.layout
        n = len(seq.block_table)
        side = layout.full_block_bytes * (1 + int(seq.has_head)) if seq.seq_len else 0
        return [tuple(b * n + (side if f.is_quantized else 0) for b, f in zip(bb, fmts))
                for bb, fmts in zip(layout.layer_block_bytes, layout.formats)]

    def drop_unused_layouts(self) -> None:
        """Page storage of layouts no sequence and no cached block uses any more goes back."""
        in_use = {s.layout for s in self.manager.sequences.values()} | set(self.manager.block_layout.values())
        self.store.drop_unused_layouts(in_use)
        self._backends = {key: b for key, b in self._backends.items() if key[0] in in_use}

    def storage_bytes(self) -> int:
        """Bytes the page store holds (capacity included): what the process really spends on KV."""
        return self.store.layer_bytes()
