"""The strip above the memory plot where mode switches, evictions, resets and loads are labelled.

Labels live here, not inside the plot, so they never cover a curve; neighbours that would touch
merge into one marker with a count, and hovering a marker lists what it holds.
"""
from __future__ import annotations

import math

from PySide6.QtCore import QEvent, QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from kvchat.app.dashboard.dashboard_data import Marker, MarkerCluster, cluster_markers

MARKER_COLOURS = {"mode": "#7e22ce", "evict": "#c2410c", "reset": "#15803d", "load": "#64748b", "restore": "#0369a1", "offload": "#a16207",
                  "mixed": "#334155"}
PAD_X = 4.0


class EventStrip(QWidget):
    def __init__(self, plot, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("eventStrip")
        self.plot = plot                # the pyqtgraph PlotWidget whose time axis this strip follows
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMouseTracking(True)
        self.markers: list[Marker] = []
        self.placed: list[tuple[MarkerCluster, float, float]] = []

    def sizeHint(self) -> QSize:
        return QSize(200, self.fontMetrics().height() + 6)

    def minimumSizeHint(self) -> QSize:
        return self.sizeHint()

    @property
    def clusters(self) -> list[MarkerCluster]:
        return [cluster for cluster, _, _ in self.placed]

    def _view_span(self) -> tuple[float, float, float, float]:
        """(left px, right px, t0, t1): where the plot's data area lies in this strip's coordinates."""
        view = self.plot.getPlotItem().getViewBox()
        rect = self.plot.mapFromScene(view.sceneBoundingRect()).boundingRect()
        left = self.mapFromGlobal(self.plot.mapToGlobal(rect.topLeft())).x()
        (t0, t1), _ = view.viewRange()
        return float(left), float(left + rect.width()), float(t0), float(t1)

    def x_of(self, t: float) -> float:
        left, right, t0, t1 = self._view_span()
        return left + (t - t0) / (t1 - t0) * (right - left) if t1 > t0 else left

    def set_markers(self, markers) -> None:
        self.markers = list(markers)
        self.relayout()

    def relayout(self) -> None:
        left, right, t0, t1 = self._view_span()
        metrics = self.fontMetrics()
        if t1 <= t0 or right <= left:
            self.placed = []
        else:
            self.placed = cluster_markers(
                self.markers, lambda t: left + (t - t0) / (t1 - t0) * (right - left),
                lambda text: metrics.horizontalAdvance(text) + 2 * PAD_X, right_px=float(self.width()))
        self.update()

    def label_rects(self) -> list[QRectF]:
        return [QRectF(x0, 1.0, x1 - x0, self.height() - 2.0) for _, x0, x1 in self.placed]

    def cluster_at(self, x: float) -> MarkerCluster | None:
        return next((cluster for cluster, x0, x1 in self.placed if x0 <= x <= x1), None)

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            cluster = self.cluster_at(event.pos().x())
            if cluster is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), cluster.tooltip(), self)
            return True
        return super().event(event)

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        for (cluster, x0, x1), rect in zip(self.placed, self.label_rects()):
            colour = QColor(MARKER_COLOURS.get(cluster.kind, "#334155"))
            fill = QColor(colour)
            fill.setAlpha(28)
            painter.setPen(QPen(colour, 1))
            painter.setBrush(fill)
            painter.drawRoundedRect(rect.adjusted(0.5, 0.5, -0.5, -0.5), 4, 4)
            x = self.x_of(cluster.time_s)
            if not math.isnan(x):          # a tick down to where the event happened on the time axis
                painter.drawLine(QPointF(x, rect.bottom() - 3), QPointF(x, self.height()))
            painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, cluster.label())
        painter.end()
