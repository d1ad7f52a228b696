"""One step's attention measure, for the items whose conversation the cache watches (KVCache.watch): where each
layer's kernels write the mass of those items' rows (kv/attention_log.AttentionLog.begin), and the columns of the
keys every plan attends, in the plan's row order.

A one-token decode of a watched sequence, alone in its run, hands the kernels a view of its log row itself (nothing
copied); a run that mixes it with others measures the run and copies the watched rows out.
"""
from __future__ import annotations

import torch

from kvchat.kernels.cpu_quant import Mass

from kvchat.engine.kv.attention_log import OBSERVED
from kvchat.engine.runtime.attention import RowMass


class StepMass:
    def __init__(self, logs: dict[int, object], items: list, steps: list, layer_steps: list[list]):
        """logs: batch item index -> its AttentionLog; items: the step's (conversation, ids) in batch order; steps:
        each item's first plan (offset, num_new, decode); layer_steps[l]: the plans layer l attends with."""
        self.targets: dict[int, tuple] = {}         # item -> (rows [R, layers, Hq, mcols], first row's offset)
        self.offsets = [st.offset for st in steps]
        self._cols: dict[int, torch.Tensor] = {}
        self._held: dict[int, torch.Tensor] = {}    # item -> its log's held [layers, mcols - 1]
        for i, log in logs.items():
            (conv, _), st = items[i], steps[i]
            n0, T = conv.num_tokens, st.num_new
            R = T if st.decode else min(OBSERVED, T)
            rows, held = log.begin(n0 + T - R, R, n0 + T, st.decode, n0)
            self.targets[i] = (rows, st.offset + T - R, log.unit, 0 if st.decode else R)
            self._held[i] = held
            last = st.offset + T - 1
            by_plan: dict[int, tuple] = {}          # what each layer held for the item's newest row, once per plan
            for layer, plans in enumerate(layer_steps):
                for p in plans:
                    if p.offset <= last < p.offset + p.num_new:
                        by_plan.setdefault(id(p), (p, []))[1].append(layer)
            for p, layers in by_plan.values():
                if whole(p):
                    held[layers] = True
                    continue
                mask = torch.zeros(held.shape[1], dtype=torch.bool)
                mask[self.cols(p, log.unit).long()] = True
                held[layers] = mask

    def layer(self, layer: int) -> "LayerWatch":
        return LayerWatch(self, layer)

    def narrowed(self, layer: int, st) -> None:
        """Retrieval narrowed a one-token decode's plan for `layer` (engine/runtime/retrieval.py): the layer held,
        for that newest row, the columns it read (blocks fetched from disk among them), not the whole table."""
        i = max(j for j, off in enumerate(self.offsets) if off <= st.offset)
        held = self._held.get(i)
        if held is None:
            return
        target = self.targets[i]
        mask = torch.zeros(held.shape[1], dtype=torch.bool)
        mask[self.cols(st, target[2]).long()] = True
        held[layer] = mask

    def _target(self, st) -> tuple | None:
        """(rows, first row's offset, unit) of the item plan st belongs to, or None: not watched."""
        i = max(j for j, off in enumerate(self.offsets) if off <= st.offset)
        return self.targets.get(i)

    def cols(self, st, unit: int) -> torch.Tensor:
        """int32 [P + T]: the column of each key st attends, in its row order (the held past, then the new rows)."""
        got = self._cols.get(id(st))
        if got is None:
            seq = st.res.seq
            n = seq.num_tokens
            if whole(st):                   # every token held, in order: a slice of one table
                got = column_table(n + st.num_new, unit)
            else:
                past = st.past_positions if st.past_positions is not None else seq.positions(st.past_slots)
                pos = torch.cat((past, torch.arange(n, n + st.num_new)))
                got = (pos // unit).to(torch.int32)
            self._cols[id(st)] = got
        return got

    def rows_for(self, layer: int, st) -> RowMass | None:
        """The torch path's measure of one plan's rows in `layer` (the observed last rows of a prompt, a decode
        row), or None: not watched."""
        target = self._target(st)
        if target is None:
            return None
        rows, first, unit, observed = target
        if observed:                                    # a prompt: its window's mean and its last row
            return RowMass(self.cols(st, unit).long(), rows[:, layer], observed)
        lo = max(first, st.offset)
        hi = st.offset + st.num_new
        if hi <= lo:
            return None
        return RowMass(self.cols(st, unit).long(), rows[lo - first:hi - first, layer])     # [W, Hq, mcols], a view

    def decodes(self, layer: int | None, steps: list) -> tuple[Mass | None, list]:
        """The C kernels' measure of a run of one-token decodes in `layer` (None: every layer, the one-call step) and
        what to copy back after the call (finish)."""
        targets = [self._target(st) for st in steps]
        if all(t is None for t in targets):
            return None, []
        units = {t[2] for t in targets if t is not None}
        unit = units.pop()
        cols = [self.cols(st, unit) for st in steps]
        if len(steps) == 1:
            rows, first = targets[0][:2]
            r = steps[0].offset - first
            out = rows[r].unsqueeze(1) if layer is None else rows[r, layer].unsqueeze(0)
            return Mass(cols[0], out), []
        mcols = max(int(c.max()) for c in cols) + 2
        shape = (len(steps), rows_heads(targets), mcols)
        out = torch.zeros((len(self._layers(targets)),) + shape if layer is None else shape)
        copies = [(b, t, st.offset - t[1]) for b, (t, st) in enumerate(zip(targets, steps)) if t is not None]
        return Mass(torch.cat(cols), out), copies

    @staticmethod
    def _layers(targets: list) -> range:
        rows = next(t[0] for t in targets if t is not None)
        return range(rows.shape[1])

    @staticmethod
    def finish(layer: int | None, mass: Mass | None, copies: list) -> None:
        """After a mixed run's kernel: each watched row's mass into its log rows (its own columns, and the sink's)."""
        for b, (rows, *_), r in copies:
            m = rows.shape[-1]
            got = mass.out[b] if layer is not None else mass.out[:, b]
            dst = rows[r, layer] if layer is not None else rows[r]
            dst[..., :m - 1] = got[..., :m - 1]
            dst[..., m - 1] = got[..., -1]


class LayerWatch:
    """What a backend is handed for one layer: rows(st) for the torch path, kernel(steps) and done() for the C
    kernels' runs of one-token decodes."""

    def __init__(self, step: StepMass, layer: int):
        self.step, self.layer = step, layer

    def rows(self, st) -> RowMass | None:
        return self.step.rows_for(self.layer, st)

    def narrowed(self, st) -> None:
        self.step.narrowed(self.layer, st)

    def kernel(self, steps: list) -> tuple[Mass | None, list]:
        return self.step.decodes(self.layer, steps)

    def done(self, mass: Mass, copies: list) -> None:
        self.step.finish(self.layer, mass, copies)


def whole(st) -> bool:
    """The plan attends every token of its sequence, in position order (no window, nothing evicted)."""
    return not st.res.seq.evicted and st.past_slots.numel() == st.res.seq.num_tokens


_tables: dict[int, torch.Tensor] = {}


def column_table(n: int, unit: int) -> torch.Tensor:
    """int32 [n]: position // unit for positions 0..n-1, a view of a table that grows by doubling."""
    table = _tables.get(unit)
    if table is None or table.numel() < n:
        table = _tables[unit] = (torch.arange(max(n, 2 * (0 if table is None else table.numel()), 4096)) // unit
                                 ).to(torch.int32)
    return table[:n]


def rows_heads(targets: list) -> int:
    return next(t[0] for t in targets if t is not None).shape[2]
