"""The Pool tab: the engine's one KV pool, shared by every open conversation.

The engine names conversations by sequence id; the window knows which saved chat it was talking
to when each snapshot came, so `PoolOwners` learns the mapping from the snapshots themselves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from kvchat.engine.events import PoolStats

from kvchat.app.dashboard.registry import Page, register
from kvchat.app.dashboard.bar_widgets import BarRows, Row, Segment, StackedBar, format_mib, format_share

IN_USE, RECLAIMABLE, FREE, SHARED = "#2563eb", "#f59e0b", "#e5e7eb", "#0d9488"
THIS_CHAT, OTHER_CHAT, ON_DISK, IN_HOST = "#2563eb", "#94a3b8", "#a78bfa", "#0d9488"
POOL, HOST, DISK = "pool", "host", "disk"     # where a conversation's cache is
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
    where: str = POOL                   # POOL: blocks in the pool; HOST: a copy in host memory beside a GPU pool;
                                        # DISK: only its saved file (the second tier)


def pool_rows(pool: PoolStats, owners: PoolOwners, title_of: Callable[[int], str | None]) -> list[PoolRow]:
    """One row per conversation holding blocks: the open one first, then by bytes held; then one per chat whose
    cache is only on disk (saved, or released to its file), the most recently used first."""
    rows, seen, others = [], set(), 0
    ordered = sorted(pool.conversations, key=lambda c: (not c[3], -c[2], c[0]))
    for seq_id, blocks, num_bytes, mine in ordered:
        owner = owners.owner(seq_id)
        title = title_of(owner) if isinstance(owner, int) else None
        if title is None:
            if mine:
                label = QCoreApplication.translate("PoolView", "this chat")
            else:
                others += 1
                label = QCoreApplication.translate("PoolView", "other chat {n}").format(n=others)
        else:
            label = title if owner not in seen else \
                QCoreApplication.translate("PoolView", "{title} (earlier copy)").format(title=title)
        if isinstance(owner, int):
            seen.add(owner)
        rows.append(PoolRow(seq_id, owner if isinstance(owner, int) else None, label, blocks, num_bytes,
                            num_bytes / pool.budget_bytes if pool.budget_bytes else 0.0, mine))
    return rows + disk_rows(pool, seen, title_of)


def disk_rows(pool: PoolStats, in_pool: set, title_of: Callable[[int], str | None]) -> list[PoolRow]:
    """Chats of this history whose cache is in host memory (beside a GPU pool) or on disk, and not in the pool (a
    file whose chat is gone is not shown)."""
    rows, seen = [], set(in_pool)
    for where, entries in ((HOST, pool.in_host), (DISK, pool.saved)):
        for key, num_bytes in entries:
            if not key.isdigit() or int(key) in seen:
                continue
            title = title_of(int(key))
            if title is not None:
                seen.add(int(key))
                rows.append(PoolRow(-1, int(key), title, 0, num_bytes,
                                    num_bytes / pool.budget_bytes if pool.budget_bytes else 0.0, False, where))
    return rows


def pool_segments(pool: PoolStats) -> list[Segment]:
    """The budget split into what conversations use, what the prefix cache keeps, and what is free."""
    budget = max(1, pool.budget_bytes)
    in_use = max(0, pool.held_bytes - pool.evictable_bytes)
    return [
        Segment(QCoreApplication.translate("PoolView", "in use {size}").format(size=format_mib(in_use)),
                in_use / budget, IN_USE,
                QCoreApplication.translate("PoolView", "In use by conversations: {size} ({share} of the budget)\n"
                                           "{blocks} blocks, {shared} of them shared by more than one "
                                           "conversation").format(
                    size=format_mib(in_use), share=f"{in_use / budget:.1%}", blocks=f"{pool.blocks_in_use:,}",
                    shared=f"{pool.shared_blocks:,}")),
        Segment(QCoreApplication.translate("PoolView", "reclaimable {size}").format(
                    size=format_mib(pool.evictable_bytes)), pool.evictable_bytes / budget, RECLAIMABLE,
                QCoreApplication.translate("PoolView", "Reclaimable prefix cache: {blocks} blocks, {size}\nFreed "
                                           "blocks kept so a conversation with the same beginning reuses them; given "
                                           "back whenever the pool needs room").format(
                    blocks=f"{pool.evictable_blocks:,}", size=format_mib(pool.evictable_bytes))),
        Segment(QCoreApplication.translate("PoolView", "free {size}").format(size=format_mib(pool.free_bytes)),
                pool.free_bytes / budget, FREE,
                QCoreApplication.translate("PoolView", "Free: {size} of the {budget} KV budget").format(
                    size=format_mib(pool.free_bytes), budget=format_mib(pool.budget_bytes))),
    ]


def block_segments(pool: PoolStats) -> list[Segment]:
    """The blocks the pool holds: shared by several conversations, one conversation's own, kept for reuse."""
    shared, own = pool.shared_blocks, max(0, pool.blocks_in_use - pool.shared_blocks)
    total = max(1, shared + own + pool.evictable_blocks)
    return [
        Segment(QCoreApplication.translate("PoolView", "shared {n}").format(n=f"{shared:,}"), shared / total, SHARED,
                QCoreApplication.translate("PoolView", "Shared: {n} blocks referenced by more than one conversation "
                                           "(a common system prompt or opening), held once").format(n=f"{shared:,}")),
        Segment(QCoreApplication.translate("PoolView", "one chat's own {n}").format(n=f"{own:,}"), own / total, IN_USE,
                QCoreApplication.translate("PoolView", "Own: {n} blocks used by exactly one conversation").format(
                    n=f"{own:,}")),
        Segment(QCoreApplication.translate("PoolView", "reclaimable {n}").format(n=f"{pool.evictable_blocks:,}"),
                pool.evictable_blocks / total, RECLAIMABLE,
                QCoreApplication.translate("PoolView", "Reclaimable: {n} freed blocks kept for prefix reuse "
                                           "({size})").format(n=f"{pool.evictable_blocks:,}",
                                                              size=format_mib(pool.evictable_bytes))),
    ]


