"""The Pool tab: the engine's one KV pool, shared by every open conversation.

The engine names conversations by sequence id; the window knows which saved chat it was talking
to when each snapshot came, so `PoolOwners` learns the mapping from the snapshots themselves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from engine.events import PoolStats

from .bar_widgets import BarRows, Row, Segment, StackedBar, format_mib, format_share

IN_USE, RECLAIMABLE, FREE, SHARED = "#2563eb", "#f59e0b", "#e5e7eb", "#0d9488"
THIS_CHAT, OTHER_CHAT = "#2563eb", "#94a3b8"
UNKNOWN = object()                      # a sequence whose conversation the window never saw


class PoolOwners:
    """Sequence id -> conversation id (None: a new chat not saved yet), learnt from snapshots."""

    def __init__(self):
        self._owner: dict[int, int | None] = {}

    def learn(self, pool: PoolStats | None, conversation_id: int | None) -> None:
        """The sequence a snapshot marks as its own belongs to the conversation the snapshot was taken for."""
        if pool is None:
            return
        for seq_id, _blocks, _bytes, mine in pool.conversations:
            if mine:
                self._owner[seq_id] = conversation_id

    def owner(self, seq_id: int):
        return self._owner.get(seq_id, UNKNOWN)


@dataclass(frozen=True, slots=True)
class PoolRow:
    seq_id: int
    conversation_id: int | None
    label: str
    blocks: int
    num_bytes: int
    budget_share: float                 # of the engine's KV budget, 0.0-1.0
    current: bool


def pool_rows(pool: PoolStats, owners: PoolOwners, title_of: Callable[[int], str | None]) -> list[PoolRow]:
    """One row per conversation holding blocks: the open one first, then by bytes held."""
    rows, seen, others = [], set(), 0
    ordered = sorted(pool.conversations, key=lambda c: (not c[3], -c[2], c[0]))
    for seq_id, blocks, num_bytes, mine in ordered:
        owner = owners.owner(seq_id)
        title = title_of(owner) if isinstance(owner, int) else None
        if title is None:
            if mine:
                label = "this chat"
            else:
                others += 1
                label = f"other chat {others}"
        else:
            label = title if owner not in seen else f"{title} (earlier copy)"
        if isinstance(owner, int):
            seen.add(owner)
        rows.append(PoolRow(seq_id, owner if isinstance(owner, int) else None, label, blocks, num_bytes,
                            num_bytes / pool.budget_bytes if pool.budget_bytes else 0.0, mine))
    return rows


def pool_segments(pool: PoolStats) -> list[Segment]:
    """The budget split into what conversations use, what the prefix cache keeps, and what is free."""
    budget = max(1, pool.budget_bytes)
    in_use = max(0, pool.held_bytes - pool.evictable_bytes)
    return [
        Segment(f"in use {format_mib(in_use)}", in_use / budget, IN_USE,
                f"In use by conversations: {format_mib(in_use)} ({in_use / budget:.1%} of the budget)\n"
                f"{pool.blocks_in_use:,} blocks, {pool.shared_blocks:,} of them shared by more than one conversation"),
        Segment(f"reclaimable {format_mib(pool.evictable_bytes)}", pool.evictable_bytes / budget, RECLAIMABLE,
                f"Reclaimable prefix cache: {pool.evictable_blocks:,} blocks, {format_mib(pool.evictable_bytes)}\n"
                f"Freed blocks kept so a conversation with the same beginning reuses them; given back whenever the "
                f"pool needs room"),
        Segment(f"free {format_mib(pool.free_bytes)}", pool.free_bytes / budget, FREE,
                f"Free: {format_mib(pool.free_bytes)} of the {format_mib(pool.budget_bytes)} KV budget"),
    ]


def block_segments(pool: PoolStats) -> list[Segment]:
    """The blocks the pool holds: shared by several conversations, one conversation's own, kept for reuse."""
    shared, own = pool.shared_blocks, max(0, pool.blocks_in_use - pool.shared_blocks)
    total = max(1, shared + own + pool.evictable_blocks)
    return [
        Segment(f"shared {shared:,}", shared / total, SHARED,
                f"Shared: {shared:,} blocks referenced by more than one conversation (a common system prompt or "
                f"opening), held once"),
        Segment(f"one chat's own {own:,}", own / total, IN_USE,
                f"Own: {own:,} blocks used by exactly one conversation"),
        Segment(f"reclaimable {pool.evictable_blocks:,}", pool.evictable_blocks / total, RECLAIMABLE,
                f"Reclaimable: {pool.evictable_blocks:,} freed blocks kept for prefix reuse "
                f"({format_mib(pool.evictable_bytes)})"),
    ]


