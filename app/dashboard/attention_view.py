"""The Attention tab: where the newest token (or the last reply, on average) put its attention, per layer along the
conversation, and one layer's heads below; hovering says which message and words a cell holds, clicking goes there
in the chat. The replay row under it (replay_panel.py) replays the chat under another cache mode.

The page keeps the latest AttentionShown and draws it only while shown; attention_data.py computes every colour and
word.
"""
from __future__ import annotations

import numpy as np
from PySide6.QtCore import QT_TRANSLATE_NOOP, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QCursor, QImage, QPainter
from PySide6.QtWidgets import (QButtonGroup, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QSpinBox, QToolTip,
                               QVBoxLayout, QWidget)

from kvchat.app.bridge.attention_events import EMPTY, REMOTE, UNSUPPORTED, AttentionShown
from kvchat.app.dashboard.attention_data import (DISK_RGB, LEFT_RGB, LINEAR_RGB, LUT, ZERO_RGB, Scale,
                                                 boundary_columns, cell_text, colours, column_message, pooled,
                                                 pooled_flags, scale_for, sinks_x, summary_text, token_ticks,
                                                 window_x)
from kvchat.app.dashboard.attention_plot import HeatMap
from kvchat.app.dashboard.registry import Page, register
from kvchat.app.dashboard.replay_panel import ReplayPanel

MISSING = {REMOTE: QT_TRANSLATE_NOOP("AttentionView", "Not measured: the model runs on a server, which does not say "
                                                      "where its attention goes."),
           UNSUPPORTED: QT_TRANSLATE_NOOP("AttentionView", "Not measured: this engine does not measure attention."),
           EMPTY: QT_TRANSLATE_NOOP("AttentionView", "Not measured yet: the map fills in after the next reply.")}