def pool_summary(pool: PoolStats) -> str:
    hits = (QCoreApplication.translate("PoolView", "prefix hit rate <b>{rate}</b> ({hits} of {queries} prompt tokens "
                                       "found cached)").format(rate=f"{pool.hit_rate:.0%}", hits=f"{pool.prefix_hits:,}",
                                                               queries=f"{pool.prefix_queries:,}")
            if pool.prefix_queries else
            QCoreApplication.translate("PoolView", "prefix hit rate: no prompt looked up yet"))
    if not pool.released:
        released = ""
    elif pool.released == 1:
        released = QCoreApplication.translate("PoolView", " · 1 idle conversation released to make room")
    else:
        released = QCoreApplication.translate("PoolView", " · {n} idle conversations released to make room").format(
            n=f"{pool.released:,}")
    return QCoreApplication.translate("PoolView", "<b>{held}</b> held of the {budget} KV budget · {blocks} blocks in "
                                      "use, <b>{shared}</b> shared · <b>{reclaimable}</b> reclaimable").format(
        held=format_mib(pool.held_bytes), budget=format_mib(pool.budget_bytes), blocks=f"{pool.blocks_in_use:,}",
        shared=f"{pool.shared_blocks:,}", reclaimable=f"{pool.evictable_blocks:,}") + f"<br>{hits}{released}" \
        + saved_line(pool)


def saved_line(pool: PoolStats) -> str:
    """The second tier: chats whose KV cache is saved on disk, beside its budget ("" when none is kept)."""
    if not pool.saved_budget_bytes:
        return ""
    return "<br>" + QCoreApplication.translate("PoolView", "saved on disk: <b>{n}</b> chats, {size} of the {budget} "
                                               "disk budget (read back when a chat is reopened)").format(
        n=f"{pool.saved_files:,}", size=format_mib(pool.saved_bytes), budget=format_mib(pool.saved_budget_bytes))


def state_line(state_bytes: int, snapshots: tuple[int, ...]) -> str:
    """This chat's recurrent state (a model with linear-attention layers) and the snapshots kept of it, each as big as
    the state and all in the budget; "" for a model without one."""
    if state_bytes <= 0:
        return ""
    state = format_mib(state_bytes)
    if not snapshots:
        return QCoreApplication.translate("PoolView", "This chat's recurrent state: <b>{state}</b> (no snapshot kept "
                                          "yet)").format(state=state)
    tokens, size = ", ".join(f"{t:,}" for t in snapshots), format_mib(state_bytes * len(snapshots))
    if len(snapshots) == 1:
        return QCoreApplication.translate("PoolView", "This chat's recurrent state: <b>{state}</b> (1 snapshot kept "
                                          "at token {tokens}; {size})").format(state=state, tokens=tokens, size=size)
    return QCoreApplication.translate("PoolView", "This chat's recurrent state: <b>{state}</b> ({n} snapshots kept at "
                                      "tokens {tokens}; {size})").format(state=state, n=len(snapshots), tokens=tokens,
                                                                        size=size)


STATE_TIP = QT_TRANSLATE_NOOP(
    "PoolView", "The model's linear-attention layers keep a recurrent state instead of K and V: the same size at any "
    "length, always fp32.\nA snapshot is a copy of the state at a turn boundary: regenerate, rewind and edit go "
    "back to one instead of reading the chat again. Each costs as much as the state, and both count against the KV "
    "budget.")


