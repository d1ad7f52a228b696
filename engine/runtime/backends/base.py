"""The seam every attention backend plugs into: one KV layout's attention on one device.

A backend is chosen once per (layout, device) by backends.backend_for, from facts that do not change per
step (the page formats, the device, whether the C kernels loaded), and owns that layout's page components.
The runner asks it for three things:
- attend: one sequence's rows of a step (prompt rows, or anything not batched below);
- attend_decodes: a run of one-token decodes of this layout, consecutive in the batch (prepare_decodes
  makes, once per step, what every layer of the run shares);
- decode: a whole step of one-token decodes of this layout through every layer in one kernel call
  (None where the model has no kernel table: the runner then runs the forward with `attend`).
Every method stores the new keys and values, and a sequence's result never depends on the others in the
batch. Each takes `watch` (step_mass.LayerWatch, or None): where to measure the attention mass of the rows of
watched conversations (the C kernels fill a cpu_quant.Mass, the torch path a RowMass); measuring changes no
output bit. A GPU backend, a save / restore exporter or importance scores attach here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvchat.engine.kv.layout import KVLayout
from kvchat.engine.kv.pages import Component

Pages = list[tuple[Component, Component]]          # per layer, the (K, V) components of one layout


@dataclass(frozen=True, slots=True, eq=False)
class LayerScores:
    """How a layer turns q . k into scores: times `scale` (its query_scale), then soft-capped (Gemma 2) or not; and
    its learned sink logits (gpt-oss), float32 [num_heads] or None: one more logit per query head that joins each
    row's softmax and carries no value (not the cache's StreamingLLM sink tokens). Compared by identity: a tensor
    field has no equality that answers a bool."""

    scale: float
    softcap: float | None = None
    sink_logits: torch.Tensor | None = None


class AttentionBackend(ABC):
    name: str = ""

    def __init__(self, layout: KVLayout, comps: Pages, num_heads: int, scores: tuple[LayerScores, ...]):
        """scores: per layer of the layout (a KV group's layers only)."""
        self.layout, self.comps, self.num_heads, self.scores = layout, comps, num_heads, scores
        # a KV group's layout holds some of the model's layers: model layer -> its index here
        self._local = {layer: j for j, layer in enumerate(layout.layers)}

    def local_layer(self, layer: int) -> int:
        """The index among this layout's layers (and scores) of model layer `layer`."""
        return self._local[layer] if self._local else layer

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, st, watch=None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] before RoPE, one sequence's rows (st: its SeqStep); -> [T, Hq, D]."""

    def prepare_decodes(self, steps: list) -> object | None:
        """What every layer of a run of one-token decodes shares, made once per step (None: nothing)."""
        return None

    def attend_decodes(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, steps: list,
                       prepared: object | None, watch=None) -> torch.Tensor:
        """q [B, Hq, D], k/v [B, Hkv, D], one token for each of B sequences; -> [B, Hq, D]."""
        outs = [self.attend(layer, q[i:i + 1], k[i:i + 1], v[i:i + 1], st, watch) for i, st in enumerate(steps)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def one_call_group(self, steps: list, prepared: object | None, num_heads: int, mass) -> object | None:
        """This layout's part of a decode step run in one kernel call (StepAttention.decode): a group as
        cpu_step.decode_layers takes it, attending every layer of the layout inside the call for the run of one-token
        decodes `steps` (prepared: prepare_decodes'; mass: the call's measure, a cpu_quant.Mass, or None), the same
        bits as attend_decodes. None (here): the layers' attention needs Python, and the kernel calls back for it."""
        return None

    def one_call_done(self, steps: list, group: object) -> None:
        """After the one-call step with `group` committed: what is left of the layout's step (nothing here)."""
