"""Attention backends, one per KV layout and device (see base.AttentionBackend), and the step's attention
callback that hands each run of the batch to its sequences' backend."""
from __future__ import annotations

import torch

from kernels import cpu_quant

from engine.kv.layout import KVLayout
from engine.runtime.backends.base import AttentionBackend, Pages
from engine.runtime.backends.full_pages import FullPagesC, FullPagesTorch, kernel_covers
from engine.runtime.backends.quant_pages import QuantPagesC, QuantPagesTorch, kernel_reads

__all__ = ["AttentionBackend", "FullPagesC", "FullPagesTorch", "QuantPagesC", "QuantPagesTorch", "StepAttention",
           "backend_for", "choice_key"]


def choice_key(layout: KVLayout, device) -> tuple:
    """What a layout's backend choice depends on besides the layout: the quantized-KV kernels build in the
    background on first use (cpu_quant.kv_kernels_ready), so a quantized layout chosen before they loaded is
    chosen again once they have."""
    cpu = torch.device(device).type == "cpu"
    return layout, bool(layout.quantized_components and cpu and cpu_quant.kv_kernels_ready())


def backend_for(layout: KVLayout, comps: Pages, device, num_heads: int) -> AttentionBackend:
    """The one backend for a layout's pages on a device: C where its kernels read these pages, else torch."""
    cpu = torch.device(device).type == "cpu"
    if layout.quantized_components:
        if cpu and any(kernel_reads(kc, vc) for kc, vc in comps):
            return QuantPagesC(layout, comps, num_heads)
        return QuantPagesTorch(layout, comps, num_heads)
    if cpu and cpu_quant.available() and kernel_covers(comps, num_heads):
        return FullPagesC(layout, comps, num_heads)
    return FullPagesTorch(layout, comps, num_heads)


class StepAttention:
    """The forward's attention callback for one step: steps[i] (a SeqStep) attended by backends[i]. Runs of
    one-token decodes of one layout go to their backend together (one kernel call per layer); the rest one
    sequence at a time. Batch rows follow the steps' order."""

    def __init__(self, steps: list, backends: list[AttentionBackend]):
        self.steps, self.backends = steps, backends
        self.runs = []                      # (first step, end step, backend, prepared or None for one sequence)
        i = 0
        while i < len(steps):
            j = i
            while j < len(steps) and steps[j].one_token_decode and backends[j] is backends[i]:
                j += 1
            if j > i:
                self.runs.append((i, j, backends[i], backends[i].prepare_decodes(steps[i:j])))
            else:
                j = i + 1
                self.runs.append((i, j, backends[i], None))
            i = j

    @property
    def one_layout_decode(self) -> bool:
        """Every item a one-token decode of one layout: the step may run in its backend's one kernel call."""
        return len(self.runs) == 1 and self.runs[0][1] - self.runs[0][0] == len(self.steps) \
            and self.steps[0].one_token_decode

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, j, backend, prepared in self.runs:
            first, last = self.steps[i], self.steps[j - 1]
            sl = slice(first.offset, last.offset + last.num_new)
            if first.one_token_decode:
                outs.append(backend.attend_decodes(layer, q[sl], k[sl], v[sl], self.steps[i:j], prepared))
            else:
                outs.append(backend.attend(layer, q[sl], k[sl], v[sl], first))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def decode(self, model, token_ids: torch.Tensor) -> torch.Tensor | None:
        """One kernel call through every layer (see one_layout_decode) -> logits [B, vocab], or None."""
        i, j, backend, prepared = self.runs[0]
        return backend.decode(model, token_ids, self.steps, prepared, self)
