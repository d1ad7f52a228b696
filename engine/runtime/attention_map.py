"""Where attention goes: the softmax mass each query head of each layer puts on each cached block, as the attention
kernels measured it (engine/kv/attention_log.py keeps it per conversation; Session.attention() returns it).

One position axis for all layers: column c holds the tokens from block_positions[c] on (blocks of the cache's block
size, one token each with weights="dense", several blocks each once a long chat is bucketed, see bucketed()). A layer
that no longer holds a block (a window that slid past it, a sliding layer's own window) puts no mass there and its
`held` is False. A learned sink's share (gpt-oss) is apart, in sink_mass; each (layer, head) row of an attending layer
plus its sink mass sums to 1. A linear-attention layer (Qwen3.5's Gated DeltaNet) attends to nothing: its rows are 0
and `attends` says so.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

OVER = ("newest", "reply", "prompt")
WEIGHTS = ("blocks", "dense")
MAX_COLUMNS = 4096          # past this many columns a map is bucketed (adjacent columns summed)


@dataclass(frozen=True, eq=False)
class AttentionMap:
    mass: np.ndarray            # float32 [layers, query_heads, columns]
    block_positions: np.ndarray     # int64 [columns]: the first token position of each column, ascending
    sink_mass: np.ndarray       # float32 [layers, query_heads]: a learned sink's share (0 without one)
    tokens: tuple[int, ...]     # the conversation's tokens up to and including the newest computed one
    block_size: int             # the cache's tokens per block (1 when weights="dense")
    over: str                   # "newest": the newest computed token; "reply": the mean over the last reply's
                                # tokens; "prompt": the mean over the last rows of the last prompt read (SnapKV's
                                # observation window, up to 32 rows)
    rows: int                   # query rows behind the map (1 for "newest")
    attends: np.ndarray         # bool [layers]: the layer attends (False: a linear-attention layer, rows 0)
    held: np.ndarray            # bool [layers, columns]: the layer held (some of) the column for the newest row
    sinks: int = 0              # the cache's attention-sink tokens (window mode), 0 otherwise
    window: int | None = None   # the cache's window in tokens; None: the whole conversation is held
    layer_windows: tuple[int | None, ...] = ()  # each layer's own sliding window (hybrid models), None: global
    message_starts: tuple[int | None, ...] = ()     # where each of session.messages begins (token index; None:
                                # not known), the system prompt (if any) before the first
    # what a column outside `held` means: "window" (it left the window), "importance" (it was dropped as the least
    # attended), "retrieval" (it is kept, but the newest row did not read it)
    kept_by: str = "window"
    on_disk: np.ndarray | None = None   # bool [columns]: retrieval past the budget, the column's block is on disk
                                # (read back when a layer's choice takes it: held there for that layer)

    def __post_init__(self):
        L, H, C = self.mass.shape
        assert self.block_positions.shape == (C,), "one position per column"
        assert self.sink_mass.shape == (L, H) and self.held.shape == (L, C) and self.attends.shape == (L,)
        assert self.over in OVER, self.over
        assert self.on_disk is None or self.on_disk.shape == (C,), "one on-disk flag per column"

    @property
    def num_layers(self) -> int:
        return self.mass.shape[0]

    @property
    def num_heads(self) -> int:
        return self.mass.shape[1]

    @property
    def num_columns(self) -> int:
        return self.mass.shape[2]

    def column_end(self, c: int) -> int:
        """One past the last token position of column c."""
        return int(self.block_positions[c + 1]) if c + 1 < self.num_columns else len(self.tokens)

    def column_of(self, position: int) -> int:
        """The column holding token `position`."""
        return int(np.searchsorted(self.block_positions, position, side="right")) - 1

    def layer_mass(self) -> np.ndarray:
        """float32 [layers, columns]: the mean over a layer's heads (the heat map's rows)."""
        return self.mass.mean(axis=1)

    def bucketed(self, max_columns: int = MAX_COLUMNS) -> "AttentionMap":
        """The same map in at most max_columns columns: adjacent columns summed in equal runs (mass and held
        combine; a run's position is its first). Itself when it already fits."""
        C = self.num_columns
        if C <= max_columns:
            return self
        per = -(-C // max_columns)
        starts = np.arange(0, C, per)
        mass = np.add.reduceat(self.mass, starts, axis=2).astype(np.float32)
        held = np.logical_or.reduceat(self.held, starts, axis=1)
        on_disk = None if self.on_disk is None else np.logical_or.reduceat(self.on_disk, starts)
        return replace(self, mass=mass, held=held, block_positions=self.block_positions[starts].copy(),
                       on_disk=on_disk)
