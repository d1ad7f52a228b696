"""Attention backends, one per KV layout and device (see base.AttentionBackend), and the step's attention
callback that hands each run of the batch to its sequences' backend."""
from __future__ import annotations

import torch

from kvchat import kernels
from kvchat.kernels import cpu_quant, cpu_step

from kvchat.engine.kv.layout import KVLayout
from kvchat.engine.kv.state import StepJournal
from kvchat.engine.model import linear_attention as gdn
from kvchat.engine.model.rope import rotate
from kvchat.engine.model.transformer import DecodeKernel
from kvchat.engine.runtime.attention import RowMass, prompt_attention
from kvchat.engine.runtime.backends.base import AttentionBackend, LayerScores, Pages
from kvchat.engine.runtime.backends.full_pages import FullPagesC, FullPagesTorch, kernel_covers, score_args, sink_args
from kvchat.engine.runtime.backends.quant_pages import (QuantPagesC, QuantPagesTorch, decode_kernel, kernel_pages,
                                                        kernel_reads, key_rope)

__all__ = ["AttentionBackend", "FullPagesC", "FullPagesTorch", "LayerScores", "QuantPagesC", "QuantPagesTorch",
           "StepAttention", "backend_for", "choice_key"]


def choice_key(layout: KVLayout, device) -> tuple:
    """What a layout's backend choice depends on besides the layout: the quantized-KV kernels build in the
    background on first use (cpu_quant.kv_kernels_ready), so a quantized layout chosen before they loaded is
    chosen again once they have."""
    cpu = torch.device(device).type == "cpu"
    return layout, bool(layout.quantized_components and cpu and cpu_quant.kv_kernels_ready()), kernels.gpu_path(device)


def backend_for(layout: KVLayout, comps: Pages, device, num_heads: int,
                scores: tuple[LayerScores, ...]) -> AttentionBackend:
    """The one backend for a layout's pages on a device: Triton on the GPU path; on the CPU, C where its kernels read
    these pages, else torch. The quantized pages' C kernels take a layer's scale, not a soft-cap: quantized pages with
    capped scores (Gemma 2) attend through torch, chosen here once rather than layer by layer inside a backend."""
    if kernels.gpu_path(device):              # CUDA (or its check on CPU tensors under triton's interpreter)
        from kvchat.engine.runtime.backends.triton_pages import FullPagesTriton, QuantPagesTriton
        kind = QuantPagesTriton if layout.quantized_components else FullPagesTriton
        return kind(layout, comps, num_heads, scores)
    cpu = torch.device(device).type == "cpu"
    if layout.quantized_components:
        if cpu and all(s.softcap is None for s in scores) and any(kernel_reads(kc, vc) for kc, vc in comps):
            return QuantPagesC(layout, comps, num_heads, scores)
        return QuantPagesTorch(layout, comps, num_heads, scores)
    if cpu and cpu_quant.available() and kernel_covers(comps, num_heads):
        return FullPagesC(layout, comps, num_heads, scores)
    return FullPagesTorch(layout, comps, num_heads, scores)


