"""The live KV memory dashboard: plot items are created once and fed with setData from a timer.

Painting is the dashboard's whole cost, and the GUI thread shares the CPU (and the GIL) with the
decoder, so: axes are cached as pixmaps, ranges move in 1-2-5 / 30 s steps so those caches stay
valid, and legends are plain labels outside the plots.
"""
from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, QTimer
from PySide6.QtGui import QCursor
from PySide6.QtWidgets import QGraphicsItem, QLabel, QToolTip, QVBoxLayout, QWidget

from .dashboard_data import DashboardData, layer_hover_text, nice_ceiling, series_hover_text, time_span_end
from .gauge import TokenGauge
from .messages import format_bytes

REDRAW_MS = 125                         # each panel at most 8 Hz
MIB = 1024.0 * 1024.0
LOG_FLOOR_MIB = 1e-3                    # a log axis cannot show 0; an empty cache sits on this floor (1 KiB)

# (K, V) colours per format family: K dark at the bottom of each bar, V light on top.
FORMAT_COLOURS = {"full": ("#2563eb", "#93c5fd"), "int8": ("#15803d", "#86efac"),
                  "fp8": ("#c2410c", "#fdba74"), "int4": ("#7e22ce", "#d8b4fe")}
MARKER_COLOURS = {"mode": "#7e22ce", "evict": "#c2410c", "reset": "#15803d", "load": "#64748b"}
MEMORY_SERIES = {"kv": ("KV held", "#2563eb", 2.5, Qt.PenStyle.SolidLine),
                 "budget": ("budget", "#dc2626", 1.5, Qt.PenStyle.DashLine),
                 "weights": ("weights", "#a16207", 1.5, Qt.PenStyle.DotLine),
                 "rss": ("process RSS", "#64748b", 1.5, Qt.PenStyle.SolidLine),
                 "torch": ("torch allocator", "#0d9488", 1.5, Qt.PenStyle.SolidLine),
                 "gpu": ("GPU (NVML)", "#ca8a04", 1.5, Qt.PenStyle.SolidLine)}
DECODE_COLOUR, PREFILL_COLOUR = "#2563eb", "#ea580c"


def format_family(name: str) -> str:
    return next((family for family in ("int8", "fp8", "int4") if name.startswith(family)), "full")


def byte_unit(max_bytes: float) -> tuple[str, float]:
    return ("MiB", MIB) if max_bytes >= MIB else ("KiB", 1024.0)


def _legend(entries: list[tuple[str, str]]) -> QLabel:
    html = "&nbsp;&nbsp;".join(f'<span style="color:{colour}">■</span>&nbsp;{text}' for text, colour in entries)
    label = QLabel(html, objectName="plotLegend")
    label.setTextFormat(Qt.TextFormat.RichText)
    label.setWordWrap(True)
    return label


