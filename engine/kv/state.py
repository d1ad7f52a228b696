"""The recurrent state of a conversation's linear-attention layers (spec.LinearAttention): the cache's other citizen.

A linear-attention layer keeps no KV: per conversation it holds the convolution's last inputs and the delta rule's
matrices, the same bytes at 10 tokens and at 10,000. The KV cache (kv/cache.py) owns it beside the pages, under the
same budget (the first group's sequence carries its bytes, see KVCache), and a step changes it as it changes pages:
the new state is made aside during the forward pass and taken only when the step commits.

A state cannot be rolled back the way KV blocks are (the tokens it has read are folded into it), so the state keeps
snapshots: copies of itself at chosen positions (where a prompt ended, where a turn began). Regenerate, edit, rewind
and take-back return to a snapshot instead of reading the conversation again; a fork starts from one. Each snapshot
costs a whole state, so a conversation keeps at most MAX_SNAPSHOTS (the oldest goes first) and they count against the
budget like the live state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.engine.model import linear_attention as gdn

MAX_SNAPSHOTS = 4           # per conversation: the turn's start, the prompt's end, and two turns back
MAX_POINTS = 8              # per cache: states at block boundaries another conversation may start from


@dataclass(frozen=True, slots=True)
class StateLayout:
    """The shape of one conversation's state: the model layers that keep one, and per layer the convolution's tail
    [kernel - 1, channels] and the matrices [value_heads, key_dim, value_dim], float32."""
    layers: tuple[int, ...]
    conv: tuple[int, int]
    matrices: tuple[int, int, int]

    @classmethod
    def of(cls, config) -> "StateLayout | None":
        """The state of a ModelConfig's linear-attention layers, or None for a model without them."""
        specs = [(i, spec.linear) for i, spec in enumerate(config.layers) if spec.linear is not None]
        if not specs:
            return None
        shapes = {la for _, la in specs}
        if len(shapes) > 1:
            raise ValueError("linear-attention layers of different shapes in one model")
        la = specs[0][1]
        return cls(tuple(i for i, _ in specs), (la.conv_kernel - 1, la.channels),
                   (la.value_heads, la.key_dim, la.value_dim))

    @property
    def layer_bytes(self) -> int:
        c, k = self.conv
        h, dk, dv = self.matrices
        return 4 * (c * k + h * dk * dv)

    @property
    def bytes(self) -> int:
        """One state (live, or one snapshot) over every linear layer."""
        return self.layer_bytes * len(self.layers)


@dataclass
class StepJournal:
    """What the last verification step (speculative decoding: several generated rows in one step) read, so its state
    can be taken back to any of its rows: the state before it and, per linear layer, the rows' inputs to the mixer.
    Replaying r rows from there gives the state the step had after row r, bit for bit (the rule runs token after
    token, kernels/cpu_gdn.h): rejected drafts are taken back without a snapshot per draft."""
    start: int                                   # the conversation's tokens before the step
    rows: int
    conv: torch.Tensor                           # the state before the step
    matrices: torch.Tensor
    layers: dict                                 # layer -> (proj rows, MixerWeights, LinearAttention, eps, C table)