def pool_summary(pool: PoolStats) -> str:
    hits = (f"prefix hit rate <b>{pool.hit_rate:.0%}</b> ({pool.prefix_hits:,} of {pool.prefix_queries:,} prompt "
            f"tokens found cached)" if pool.prefix_queries else "prefix hit rate: no prompt looked up yet")
    released = (f" · {pool.released:,} idle conversation{'s' if pool.released != 1 else ''} released to make room"
                if pool.released else "")
    return (f"<b>{format_mib(pool.held_bytes)}</b> held of the {format_mib(pool.budget_bytes)} KV budget · "
            f"{pool.blocks_in_use:,} blocks in use, <b>{pool.shared_blocks:,}</b> shared · "
            f"<b>{pool.evictable_blocks:,}</b> reclaimable<br>{hits}{released}")


def conversation_bar_rows(rows: list[PoolRow], budget_bytes: int) -> list[Row]:
    """Bars to scale with the largest conversation; the number is the share of the KV budget."""
    largest = max((r.num_bytes for r in rows), default=0) or 1
    return [Row(r.label, r.num_bytes / largest, f"{format_mib(r.num_bytes)} · {format_share(r.budget_share)}",
                THIS_CHAT if r.current else OTHER_CHAT,
                f"{r.label}{' (open now)' if r.current else ''}\n{r.blocks:,} blocks · {format_mib(r.num_bytes)}\n"
                f"{format_share(r.budget_share)} of the {format_mib(budget_bytes)} KV budget\n"
                f"(blocks shared with another conversation count in each)", r.current)
            for r in rows]


class PoolView(QWidget):
    """Summary line, the budget as one stacked bar, and a bar per open conversation."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("poolView")
        self.pool: PoolStats | None = None
        self.rows: list[PoolRow] = []
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(4)
        self.summary = QLabel("No pool yet: the model is loading.", objectName="dashboardSummary")
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)
        layout.addWidget(QLabel("KV budget", objectName="dashboardSection"))
        self.budget_bar = StackedBar()
        layout.addWidget(self.budget_bar)
        layout.addWidget(QLabel("Blocks held", objectName="dashboardSection"))
        self.block_bar = StackedBar()
        layout.addWidget(self.block_bar)
        self.conversations_title = QLabel("Open conversations · KV held, share of the budget",
                                          objectName="dashboardSection")
        layout.addWidget(self.conversations_title)
        self.conversation_bars = BarRows("No conversation holds blocks yet.")
        layout.addWidget(self.conversation_bars)
        self.note = QLabel("", objectName="plotLegend")
        self.note.setWordWrap(True)
        layout.addWidget(self.note)
        layout.addStretch(1)

    def set_pool(self, pool: PoolStats | None, rows: list[PoolRow]) -> None:
        self.pool, self.rows = pool, rows
        if pool is None:
            self.summary.setText("This engine reports no shared pool (a remote server shows its usage in Live).")
            self.budget_bar.set_segments([])
            self.block_bar.set_segments([])
            self.conversation_bars.set_rows([])
            return
        self.summary.setText(pool_summary(pool))
        self.budget_bar.set_segments(pool_segments(pool))
        self.block_bar.set_segments(block_segments(pool))
        self.conversation_bars.set_rows(conversation_bar_rows(rows, pool.budget_bytes))
        self.note.setText("Bars are to scale with the largest conversation; blocks shared with another count in "
                          "each. Hover for blocks and bytes. Idle conversations keep their blocks until the pool "
                          "needs room; the least recently used gives them back first.")
