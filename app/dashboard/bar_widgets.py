"""Small painted charts for the dashboard's Pool, Plan and Lengths tabs: bars that say their numbers on hover.

Each widget keeps its items as frozen rows, paints them in paintEvent, and answers `tip_at(point)`
with the hovered item's numbers (the ToolTip event calls it; tests call it directly).
"""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QEvent, QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetricsF, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from kvchat.engine.units import MIB

TEXT = QColor("#1f2937")
MUTED = QColor("#6b7280")
TRACK = QColor("#f1f5f9")
SELECTED = QColor("#0f172a")
# (K, V) colours per format family: K dark at the bottom of each bar, V light on top.
FORMAT_COLOURS = {"full": ("#2563eb", "#93c5fd"), "int8": ("#15803d", "#86efac"),
                  "fp8": ("#c2410c", "#fdba74"), "int4": ("#7e22ce", "#d8b4fe")}


def format_share(fraction: float) -> str:
    """Percentages that stay readable next to a large budget: 42%, 3.1%, 0.05%."""
    if fraction >= 0.1 or fraction == 0:
        return f"{fraction:.0%}"
    return f"{fraction:.1%}" if fraction >= 0.001 else f"{fraction:.2%}"


def format_family(name: str) -> str:
    return next((family for family in ("int8", "fp8", "int4") if name.startswith(family)), "full")


def format_mib(num_bytes: float) -> str:
    """Dashboard text speaks MiB throughout: 0.02 MiB, 2.74 MiB, 92.1 MiB, 1,024 MiB."""
    value = num_bytes / MIB
    return f"{value:,.0f} MiB" if value >= 100 else f"{value:.1f} MiB" if value >= 10 else f"{value:.2f} MiB"


class _Tipped(QWidget):
    """A widget whose tooltip depends on where the pointer is."""

    def tip_at(self, point: QPointF) -> str | None:
        raise NotImplementedError

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            tip = self.tip_at(QPointF(event.pos()))
            if tip:
                QToolTip.showText(event.globalPos(), tip, self)
            else:
                QToolTip.hideText()
                event.ignore()
            return True
        return super().event(event)


@dataclass(frozen=True, slots=True)
class Segment:
    label: str
    fraction: float                     # of the whole bar, 0.0-1.0
    colour: str
    tip: str


class StackedBar(_Tipped):
    """One bar split into segments (the pool: in use, reclaimable, free) with a legend under it that wraps."""

    BAR_H = 18

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.segments: tuple[Segment, ...] = ()
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self._fit()

    def sizeHint(self) -> QSize:
        return QSize(300, self.height())

    def set_segments(self, segments: list[Segment]) -> None:
        if tuple(segments) != self.segments:
            self.segments = tuple(segments)
            self._fit()
            self.update()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit()

    def _legend_items(self, width: float) -> list[QPointF]:
        """Top-left of each legend entry; an entry that does not fit starts a new line."""
        metrics = self.fontMetrics()
        x, y, places = 0.0, self.BAR_H + 4.0, []
        for segment in self.segments:
            w = 13 + metrics.horizontalAdvance(segment.label)
            if x > 0 and x + w > width:
                x, y = 0.0, y + metrics.lineSpacing() + 2
            places.append(QPointF(x, y))
            x += w + 12
        return places

    def _fit(self) -> None:
        places = self._legend_items(self.width())
        bottom = places[-1].y() if places else self.BAR_H + 4.0
        height = int(bottom + self.fontMetrics().lineSpacing() + 4)
        if height != self.height():
            self.setFixedHeight(height)

    def segment_rects(self) -> list[QRectF]:
        width, x, rects = self.width() - 1.0, 0.5, []
        for segment in self.segments:
            w = width * max(0.0, segment.fraction)
            if segment.fraction > 0:
                w = max(w, 3.0)         # anything held stays visible next to a large budget
            w = max(0.0, min(w, 0.5 + width - x))
            rects.append(QRectF(x, 0.5, w, self.BAR_H))
            x += w
        return rects

    def tip_at(self, point: QPointF) -> str | None:
        for segment, rect in zip(self.segments, self.segment_rects()):
            if rect.adjusted(-1, 0, 1, 0).contains(point):
                return segment.tip
        return None

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        painter.fillRect(QRectF(0.5, 0.5, self.width() - 1.0, self.BAR_H), TRACK)
        for segment, rect in zip(self.segments, self.segment_rects()):
            if rect.width() > 0:
                painter.fillRect(rect, QColor(segment.colour))
        metrics = painter.fontMetrics()
        painter.setPen(TEXT)
        for segment, place in zip(self.segments, self._legend_items(self.width())):
            painter.fillRect(QRectF(place.x(), place.y() + 3, 9, 9), QColor(segment.colour))
            painter.drawText(QPointF(place.x() + 13, place.y() + metrics.ascent()), segment.label)
        painter.end()


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    fraction: float                     # bar length, 0.0-1.0 of the row's track
    text: str                           # the number at the right of the bar
    colour: str
    tip: str
    bold: bool = False