def attend_stored(comps: tuple, q: torch.Tensor, steps: list, scores: LayerScores,
                  kv: tuple | None = None, watch=None, observe: RowMass | None = None) -> torch.Tensor:
    """Attention over a layer's K and V as they are stored after this step's writes, without writing: q [T, Hq, D]
    of the steps' rows in order (one step per sequence, or per row of a verification) -> [T, Hq, D]. The reading
    half of every backend's attend, for a layer that shares another layer's KV (LayerSpec.kv_source): the source
    wrote this step's keys and values, so the rows are the held past and the new slots, in any page format.

    kv: the source's own k, v of these rows (before RoPE), where kept: a quantized layer then takes its new rows from
    them, as the source read them (in float32; its tail keeps them at 16 bits). watch: where the rows' mass goes
    (step_mass.LayerWatch), or observe: one step's (RowMass)."""
    kc, vc = comps
    quantized = kc.fmt.is_quantized or vc.fmt.is_quantized
    outs, r = [], 0
    for st in steps:
        n = st.num_new
        seq = st.res.seq
        written = st.res.first_slot + n
        if quantized and kv is not None:
            k_all = torch.cat((kc.values(seq.seq_id, seq.block_table, written, st.past_slots), kv[0][r:r + n].float()))
            v_all = torch.cat((vc.values(seq.seq_id, seq.block_table, written, st.past_slots), kv[1][r:r + n].float()))
            if not kc.fmt.is_quantized:     # keys stored rotated: the new ones turned here
                P = st.past_slots.numel()
                k_all[P:] = rotate(k_all[P:], st.q_cos, st.q_sin)
        else:
            slots = torch.cat((st.past_slots, torch.arange(st.res.first_slot, written)))
            k_all = kc.values(seq.seq_id, seq.block_table, written, slots)
            v_all = vc.values(seq.seq_id, seq.block_table, written, slots)
        if kc.fmt.is_quantized:             # stored before RoPE: turned at the effective key positions
            k_all = rotate(k_all, *key_rope(st))
        elif st.n_sink:                     # stored rotated: only the sinks see the query at its in-cache position
            k_all[:st.n_sink] = rotate(k_all[:st.n_sink], st.delta_cos, st.delta_sin)
        q_rot = rotate(q[r:r + n].float(), st.q_cos, st.q_sin)
        outs.append(prompt_attention(q_rot, k_all, v_all, st.decode, *score_args(scores), st.outside,
                                      sink_args(scores), observe if watch is None else watch.rows(st)))
        r += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def read_quantized_decodes(comps: tuple, q, k, v, steps: list, scores: LayerScores, watch=None) -> torch.Tensor:
    """attend_stored for one-token decodes over quantized pages the C kernel reads: it reads the held past in place
    and takes the new row from the source's own k and v (what the source's step stored). Where the source's row
    completed its block, the block moved from the tail into a quantized page: that row reads the pages as stored."""
    kc, vc = comps
    bs = kc.block_size
    outs = []
    for r, st in enumerate(steps):
        if st.res.first_slot % bs == bs - 1:
            outs.append(attend_stored(comps, q[r:r + 1], [st], scores, (k[r:r + 1], v[r:r + 1]), watch))
        else:
            mass, copies = (None, []) if watch is None else watch.kernel([st])
            outs.append(decode_kernel(q[r:r + 1], k[r:r + 1], v[r:r + 1], st, *kernel_pages(kc, vc, st),
                                      scores.scale, scores.sink_logits, mass))
            if copies:
                watch.done(mass, copies)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class StepAttention:
    """The forward's attention callback for one step: layer_steps[l][i] (a SeqStep: item i's sequence of the KV
    group holding layer l, at the layer's RoPE) attended by backend_of(that step). Runs of one-token decodes of one
    backend go to it together (one kernel call per layer); the rest one sequence at a time. Batch rows follow the
    items' order. Layers that share their steps (every layer of a one-group model) share their runs."""

    def __init__(self, layer_steps: list[list], backend_of, items: list | None = None,
                 sources: dict[int, int] | None = None, mass=None, chooser=None):
        self.layer_steps = layer_steps
        self.chooser = chooser              # retrieval.BlockChooser where a decode row reads chosen blocks, else None
        self.mass = mass                    # step_mass.StepMass where a conversation is watched, else None
        self.sources = sources or {}        # a layer that reads another layer's KV -> that layer
        self.kept: dict[int, tuple] = {}    # a source layer's k, v of this step, for the C decode read (see __call__)
        self.steps = next(steps for steps in layer_steps if steps)
        by_steps: dict[tuple, list] = {}
        self.layer_runs = []
        for steps in layer_steps:
            if not steps:                   # a linear-attention layer: its rows go through recurrent()
                self.layer_runs.append([])
                continue
            key = tuple(map(id, steps))
            if key not in by_steps:
                by_steps[key] = self._runs(steps, [backend_of(st) for st in steps])
            self.layer_runs.append(by_steps[key])
        self.shared = len(by_steps) == 1 and all(layer_steps)
        self.items = items or []            # (conversation, offset, rows, decode) per item, for recurrent()
        self.pending: dict[tuple[int, int], tuple] = {}     # (item, layer) -> the state after this step
        self.journal: dict[int, dict] = {}          # item -> layer -> a verification's inputs (kv/state.StepJournal)

    @staticmethod
    def _runs(steps: list, backends: list[AttentionBackend]) -> list:
        runs = []                      # (first step, end step, backend, prepared or None for one sequence, steps)
        i = 0
        while i < len(steps):
            j = i
            while j < len(steps) and steps[j].one_token_decode and backends[j] is backends[i]:
                j += 1
            if j > i:
                runs.append((i, j, backends[i], backends[i].prepare_decodes(steps[i:j]), steps))
            else:
                j = i + 1
                runs.append((i, j, backends[i], None, steps))
            i = j
        return runs

    def watch_all(self, steps: list) -> tuple:
        """The one-call step's measure of every layer (cpu_quant.Mass or None, and what to copy back after it)."""
        return (None, []) if self.mass is None else self.mass.decodes(None, steps)

    def watch_done(self, mass, copies: list) -> None:
        self.mass.finish(None, mass, copies)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        """k = v = None: a layer over another layer's KV (sources), read as its source left it this step."""
        outs = []
        watch = None if self.mass is None else self.mass.layer(layer)
        for i, j, backend, prepared, steps in self.layer_runs[layer]:
            first, last = steps[i], steps[j - 1]
            sl = slice(first.offset, last.offset + last.num_new)
            if k is None:
                source = self.sources[layer]
                local = backend.local_layer(source)
                if first.one_token_decode and type(backend) is FullPagesC and source in self.kept:
                    # the C decode attention stores before it reads: given the source's own k and v it writes the
                    # bytes already there, and reads what attend_stored reads, at the C kernel's speed
                    ks, vs = self.kept[source]
                    outs.append(backend.attend_decodes(local, q[sl], ks[sl], vs[sl], steps[i:j], prepared, watch))
                elif first.one_token_decode and type(backend) is QuantPagesC and source in self.kept \
                        and backend.kernel_layers[local]:
                    ks, vs = self.kept[source]
                    outs.append(read_quantized_decodes(backend.comps[local], q[sl], ks[sl], vs[sl], steps[i:j],
                                                       backend.scores[local], watch))
                else:
                    kept = self.kept.get(source)
                    outs.append(attend_stored(backend.comps[local], q[sl], steps[i:j], backend.scores[local],
                                              None if kept is None else (kept[0][sl], kept[1][sl]), watch))
                continue
            if self.sources and layer in self.sources.values():
                self.kept[layer] = (k, v)
            local = backend.local_layer(layer)
            if first.one_token_decode and self.chooser is not None:
                run = [self.chooser.narrow(st, local, q[st.offset:st.offset + 1], backend.comps[local][0])
                       if self.chooser.applies(st) else st for st in steps[i:j]]
                if any(a is not b for a, b in zip(run, steps[i:j])):
                    if watch is not None:
                        for a, b in zip(run, steps[i:j]):
                            if a is not b:
                                watch.narrowed(a)
                    prepared, (i, j, steps) = backend.prepare_decodes(run), (0, len(run), run)
            if first.one_token_decode:
                outs.append(backend.attend_decodes(local, q[sl], k[sl], v[sl], steps[i:j], prepared, watch))
            else:
                outs.append(backend.attend(local, q[sl], k[sl], v[sl], first, watch))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def recurrent(self, layer: int, proj: torch.Tensor, weights, la, eps: float, table=None) -> torch.Tensor:
        """A linear-attention layer over the step's rows (engine/model/linear_attention.py: mix): proj [T, ...] each
        row's projections (mixed | z | b | a), weights the layer's vectors, table its C form or None -> outputs
        [T, value heads * value_dim] float32, gated-normed for out_proj. Each item starts from its conversation's
        state; the state after the step waits in `pending` until the step commits (commit_states), so a step that
        fails changes no state (in C every row one token after another; in torch, generated rows so and prompt rows
        in chunks)."""
        outs = []
        for i, (conv, offset, n, decode) in enumerate(self.items):
            rows = proj[offset:offset + n]
            tail, matrices = conv.state.layer(layer)
            if decode and n > 1:            # a verification: its rows' inputs, to take rejected drafts back
                self.journal.setdefault(i, {})[layer] = (rows.clone(), weights, la, eps, table)
            out = conv.state.spare_layer(layer) if conv.state.spare is not None else None
            o, tail, matrices = gdn.mix(rows, weights, la, eps, tail, matrices, decode, table, out)
            self.pending[(i, layer)] = (tail, matrices)
            outs.append(o)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def kernel_states(self, layers: list[int]) -> list:
        """The one-call step's Gated DeltaNet states (cpu_step.decode_layers' `states`) for the model's linear
        layers `layers`, every item one decode row: per layer, per item, its state's (tail, matrices) and new buffers
        the kernel writes, which wait in `pending` until the step commits, as recurrent()'s do."""
        out = []
        for layer in layers:
            per_item = []
            for i, (conv, _, n, _) in enumerate(self.items):
                assert n == 1, "the one-call step's states are one decode row's"
                tail, matrices = conv.state.layer(layer)
                new = conv.state.spare_layer(layer) if conv.state.spare is not None else \
                    (torch.empty_like(tail), torch.empty_like(matrices))
                self.pending[(i, layer)] = new
                per_item.append((tail, matrices, *new))
            out.append(per_item)
        return out

    def commit_states(self) -> None:
        """The step committed: each item's conversation takes the states the step made, at its new token count; a
        verification keeps a journal of it (the state before, the rows' inputs) so rejected drafts can go back."""
        for i, (conv, _, n, _) in enumerate(self.items):
            state = conv.state
            if state is None:
                continue
            layers = self.journal.get(i)
            state.journal = (StepJournal(conv.num_tokens - n, n, state.conv.clone(), state.matrices.clone(), layers)
                             if layers else None)
        adopted = set()
        for i, (conv, _, _, _) in enumerate(self.items):        # every layer's new state in the spare: taken whole
            state = conv.state
            if state is not None and state.spare is not None and all(
                    [t.data_ptr() for t in self.pending.get((i, layer), ())]
                    == [t.data_ptr() for t in state.spare_layer(layer)] for layer in state.layout.layers):
                state.adopt()
                adopted.add(i)
        for (i, layer), (tail, matrices) in self.pending.items():
            if i not in adopted:
                self.items[i][0].state.write(layer, tail, matrices)
        for conv, _, n, _ in self.items:
            if conv.state is not None:
                conv.state.position = conv.num_tokens
        self.pending.clear()

    def _call_groups(self, c) -> tuple | None:
        """The one-call step's groups: (runs, a run per group; layer_group; layer_index, each layer's index in its
        group's backend, a layer over another's KV its source's), both None where every layer shares the runs; None
        where some layer has more than one run."""
        if self.shared and not self.sources:    # every layer on the same runs: one backend, holding every layer
            return (self.layer_runs[0], None, None) if len(self.layer_runs[0]) == 1 else None
        owners: dict[int, int] = {}             # id(backend) -> its group
        runs, layer_group, layer_index = [], [], []
        for layer, layer_runs in enumerate(self.layer_runs):
            if not layer_runs and c.layers[layer].linear is not None:     # no attention: its state's, in C
                layer_group.append(0)
                layer_index.append(0)
                continue
            if len(layer_runs) != 1:
                return None
            backend = layer_runs[0][2]
            if id(backend) not in owners:
                owners[id(backend)] = len(runs)
                runs.append(layer_runs[0])
            layer_group.append(owners[id(backend)])
            layer_index.append(backend.local_layer(self.sources.get(layer, layer)))     # shared KV: the source's
        return runs, layer_group, layer_index

    def decode(self, model, token_ids: torch.Tensor) -> torch.Tensor | None:
        """The step in one kernel call through every layer, each layer attending inside it (cpu_step.decode_layers):
        every item a one-token decode and each layer one run of one backend over all of them, a group of the call
        per backend (Gemma's sliding and global layers: two). Gemma 4's layers (LayerSpec.own_heads) attend in C
        over full-precision and quantized pages, a layer over another's KV as its source's layer there. ->
        logits [B, vocab], or None where some layer's attention needs Python (a backend without a one-call group,
        chosen blocks, a measure over more than one group or beside shared KV, Gemma 4's layers over pages no C
        group reads or over quantized pages beside shared KV): the runner then calls back for each layer."""
        c = model.config
        if self.chooser is not None or (self.sources and self.mass is not None) or model.kernel_layers() is None:
            return None
        # a mixer C does not compute stays the forward's; Gated DeltaNet layers run in C from the items' states
        linear = [i for i, spec in enumerate(c.layers) if spec.linear is not None]
        own, called_back = model.own_attention()
        if called_back or any(layer not in own for layer in self.sources) \
                or (linear and (model.gdn_layers != linear or self.mass is not None)):
            return None
        planned = self._call_groups(c)
        if planned is None:
            return None
        runs, layer_group, layer_index = planned
        readers = (FullPagesC,) if self.sources else (FullPagesC, QuantPagesC)
        if not runs or any(type(runs[layer_group[i] if layer_group else 0][2]) not in readers for i in own):
            # Gemma 4's own attention: over the C one-call groups' pages, and not over quantized pages with layers
            # reading another's KV: there the layer path stores each source's row before its readers attend, so a
            # block the step completes is read quantized by them and at full precision by the source
            return None
        for i, j, _, _, steps in runs:
            if i != 0 or j != len(steps) or not steps[0].one_token_decode:
                return None
        if len(runs) > 1 and self.mass is not None:
            return None
        mass, copies = self.watch_all(runs[0][4]) if len(runs) == 1 else (None, [])
        groups, scales = [], set()
        for _, _, backend, prepared, steps in runs:
            group = backend.one_call_group(steps, prepared, model.config.num_heads, mass)
            if group is None:
                return None
            groups.append(group)
            if isinstance(group, tuple):        # full-precision pages: one scale for all of them
                scales |= {sc.scale for sc in backend.scores}
        if len(scales) > 1:
            return None
        scale = scales.pop() if scales else 0.0

        def run_layers(table, x, ple):
            states = self.kernel_states(linear) if linear else None
            cpu_step.decode_layers(table, x, c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim, groups,
                                   layer_group, layer_index, scale, mass=mass, states=states, ple=ple)
        kinds = {"quant-pages" if isinstance(g, cpu_step.QuantStep) else "full-pages" for g in groups}
        logits = model.forward_decode(token_ids, kernel=DecodeKernel(kinds.pop() if len(kinds) == 1 else "mixed-pages",
                                                                     run_layers))
        if logits is not None:
            for (_, _, backend, _, steps), group in zip(runs, groups):
                backend.one_call_done(steps, group)
            if copies:
                self.watch_done(mass, copies)
        return logits
