"""One heat map of the Attention page: rows (layers, or one layer's heads) across the conversation's columns, with
the message boundaries, the sinks and the window's edge drawn over it.

Every item is made once and updated (setImage, setData, setPos), so a 30,000-token chat redraws as cheaply as a short
one; the pointer's row and column go out as signals, the page says what is there.
"""
from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QSize, Qt, Signal
from PySide6.QtGui import QFont

from kvchat.app.dashboard.experts_view import centre_ticks

ROW_PX, MAX_ROW_PX, AXIS_PX = 7, 28, 44     # a row: readable at 48 layers, not a slab at 4
MIN_HEIGHT, MAX_MIN_HEIGHT = 110, 340
LABEL_ROW_PX = 10                       # a row this tall has room for its "no attention" label
LABELLED_MIN_HEIGHT = 480               # rows of linear layers get this much room to carry their label
BOUNDARY_PEN = pg.mkPen((15, 23, 42, 150), width=1)
WINDOW_PEN = pg.mkPen((37, 99, 235), width=2, style=Qt.PenStyle.DashLine)
SINKS_PEN = pg.mkPen((37, 99, 235), width=2)


class HeatMap(pg.PlotWidget):
    hovered = Signal(int, int)          # row, column under the pointer; (-1, -1) off the map
    clicked = Signal(int, int)

    def __init__(self, row_name: str, parent=None):
        super().__init__(parent, background="w")
        self.images_set = 0             # setImage calls: a hover never draws
        self.num_rows = self.num_columns = 0
        self._row_labels: list[pg.TextItem] = []
        self._empty: tuple[list[int], str] = ([], "")
        self._small = QFont()
        self._small.setPointSizeF(7.0)
        self.setMenuEnabled(False)
        self.setMouseEnabled(x=False, y=False)
        self.hideButtons()
        self.enableAutoRange(False)
        self.invertY(True)              # row 0 on top, as in a table
        self.setMinimumHeight(MIN_HEIGHT)
        self.getPlotItem().layout.setContentsMargins(2, 4, 8, 2)
        self.getViewBox().setBorder(pg.mkPen("#cbd5e1"))
        for side in ("left", "bottom"):
            axis = self.getAxis(side)
            axis.setTextPen("#374151")
            axis.setPen("#9ca3af")
        self.getAxis("left").setStyle(hideOverlappingLabels=False)
        self.setLabel("left", row_name, color="#374151")
        self.image = pg.ImageItem(axisOrder="row-major")
        self.addItem(self.image)
        self.boundaries = pg.PlotDataItem(pen=BOUNDARY_PEN, connect="pairs")
        self.addItem(self.boundaries)
        self.sinks = pg.PlotDataItem(pen=SINKS_PEN)
        self.addItem(self.sinks)
        self.window_edge = pg.InfiniteLine(angle=90, pen=WINDOW_PEN, movable=False)
        self.addItem(self.window_edge)
        self.window_label = pg.TextItem("", color=(37, 99, 235), anchor=(0, 0), fill=(255, 255, 255, 210))
        self.addItem(self.window_label)
        self.scene().sigMouseMoved.connect(self._moved)
        self.scene().sigMouseClicked.connect(self._clicked)
        self.clear_map()

    def sizeHint(self) -> QSize:
        return QSize(300, MIN_HEIGHT)

    def clear_map(self) -> None:
        self.image.clear()
        self.num_rows = self.num_columns = 0
        for item in (self.boundaries, self.sinks):
            item.setData([], [])
        self.window_edge.setVisible(False)
        self.window_label.setVisible(False)
        self._empty = ([], "")
        for label in self._row_labels:
            label.setVisible(False)

    def show_map(self, rgba: np.ndarray, per: int, num_columns: int, boundaries: list[float],
                 sinks_end: float | None, window_start: float | None, window_text: str,
                 empty_rows: list[int], empty_text: str, x_ticks: list[tuple[float, str]]) -> None:
        """rgba: [rows, drawn columns, 4], each drawn column `per` of the map's num_columns columns; boundaries,
        sinks_end and window_start in map columns; empty_rows get `empty_text` written across them."""
        rows = rgba.shape[0]
        self.num_rows, self.num_columns = rows, num_columns
        self.image.setImage(rgba, levels=None, autoLevels=False)
        self.images_set += 1
        self.image.setRect(0, 0, rgba.shape[1] * per, rows)
        xs = np.repeat(np.asarray(boundaries, float), 2)
        ys = np.tile([0.0, float(rows)], len(boundaries))
        self.boundaries.setData(xs, ys)
        if sinks_end is not None:       # a bracket under the sink columns, along the top
            self.sinks.setData([0.0, 0.0, sinks_end, sinks_end], [rows, 0.0, 0.0, rows])
        else:
            self.sinks.setData([], [])
        self.window_edge.setVisible(window_start is not None)
        self.window_label.setVisible(window_start is not None)
        if window_start is not None:
            self.window_edge.setPos(window_start)
            self.window_label.setText(window_text)
            self.window_label.setPos(window_start, 0)
        self.getAxis("bottom").setTicks([x_ticks])
        self.getAxis("left").setTicks([centre_ticks(rows)])
        self.setXRange(0, num_columns, padding=0)
        self.setYRange(0, rows, padding=0)
        row_px = LABEL_ROW_PX if empty_rows else ROW_PX
        self.setMinimumHeight(min(LABELLED_MIN_HEIGHT if empty_rows else MAX_MIN_HEIGHT,
                                  max(MIN_HEIGHT, row_px * rows + AXIS_PX)))
        self.setMaximumHeight(max(MIN_HEIGHT, MAX_ROW_PX * rows + AXIS_PX))
        self._empty = (empty_rows, empty_text)
        self._label_rows()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if getattr(self, "num_rows", 0):      # pyqtgraph resizes before __init__ is done
            self._label_rows()

    def _label_rows(self) -> None:
        """The empty rows' text (linear-attention layers) across each of them, where a row is tall enough to read it."""
        rows, text = self._empty
        num_columns = self.num_columns
        tall = self.getViewBox().height() >= LABEL_ROW_PX * max(1, self.num_rows)
        while len(self._row_labels) < len(rows):
            label = pg.TextItem("", color=(71, 85, 105), anchor=(0.5, 0.5))
            label.setFont(self._small)
            self.addItem(label)
            self._row_labels.append(label)
        for i, label in enumerate(self._row_labels):
            shown = i < len(rows) and tall
            label.setVisible(shown)
            if shown:
                label.setText(text)
                label.setPos(num_columns / 2, rows[i] + 0.5)

    def cell_at(self, scene_pos: QPointF) -> tuple[int, int]:
        view = self.getViewBox()
        if not self.num_rows or not view.sceneBoundingRect().contains(scene_pos):
            return -1, -1
        point = view.mapSceneToView(scene_pos)
        row, column = math.floor(point.y()), math.floor(point.x())
        if not (0 <= row < self.num_rows and 0 <= column < self.num_columns):
            return -1, -1
        return row, column

    def _moved(self, scene_pos: QPointF) -> None:
        self.hovered.emit(*self.cell_at(scene_pos))

    def _clicked(self, event) -> None:
        if event.button() == Qt.MouseButton.LeftButton:
            row, column = self.cell_at(event.scenePos())
            if row >= 0:
                self.clicked.emit(row, column)