class BarRows(_Tipped):
    """Horizontal bars, one labelled row each (conversations and their KV bytes)."""

    ROW_H = 20

    def __init__(self, empty_text: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.rows: tuple[Row, ...] = ()
        self.empty_text = empty_text
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self._fit()

    def sizeHint(self) -> QSize:
        return QSize(300, self.height())

    def _fit(self) -> None:
        self.setFixedHeight(max(1, len(self.rows)) * self.ROW_H + 4)

    def set_rows(self, rows: list[Row]) -> None:
        if tuple(rows) != self.rows:
            self.rows = tuple(rows)
            self._fit()
            self.update()

    def _columns(self) -> tuple[float, float, float]:
        """(label width, bar x, text width): the label takes about a third, the number its own width."""
        bold = QFont(self.font())
        bold.setBold(True)
        text_w = max([QFontMetricsF(bold if r.bold else self.font()).horizontalAdvance(r.text) for r in self.rows]
                     + [40.0]) + 8
        label_w = min(max(80.0, self.width() * 0.34), 220.0)
        return label_w, label_w + 6, float(text_w)

    def row_rect(self, index: int) -> QRectF:
        return QRectF(0, 2 + index * self.ROW_H, self.width(), self.ROW_H)

    def tip_at(self, point: QPointF) -> str | None:
        for i, row in enumerate(self.rows):
            if self.row_rect(i).contains(point):
                return row.tip
        return None

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        if not self.rows:
            painter.setPen(MUTED)
            painter.drawText(QRectF(0, 0, self.width(), self.ROW_H), Qt.AlignmentFlag.AlignVCenter, self.empty_text)
            painter.end()
            return
        label_w, bar_x, text_w = self._columns()
        track_w = max(10.0, self.width() - bar_x - text_w)
        plain, bold = painter.font(), QFont(painter.font())
        bold.setBold(True)
        for i, row in enumerate(self.rows):
            rect = self.row_rect(i)
            painter.setFont(bold if row.bold else plain)
            painter.setPen(TEXT)
            label = painter.fontMetrics().elidedText(row.label, Qt.TextElideMode.ElideRight, int(label_w))
            painter.drawText(QRectF(0, rect.y(), label_w, rect.height()), Qt.AlignmentFlag.AlignVCenter, label)
            bar = QRectF(bar_x, rect.y() + 4, track_w, rect.height() - 8)
            painter.fillRect(bar, TRACK)
            if row.fraction > 0:
                painter.fillRect(QRectF(bar.x(), bar.y(), max(2.0, track_w * min(1.0, row.fraction)), bar.height()),
                                 QColor(row.colour))
            painter.setPen(MUTED if not row.bold else TEXT)
            painter.drawText(QRectF(bar_x + track_w + 6, rect.y(), text_w, rect.height()),
                             Qt.AlignmentFlag.AlignVCenter, row.text)
        painter.end()


@dataclass(frozen=True, slots=True)
class Column:
    label: str                          # under the column
    values: tuple[float, ...]           # heights in chart units, drawn side by side
    colours: tuple[str, ...]
    tip: str
    top_text: str = ""                  # over the column
    marker: float | None = None         # a tick across the column (where the open conversation sits)
    selected: bool = False


@dataclass(frozen=True, slots=True)
class Line:
    value: float                        # in chart units
    colour: str
    label: str


class ColumnChart(_Tipped):
    """Vertical columns on a shared scale, with an optional horizontal line (the budget); click selects."""

    clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None, min_height: int = 120):
        super().__init__(parent)
        self.columns: tuple[Column, ...] = ()
        self.top = 1.0
        self.line: Line | None = None
        self.setMinimumHeight(min_height)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def sizeHint(self) -> QSize:
        return QSize(300, self.minimumHeight())

    def set_data(self, columns: list[Column], top: float, line: Line | None = None) -> None:
        state = (tuple(columns), float(top), line)
        if state != (self.columns, self.top, self.line):
            self.columns, self.top, self.line = state
            self.update()

    def _plot_rect(self) -> QRectF:
        line_h = self.fontMetrics().lineSpacing()
        return QRectF(4, line_h + 6, self.width() - 8, self.height() - 2 * line_h - 12)

    def column_rect(self, index: int) -> QRectF:
        plot = self._plot_rect()
        slot = plot.width() / max(1, len(self.columns))
        return QRectF(plot.x() + index * slot, 0, slot, self.height())

    def y_of(self, value: float) -> float:
        plot = self._plot_rect()
        return plot.bottom() - plot.height() * min(1.0, max(0.0, value / self.top if self.top else 0.0))

    def column_at(self, point: QPointF) -> int | None:
        for i in range(len(self.columns)):
            if self.column_rect(i).contains(point):
                return i
        return None

    def tip_at(self, point: QPointF) -> str | None:
        i = self.column_at(point)
        if i is None:
            return None
        tip = self.columns[i].tip
        if self.line is not None:
            tip += f"\n{self.line.label}"
        return tip

    def mousePressEvent(self, event) -> None:
        i = self.column_at(QPointF(event.position()))
        if i is not None:
            self.clicked.emit(i)
        super().mousePressEvent(event)

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        metrics = painter.fontMetrics()
        plot = self._plot_rect()
        painter.setPen(QPen(QColor("#cbd5e1"), 1))
        painter.drawLine(QPointF(plot.left(), plot.bottom() + 0.5), QPointF(plot.right(), plot.bottom() + 0.5))
        for i, column in enumerate(self.columns):
            slot = self.column_rect(i)
            inner = slot.adjusted(slot.width() * 0.14, 0, -slot.width() * 0.14, 0)
            if column.selected:
                painter.fillRect(QRectF(slot.x() + 1, plot.top() - 2, slot.width() - 2, plot.height() + 2),
                                 QColor("#e0e7ff"))
            width = inner.width() / max(1, len(column.values))
            for j, (value, colour) in enumerate(zip(column.values, column.colours)):
                y = self.y_of(value)
                if value > 0:
                    painter.fillRect(QRectF(inner.x() + j * width, min(y, plot.bottom() - 1), width - 1,
                                            max(1.0, plot.bottom() - y)), QColor(colour))
            if column.marker is not None:
                y = self.y_of(column.marker)
                painter.setPen(QPen(SELECTED, 2))
                painter.drawLine(QPointF(inner.left() - 3, y), QPointF(inner.right() + 3, y))
            painter.setPen(TEXT)
            top = self.y_of(max(column.values, default=0.0))
            if column.top_text:
                text = metrics.elidedText(column.top_text, Qt.TextElideMode.ElideRight, int(slot.width()))
                painter.drawText(QRectF(slot.x(), top - metrics.lineSpacing() - 2, slot.width(), metrics.lineSpacing()),
                                 Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignBottom, text)
            font = painter.font()
            font.setBold(column.selected)
            painter.setFont(font)
            label = painter.fontMetrics().elidedText(column.label, Qt.TextElideMode.ElideRight, int(slot.width()))
            painter.drawText(QRectF(slot.x(), plot.bottom() + 4, slot.width(), metrics.lineSpacing() + 2),
                             Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop, label)
            font.setBold(False)
            painter.setFont(font)
        if self.line is not None:
            colour = QColor(self.line.colour)
            painter.setPen(colour)
            if self.line.value <= self.top:
                y = self.y_of(self.line.value)
                painter.setPen(QPen(colour, 1, Qt.PenStyle.DashLine))
                painter.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
                painter.setPen(colour)
                painter.drawText(QRectF(plot.left(), y - metrics.lineSpacing() - 1, plot.width(), metrics.lineSpacing()),
                                 Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignBottom, self.line.label)
            else:
                painter.drawText(QRectF(plot.left(), 0, plot.width(), metrics.lineSpacing() + 2),
                                 Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignTop,
                                 self.tr("{label} ↑ (above)").format(label=self.line.label))
        painter.end()
