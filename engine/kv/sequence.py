"""One conversation's (or request's) blocks in one KV group: a positioned block table, and a step's reservation.

The manager (kv/manager.py) changes these; everyone else reads them. An entry of the table is a block of tokens by
position, null where the block has left, so positions come from the table alone (`Sequence.positions`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvchat.engine.kv.layout import KVLayout, WindowGeometry

_ids = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    """One conversation's (or request's) blocks. Slots are the table's blocks laid end to end."""

    layout: KVLayout
    geometry: WindowGeometry
    sink_blocks: int                    # blocks at the start that never leave (kept if the window is removed)
    seq_id: int = field(default_factory=lambda: next(_ids))
    # positioned: entry i holds tokens [i * block_size, (i + 1) * block_size), None where that block left (a window
    # moved past it, or it was dropped); the table keeps its length, so an entry's index is its position
    table: list[int | None] = field(default_factory=list)
    num_tokens: int = 0                 # tokens committed since the sequence started (or was reset)
    token_ids: list[int] = field(default_factory=list)   # committed ids, kept while blocks are hashed
    block_keys: list[tuple] = field(default_factory=list)  # prefix keys of the full blocks, in order
    last_used: int = 0
    released: bool = False              # its blocks were taken back for another conversation
    closed: bool = False
    conversation: "Conversation | None" = field(default=None, repr=False)     # whose group this is
    state_bytes: int = 0                # the conversation's recurrent state and snapshots (its first group carries them)
    pinned: bool = False                # never released for room (a retrieval tier's fetch cache: kv/block_tier.py)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def block_table(self) -> list[int]:
        """The held blocks in position order: the pages' view, whose slots are these blocks laid end to end."""
        return [b for b in self.table if b is not None]

    @property
    def evicted(self) -> int:
        """Blocks that left (null entries); only whole blocks ever leave."""
        return self.table.count(None)

    @property
    def seq_len(self) -> int:
        """Slots in use: tokens committed less those in blocks that left."""
        return self.num_tokens - self.evicted * self.block_size

    @property
    def has_head(self) -> bool:
        """Quantized components keep the first block in full precision while it is full and held."""
        return self.num_tokens >= self.block_size and bool(self.table) and self.table[0] is not None

    def held_positions(self) -> list[int]:
        """The first token position of each held block, in slot order."""
        bs = self.block_size
        return [i * bs for i, b in enumerate(self.table) if b is not None]

    @property
    def side_bytes(self) -> int:
        return self.layout.side_bytes(self.seq_len, self.has_head)

    @property
    def tokens_held(self) -> int:
        return self.geometry.held(self.num_tokens, self.evicted)

    def window(self) -> tuple[int, int]:
        """(window_start slot, num_sinks) now."""
        return self.geometry.start(self.num_tokens, self.evicted)

    def positions(self, slots):
        """The token positions of slots (an int64 tensor, or an int): the one map from where a value sits in the
        pages to the token it belongs to, read off the positioned table (blocks that left shift later slots)."""
        import torch
        bs = self.block_size
        starts = torch.tensor(self.held_positions(), dtype=torch.long)
        if isinstance(slots, int):
            return int(starts[slots // bs]) + slots % bs
        if not self.evicted:
            return slots.clone()
        return starts[slots // bs] + slots % bs

    @property
    def members(self) -> list["Sequence"]:
        """Every group's sequence of its conversation (itself alone outside one)."""
        return list(self.conversation.groups) if self.conversation is not None else [self]


class Conversation:
    """A conversation's (or a server request's) cache: one Sequence per KV group of the model (kv/layout.kv_groups),
    which the cache reserves, forks, truncates, releases and saves together. The first group keeps the most (every
    token, where any layer attends to all of them) and answers where one number is asked: its reads below. A model
    with linear-attention layers gives it a recurrent state too (kv/state.py), which moves with the groups."""

    __slots__ = ("groups", "state")

    def __init__(self, groups: list[Sequence], state=None):
        self.groups = tuple(groups)
        self.state = state                  # kv/state.RecurrentState of its linear-attention layers, or None
        for g in self.groups:
            g.conversation = self

    @property
    def members(self) -> list[Sequence]:
        return list(self.groups)

    @property
    def hybrid(self) -> bool:
        """Whether its layers keep different tokens (a model with sliding layers beside global ones)."""
        return len(self.groups) > 1

    @property
    def released(self) -> bool:
        """Its blocks were taken back for another conversation (every group goes together)."""
        return self.groups[0].released

    @released.setter
    def released(self, value: bool) -> None:
        for g in self.groups:
            g.released = value

    def window(self) -> tuple[int, int]:
        return self.groups[0].window()

    def positions(self, slots):
        return self.groups[0].positions(slots)

    def __repr__(self) -> str:
        return f"Conversation({', '.join(str(g.seq_id) for g in self.groups)}: {self.num_tokens} tokens)"


def _first_group(name: str) -> property:
    return property(lambda self: getattr(self.groups[0], name), doc=f"The first group's `{name}`.")


for _name in ("seq_id", "layout", "geometry", "block_size", "sink_blocks", "table", "block_table", "num_tokens",
              "evicted", "seq_len", "has_head", "side_bytes", "state_bytes", "tokens_held", "token_ids", "block_keys",
              "last_used", "closed"):
    setattr(Conversation, _name, _first_group(_name))


@dataclass
class Reservation:
    """What a step took before its forward pass, so it can be committed or undone."""

    seq: Sequence
    num_new: int
    first_slot: int
    new_blocks: list[int]
    copied: tuple[int, int, int] | None = None   # (table index, old id, new id) of a copied-on-write block
    undo: tuple | None = None           # what the pages need to undo the step (KVCache.reserve: tails, a new head)
