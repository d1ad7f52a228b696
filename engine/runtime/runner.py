"""The model runner: owns the forward pass, the KV manager, the page store and the budget.

A step takes (sequence, new token ids) pairs, reserves their slots, runs one forward pass over all
of their tokens (the linear layers see one batch; attention runs per sequence over its pages) and
commits. Any exception inside the step (a stop, an error at any layer) rolls every sequence back
to exactly where it was.
"""
from __future__ import annotations

import threading

import torch

from kernels import cpu_quant

from engine.runtime import attention
from engine.config import CacheConfig, ConfigError
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

    # ---- one step ------------------------------------------------------------------------------

    def step(self, items: list[tuple[Sequence, list[int]]], all_logits: bool = False,
             hash_ids: bool = True, decode: list[bool] | None = None) -> list[torch.Tensor]:
        """Feed each sequence its new ids in one forward pass; returns per sequence logits [T, vocab] (all_logits)
        or [1, vocab] (its last token). Raises NoFreeBlocks when the budget cannot take the tokens.

        decode[i]: item i is generated tokens (default: a single token), else prompt tokens. The two kinds
        take different kernels, chosen per row, so that a sequence's numbers never depend on the other
        sequences of the batch: decode items go first in the batch."""
        if decode is None:
            decode = [len(ids) == 1 for _, ids in items]
        layouts = {}
        for seq, _ in items:
            layouts.setdefault(seq.layout, len(layouts))
        # decode items first, those of one layout together (one kernel call attends them all)
        order = sorted(range(len(items)), key=lambda i: (not decode[i], layouts[items[i][0].layout]))
        items = [items[i] for i in order]
        num_decode = sum(len(items[j][1]) for j in range(len(items)) if decode[order[j]])
        with self.lock:
            m = self.manager
            keep = {s.seq_id for s, _ in items}
            reservations, steps, saved = [], [], []
            try:
                offset = 0
                for j, (seq, ids) in enumerate(items):
                    res = m.reserve(seq, len(ids), keep)
                    reservations.append(res)
                    self.store.reserve(seq.layout, m.pool.high_water, seq.layout.budget_blocks(m.budget_bytes) + 1)
                    if res.copied:
                        self.store.copy_block(seq.layout, res.copied[1], res.copied[2])
                    quantized = seq.layout.quantized_components > 0
                    head_new = quantized and res.first_slot < seq.block_size <= res.first_slot + len(ids)
                    saved.append((self.store.snapshot_tails(seq.layout, seq.seq_id) if quantized else None,
                                  seq.block_table[0] if head_new else None))
                    steps.append(attention.plan(res, offset, self.inv_freq, self.device, quantized, decode[order[j]]))
                    offset += len(ids)
                x = torch.tensor([t for _, ids in items for t in ids], dtype=torch.long, device=self.device)
                comps = [self.store.components(s.layout) for s, _ in items]
                if all_logits:
                    rows = None
                else:
                    rows = [st.offset + st.num_new - 1 for st in steps]

                groups = self._decode_groups(items, steps)

                def attend(layer, q, k, v):
                    if len(steps) == 1 and not groups:
                        kc, vc = comps[0][layer]
                        return attention.attend(kc, vc, q, k, v, steps[0])
                    outs, i = [], 0
                    while i < len(steps):
                        kc, vc = comps[i][layer]
                        grp = groups.get(i)
                        if grp is not None:
                            sl = slice(grp.start, grp.start + grp.size)
                            out = attention.attend_group(kc, vc, q[sl], k[sl], v[sl], grp)
                            if out is not None:
                                outs.append(out)
                                i += grp.size
                                continue
                        st = steps[i]
                        sl = slice(st.offset, st.offset + st.num_new)
                        outs.append(attention.attend(kc, vc, q[sl], k[sl], v[sl], st))
                        i += 1
                    return outs[0] if len(outs) == 1 else torch.cat(outs)

                logits = None
                whole = groups.get(0)
                if whole is not None and whole.size == len(steps) and not all_logits:
                    # every item a one-token decode over one full-precision layout: all layers in one kernel call
                    logits = self.model.forward_decode(x, attention.group_args(whole),
                                                       [(kc.flat_pages(), vc.flat_pages()) for kc, vc in comps[0]])
                elif not all_logits and self.model.kernel_layers() is not None \
                        and (quant := attention.quant_step(comps, steps, self.model.config.num_heads)) is not None:
                    # one-token decodes over quantized pages: the layers and their attention in one kernel call
                    logits = self.model.forward_decode(x, quant=quant)
                    if logits is not None:
                        attention.finish_quant_step(comps, steps, quant)
                elif not all_logits and all(st.decode and st.num_new == 1 for st in steps):
                    # one-token decodes over other caches (quantized): the layers in one kernel call, which
                    # calls back for each layer's attention
                    logits = self.model.forward_decode(x, attention=attend)
                if logits is None:
                    logits = self.model.forward(x, attend, all_logits=True, rows=rows, num_decode=num_decode)
            except BaseException:
                for i in reversed(range(len(reservations))):
                    res = reservations[i]
                    if i < len(saved) and saved[i][0] is not None:
                        self.store.restore_tails(res.seq.layout, res.seq.seq_id, *saved[i])
                    m.rollback(res)
                raise
            for (seq, ids), res in zip(items, reservations):
                m.commit(res, ids if hash_ids else None)
            self.steps += 1
        if all_logits:
            out = [logits[st.offset:st.offset + st.num_new] for st in steps]
        else:
            out = [logits[i:i + 1] for i in range(len(steps))]
        result = [None] * len(out)
        for j, i in enumerate(order):
            result[i] = out[j]
        return result

    @staticmethod
    def _decode_groups(items, steps) -> dict:
        """First step index -> DecodeGroup, for each run of one-token decode steps whose sequences share a
        full-precision layout (on the CPU, where one kernel call does their attention)."""
        groups, i = {}, 0
        while i < len(steps):
            j = i
            while (j < len(steps) and steps[j].decode and steps[j].num_new == 1
                   and not items[j][0].layout.quantized_components and items[j][0].layout == items[i][0].layout):
                j += 1
            if j > i and steps[i].rows.device.type == "cpu" and cpu_quant.available():
                groups[i] = attention.decode_group(steps[i:j])
            i = max(j, i + 1)
        return groups

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

    def storage_bytes(self) -> int:
        """Bytes the page store holds (capacity included): what the process really spends on KV."""
        return self.store.layer_bytes()