def conversation_bar_rows(rows: list[PoolRow], budget_bytes: int) -> list[Row]:
    """Bars to scale with the largest conversation; the number is the share of the KV budget."""
    largest = max((r.num_bytes for r in rows), default=0) or 1
    return [disk_bar_row(r, largest) if r.where != POOL else
            Row(r.label, r.num_bytes / largest, f"{format_mib(r.num_bytes)} · {format_share(r.budget_share)}",
                THIS_CHAT if r.current else OTHER_CHAT,
                r.label + (QCoreApplication.translate("PoolView", " (open now)") if r.current else "") + "\n"
                + QCoreApplication.translate("PoolView", "{blocks} blocks · {size}\n{share} of the {budget} KV budget\n"
                                             "(blocks shared with another conversation count in each)").format(
                    blocks=f"{r.blocks:,}", size=format_mib(r.num_bytes), share=format_share(r.budget_share),
                    budget=format_mib(budget_bytes)), r.current)
            for r in rows]


def disk_bar_row(r: PoolRow, largest: int) -> Row:
    if r.where == HOST:
        return Row(r.label, r.num_bytes / largest,
                   QCoreApplication.translate("PoolView", "{size} in host memory").format(size=format_mib(r.num_bytes)),
                   IN_HOST, r.label + "\n" + QCoreApplication.translate(
                       "PoolView", "Its cache was moved to host memory ({size}) to make room on the GPU: reopening "
                       "the chat copies it back instead of reading the text").format(size=format_mib(r.num_bytes)),
                   False)
    return Row(r.label, r.num_bytes / largest,
               QCoreApplication.translate("PoolView", "{size} on disk").format(size=format_mib(r.num_bytes)), ON_DISK,
               r.label + "\n" + QCoreApplication.translate(
                   "PoolView", "Its cache is on disk only ({size}): it holds no blocks of the pool, and reopening "
                   "the chat reads it back instead of the text").format(size=format_mib(r.num_bytes)), False)


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
        self.summary = QLabel(self.tr("No pool yet: the model is loading."), objectName="dashboardSummary")
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)
        self.state = QLabel("", objectName="poolState")     # a model with linear-attention layers only
        self.state.setWordWrap(True)
        self.state.setToolTip(QCoreApplication.translate("PoolView", STATE_TIP))
        self.state.setVisible(False)
        layout.addWidget(self.state)
        layout.addWidget(QLabel(self.tr("KV budget"), objectName="dashboardSection"))
        self.budget_bar = StackedBar()
        layout.addWidget(self.budget_bar)
        layout.addWidget(QLabel(self.tr("Blocks held"), objectName="dashboardSection"))
        self.block_bar = StackedBar()
        layout.addWidget(self.block_bar)
        self.conversations_title = QLabel(self.tr("Conversations · KV in the pool (share of the budget), in host "
                                                  "memory or on disk"),
                                          objectName="dashboardSection")
        self.conversations_title.setWordWrap(True)
        layout.addWidget(self.conversations_title)
        self.conversation_bars = BarRows(self.tr("No conversation holds blocks yet."))
        layout.addWidget(self.conversation_bars)
        self.note = QLabel("", objectName="plotLegend")
        self.note.setWordWrap(True)
        layout.addWidget(self.note)
        layout.addStretch(1)

    def set_pool(self, pool: PoolStats | None, rows: list[PoolRow], state_bytes: int = 0,
                 snapshots: tuple[int, ...] = ()) -> None:
        """The pool, its conversations, and the open chat's recurrent state (state_bytes 0: the model has none)."""
        self.pool, self.rows = pool, rows
        line = state_line(state_bytes, snapshots) if pool is not None else ""
        self.state.setText(line)
        self.state.setVisible(bool(line))
        if pool is None:
            self.summary.setText(self.tr("This engine reports no shared pool (a remote server shows its usage in "
                                         "Live)."))
            self.budget_bar.set_segments([])
            self.block_bar.set_segments([])
            self.conversation_bars.set_rows([])
            return
        self.summary.setText(pool_summary(pool))
        self.budget_bar.set_segments(pool_segments(pool))
        self.block_bar.set_segments(block_segments(pool))
        self.conversation_bars.set_rows(conversation_bar_rows(rows, pool.budget_bytes))
        self.note.setText(self.tr("Bars are to scale with the largest conversation; blocks shared with another "
                                  "count in each. Hover for blocks and bytes. Idle conversations keep their blocks "
                                  "until the pool needs room; the least recently used gives them back first."))


register(Page("Pool", QT_TRANSLATE_NOOP("Dashboard", "Pool"),
              QT_TRANSLATE_NOOP("Dashboard", "The shared KV pool: blocks per conversation, shared and reclaimable "
                                "blocks, prefix hit rate"),
              lambda _data: PoolView(), order=20,
              local_only=QT_TRANSLATE_NOOP("Dashboard", "The KV pool's blocks, shared blocks and prefix hits per "
                                                   "conversation")))