class Dashboard(QWidget):
    PANELS = ("layers", "speed", "memory", "markers")   # "layers" also updates the gauge and summary
    def __init__(self, data: DashboardData | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("dashboard")
        self.data = data or DashboardData()
        self._drawn: dict[str, int] = {}
        self._next_panel = 0
        self._drawn_marks = 0
        self._markers: list[tuple[pg.PlotWidget, pg.InfiniteLine]] = []
        self._ranges: dict[str, tuple] = {}
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(4)
        self.summary = QLabel("Waiting for the model…", objectName="dashboardSummary")
        self.summary.setWordWrap(True)
        self.summary.setMinimumHeight(2 * self.summary.fontMetrics().lineSpacing() + 4)
        layout.addWidget(self.summary)
        layout.addWidget(self._section("Tokens in cache"))
        self.gauge = TokenGauge(self)
        layout.addWidget(self.gauge)
        self._build_layer_plot()
        self._build_speed_plot()
        self._build_memory_plot()
        for title, plot, legend in (
                ("KV bytes per layer", self.layer_plot, _legend(
                    [("full precision", FORMAT_COLOURS["full"][0]), ("int8", FORMAT_COLOURS["int8"][0]),
                     ("fp8", FORMAT_COLOURS["fp8"][0]), ("int4", FORMAT_COLOURS["int4"][0]),
                     ("K dark, V light; dashed: budget share", "#dc2626")])),
                ("Tokens per second", self.speed_plot, _legend([("decode (left axis)", DECODE_COLOUR),
                                                                ("prefill (right axis)", PREFILL_COLOUR)])),
                ("Memory (log scale)", self.memory_plot, _legend([(label, colour) for label, colour, _, _
                                                                 in MEMORY_SERIES.values()]))):
            layout.addWidget(self._section(title))
            layout.addWidget(plot, 1)
            layout.addWidget(legend)
        self.timer = QTimer(self, interval=REDRAW_MS // len(self.PANELS))
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    # --- construction: every item is made here, once ---

    @staticmethod
    def _section(text: str) -> QLabel:
        return QLabel(text, objectName="dashboardSection")

    @staticmethod
    def _plot() -> pg.PlotWidget:
        plot = pg.PlotWidget(background="w")
        plot.showGrid(x=True, y=True, alpha=0.15)
        plot.setMenuEnabled(False)
        plot.setMouseEnabled(x=False, y=False)
        plot.hideButtons()
        plot.enableAutoRange(False)
        plot.setMinimumHeight(130)
        for side in ("left", "bottom", "right"):
            axis = plot.getAxis(side)
            axis.setTextPen("#374151")
            axis.setPen("#9ca3af")
            axis.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
        return plot

    def _build_layer_plot(self) -> None:
        self.layer_plot = self._plot()
        self.layer_plot.setLabel("bottom", "layer")
        self.layer_plot.setLabel("left", "KiB")
        self.k_bars = pg.BarGraphItem(x=[], height=[], width=0.8, pen=None)
        self.v_bars = pg.BarGraphItem(x=[], height=[], y0=[], width=0.8, pen=None)
        self.layer_plot.addItem(self.k_bars)
        self.layer_plot.addItem(self.v_bars)
        self.budget_line = pg.InfiniteLine(angle=0, movable=False,
                                           pen=pg.mkPen("#dc2626", width=1, style=Qt.PenStyle.DashLine))
        self.budget_line.setVisible(False)
        self.layer_plot.addItem(self.budget_line, ignoreBounds=True)
        self.layer_plot.scene().sigMouseMoved.connect(self._hover_layers)

    def _build_speed_plot(self) -> None:
        self.speed_plot = self._plot()
        item = self.speed_plot.getPlotItem()
        self.speed_plot.setLabel("bottom", "time (s)")
        self.speed_plot.setLabel("left", "decode tok/s", color=DECODE_COLOUR)
        self.decode_curve = self.speed_plot.plot([], [], pen=pg.mkPen(DECODE_COLOUR, width=2))
        # prefill runs 10-50x faster than decode: it gets its own right-hand axis
        self.prefill_view = pg.ViewBox(enableMouse=False)
        self.prefill_view.enableAutoRange(False)
        item.showAxis("right")
        item.scene().addItem(self.prefill_view)
        item.getAxis("right").linkToView(self.prefill_view)
        item.getAxis("right").setLabel("prefill tok/s", color=PREFILL_COLOUR)
        self.prefill_view.setXLink(item)
        self.prefill_curve = pg.PlotDataItem([], [], pen=None, symbol="o", symbolSize=7,
                                             symbolBrush=PREFILL_COLOUR, symbolPen=None)
        self.prefill_view.addItem(self.prefill_curve)
        view = item.getViewBox()
        view.sigResized.connect(lambda: self.prefill_view.setGeometry(view.sceneBoundingRect()))
        self.speed_plot.scene().sigMouseMoved.connect(self._hover_speed)

    def _build_memory_plot(self) -> None:
        self.memory_plot = self._plot()
        self.memory_plot.setLabel("bottom", "time (s)")
        self.memory_plot.setLabel("left", "MiB")
        self.memory_plot.setLogMode(x=False, y=True)
        self.memory_curves = {name: self.memory_plot.plot([], [], pen=pg.mkPen(colour, width=width, style=style))
                              for name, (_, colour, width, style) in MEMORY_SERIES.items()}
        self.memory_plot.scene().sigMouseMoved.connect(self._hover_memory)

    # --- updates ---

    def _set_range(self, key: str, target, *limits) -> None:
        """setXRange/setYRange only when the stepped range moved, so cached axes stay valid."""
        if self._ranges.get(key) != limits:
            self._ranges[key] = limits
            target(*limits, padding=0)

    def redraw(self) -> None:
        """Bring every panel up to date now."""
        for panel in self.PANELS:
            self._draw_panel(panel)

    def _tick(self) -> None:
        """Timer tick: redraw the next stale panel only. Each panel then paints in an event of its
        own, which keeps every GUI event short while the decoder competes for the CPU."""
        for _ in range(len(self.PANELS)):
            panel = self.PANELS[self._next_panel]
            self._next_panel = (self._next_panel + 1) % len(self.PANELS)
            if self._drawn.get(panel) != self.data.version:
                self._draw_panel(panel)
                return

    def _draw_panel(self, panel: str) -> None:
        if self._drawn.get(panel) == self.data.version:
            return
        self._drawn[panel] = self.data.version
        snapshot = self.data.latest
        if panel == "markers":
            self._draw_markers()
        elif snapshot is None:
            return
        elif panel == "layers":
            self._draw_layers(snapshot)
            self._draw_summary(snapshot)
        else:
            times = np.fromiter(self.data.times, float)
            plot = self.speed_plot if panel == "speed" else self.memory_plot
            self._set_range(f"{panel}_x", plot.setXRange, 0.0, time_span_end(float(times[-1]) if len(times) else 0.0))
            self._draw_speed(times) if panel == "speed" else self._draw_memory(times)

    def _draw_speed(self, times: np.ndarray) -> None:
        decode = np.fromiter(self.data.series["decode"], float)
        self.decode_curve.setData(times, decode)
        self._set_range("decode_y", self.speed_plot.setYRange, 0.0, nice_ceiling(float(decode.max()) * 1.1))
        prefill = np.fromiter(self.data.series["prefill"], float)
        changed = np.r_[True, np.diff(prefill) != 0] & (prefill > 0)   # one dot per turn, not per snapshot
        self.prefill_curve.setData(times[changed], prefill[changed])
        self._set_range("prefill_y", self.prefill_view.setYRange, 0.0, nice_ceiling(float(prefill.max()) * 1.1))

    def _draw_summary(self, snapshot) -> None:
        blocks = snapshot.blocks_used / snapshot.blocks_budget if snapshot.blocks_budget else 0.0
        self.gauge.set_tokens(snapshot.tokens_held, snapshot.tokens_left, snapshot.tokens_evicted, blocks)
        self.summary.setText(
            f"<b>{snapshot.cache_label}</b> · KV {format_bytes(snapshot.kv_bytes)} of "
            f"{format_bytes(snapshot.budget_bytes)} budget ({snapshot.usage:.1%}) · "
            f"{snapshot.bytes_per_token:,.0f} B/token<br>decode {snapshot.decode_tok_s:.1f} tok/s · "
            f"prefill {snapshot.prefill_tok_s:.0f} tok/s · TTFT {snapshot.ttft_s * 1000:.0f} ms · "
            f"RSS {format_bytes(snapshot.memory.rss_bytes)}"
            + (f"<br>weights {format_bytes(snapshot.weight_bytes)} ({snapshot.weights_label}) beside KV "
               f"{format_bytes(snapshot.kv_bytes)}" if snapshot.weight_bytes else ""))

    def _draw_memory(self, times: np.ndarray) -> None:
        lowest, highest = math.inf, LOG_FLOOR_MIB
        for name, curve in self.memory_curves.items():
            values = np.maximum(np.fromiter(self.data.series[name], float) / MIB, LOG_FLOOR_MIB)
            if name in ("torch", "gpu", "weights") and not (values > LOG_FLOOR_MIB).any():
                curve.setData([], [])
                continue
            curve.setData(times, values)
            lowest, highest = min(lowest, float(values.min())), max(highest, float(values.max()))
        self._set_range("memory_y", self.memory_plot.setYRange,
                        math.floor(math.log10(lowest)), math.ceil(math.log10(highest) + 0.05))

    def _draw_layers(self, snapshot) -> None:
        layers = snapshot.layers
        if not layers:
            return
        budget_share = snapshot.budget_bytes / len(layers)
        biggest = max(layer.k_bytes + layer.v_bytes for layer in layers)
        unit, scale = byte_unit(biggest)
        x = np.array([layer.layer for layer in layers], float)
        k = np.array([layer.k_bytes for layer in layers], float) / scale
        v = np.array([layer.v_bytes for layer in layers], float) / scale
        k_brushes = [pg.mkBrush(FORMAT_COLOURS[format_family(layer.k_format)][0]) for layer in layers]
        v_brushes = [pg.mkBrush(FORMAT_COLOURS[format_family(layer.v_format)][1]) for layer in layers]
        self.k_bars.setOpts(x=x, height=k, width=0.8, brushes=k_brushes)
        self.v_bars.setOpts(x=x, height=v, y0=k, width=0.8, brushes=v_brushes)
        if self._ranges.get("layer_unit") != unit:
            self._ranges["layer_unit"] = unit
            self.layer_plot.setLabel("left", f"KV bytes ({unit})")
        # the budget line only shows when the bars come within reach of it; otherwise it would flatten them
        near = biggest > 0 and budget_share <= 4 * biggest
        self.budget_line.setVisible(near)
        self.budget_line.setValue(budget_share / scale)
        top = max(float((k + v).max()) * 1.05, budget_share / scale * 1.05 if near else 0.0)
        self._set_range("layer_x", self.layer_plot.setXRange, -0.6, len(layers) - 0.4)
        self._set_range("layer_y", self.layer_plot.setYRange, 0.0, nice_ceiling(top))

    def _draw_markers(self) -> None:
        if self.data.num_marks == self._drawn_marks:
            return
        for plot, line in self._markers:
            plot.removeItem(line)
        self._markers = []
        t_end = time_span_end(self.data.times[-1] if self.data.times else 0.0)
        for index, marker in enumerate(self.data.markers):
            colour = MARKER_COLOURS.get(marker.kind, "#64748b")
            corner = (1, 1) if marker.time_s > 0.7 * t_end else (0, 1)   # keep labels near the right edge inside
            for plot, labelled in ((self.memory_plot, True), (self.speed_plot, False)):
                line = pg.InfiniteLine(marker.time_s, angle=90, movable=False,
                                       pen=pg.mkPen(colour, width=1.5, style=Qt.PenStyle.DotLine),
                                       label=marker.label if labelled else None,
                                       labelOpts={"color": colour, "position": 0.08 + 0.16 * (index % 3), "anchors": [corner, corner],
                                                  "fill": (255, 255, 255, 200)})
                plot.addItem(line, ignoreBounds=True)
                self._markers.append((plot, line))
        self._drawn_marks = self.data.num_marks

    # --- hover read-outs: exact numbers ---

    def layer_hover_text(self, layer_index: int) -> str | None:
        return layer_hover_text(self.data.latest, layer_index)

    def series_hover_text(self, kind: str, t: float) -> str | None:
        return series_hover_text(self.data, kind, t)

    def _view_point(self, plot: pg.PlotWidget, scene_pos: QPointF) -> QPointF | None:
        view = plot.getPlotItem().getViewBox()
        if not view.sceneBoundingRect().contains(scene_pos):
            QToolTip.hideText()
            return None
        return view.mapSceneToView(scene_pos)

    def _show_tip(self, text: str | None) -> None:
        if text:
            QToolTip.showText(QCursor.pos(), text, self)

    def _hover_layers(self, scene_pos: QPointF) -> None:
        point = self._view_point(self.layer_plot, scene_pos)
        if point is not None and not math.isnan(point.x()):
            self._show_tip(self.layer_hover_text(int(round(point.x()))))

    def _hover_speed(self, scene_pos: QPointF) -> None:
        point = self._view_point(self.speed_plot, scene_pos)
        if point is not None:
            self._show_tip(self.series_hover_text("speed", point.x()))

    def _hover_memory(self, scene_pos: QPointF) -> None:
        point = self._view_point(self.memory_plot, scene_pos)
        if point is not None:
            self._show_tip(self.series_hover_text("memory", point.x()))
