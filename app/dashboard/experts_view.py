"""The Experts tab: for a mixture-of-experts model, which experts each layer's router chose in the last turn.

One image, a row per layer (layer 0 on top) and a column per expert, coloured by the share of the layer's tokens the
expert took (experts_data.py computes every number); the tab is hidden for a dense model.
"""
from __future__ import annotations

import html
import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QT_TRANSLATE_NOOP, QPointF, QSize, Qt
from PySide6.QtGui import QCursor
from PySide6.QtWidgets import QLabel, QToolTip, QVBoxLayout, QWidget

from kvchat.app.dashboard.registry import Page, register
from kvchat.app.dashboard.dashboard_data import nice_ceiling
from kvchat.app.dashboard.experts_data import ExpertUse, expert_use, hover_text, scale_entries, summary_text

NONE_RGB, LIGHT_RGB, DARK_RGB = (255, 255, 255), (191, 219, 254), (30, 58, 138)   # no token; the least; the busiest
DENSE_RGB, PENDING_RGB = (209, 213, 219), (241, 245, 249)   # a dense layer; a routed one not counted yet
MAX_TICKS = 8
DENSE = QT_TRANSLATE_NOOP("ExpertsView", "A dense model: every token goes through every layer's one feed-forward "
                          "block, no experts.")
ROW_PX, MAX_ROW_PX, AXIS_PX = 6, 48, 40     # a layer's row: readable at 48 layers, not a slab at 3
MIN_HEIGHT, MAX_MIN_HEIGHT = 120, 360


