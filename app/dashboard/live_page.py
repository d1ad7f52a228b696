"""Past 450 lines on purpose: one page's construction, drawing and hover read-outs share every plot item and legend.

The Live page: the KV bytes per layer, speed and memory of the loaded model, plot items created once and fed
with setData by the dock's redraw clock.

Painting is the dashboard's whole cost, and the GUI thread shares the CPU (and the GIL) with the decoder, so: axes are
cached as pixmaps, ranges move in 1-2-5 / 30 s steps so those caches stay valid, and legends are plain labels outside
the plots. Units sit in the section titles, so no axis label competes with a legend for room. Its text keeps the
"Dashboard" translation context it had when the dock drew it.
"""
from __future__ import annotations

import html
import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QEvent, QPointF, QSize, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QCursor, QTextDocument
from PySide6.QtWidgets import (QBoxLayout, QFrame, QGraphicsItem, QHBoxLayout, QLabel, QScrollArea, QSizePolicy,
                               QToolButton, QToolTip, QVBoxLayout, QWidget)

from kvchat.engine.units import MIB

from kvchat.app.dashboard.bar_widgets import FORMAT_COLOURS, format_family, format_mib
from kvchat.app.dashboard.dashboard_data import (DashboardData, attention_layers, byte_unit, full_precision_layer_bytes,
                                                 is_hybrid, layer_budget_share, layer_hover_text,
                                                 layer_kinds, nice_ceiling, series_hover_text, shared_layers,
                                                 state_layers, time_span_end, token_room)
from kvchat.app.dashboard.event_strip import MARKER_COLOURS, EventStrip
from kvchat.app.dashboard.gauge import TokenGauge
from kvchat.app.dashboard.quality_view import QualityRow
from kvchat.app.dashboard.registry import Page, register
from kvchat.app.dashboard.server_panel import ServerPanel, unavailable_remote
from kvchat.app.i18n import label_text, weights_text

translate = QCoreApplication.translate

LOG_FLOOR_MIB = 1e-3                    # a log axis cannot show 0; an empty cache sits on this floor (1 KiB)
PLOT_MIN_HEIGHT = 92

FORMAT_NAMES = {"full": QT_TRANSLATE_NOOP("Dashboard", "full precision"), "int8": "int8", "fp8": "fp8", "int4": "int4"}
OUTLINE_COLOUR = "#475569"
MEMORY_SERIES = {"budget": (QT_TRANSLATE_NOOP("Dashboard", "budget"), "#dc2626", 1.5, Qt.PenStyle.DashLine),
                 "weights": (QT_TRANSLATE_NOOP("Dashboard", "weights"), "#a16207", 1.5, Qt.PenStyle.DotLine),
                 "rss": (QT_TRANSLATE_NOOP("Dashboard", "process RSS"), "#64748b", 1.5, Qt.PenStyle.SolidLine),
                 "torch": (QT_TRANSLATE_NOOP("Dashboard", "torch allocator"), "#0d9488", 1.5, Qt.PenStyle.SolidLine),
                 "gpu": ("GPU (NVML)", "#ca8a04", 1.5, Qt.PenStyle.SolidLine),
                 "kv": (QT_TRANSLATE_NOOP("Dashboard", "KV held"), "#2563eb", 2.5, Qt.PenStyle.SolidLine)}  # last: on top
OPTIONAL_SERIES = ("weights", "torch", "gpu")   # shown only when this machine reports them
DECODE_COLOUR, PREFILL_COLOUR = "#2563eb", "#ea580c"
WINDOW_COLOUR = "#7c3aed"               # sliding layers: their legend entry and the line where the window is full
STATE_COLOUR = "#db2777"                # linear-attention layers' recurrent state: no format's colour, it has none
SHARED_COLOUR = "#0891b2"               # a layer reading an earlier layer's K and V: an empty box, it holds no bytes
SHARED_MARK = 0.04                      # that box's height, of the y-axis top: seen, but not read as bytes
TITLE_PADDING = 4                       # a section title's room beside its text
NOISE_SHARE = 0.05                      # a time saved or cost within this share of decode time is not a gain shown
SPECULATION_TIP = QT_TRANSLATE_NOOP(
    "Dashboard", "Speculative decoding: a cheap guess proposes the next tokens and one step of the model checks them "
    "all.\n• accepted: the share of the guessed tokens the model kept (it would have written them itself).\n"
    "• tokens/step: the tokens each step of the model produced (1.0 without drafts). More is not faster by itself: "
    "a step that checks drafts takes longer than a plain one.\n• saved / cost: the time this reply's steps took "
    "against plain steps for the same tokens, at the time a plain step was measured to take here; “no gain "
    "measured” when the difference is under 5% or a plain step was not timed yet.")



