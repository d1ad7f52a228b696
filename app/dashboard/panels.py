"""Feeds the dashboard's Pool, Plan and Lengths tabs from the window's engine events and history.

Only the visible tab is redrawn, from a timer, when something changed. The Plan tab's button goes
through the window's own live-switch path (EngineHost.set_cache), so the chat, its history row and
the Live tab's marker see the switch as if it came from Settings.
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, QTimer

from kvchat.engine.config import CacheConfig
from kvchat.engine.units import MIB

from kvchat.app.dashboard.bar_widgets import Row
from kvchat.app.bridge.messages import TokenCounts
from kvchat.app.dashboard.lengths_view import share_rows
from kvchat.app.dashboard.pool_view import PoolOwners, PoolRow, pool_rows

REFRESH_MS = 250


class DashboardPanels(QObject):
    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.dashboard = window.dashboard
        self.owners = PoolOwners()
        self.tokens: dict[int, tuple[float, int]] = {}      # conversation id -> (updated_at counted, tokens)
        self._asked: set[tuple[int, float]] = set()
        self._model_name = ""
        self._drawn: dict[str, object] = {}
        self._lengths_stale = True
        host = window.host
        host.ready.connect(self._on_ready)
        host.session_opened.connect(lambda e: self._learn(e.stats, e.conversation_id))
        host.stats.connect(self._on_stats)
        host.mode_switched.connect(lambda e: self._on_stats(e.stats))
        host.reset_done.connect(lambda e: self._on_stats(e.stats))
        host.turn_finished.connect(self._mark_lengths_stale)
        host.token_counts.connect(self._on_counts)
        window.conversations.deleted.connect(self._mark_lengths_stale)
        self.dashboard.plan.apply_requested.connect(self.apply_cache)
        self.dashboard.switcher.currentChanged.connect(lambda _i: self.refresh())
        self.timer = QTimer(self, interval=REFRESH_MS)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        window.installEventFilter(self)

    def eventFilter(self, watched, event) -> bool:
        if watched is self.window and event.type() == QEvent.Type.Close:
            self.timer.stop()           # the history may be closed next: nothing reads it after the window goes
        return False

    # --- engine events ---

    def _on_ready(self, event) -> None:
        self.dashboard.plan.set_model(event.model_config, event.dtype, event.device)
        if event.model_name != self._model_name:        # another tokenizer: count again
            self._model_name = event.model_name
            self.tokens.clear()
            self._asked.clear()
        self._mark_lengths_stale()

    def _on_stats(self, snapshot) -> None:
        """A snapshot of the engine's current session: during a turn that is the turn's chat, else the open one
        (while another chat's session is being opened, nobody can say: it is not learnt from)."""
        w = self.window
        if w.generating:
            self._learn(snapshot, w.turn_conversation_id)
        elif w.session_ready:
            self._learn(snapshot, w.conversation_id)

    def _learn(self, snapshot, conversation_id: int | None) -> None:
        if snapshot is not None:
            self.owners.learn(snapshot.pool, conversation_id)

    def _on_counts(self, counts: TokenCounts) -> None:
        if counts.model_name != self._model_name or not self.timer.isActive():
            return
        updated = {c.id: c.updated_at for c in self.window.history.lengths()}
        for conversation_id, tokens in counts.counts:
            if conversation_id in updated:
                self.tokens[conversation_id] = (updated[conversation_id], tokens)
        self._mark_lengths_stale()

    def _mark_lengths_stale(self, *_args) -> None:
        self._lengths_stale = True

    # --- the Plan tab's button ---

    def apply_cache(self, cache: CacheConfig) -> None:
        if self.window.session_ready:
            self.window.host.set_cache(cache)

    # --- drawing the visible tab ---

    def _title(self, conversation_id: int) -> str | None:
        conversation = self.window.history.get(conversation_id)
        return conversation.title if conversation is not None else None

    def rows(self) -> list[PoolRow]:
        latest = self.dashboard.data.latest
        if latest is None or latest.pool is None:
            return []
        return pool_rows(latest.pool, self.owners, self._title)

    def refresh(self) -> None:
        if not self.timer.isActive():
            return
        page = self.dashboard.current_page()
        latest = self.dashboard.data.latest
        w = self.window
        key = (self.dashboard.data.version, w.session_cache, w.session_ready, w.conversation_id)
        if page is self.dashboard.pool_view and self._drawn.get("pool") != key:
            self._drawn["pool"] = key
            self.dashboard.pool_view.set_pool(latest.pool if latest is not None else None, self.rows(),
                                              latest.state_bytes if latest is not None else 0,
                                              latest.snapshots if latest is not None else ())
        elif page is self.dashboard.plan and self._drawn.get("plan") != key:
            self._drawn["plan"] = key
            self.dashboard.plan.set_conversation(
                w.session_cache, latest.tokens_in_context if latest else 0, latest.tokens_held if latest else 0,
                latest.budget_bytes if latest else int(w.session_cache.budget_mb * MIB), w.session_ready)
        elif page is self.dashboard.lengths and (self._lengths_stale or self._drawn.get("lengths") != key):
            self._drawn["lengths"] = key
            self._lengths_stale = False
            self.refresh_lengths()

    def refresh_lengths(self) -> None:
        w = self.window
        lengths = w.history.lengths()
        self._ask_counts(lengths)
        info = w.engine_info
        tokens = {c.id: self.tokens[c.id][1] for c in lengths if c.id in self.tokens}
        self.dashboard.lengths.set_data(lengths, tokens, info.model_config if info else None,
                                        info.dtype if info else "fp32", info.device if info else "cpu",
                                        w.session_cache, self._pool_share_rows())

    def _ask_counts(self, lengths) -> None:
        """Conversations never counted, or changed since: counted by the model's tokenizer in the engine thread."""
        if self.window.engine_info is None:
            return
        missing = [c for c in lengths if self.tokens.get(c.id, (None,))[0] != c.updated_at
                   and (c.id, c.updated_at) not in self._asked]
        if not missing:
            return
        history = self.window.history
        requests = []
        for c in missing:
            self._asked.add((c.id, c.updated_at))
            conversation = history.get(c.id)
            turns = tuple((m["role"], m["content"]) for m in history.messages(c.id))
            requests.append((c.id, conversation.system_prompt if conversation else "", turns))
        self.window.host.count_tokens(tuple(requests))

    def _pool_share_rows(self) -> list[Row]:
        """Each conversation with a cache, and its share of the KV they hold together (lengths_view.share_rows)."""
        rows = self.rows()
        return share_rows(rows, self.dashboard.data.latest.pool.budget_bytes) if rows else []