def colours(shares: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """[layers, experts] shares (NaN: nothing counted there) and [layers] dense rows -> [layers, experts, 4] RGBA
    bytes: white for an expert that took no token, light to dark blue from the least to the busiest, grey for a
    dense layer, pale grey for a routed one not counted yet."""
    top = np.nanmax(shares) if np.isfinite(shares).any() else 0.0
    t = np.nan_to_num(shares / top if top > 0 else shares, nan=0.0)[..., None]
    rgb = np.array(LIGHT_RGB, float) + t * (np.array(DARK_RGB, float) - np.array(LIGHT_RGB, float))
    rgb = np.where(np.nan_to_num(shares, nan=1.0)[..., None] == 0, np.array(NONE_RGB, float), rgb)
    rgb = np.where(np.isnan(shares)[..., None], np.array(PENDING_RGB, float), rgb)
    rgb = np.where(dense[:, None, None], np.array(DENSE_RGB, float), rgb)
    return np.concatenate([rgb, np.full(shares.shape + (1,), 255.0)], axis=-1).round().astype(np.ubyte)


def centre_ticks(n: int) -> list[tuple[float, str]]:
    """Labels at the middle of cells 0, step, 2 step, ... with at most MAX_TICKS of them (a 1-2-5 step)."""
    step = max(1, int(nice_ceiling(n / MAX_TICKS)))
    return [(i + 0.5, str(i)) for i in range(0, n, step)]


class _Plot(pg.PlotWidget):
    def sizeHint(self) -> QSize:
        return QSize(300, MIN_HEIGHT)


class ExpertsView(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("expertsView")
        self.config = None
        self.use: ExpertUse | None = None
        self.shares = np.zeros((0, 0))  # [layer, expert] as drawn; NaN: a dense layer or nothing counted
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(4)
        self.summary = QLabel(self.tr(DENSE), objectName="dashboardSummary")
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)
        layout.addWidget(QLabel(self.tr("Last turn's tokens per expert · layers × experts"),
                                objectName="dashboardSection", wordWrap=True))
        self.plot = self._build_plot()
        layout.addWidget(self.plot, 1)
        self.legend = QLabel("", objectName="plotLegend", wordWrap=True)
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        layout.addWidget(self.legend)
        layout.addStretch(0)

    def _build_plot(self) -> pg.PlotWidget:
        plot = _Plot(background="w")
        plot.setMenuEnabled(False)
        plot.setMouseEnabled(x=False, y=False)
        plot.hideButtons()
        plot.enableAutoRange(False)
        plot.setMinimumHeight(MIN_HEIGHT)
        plot.invertY(True)              # layer 0 on top, as in a table
        plot.getPlotItem().layout.setContentsMargins(2, 4, 6, 2)
        plot.getViewBox().setBorder(pg.mkPen("#cbd5e1"))
        for side in ("left", "bottom"):
            axis = plot.getAxis(side)
            axis.setTextPen("#374151")
            axis.setPen("#9ca3af")
            axis.setStyle(hideOverlappingLabels=False)  # expert 0's label half a cell from the edge is kept
        self.image = pg.ImageItem(axisOrder="row-major")
        plot.addItem(self.image)
        plot.scene().sigMouseMoved.connect(self._hover)
        return plot

    @property
    def applies(self) -> bool:
        """The model routes its tokens to experts: the tab has something to show."""
        return expert_use(None, self.config) is not None

    def set_model(self, config) -> None:
        """A model was loaded (None: a remote one, whose experts nobody here counts)."""
        self.config = config
        self._show(expert_use(None, config))

    def show_stats(self, snapshot) -> None:
        use = expert_use(snapshot, self.config)
        if use != self.use:
            self._show(use)

    def _show(self, use: ExpertUse | None) -> None:
        self.use = use
        if use is None:
            self.summary.setText(self.tr(DENSE))
            self.legend.setText("")
            self.shares = np.zeros((0, 0))
            self.image.clear()
            return
        self.summary.setText(summary_text(use))
        self.legend.setText(self._legend_html(use))
        self.shares = np.array([[math.nan if s is None else s for s in row] for row in use.shares()], float)
        layers, experts = use.num_layers, use.max_experts
        dense = np.array([routing is None for routing in use.routing])
        self.image.setImage(colours(self.shares, dense), levels=None, autoLevels=False)
        self.image.setRect(0, 0, experts, layers)
        self.plot.getAxis("bottom").setTicks([centre_ticks(experts)])
        self.plot.getAxis("left").setTicks([centre_ticks(layers)])
        self.plot.setXRange(0, experts, padding=0)
        self.plot.setYRange(0, layers, padding=0)
        self.plot.setMinimumHeight(min(MAX_MIN_HEIGHT, max(MIN_HEIGHT, ROW_PX * layers + AXIS_PX)))
        self.plot.setMaximumHeight(max(MIN_HEIGHT, MAX_ROW_PX * layers + AXIS_PX))

    def _legend_html(self, use: ExpertUse) -> str:
        """The colours, each beside what it stands for: white no token, light to dark the share, grey dense."""
        rgb = {"none": NONE_RGB, "few": LIGHT_RGB, "busiest": DARK_RGB, "dense": DENSE_RGB}
        swatches = []
        for kind, text in scale_entries(use):
            if not kind:
                swatches.append(html.escape(text))
                continue
            mark = '□' if kind == "none" else '<span style="color:#{:02x}{:02x}{:02x}">■</span>'.format(*rgb[kind])
            swatches.append(mark + "&nbsp;" + html.escape(text).replace(" ", "&nbsp;"))   # an entry never breaks
        colours_named = "&nbsp;&nbsp; ".join(swatches[:-1])
        return html.escape(self.tr("Colour: the share of its layer's tokens an expert took.")) + "<br>" + \
            (colours_named + " · " if colours_named else "") + swatches[-1]

    def hover_text(self, layer: int, expert: int) -> str | None:
        return hover_text(self.use, layer, expert)

    def _hover(self, scene_pos: QPointF) -> None:
        view = self.plot.getViewBox()
        if not view.sceneBoundingRect().contains(scene_pos):
            QToolTip.hideText()
            return
        point = view.mapSceneToView(scene_pos)
        text = self.hover_text(math.floor(point.y()), math.floor(point.x()))
        if text:
            QToolTip.showText(QCursor.pos(), text, self)
        else:
            QToolTip.hideText()


def routes_to_experts(view: ExpertsView, remote: bool) -> bool:
    """The Experts tab is offered for a local mixture of experts only: a remote server reports no routing."""
    return view.applies and not remote


register(Page("Experts", QT_TRANSLATE_NOOP("Dashboard", "Experts"),
              QT_TRANSLATE_NOOP("Dashboard", "A mixture of experts: which experts each layer's router chose in the "
                                "last turn"),
              lambda _data: ExpertsView(), order=50,
              shown=routes_to_experts))