class RecurrentState:
    """One conversation's state: `conv` [layers, kernel - 1, channels] and `matrices` [layers, heads, Dk, Dv] after
    `position` tokens, and its snapshots by position (oldest first)."""

    def __init__(self, layout: StateLayout, device):
        self.layout = layout
        self.device = device
        n = len(layout.layers)
        self.conv = torch.zeros(n, *layout.conv, device=device)
        self.matrices = torch.zeros(n, *layout.matrices, device=device)
        self.position = 0
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.index = {layer: j for j, layer in enumerate(layout.layers)}
        self.journal: StepJournal | None = None  # the last step's, where it was a verification
        # a second whole state a step writes its new state into, which then becomes the live one (adopt): no copy
        # at the commit; held between steps where the budget has room, its bytes the cache's (KVCache.hold_spare)
        self.spare: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def bytes(self) -> int:
        """The live state, every snapshot, and the copy a verification's journal keeps (not the spare: the cache
        counts it apart, as room it may take back)."""
        return self.layout.bytes * (1 + len(self.snapshots) + (self.journal is not None))

    def reset(self) -> None:
        """Back to the state before any token, no snapshots."""
        self.conv.zero_()
        self.matrices.zero_()
        self.position = 0
        self.snapshots.clear()
        self.journal = None

    def add_spare(self) -> None:
        self.spare = (torch.empty_like(self.conv), torch.empty_like(self.matrices))

    def spare_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model layer `layer`'s (conv tail, matrices) in the spare, for a step to write its new state into."""
        j = self.index[layer]
        return self.spare[0][j], self.spare[1][j]

    def adopt(self) -> None:
        """A step wrote every layer's new state into the spare: it becomes the live state, and the old one the
        spare."""
        (self.conv, self.matrices), self.spare = self.spare, (self.conv, self.matrices)

    def snapshot(self, limit: int = MAX_SNAPSHOTS) -> int:
        """Keep a copy of the state at its position (the oldest snapshots go past `limit`); returns the bytes it
        added (0 where one is already kept there, or limit is 0)."""
        if limit <= 0 or self.position in self.snapshots or self.position == 0:    # at 0 the state is zeros
            return 0
        added = self.layout.bytes
        self.snapshots[self.position] = (self.conv.clone(), self.matrices.clone())
        while len(self.snapshots) > limit:
            del self.snapshots[min(self.snapshots)]
            added -= self.layout.bytes
        return added

    def drop_oldest(self) -> int:
        """One snapshot less to make room; returns its bytes (0 when there is none)."""
        if not self.snapshots:
            return 0
        del self.snapshots[min(self.snapshots)]
        return self.layout.bytes

    def can_return(self, position: int) -> bool:
        j = self.journal
        return (position in (0, self.position) or position in self.snapshots
                or (j is not None and j.start <= position <= j.start + j.rows))

    def restore(self, position: int) -> None:
        """The state after `position` tokens, from its snapshot (kept: it may be returned to again); later snapshots
        go (they belong to tokens that are taken back)."""
        if position == 0:
            self.reset()
            return
        j = self.journal
        if position == self.position:
            pass
        elif position in self.snapshots:
            conv, matrices = self.snapshots[position]
            self.conv.copy_(conv)
            self.matrices.copy_(matrices)
            self.position = position
        else:
            self._replay(j, position - j.start)
        # the journal still covers the rows kept (a stop inside them may take more back), none before its start
        self.journal = j if j is not None and j.start <= position else None
        if self.journal is not None:
            j.rows = min(j.rows, position - j.start)
        for p in [p for p in self.snapshots if p > position]:
            del self.snapshots[p]

    def _replay(self, j: StepJournal, rows: int) -> None:
        """The state after the first `rows` rows of the journalled step: the state before it, then those rows again
        through the layer's mixer (linear_attention.mix, as the step ran them)."""
        self.conv.copy_(j.conv)
        self.matrices.copy_(j.matrices)
        for layer, (proj, weights, la, eps, table) in j.layers.items():
            if rows:
                tail, matrices = self.layer(layer)
                _, new_tail, new_matrices = gdn.mix(proj[:rows], weights, la, eps, tail, matrices, True, table)
                self.write(layer, new_tail, new_matrices)
        self.position = j.start + rows

    def best_at_most(self, position: int) -> int | None:
        """The latest position <= `position` the state can return to, or None."""
        held = [p for p in (0, self.position, *self.snapshots) if p <= position]
        return max(held) if held else None

    def copy_at(self, position: int) -> "RecurrentState":
        """A new state equal to this one at `position` (which can_return), with the snapshots up to there: a
        snapshot is never written once taken, so the two states share them."""
        child = RecurrentState(self.layout, self.device)
        if position == 0:
            return child
        conv, matrices = (self.conv, self.matrices) if position == self.position else self.snapshots[position]
        child.conv.copy_(conv)
        child.matrices.copy_(matrices)
        child.position = position
        child.snapshots = {p: pair for p, pair in self.snapshots.items() if p <= position}
        return child

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model layer `layer`'s (conv tail, matrices), views of the live state."""
        j = self.index[layer]
        return self.conv[j], self.matrices[j]

    def write(self, layer: int, conv: torch.Tensor, matrices: torch.Tensor) -> None:
        j = self.index[layer]
        self.conv[j].copy_(conv)
        self.matrices[j].copy_(matrices)

    def export(self) -> dict[str, torch.Tensor]:
        """The live state and its snapshots as tensors for a saved cache: state.conv / state.matrices (at the
        conversation's token count), state.at{P}.conv / .matrices (the snapshot after P tokens)."""
        out = {"state.conv": self.conv.cpu().clone(), "state.matrices": self.matrices.cpu().clone()}
        for p, (conv, matrices) in self.snapshots.items():
            out[f"state.at{p}.conv"], out[f"state.at{p}.matrices"] = conv.cpu().clone(), matrices.cpu().clone()
        return out

    def load(self, tensors: dict[str, torch.Tensor], position: int) -> None:
        """The state from export()'s tensors after `position` tokens; a ValueError where they are not this layout's
        (nothing changes then)."""
        pairs: dict[int, list] = {}
        for name, t in tensors.items():
            if not name.startswith("state."):
                continue
            parts = name.split(".")
            where = position if len(parts) == 2 else _snapshot_position(parts)
            if where is None or where > position or parts[-1] not in ("conv", "matrices"):
                raise ValueError(f"the saved cache holds a state tensor it should not ({name[:40]})")
            pairs.setdefault(where, [None, None])[parts[-1] == "matrices"] = t
        for where, (conv, matrices) in pairs.items():
            if conv is None or matrices is None:
                raise ValueError("the saved cache holds half a recurrent state")
            if tuple(conv.shape) != tuple(self.conv.shape) or tuple(matrices.shape) != tuple(self.matrices.shape):
                raise ValueError(f"the saved state has shapes {list(conv.shape)} / {list(matrices.shape)}, this "
                                 f"model's {list(self.conv.shape)} / {list(self.matrices.shape)}")
            if conv.dtype != torch.float32 or matrices.dtype != torch.float32:
                raise ValueError("the saved state is not float32")
            if not (torch.isfinite(conv).all() and torch.isfinite(matrices).all()):
                raise ValueError("the saved state holds values that are not finite")
        if position not in pairs:
            raise ValueError("the saved cache holds no recurrent state")
        conv, matrices = pairs.pop(position)
        self.conv.copy_(conv)
        self.matrices.copy_(matrices)
        self.position = position
        self.snapshots = {p: (c.to(self.device).clone(), m.to(self.device).clone())
                          for p, (c, m) in sorted(pairs.items())[-MAX_SNAPSHOTS:]}


