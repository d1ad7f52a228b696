"""A horizontal gauge: tokens the cache holds now against what still fits, and which limit binds.

Two limits can end a conversation: the KV budget (memory) and the model's context (positions).
The gauge shows whichever comes first; a sliding window bounds the cache, so it never fills.
"""
from __future__ import annotations

from PySide6.QtCore import QT_TRANSLATE_NOOP, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPainterPath
from PySide6.QtWidgets import QSizePolicy, QWidget

from kvchat.app.bridge.messages import format_bytes
from kvchat.app.dashboard.dashboard_data import TokenRoom

HELD = QColor("#2563eb")
LEFT = QColor("#e5e7eb")
WARN = QColor("#dc2626")
BINDING_TEXT = {"budget": QT_TRANSLATE_NOOP("TokenGauge", "the KV budget binds"),
                "context": QT_TRANSLATE_NOOP("TokenGauge", "the model's context binds")}


class TokenGauge(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("tokenGauge")
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.room = TokenRoom(0, 0, "budget", 0, 0.0)
        self.tokens_evicted = 0
        self.reading = (0, 0, 0)            # retrieval: (blocks read, held) a token per layer, summary bytes
        self.on_disk = ()                   # retrieval past the budget: (blocks on disk, fetched, cache hits)
        self._update_tooltip()

    def sizeHint(self) -> QSize:
        return QSize(320, self._height())

    def minimumSizeHint(self) -> QSize:
        return QSize(160, self._height())

    def _height(self) -> int:
        """The bar and one line of text, or two while retrieval has a line of its own."""
        return 42 if not (self.reading[1] or self.reading[2] or self.on_disk) else 42 + self.fontMetrics().height()

    @property
    def windowed(self) -> bool:
        return self.room.binding == "window"

    @property
    def binding(self) -> str:
        return self.room.binding

    @property
    def fraction(self) -> float:
        return self.room.fraction

    def left_text(self) -> str:
        if self.windowed:
            return self.tr("window: bounded, never fills")
        if self.binding == "context":
            return self.tr("{n} left, context binds").format(n=f"{self.room.left:,}")
        return self.tr("{n} left, budget binds").format(n=f"{self.room.left:,}")

    def text(self) -> str:
        return "".join(self.lines())

    def lines(self) -> tuple[str, str]:
        """The gauge's two lines: what the cache holds, then what retrieval reads and fetches (empty without it)."""
        text = self.tr("{n} tokens in cache · {left}").format(n=f"{self.room.held:,}", left=self.left_text())
        if self.room.context_limit:
            text += self.tr(" · context {n}").format(n=f"{self.room.context_limit:,}")
        if self.tokens_evicted:
            text += self.tr(" · {n} evicted").format(n=f"{self.tokens_evicted:,}")
        detail = ""
        read, held, summaries = self.reading
        if held:
            detail += self.tr(" · reads {read} of {held} blocks a token").format(read=f"{read:,}", held=f"{held:,}")
        if summaries:
            detail += self.tr(" · summaries {size}").format(size=format_bytes(summaries))
        if self.on_disk:
            detail += self.tr(" · {n} on disk, {f} fetched, {h} hits").format(
                n=f"{self.on_disk[0]:,}", f=f"{self.on_disk[1]:,}", h=f"{self.on_disk[2]:,}")
        return text, detail

    def set_room(self, room: TokenRoom, evicted: int = 0, reading: tuple[int, int, int] = (0, 0, 0),
                 on_disk: tuple = ()) -> None:
        if (room, int(evicted), tuple(reading), tuple(on_disk)) != (self.room, self.tokens_evicted, self.reading,
                                                                    self.on_disk):
            two = self._height()
            self.room, self.tokens_evicted, self.reading, self.on_disk = room, int(evicted), tuple(reading), \
                tuple(on_disk)
            self._update_tooltip()
            if self._height() != two:
                self.updateGeometry()
            self.update()

    def _update_tooltip(self) -> None:
        room = self.room
        lines = [self.tr("Tokens in cache: {n}").format(n=f"{room.held:,}")]
        if self.windowed:
            lines.append(self.tr("Tokens left: unbounded (a sliding window keeps the cache at a fixed size)"))
            lines.append(self.tr("Budget blocks in use: {share}").format(share=f"{room.fraction:.1%}"))
        else:
            lines.append(self.tr("Tokens left: {n} ({binding})").format(n=f"{room.left:,}",
                                                                        binding=self.tr(BINDING_TEXT[room.binding])))
            lines.append((self.tr("Context used: {share}") if room.binding == "context" else
                          self.tr("Budget used: {share}")).format(share=f"{room.fraction:.1%}"))
        if room.context_limit:
            lines.append(self.tr("Model context: {n} tokens").format(n=f"{room.context_limit:,}"))
        lines.append(self.tr("Tokens evicted from the window: {n}").format(n=f"{self.tokens_evicted:,}"))
        read, held, summaries = self.reading
        if held:
            lines.append(self.tr("Blocks each new token read, per layer: {read} of {held} (the sinks, the newest, "
                                 "and those whose key summaries bound the highest score)").format(
                read=f"{read:,}", held=f"{held:,}"))
        if summaries:
            lines.append(self.tr("Key summaries (each block's per-channel min and max keys): {size}, in the "
                                 "budget").format(size=format_bytes(summaries)))
        if self.on_disk:
            lines.append(self.tr("Blocks on disk past the budget: {n}; read back from disk: {f}; found in the "
                                 "fetch cache: {h}").format(n=f"{self.on_disk[0]:,}", f=f"{self.on_disk[1]:,}",
                                                            h=f"{self.on_disk[2]:,}"))
        self.setToolTip("\n".join(lines))

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        bar = QRectF(0.5, 0.5, self.width() - 1.0, 16.0)
        track = QPainterPath()
        track.addRoundedRect(bar, 5, 5)
        painter.fillPath(track, LEFT)
        if self.fraction > 0:
            filled = QRectF(bar.x(), bar.y(), max(4.0, bar.width() * self.fraction), bar.height())
            path = QPainterPath()
            path.addRoundedRect(filled, 5, 5)
            painter.fillPath(path, WARN if self.fraction > 0.9 and not self.windowed else HELD)
        painter.setPen(self.palette().windowText().color())
        text_rect = QRectF(0, bar.bottom() + 4, self.width(), self.height() - bar.bottom() - 4)
        metrics = painter.fontMetrics()
        for line in self.lines():
            if line:
                text = metrics.elidedText(line.removeprefix(" · "), Qt.TextElideMode.ElideRight,
                                          int(text_rect.width()))
                painter.drawText(text_rect, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop, text)
                text_rect.adjust(0, metrics.height(), 0, 0)
        painter.end()