class _PlotWidget(pg.PlotWidget):
    """A plot that asks for little, so the scroll area gives it what the dock has instead of scrolling."""

    def sizeHint(self) -> QSize:
        return QSize(300, PLOT_MIN_HEIGHT)


def legend_html(entries: list[tuple[str, str] | tuple[str, str, str]]) -> str:
    """(text, colour) entries after a ■ in that colour; a third field is another glyph (□: an empty box)."""
    return "&nbsp;&nbsp; ".join(f'<span style="color:{entry[1]}">{entry[2] if len(entry) > 2 else "■"}</span>'
                                f'&nbsp;{html.escape(entry[0])}' for entry in entries)


def shared_legend(shared) -> str:
    """"18 sharing the KV of layers 22, 23: no bytes of their own" (Gemma 4's last layers)."""
    sources = sorted({layer.kv_source for layer in shared})
    if len(sources) == 1:
        return translate("Dashboard", "{n} sharing layer {source}'s KV: no bytes of their own").format(
            n=len(shared), source=sources[0])
    return translate("Dashboard", "{n} sharing the KV of layers {sources}: no bytes of their own").format(
        n=len(shared), sources=", ".join(map(str, sources)))


class LivePage(QScrollArea):
    """The page of the running model; it scrolls itself, so its headers measure the room its viewport leaves."""

    PANELS = ("layers", "speed", "memory", "markers")   # "layers" also updates the gauge and summary
    markers_stale = Signal()            # the memory plot's x range or size moved: its marker lines are drawn again

    def __init__(self, data: DashboardData, parent: QWidget | None = None):
        super().__init__(parent, objectName="dashboardScroll")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.data = data
        self.remote_url = ""            # set while the engine is a remote server
        self.reading = ""               # what the engine does before a turn's first token, shown in place of "idle"
        self._drawn_marks = 0
        self._marker_lines: list[tuple[pg.PlotWidget, pg.InfiniteLine]] = []
        self._ranges: dict[str, tuple] = {}
        self.legends: dict[str, QLabel] = {}
        self._header_rows: dict[str, QHBoxLayout] = {}
        self.sections: dict[str, QLabel] = {}
        body = QWidget(objectName="dashboardBody")
        self.setWidget(body)
        self.viewport().installEventFilter(self)
        layout = QVBoxLayout(body)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(3)

        self.summary = QLabel(translate("Dashboard", "Waiting for the model…"), objectName="dashboardSummary")
        self.summary.setWordWrap(True)
        self.summary.setMinimumHeight(2 * self.summary.fontMetrics().lineSpacing() + 4)
        layout.addWidget(self.summary)
        layout.addWidget(self._build_notice())
        self.quality_row = QualityRow()
        layout.addWidget(self.quality_row)
        self.prompt_note = QLabel(objectName="promptPrecision")      # said only when prompts are not read exactly
        self.prompt_note.setWordWrap(True)
        self.prompt_note.setVisible(False)
        layout.addWidget(self.prompt_note)
        self.server_panel = ServerPanel()
        self.server_panel.setVisible(False)
        layout.addWidget(self.server_panel)
        layout.addLayout(self._header("tokens", translate("Dashboard", "Tokens in cache")))
        self.gauge = TokenGauge(self)
        layout.addWidget(self.gauge)
        self._build_layer_plot()
        self._build_speed_plot()
        self._build_memory_plot()
        layout.addLayout(self._header("layers", translate("Dashboard", "KV bytes per layer ({unit})").format(unit="KiB")))
        layout.addWidget(self.layer_plot, 1)
        self.layers_unavailable = QLabel(translate("Dashboard", "Per-layer K and V bytes: {unavailable} (the server holds the "
                                                 "cache; its KV usage is in the Server section).").format(
                                                     unavailable=unavailable_remote()), objectName="layersUnavailable")
        self.layers_unavailable.setWordWrap(True)
        self.layers_unavailable.setVisible(False)
        layout.addWidget(self.layers_unavailable)
        layout.addLayout(self._header("speed", translate("Dashboard", "Tokens per second · time in s")))
        layout.addWidget(self.speed_plot, 1)
        layout.addLayout(self._header("memory", translate("Dashboard", "Memory in MiB (log scale) · time in s")))
        self.event_strip = EventStrip(self.memory_plot)
        layout.addWidget(self.event_strip)
        layout.addWidget(self.memory_plot, 1)
        self.legends["speed"].setText(legend_html([(translate("Dashboard", "decode (left)"), DECODE_COLOUR),
                                                   (translate("Dashboard", "prefill (right)"), PREFILL_COLOUR)]))

    def set_remote(self, url: str, model: str = "") -> None:
        """A remote server (url) or this computer (""): what only a local cache can show says it is unavailable."""
        self.remote_url = url
        remote = bool(url)
        if remote:
            self.server_panel.set_server(url, model)
        self.server_panel.setVisible(remote)
        for widget in (self.sections["tokens"], self.gauge, self.sections["layers"], self.legends["layers"],
                       self.layer_plot):
            widget.setVisible(not remote)
        self.layers_unavailable.setVisible(remote)
        if remote:
            self.quality_row.state = "remote"
            self.quality_row.label.setText(translate("Dashboard", "Quality of the cache mode (Measure): {unavailable}.").format(
                unavailable=unavailable_remote()))
            self.quality_row.button.setVisible(False)

    def draw(self, panel: str) -> None:
        """Draw one of PANELS from the latest snapshot; the dock's clock says which and when."""
        snapshot = self.data.latest
        if panel == "markers":
            self._draw_markers()
        elif snapshot is None:
            return
        elif panel == "layers" and self.remote_url:
            self.server_panel.show_stats(snapshot)
            self._draw_remote_summary(snapshot)
        elif panel == "layers":
            self._draw_layers(snapshot)
            self._draw_summary(snapshot)
        else:
            times = np.fromiter(self.data.times, float)
            plot = self.speed_plot if panel == "speed" else self.memory_plot
            self._set_range(f"{panel}_x", plot.setXRange, 0.0, time_span_end(float(times[-1]) if len(times) else 0.0))
            self._draw_speed(times) if panel == "speed" else self._draw_memory(times)

    def _markers_moved(self, *_args) -> None:
        self._drawn_marks = -1
        self.markers_stale.emit()

    # --- construction: every item is made here, once ---

    def _header(self, key: str, title: str) -> QHBoxLayout:
        """A section title with its legend to the right, or under it when the two do not fit on one line."""
        row = QHBoxLayout()
        self._header_rows[key] = row
        row.setSpacing(10)
        self.sections[key] = QLabel(title, objectName="dashboardSection")
        self.sections[key].installEventFilter(self)      # its font from the style sheet: measured again
        row.addWidget(self.sections[key], 0, Qt.AlignmentFlag.AlignTop)
        if key != "tokens":
            legend = QLabel("", objectName="plotLegend")
            legend.setTextFormat(Qt.TextFormat.RichText)
            legend.setWordWrap(True)
            legend.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            legend.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
            self.legends[key] = legend
            row.addWidget(legend, 1)
        else:
            row.addStretch(1)
        return row

    def _build_notice(self) -> QWidget:
        self.notice = QWidget(objectName="dashboardNotice")
        row = QHBoxLayout(self.notice)
        row.setContentsMargins(6, 3, 3, 3)
        self.notice_label = QLabel("", objectName="dashboardNoticeText")
        self.notice_label.setWordWrap(True)
        self.notice_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QToolButton(objectName="dashboardNoticeClose", text="×", autoRaise=True)
        close.setToolTip(translate("Dashboard", "Dismiss"))
        close.clicked.connect(self.hide_notice)
        row.addWidget(self.notice_label, 1)
        row.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.notice.setStyleSheet("#dashboardNotice { background: #f1f5f9; border: 1px solid #cbd5e1; border-radius: 4px; }"
                                  "#dashboardNotice[error=\"true\"] { background: #fef2f2; border-color: #fca5a5; }")
        self.notice.setVisible(False)
        return self.notice

    def show_notice(self, text: str, error: bool = False) -> None:
        """A message that stays in the dashboard until the next one or until dismissed."""
        self.notice_label.setText(text)
        self.notice.setProperty("error", error)
        self.notice.style().unpolish(self.notice)
        self.notice.style().polish(self.notice)
        self.notice.setVisible(True)

    def set_reading(self, text: str) -> None:
        """A turn reads a long prompt, or a chat into an empty cache, first: say so in the summary until its first
        token."""
        self.reading = text
        if self.data.latest is None:
            self.summary.setText(text)
        self.data.version += 1          # the summary is drawn again with it

    def turn_ended(self) -> None:
        """A reply ended or failed: nothing is read any more, and its rates are the last reply's, not live ones."""
        self.reading = ""
        self.data.idle()

    def show_load_failed(self, title: str, message: str) -> None:
        """A refused load: the summary says so, not the last load step it reached."""
        self.summary.setText(translate("Dashboard", "<b>{title}</b>: {message}").format(title=html.escape(title),
                                                                        message=html.escape(message)))

    def hide_notice(self) -> None:
        self.notice.setVisible(False)

    @staticmethod
    def _plot() -> pg.PlotWidget:
        plot = _PlotWidget(background="w")
        plot.showGrid(x=True, y=True, alpha=0.15)
        plot.setMenuEnabled(False)
        plot.setMouseEnabled(x=False, y=False)
        plot.hideButtons()
        plot.enableAutoRange(False)
        plot.setMinimumHeight(PLOT_MIN_HEIGHT)
        plot.getPlotItem().layout.setContentsMargins(2, 4, 2, 2)
        for side in ("left", "bottom", "right"):
            axis = plot.getAxis(side)
            axis.setTextPen("#374151")
            axis.setPen("#9ca3af")
            axis.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
        return plot

    def _build_layer_plot(self) -> None:
        self.layer_plot = self._plot()
        # the full-precision size of each layer, outlined behind its bar: quantized bars sit inside it
        self.full_bars = pg.BarGraphItem(x=[], height=[], width=0.9, brush=None,
                                         pen=pg.mkPen(OUTLINE_COLOUR, width=1, style=Qt.PenStyle.DashLine))
        self.k_bars = pg.BarGraphItem(x=[], height=[], width=0.7, pen=None)
        self.v_bars = pg.BarGraphItem(x=[], height=[], y0=[], width=0.7, pen=None)
        # a linear-attention layer's recurrent state: one bar of constant height where K and V would be
        self.state_bars = pg.BarGraphItem(x=[], height=[], width=0.7, pen=None, brush=QBrush(QColor(STATE_COLOUR)))
        # a layer that reads an earlier layer's K and V: an empty box at the foot of its slot, no bar of bytes
        self.shared_bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush=None,
                                           pen=pg.mkPen(SHARED_COLOUR, width=1.5))
        for item in (self.full_bars, self.k_bars, self.v_bars, self.state_bars, self.shared_bars):
            self.layer_plot.addItem(item)
        # a sliding layer's bar is hatched, and a line across it marks what it holds once its window is full
        self.window_ticks = pg.PlotDataItem([], [], connect="pairs", pen=pg.mkPen(WINDOW_COLOUR, width=2))
        self.window_ticks.setZValue(5)
        self.layer_plot.addItem(self.window_ticks)
        self.budget_line = pg.InfiniteLine(angle=0, movable=False,
                                           pen=pg.mkPen("#dc2626", width=1, style=Qt.PenStyle.DashLine))
        self.budget_line.setVisible(False)
        self.layer_plot.addItem(self.budget_line, ignoreBounds=True)
        self.layer_plot.scene().sigMouseMoved.connect(self._hover_layers)

    def _build_speed_plot(self) -> None:
        self.speed_plot = self._plot()
        item = self.speed_plot.getPlotItem()
        self.speed_plot.setLabel("left", translate("Dashboard", "decode tok/s"), color=DECODE_COLOUR)
        # gaps (NaN) are idle time: the line breaks instead of holding the last rate
        self.decode_curve = self.speed_plot.plot([], [], pen=pg.mkPen(DECODE_COLOUR, width=2), connect="finite")
        self.decode_curve.setZValue(10)
        # prefill runs 10-50x faster than decode: it gets its own right-hand axis
        self.prefill_view = pg.ViewBox(enableMouse=False)
        self.prefill_view.enableAutoRange(False)
        item.showAxis("right")
        item.scene().addItem(self.prefill_view)
        item.getAxis("right").linkToView(self.prefill_view)
        item.getAxis("right").setLabel(translate("Dashboard", "prefill tok/s"), color=PREFILL_COLOUR)
        self.prefill_view.setXLink(item)
        self.prefill_curve = pg.PlotDataItem([], [], pen=None, symbol="o", symbolSize=7,
                                             symbolBrush=PREFILL_COLOUR, symbolPen=None)
        self.prefill_view.addItem(self.prefill_curve)
        view = item.getViewBox()
        view.sigResized.connect(lambda: self.prefill_view.setGeometry(view.sceneBoundingRect()))
        self.speed_plot.scene().sigMouseMoved.connect(self._hover_speed)

    def _build_memory_plot(self) -> None:
        self.memory_plot = self._plot()
        self.memory_plot.setLogMode(x=False, y=True)
        self.memory_curves = {}
        for z, (name, (_, colour, width, style)) in enumerate(MEMORY_SERIES.items()):
            curve = self.memory_plot.plot([], [], pen=pg.mkPen(colour, width=width, style=style))
            curve.setZValue(10 + z)     # the KV-held line comes last: on top of every other curve and marker
            self.memory_curves[name] = curve
        view = self.memory_plot.getPlotItem().getViewBox()
        view.sigXRangeChanged.connect(self._markers_moved)
        view.sigResized.connect(self._markers_moved)
        self.memory_plot.scene().sigMouseMoved.connect(self._hover_memory)

    # --- updates ---

    def _set_range(self, key: str, target, *limits) -> None:
        """setXRange/setYRange only when the stepped range moved, so cached axes stay valid."""
        if self._ranges.get(key) != limits:
            self._ranges[key] = limits
            target(*limits, padding=0)

    def _set_legend(self, key: str, entries: list[tuple[str, str]]) -> None:
        text = legend_html(entries)
        if self.legends[key].text() != text:
            self.legends[key].setText(text)
            self._arrange_header(key)

    def _arrange_header(self, key: str) -> None:
        """A legend beside a title wraps into a narrow column of many lines: below the title it takes one or two."""
        legend, title = self.legends[key], self.sections[key]
        document = QTextDocument()
        document.setDefaultFont(legend.font())
        document.setHtml(legend.text())
        room = self.viewport().width() - 16
        # a title wider than a narrow dock wraps rather than be cut off (measured on one line: a wrapping label's
        # size hint is not its one-line width)
        wrap = title.fontMetrics().horizontalAdvance(title.text()) + 2 * TITLE_PADDING > room
        if title.wordWrap() != wrap:
            title.setWordWrap(wrap)
        stacked = title.sizeHint().width() + 10 + document.idealWidth() > room
        direction = QBoxLayout.Direction.TopToBottom if stacked else QBoxLayout.Direction.LeftToRight
        if self._header_rows[key].direction() != direction:
            self._header_rows[key].setDirection(direction)
            legend.setAlignment((Qt.AlignmentFlag.AlignLeft if stacked else Qt.AlignmentFlag.AlignRight)
                                | Qt.AlignmentFlag.AlignVCenter)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        for key in self.legends:
            self._arrange_header(key)

    def eventFilter(self, watched, event) -> bool:
        """The viewport's width changes without the page's too (its scroll bar comes and goes), and a title's
        width with the style sheet's font, applied after the first layout. QScrollArea filters its body's resizes
        to place it: that still runs."""
        if (watched is self.viewport() and event.type() == QEvent.Type.Resize) or \
                event.type() in (QEvent.Type.Polish, QEvent.Type.FontChange):
            for key in self.legends:
                self._arrange_header(key)
        return super().eventFilter(watched, event)

    def _draw_speed(self, times: np.ndarray) -> None:
        decode = np.fromiter(self.data.series["decode"], float)
        self.decode_curve.setData(times, decode, connect="finite")
        top = float(np.nanmax(decode)) if np.isfinite(decode).any() else 0.0
        self._set_range("decode_y", self.speed_plot.setYRange, 0.0, nice_ceiling(top * 1.1))
        prefill = np.fromiter(self.data.series["prefill"], float)
        with np.errstate(invalid="ignore"):
            changed = np.r_[True, np.diff(prefill) != 0] & (prefill > 0)   # one dot per turn, not per snapshot
        self.prefill_curve.setData(times[changed], prefill[changed])
        top = float(np.nanmax(prefill)) if np.isfinite(prefill).any() else 0.0
        self._set_range("prefill_y", self.prefill_view.setYRange, 0.0, nice_ceiling(top * 1.1))

    def _generating(self) -> bool:
        return self.data.generating and bool(self.data.series["decode"]) \
            and not math.isnan(self.data.series["decode"][-1])

    def _draw_summary(self, snapshot) -> None:
        self.gauge.set_room(token_room(snapshot), snapshot.tokens_evicted,
                            (*snapshot.blocks_read, snapshot.summary_bytes),
                            (snapshot.blocks_on_disk, *snapshot.tier_fetches) if snapshot.blocks_on_disk else ())
        generating = self._generating()
        speed = translate("Dashboard", "decode {decode} tok/s{drafts} · prefill {prefill} tok/s · TTFT {ttft} ms").format(
            decode=f"{snapshot.decode_tok_s:.1f}", drafts=self._drafts_text(snapshot.spec),
            prefill=f"{snapshot.prefill_tok_s:.0f}", ttft=f"{snapshot.ttft_s * 1000:.0f}")
        if self.reading:
            speed = html.escape(self.reading)
        elif not generating:
            speed = translate("Dashboard", "idle · last reply: {speed}").format(speed=speed) \
                if snapshot.decode_tok_s or snapshot.prefill_tok_s else translate("Dashboard", "idle")
        self.summary.setText(
            translate("Dashboard", "<b>{cache}</b> · KV {kv} of {budget} budget ({usage}) · {per_token} B/token<br>{speed}<br>"
                    "process RSS {rss}").format(
                cache=html.escape(label_text(snapshot.cache_label)), kv=format_mib(snapshot.kv_bytes),
                budget=format_mib(snapshot.budget_bytes), usage=f"{snapshot.usage:.1%}",
                per_token=f"{snapshot.bytes_per_token:,.0f}", speed=speed, rss=format_mib(snapshot.memory.rss_bytes))
            + (translate("Dashboard", " · weights {size} ({label})").format(size=format_mib(snapshot.weight_bytes),
                                                             label=html.escape(weights_text(snapshot.weights_label)))
               if snapshot.weight_bytes else ""))

    def set_prompt_precision(self, precision: str) -> None:
        """The quality line's companion: prompts read in bf16 or int8 are named, with where to change it."""
        self.prompt_note.setText(translate("Dashboard", "Prompts are read in {precision}: faster on this CPU, close to exact "
                                         "but not exact (Settings › Model › Read prompts in)").format(precision=precision))
        self.prompt_note.setVisible(precision in ("bf16", "int8"))

    def _drafts_text(self, spec) -> str:
        """What speculative decoding did in the last turn, to follow the decode rate; "" when it was off. Tokens per
        step is not speed (a step that checks drafts costs more than a plain one): the time it saved or cost is said,
        measured, and the summary's tooltip says what each word means."""
        self.summary.setToolTip(translate("Dashboard", SPECULATION_TIP) if spec is not None and spec.drafted else "")
        if spec is None or spec.steps <= 0:
            return ""
        if not spec.drafted:            # no acceptance to show: the chat gave prompt lookup nothing to copy
            return " · " + translate("Dashboard", "nothing drafted")
        return " · " + translate("Dashboard", "drafts {accepted} accepted, {per_step} tokens/step, {gain}").format(
            accepted=f"{spec.acceptance_rate:.0%}", per_step=f"{spec.tokens_per_step:.1f}", gain=self._gain_text(spec))

    def _gain_text(self, spec) -> str:
        saved = spec.time_saved
        if saved is None or abs(saved) < NOISE_SHARE:
            return translate("Dashboard", "no gain measured")
        if saved > 0:
            return translate("Dashboard", "saved ~{share} of decode time").format(share=f"{saved:.0%}")
        return translate("Dashboard", "cost ~{share} more decode time").format(share=f"{-saved:.0%}")

    def _draw_remote_summary(self, snapshot) -> None:
        generating = self._generating()
        speed = translate("Dashboard", "decode {decode} tok/s{drafts} · TTFT {ttft} ms").format(
            decode=f"{snapshot.decode_tok_s:.1f}", drafts=self._drafts_text(snapshot.spec),
            ttft=f"{snapshot.ttft_s * 1000:.0f}")
        if not generating:
            speed = translate("Dashboard", "idle · last reply: {speed}").format(speed=speed) \
                if snapshot.decode_tok_s or snapshot.ttft_s else translate("Dashboard", "idle")
        self.summary.setText(translate("Dashboard", "<b>{cache}</b> on {url}<br>{speed}<br>this app's process RSS {rss}").format(
            cache=html.escape(label_text(snapshot.cache_label)), url=html.escape(self.remote_url), speed=speed,
            rss=format_mib(snapshot.memory.rss_bytes)))

    def applicable_series(self) -> list[str]:
        """Memory series this machine reports: no torch allocator or NVML line on a CPU-only machine; no KV or
        budget line when the cache lives on a remote server."""
        return [name for name in MEMORY_SERIES
                if (name not in OPTIONAL_SERIES or any(value > 0 for value in self.data.series[name]))
                and not (self.remote_url and name in ("kv", "budget", "weights"))]

    def _draw_memory(self, times: np.ndarray) -> None:
        lowest, highest = math.inf, LOG_FLOOR_MIB
        shown = self.applicable_series()
        for name, curve in self.memory_curves.items():
            if name not in shown:
                curve.setData([], [])
                continue
            values = np.maximum(np.fromiter(self.data.series[name], float) / MIB, LOG_FLOOR_MIB)
            curve.setData(times, values)
            lowest, highest = min(lowest, float(values.min())), max(highest, float(values.max()))
        self._set_legend("memory", [(translate("Dashboard", MEMORY_SERIES[name][0]), MEMORY_SERIES[name][1])
                                    for name in reversed(list(MEMORY_SERIES)) if name in shown])
        self._set_range("memory_y", self.memory_plot.setYRange,
                        math.floor(math.log10(lowest)), math.ceil(math.log10(highest) + 0.05))

    def _draw_layers(self, snapshot) -> None:
        layers = snapshot.layers
        if not layers:
            return
        top_bytes = max(self.data.layer_top_bytes, 1024.0)
        unit, scale = byte_unit(top_bytes)
        x = np.array([layer.layer for layer in layers], float)
        k = np.array([layer.k_bytes for layer in layers], float) / scale
        v = np.array([layer.v_bytes for layer in layers], float) / scale
        full = full_precision_layer_bytes(snapshot) / scale
        hybrid = is_hybrid(snapshot)
        kv_layers, states, shared = attention_layers(snapshot), state_layers(snapshot), shared_layers(snapshot)

        def brush(colour: str, layer) -> QBrush:     # a sharing layer has no bar to hatch (nor a 0-high edge)
            hatched = hybrid and layer.window is not None and layer.kv_source is None
            style = Qt.BrushStyle.BDiagPattern if hatched else Qt.BrushStyle.SolidPattern
            return QBrush(QColor(colour), style)

        k_brushes = [brush(FORMAT_COLOURS[format_family(layer.k_format)][0], layer) for layer in layers]
        v_brushes = [brush(FORMAT_COLOURS[format_family(layer.v_format)][1], layer) for layer in layers]
        sliding = [layer for layer in kv_layers if hybrid and layer.window_bytes is not None]
        self.window_ticks.setData(np.repeat([layer.layer for layer in sliding], 2) + np.tile([-0.45, 0.45], len(sliding)),
                                  np.repeat([layer.window_bytes / scale for layer in sliding], 2))
        # the outline is what K and V would take at full precision: a state or sharing layer has none to outline
        self.full_bars.setOpts(x=np.array([layer.layer for layer in kv_layers], float),
                               height=np.full(len(kv_layers), full), width=0.9)
        self.full_bars.setVisible(full > 0)
        # a hatched bar gets an edge in its own colour, so its height reads as well as a solid bar's
        k_pens = [pg.mkPen(b.color(), width=1) if b.style() != Qt.BrushStyle.SolidPattern else None for b in k_brushes]
        v_pens = [pg.mkPen(b.color(), width=1) if b.style() != Qt.BrushStyle.SolidPattern else None for b in v_brushes]
        self.k_bars.setOpts(x=x, height=k, width=0.7, brushes=k_brushes, pens=k_pens)
        self.v_bars.setOpts(x=x, height=v, y0=k, width=0.7, brushes=v_brushes, pens=v_pens)
        self.state_bars.setOpts(x=np.array([layer.layer for layer in states], float),
                                height=np.array([layer.state_bytes for layer in states], float) / scale, width=0.7)
        self.state_bars.setVisible(bool(states))
        self.shared_bars.setOpts(x=np.array([layer.layer for layer in shared], float),
                                 height=np.full(len(shared), SHARED_MARK * top_bytes / scale), width=0.7)
        self.shared_bars.setVisible(bool(shared))
        title = (unit, bool(states))
        if self._ranges.get("layer_unit") != title:
            self._ranges["layer_unit"] = title
            self.sections["layers"].setText(
                translate("Dashboard", "KV and state bytes per layer ({unit})").format(unit=unit) if states else
                translate("Dashboard", "KV bytes per layer ({unit})").format(unit=unit))
        budget_share = layer_budget_share(snapshot) / scale
        near = budget_share <= top_bytes / scale
        self.budget_line.setVisible(near)
        self.budget_line.setValue(budget_share)
        families = sorted({format_family(f) for layer in kv_layers for f in (layer.k_format, layer.v_format)},
                          key=list(FORMAT_COLOURS).index)
        entries = [(translate("Dashboard", FORMAT_NAMES[family]), FORMAT_COLOURS[family][0]) for family in families]
        entries.append((translate("Dashboard", "K dark, V light"), "#94a3b8"))
        if states:
            entries.append((translate("Dashboard", "state of {n} linear-attention layers, constant").format(
                n=len(states)), STATE_COLOUR))
        if shared:
            entries.append((shared_legend(shared), SHARED_COLOUR, "□"))
        if hybrid:
            for window, count in layer_kinds(snapshot):
                entries.append((translate("Dashboard", "{n} global").format(n=count) if window is None else
                                translate("Dashboard", "{n} sliding (window {window}), hatched; line: window full").format(
                                    n=count, window=f"{window:,}"),
                                "#334155" if window is None else WINDOW_COLOUR))
        if full > 0:
            entries.append((translate("Dashboard", "outline: full precision, no window") if hybrid else
                            translate("Dashboard", "outline: full precision"), OUTLINE_COLOUR))
        if near:
            entries.append((translate("Dashboard", "dashed line: budget share"), "#dc2626"))
        self._set_legend("layers", entries)
        self._set_range("layer_x", self.layer_plot.setXRange, -0.6, len(layers) - 0.4)
        step = max(1, int(nice_ceiling(len(layers) / 8)))   # whole layers: no "0.5" under three bars
        if self._ranges.get("layer_ticks") != step:
            self._ranges["layer_ticks"] = step
            self.layer_plot.getAxis("bottom").setTickSpacing(step, step)
        self._set_range("layer_y", self.layer_plot.setYRange, 0.0, top_bytes / scale)

    def _draw_markers(self) -> None:
        if self.data.num_marks == self._drawn_marks:
            return
        for plot, line in self._marker_lines:
            plot.removeItem(line)
        self._marker_lines = []
        self.event_strip.set_markers(self.data.markers)
        for cluster in self.event_strip.clusters:
            colour = MARKER_COLOURS.get(cluster.kind, "#334155")
            for plot in (self.memory_plot, self.speed_plot):
                line = pg.InfiniteLine(cluster.time_s, angle=90, movable=False,
                                       pen=pg.mkPen(colour, width=1, style=Qt.PenStyle.DotLine))
                line.setZValue(-5)      # behind every curve: a marker never hides data
                plot.addItem(line, ignoreBounds=True)
                self._marker_lines.append((plot, line))
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

register(Page("Live", QT_TRANSLATE_NOOP("Dashboard", "Live"),
              QT_TRANSLATE_NOOP("Dashboard", "KV bytes per layer, speed and memory over time"), LivePage, order=10))
