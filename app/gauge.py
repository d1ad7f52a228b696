"""A horizontal gauge: tokens the cache holds now against tokens that still fit in the budget."""
from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPainterPath
from PySide6.QtWidgets import QSizePolicy, QWidget

HELD = QColor("#2563eb")
LEFT = QColor("#e5e7eb")
WARN = QColor("#dc2626")


class TokenGauge(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("tokenGauge")
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.tokens_held = 0
        self.tokens_left = 0
        self.tokens_evicted = 0
        self.blocks_fraction = 0.0
        self._update_tooltip()

    def sizeHint(self) -> QSize:
        return QSize(320, 46)

    def minimumSizeHint(self) -> QSize:
        return QSize(160, 46)

    @property
    def windowed(self) -> bool:
        """The engine reports tokens_left < 0 when a sliding window keeps the cache bounded."""
        return self.tokens_left < 0

    @property
    def fraction(self) -> float:
        if self.windowed:
            return self.blocks_fraction
        total = self.tokens_held + self.tokens_left
        return self.tokens_held / total if total else 0.0

    def left_text(self) -> str:
        return "window: never fills" if self.windowed else f"{self.tokens_left:,} left before the budget is full"

    def text(self) -> str:
        text = f"{self.tokens_held:,} tokens in cache · {self.left_text()}"
        if self.tokens_evicted:
            text += f" · {self.tokens_evicted:,} evicted"
        return text

    def set_tokens(self, held: int, left: int, evicted: int = 0, blocks_fraction: float = 0.0) -> None:
        values = (int(held), int(left), int(evicted), float(blocks_fraction))
        if values != (self.tokens_held, self.tokens_left, self.tokens_evicted, self.blocks_fraction):
            self.tokens_held, self.tokens_left, self.tokens_evicted, self.blocks_fraction = values
            self._update_tooltip()
            self.update()

    def _update_tooltip(self) -> None:
        left = "unbounded (sliding window)" if self.windowed else f"{self.tokens_left:,}"
        self.setToolTip(f"Tokens in cache: {self.tokens_held:,}\nTokens left before the budget is full: {left}\n"
                        f"Tokens evicted from the window: {self.tokens_evicted:,}\nBudget used: {self.fraction:.2%}")

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        bar = QRectF(0.5, 0.5, self.width() - 1.0, 18.0)
        track = QPainterPath()
        track.addRoundedRect(bar, 5, 5)
        painter.fillPath(track, LEFT)
        if self.fraction > 0:
            filled = QRectF(bar.x(), bar.y(), max(4.0, bar.width() * self.fraction), bar.height())
            path = QPainterPath()
            path.addRoundedRect(filled, 5, 5)
            painter.fillPath(path, WARN if self.fraction > 0.9 else HELD)
        painter.setPen(self.palette().windowText().color())
        text_rect = QRectF(0, bar.bottom() + 4, self.width(), self.height() - bar.bottom() - 4)
        metrics = painter.fontMetrics()
        text = metrics.elidedText(self.text(), Qt.TextElideMode.ElideRight, int(text_rect.width()))
        painter.drawText(text_rect, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop, text)
        painter.end()