class ColourBar(QWidget):
    """The colour scale as a strip, its decades written under it."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("attentionScale")
        self.scale = Scale(-4, 0)
        self.setMinimumHeight(30)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        strip = np.ascontiguousarray(np.concatenate([LUT, np.full((len(LUT), 1), 255, np.uint8)], axis=1)[None])
        self._strip = QImage(strip.data, len(LUT), 1, QImage.Format.Format_RGBA8888).copy()

    def sizeHint(self) -> QSize:
        return QSize(240, 30)

    def set_scale(self, scale: Scale) -> None:
        self.scale = scale
        self.update()

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        metrics = painter.fontMetrics()
        margin = metrics.horizontalAdvance("0.01%") // 2 + 2
        bar = QRectF(margin, 1, self.width() - 2 * margin, 12)
        painter.drawImage(bar, self._strip)
        painter.setPen(QColor("#94a3b8"))
        painter.drawRect(bar)
        painter.setPen(QColor("#374151"))
        for at, text in self.scale.ticks():
            x = bar.left() + at * bar.width()
            painter.drawLine(int(x), int(bar.bottom()), int(x), int(bar.bottom()) + 3)
            w = metrics.horizontalAdvance(text)
            painter.drawText(int(min(max(0, x - w / 2), self.width() - w)), int(bar.bottom()) + 4 + metrics.ascent(),
                             text)
        painter.end()


def _swatch(rgb: tuple[int, int, int], text: str) -> str:
    """A colour as a small filled box (a background, so white and pale grey show on the page too), then its text."""
    return '<span style="background-color:#{:02x}{:02x}{:02x}">&nbsp;&nbsp;&nbsp;</span>'.format(*rgb) + \
        "&nbsp;" + text.replace(" ", "&nbsp;")


class AttentionView(QWidget):
    message_clicked = Signal(int)       # a session message index

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("attentionView")
        self.shown: AttentionShown | None = None
        self.missing = EMPTY
        self.over = "newest"
        self.scale = Scale(-4, 0)
        self._stale = False
        self._hovered: tuple = ()
        self.hover_texts = 0            # hover texts worked out (a pointer resting on a cell works out one)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(4)
        self.summary = QLabel(self.tr(MISSING[EMPTY]), objectName="dashboardSummary", wordWrap=True)
        layout.addWidget(self.summary)
        toggle = QHBoxLayout()
        self.over_group = QButtonGroup(self)
        self.newest_button = QPushButton(self.tr("Newest token"), objectName="attentionNewest", checkable=True)
        self.newest_button.setToolTip(self.tr("Where the newest token computed put its attention"))
        self.reply_button = QPushButton(self.tr("Last reply"), objectName="attentionReply", checkable=True)
        self.reply_button.setToolTip(self.tr("Where the last reply's tokens put their attention, on average"))
        for over, button in (("newest", self.newest_button), ("reply", self.reply_button)):
            self.over_group.addButton(button)
            button.clicked.connect(lambda _checked, over=over: self.set_over(over))
            toggle.addWidget(button)
        self.newest_button.setChecked(True)
        toggle.addStretch(1)
        layout.addLayout(toggle)
        self.maps = QWidget(objectName="attentionMaps")
        maps = QVBoxLayout(self.maps)
        maps.setContentsMargins(0, 0, 0, 0)
        maps.setSpacing(4)
        maps.addWidget(QLabel(self.tr("Attention per block · layers × conversation (tokens)"),
                              objectName="dashboardSection", wordWrap=True))
        self.layers_map = HeatMap(self.tr("layer"))
        maps.addWidget(self.layers_map)
        self.colour_bar = ColourBar()
        maps.addWidget(self.colour_bar)
        self.legend = QLabel("", objectName="plotLegend", wordWrap=True)
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        maps.addWidget(self.legend)
        heads_row = QHBoxLayout()
        heads_title = QLabel(self.tr("One layer's heads · heads × conversation"), objectName="dashboardSection")
        heads_row.addWidget(heads_title, 1)
        heads_row.addWidget(QLabel(self.tr("Layer")))
        self.layer_spin = QSpinBox(objectName="attentionLayer", minimum=0, maximum=0)
        self.layer_spin.setToolTip(self.tr("The layer whose heads are drawn below (or click a row above)"))
        self.layer_spin.valueChanged.connect(lambda _v: self._draw_heads())
        heads_row.addWidget(self.layer_spin)
        maps.addLayout(heads_row)
        self.heads_map = HeatMap(self.tr("head"))
        maps.addWidget(self.heads_map)
        layout.addWidget(self.maps)
        self.replay = ReplayPanel()
        self.replay.message_clicked.connect(self.message_clicked)
        layout.addWidget(self.replay)
        layout.addStretch(1)
        self.layers_map.hovered.connect(lambda row, column: self._hover(self.layers_map, row, column))
        self.heads_map.hovered.connect(lambda row, column: self._hover(self.heads_map, row, column))
        self.layers_map.clicked.connect(self._clicked_layer)
        self.heads_map.clicked.connect(lambda _row, column: self._go_to(column))
        self.maps.setVisible(False)

    # --- what is shown ---

    def show_attention(self, shown: AttentionShown) -> None:
        """The chat's maps after a turn (or why there are none); drawn now if the page is shown, else when it is."""
        self.shown = shown
        self._stale = True
        if self.isVisible():
            self.draw()

    def set_missing(self, missing: str) -> None:
        """No map to draw, and why (REMOTE, UNSUPPORTED, EMPTY)."""
        self.show_attention(AttentionShown(None, None, None, missing=missing))

    def set_over(self, over: str) -> None:
        self.over = over
        (self.reply_button if over == "reply" else self.newest_button).setChecked(True)
        self._stale = True
        self.draw()

    def current(self):
        """(the AttentionMap drawn, its column texts), or (None, ())."""
        return self.shown.of(self.over) if self.shown is not None else (None, ())

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if self._stale:
            self.draw()

    def draw(self) -> None:
        self._stale = False
        self._hovered = ()
        m, _texts = self.current()
        if m is None:
            missing = self.shown.missing if self.shown is not None and self.shown.missing else EMPTY
            if self.shown is not None and not self.shown.missing:       # this toggle's map alone is missing
                missing = EMPTY
            self.missing = missing
            self.summary.setText(self.tr(MISSING[missing]))
            self.maps.setVisible(False)
            self.layers_map.clear_map()
            self.heads_map.clear_map()
            return
        self.missing = ""
        self.summary.setText(summary_text(m))
        self.maps.setVisible(True)
        self.scale = scale_for(m)
        mass, held, per = pooled(m.layer_mass(), m.held)
        linear = [i for i in range(m.num_layers) if not m.attends[i]]
        self.layers_map.show_map(colours(mass, held, m.attends, self.scale, pooled_flags(m.on_disk, per)), per,
                                 m.num_columns, boundary_columns(m), sinks_x(m), window_x(m), self.tr("window"), linear,
                                 self.tr("linear attention: no cache to attend to"), token_ticks(m))
        self.colour_bar.set_scale(self.scale)
        self.legend.setText(self._legend_html(m, bool(linear)))
        self.layer_spin.setMaximum(m.num_layers - 1)
        self._draw_heads()

    def _draw_heads(self) -> None:
        m, _texts = self.current()
        if m is None or self.missing:
            return
        layer = min(self.layer_spin.value(), m.num_layers - 1)
        heads = m.num_heads
        held = np.repeat(m.held[layer][None], heads, axis=0)
        attends = np.repeat(m.attends[layer], heads)
        mass, held, per = pooled(m.mass[layer], held)
        self.heads_map.show_map(colours(mass, held, attends, self.scale, pooled_flags(m.on_disk, per)), per,
                                m.num_columns, boundary_columns(m),
                                sinks_x(m), window_x(m), self.tr("window"), [] if m.attends[layer] else [0],
                                self.tr("linear attention: no cache to attend to"), token_ticks(m))
        self._hovered = ()

    def _legend_html(self, m, linear: bool) -> str:
        entries = [_swatch(ZERO_RGB, self.tr("no mass"))]
        disk = np.zeros(m.num_columns, bool) if m.on_disk is None else m.on_disk
        if (~m.held & m.attends[:, None] & ~disk[None, :]).any():
            entries.append(_swatch(LEFT_RGB, {
                "importance": self.tr("dropped (the least attended went)"),
                "retrieval": self.tr("kept, not read for this token")}.get(
                    m.kept_by, self.tr("no longer held (left the window)"))))
        if (~m.held & m.attends[:, None] & disk[None, :]).any():
            entries.append(_swatch(DISK_RGB, self.tr("on disk, not fetched for this token")))
        if linear:
            entries.append(_swatch(LINEAR_RGB, self.tr("linear-attention layer")))
        lines = self.tr("thin lines: where each message begins")
        if m.window is not None:
            lines += self.tr("; blue: the sinks and the window's edge")
        return self.tr("Colour: the share of the layer's attention on a block (log scale).") + "<br>" + \
            "&nbsp;&nbsp; ".join(entries) + "<br>" + lines

    # --- pointer ---

    def hover_text(self, layer: int, column: int, head: int | None = None) -> str | None:
        m, texts = self.current()
        if m is None:
            return None
        self.hover_texts += 1
        return cell_text(m, texts, self.shown.roles, layer, column, head)

    def _hover(self, plot: HeatMap, row: int, column: int) -> None:
        key = (plot is self.heads_map, row, column)
        if key == self._hovered:
            return
        self._hovered = key
        if row < 0:
            QToolTip.hideText()
            return
        text = self.hover_text(row, column) if plot is self.layers_map else \
            self.hover_text(self.layer_spin.value(), column, head=row)
        if text:
            QToolTip.showText(QCursor.pos(), text, plot)

    def _clicked_layer(self, row: int, column: int) -> None:
        self.layer_spin.setValue(row)
        self._go_to(column)

    def _go_to(self, column: int) -> None:
        m, _texts = self.current()
        index = column_message(m, column) if m is not None else None
        if index is not None:
            self.message_clicked.emit(index)


register(Page("Attention", QT_TRANSLATE_NOOP("Dashboard", "Attention"),
              QT_TRANSLATE_NOOP("Dashboard", "Where the newest token's attention goes, per layer and head, along the "
                                "conversation; replay the chat under another cache mode"),
              lambda _data: AttentionView(), order=60))