class StatePoints:
    """States at block boundaries that any conversation reading the same tokens may start from: prefix sharing over
    a recurrent state. A KV block is shared by its key (its tokens and every token before it, kv/manager.py); a state
    point is kept under the key of the block it ends with, so a conversation that adopts the cached blocks up to
    there can take the state after them too, instead of reading them again. Each point costs a whole state: the
    cache keeps at most MAX_POINTS, the oldest dropped first, and drops them for room before it releases anyone."""

    def __init__(self, layout: StateLayout | None = None):
        self.layout = layout
        self.points: dict[object, tuple[int, torch.Tensor, torch.Tensor]] = {}     # key -> (position, conv, matrices)

    @property
    def bytes(self) -> int:
        return 0 if self.layout is None else self.layout.bytes * len(self.points)

    def publish(self, key, state: RecurrentState) -> int:
        """Keep a copy of `state` (at a block boundary) under `key`; returns the bytes added (0 where it is kept)."""
        if key in self.points:
            self.points[key] = self.points.pop(key)         # the newest again
            return 0
        self.layout = state.layout
        self.points[key] = (state.position, state.conv.clone(), state.matrices.clone())
        added = self.layout.bytes
        while len(self.points) > MAX_POINTS:
            added -= self.drop_oldest()
        return added

    def drop_oldest(self) -> int:
        if not self.points:
            return 0
        del self.points[next(iter(self.points))]
        return self.layout.bytes

    def take(self, key, state: RecurrentState) -> bool:
        """The state after the point kept under `key` into `state` (nothing else of it kept); False where none."""
        point = self.points.get(key)
        if point is None:
            return False
        position, conv, matrices = point
        state.reset()
        state.conv.copy_(conv)
        state.matrices.copy_(matrices)
        state.position = position
        self.points[key] = self.points.pop(key)
        return True

    def clear(self) -> int:
        freed = self.bytes
        self.points.clear()
        return freed


def _snapshot_position(parts: list[str]) -> int | None:
    """state.at{P}.conv -> P, else None."""
    if len(parts) != 3 or not parts[1].startswith("at") or not parts[1][2:].isdigit():
        return None
    return int(parts[1][2:])
