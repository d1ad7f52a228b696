"""The Lengths tab: most saved conversations are short, a few long ones would hold most of the KV memory.

A histogram of the saved conversations' lengths (share of conversations beside share of KV bytes),
each conversation with a cache and its share of the KV they hold together, and a window suggested for the long ones.
"""
from __future__ import annotations

import statistics

from PySide6.QtCore import QT_TRANSLATE_NOOP
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.kv.layout import kv_layout

from kvchat.app.dashboard.registry import Page, register
from kvchat.app.dashboard.bar_widgets import BarRows, Column, ColumnChart, Row, format_mib, format_share
from kvchat.app.store.history import ConversationLength
from kvchat.app.i18n import cache_label
from kvchat.app.dashboard.lengths_data import (ConversationBytes, WindowSuggestion, histogram, kv_shares, no_window_text,
                                     suggest_window, without_window)
from kvchat.app.dashboard.pool_view import POOL, PoolRow, conversation_bar_rows

COUNT_COLOUR, BYTES_COLOUR = "#94a3b8", "#7e22ce"


def share_rows(rows: list[PoolRow], budget_bytes: int) -> list[Row]:
    """A bar per conversation with a cache (pool_rows: in the pool, host memory or on disk), as long as its share of
    the KV they hold together (kv_shares)."""
    bars = conversation_bar_rows(rows, budget_bytes)
    shares = kv_shares([r.num_bytes for r in rows])
    return [Row(bar.label, share, f"{format_share(share)} · "
                + (format_mib(row.num_bytes) if row.where == POOL else bar.text), bar.colour, bar.tip, bar.bold)
            for bar, row, share in zip(bars, rows, shares)]


class LengthsView(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("lengthsView")
        self.bins = []
        self.suggestion: WindowSuggestion | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(4)
        self.summary = QLabel(self.tr("No saved conversations yet."), objectName="dashboardSummary")
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)
        layout.addWidget(QLabel(self.tr("Saved conversations by length in tokens"), objectName="dashboardSection"))
        self.chart = ColumnChart(min_height=130)
        layout.addWidget(self.chart, 1)
        legend = QLabel('<span style="color:{count}">■</span>&nbsp;{conversations}&nbsp;&nbsp; '
                        '<span style="color:{bytes}">■</span>&nbsp;{kv}'.format(
                            count=COUNT_COLOUR, bytes=BYTES_COLOUR, conversations=self.tr("share of conversations"),
                            kv=self.tr("share of the KV they would hold, all open at once")), objectName="plotLegend")
        legend.setWordWrap(True)
        layout.addWidget(legend)
        self.suggestion_label = QLabel("", objectName="lengthsSuggestion")
        self.suggestion_label.setWordWrap(True)
        self.suggestion_label.setStyleSheet("#lengthsSuggestion { background: #f5f3ff; border: 1px solid #ddd6fe; "
                                            "border-radius: 4px; padding: 4px 6px; }")
        layout.addWidget(self.suggestion_label)
        layout.addWidget(QLabel(self.tr("Conversations with a cache · share of the KV they hold together"),
                                objectName="dashboardSection"))
        self.open_bars = BarRows(self.tr("No conversation holds blocks yet."))
        layout.addWidget(self.open_bars)
        note = QLabel(self.tr("Of the KV bytes these conversations hold together, in the pool, in host memory or on "
                              "disk. Blocks shared by several conversations (a common system prompt) count in each."),
                      objectName="plotLegend")
        note.setWordWrap(True)
        layout.addWidget(note)

    def set_data(self, lengths: list[ConversationLength], tokens: dict[int, int], model_config, model_dtype: str,
                 device: str, cache: CacheConfig, open_rows: list[Row]) -> None:
        """Conversations with a token count (the engine thread counts them) go into the histogram."""
        self.open_bars.set_rows(open_rows)
        counted = [tokens[c.id] for c in lengths if c.id in tokens]
        waiting = len(lengths) - len(counted)
        if not lengths:
            self._clear(self.tr("No saved conversations yet: their lengths show here once you have chatted."))
            return
        if model_config is None:
            self._clear(self.tr("{n} saved conversations; their lengths in tokens show once a model is "
                                "loaded.").format(n=len(lengths)))
            return
        base = without_window(cache)
        try:
            layout = kv_layout(model_config, base, model_dtype, device)
        except ConfigError as exc:
            self._clear(self.tr("Cannot size these conversations on this model: {error}").format(error=exc))
            return
        label = cache_label(base).replace("auto", layout.full_dtype)
        layout = ConversationBytes(model_config, base, model_dtype, device)     # hybrid layers count their window
        self.bins = histogram(counted, layout.sequence_bytes)
        total_bytes = sum(b.num_bytes for b in self.bins) or 1
        total = len(counted) or 1
        columns = [Column(b.label, (100.0 * b.count / total, 100.0 * b.num_bytes / total_bytes),
                          (COUNT_COLOUR, BYTES_COLOUR),
                          (self.tr("1 conversation with {range} ({share})") if b.count == 1 else
                           self.tr("{n} conversations with {range} ({share})")).format(
                              n=b.count, range=b.range_text, share=f"{b.count / total:.0%}") + "\n"
                          + self.tr("Their KV in {mode}: {size} ({share} of all conversations' KV)").format(
                              mode=label, size=format_mib(b.num_bytes), share=f"{b.num_bytes / total_bytes:.0%}"),
                          f"{b.count}")
                   for b in self.bins]
        self.chart.set_data(columns, 1.25 * max((max(c.values) for c in columns), default=1.0))
        counting = self.tr(" · counting tokens of {n} more…").format(n=waiting) if waiting else ""
        if counted:
            self.summary.setText(self.tr("<b>{n}</b> saved conversations · median <b>{median}</b> tokens · longest "
                                         "<b>{longest}</b> · all held at once in {mode}: <b>{size}</b>").format(
                n=len(counted), median=f"{statistics.median(counted):,.0f}", longest=f"{max(counted):,}", mode=label,
                size=format_mib(sum(layout.sequence_bytes(n) for n in counted))) + counting)
        else:
            self.summary.setText(self.tr("{n} saved conversations").format(n=len(lengths)) + counting)
        context = getattr(model_config, "max_position_embeddings", 0)
        self.suggestion = suggest_window(counted, layout, context, cache.sinks, label)
        if self.suggestion is not None:
            text = self.suggestion.text()
            if cache.window is not None:
                text += self.tr(" This chat already uses a window of {window} + {sinks} sinks.").format(
                    window=f"{cache.window:,}", sinks=cache.sinks)
            else:
                text += self.tr(" Set it in Settings (Window and sinks) for a long chat; the switch is live.")
            self.suggestion_label.setText(text)
        else:
            self.suggestion_label.setText(no_window_text(counted, context, cache.sinks) if counted else "")
        self.suggestion_label.setVisible(bool(self.suggestion_label.text()))

    def _clear(self, message: str) -> None:
        self.bins, self.suggestion = [], None
        self.chart.set_data([], 1.0)
        self.summary.setText(message)
        self.suggestion_label.setVisible(False)


register(Page("Lengths", QT_TRANSLATE_NOOP("Dashboard", "Lengths"),
              QT_TRANSLATE_NOOP("Dashboard", "How long your saved conversations are and which ones hold the memory"),
              lambda _data: LengthsView(), order=40,
              local_only=QT_TRANSLATE_NOOP("Dashboard", "Conversation lengths in tokens and each chat's share of "
                                                   "the pool")))
