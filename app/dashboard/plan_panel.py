"""The Plan tab: what each cache format would hold for a context of the user's choosing, on the loaded model.

Every byte count comes from engine.kv.layout, the function the cache itself allocates by, so the
plan and the memory cannot disagree. A chosen format is applied to the open chat as a live switch.
"""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QT_TRANSLATE_NOOP, QPointF, Qt, Signal
from PySide6.QtGui import QColor, QPainter, QPen, QPolygonF
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QLabel, QPushButton, QSlider, QStyle, QStyleOptionSlider,
                               QVBoxLayout, QWidget)

from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.kv.layout import MIB, conversation_bytes, kv_groups, kv_layout, max_conversation_tokens
from kvchat.engine.plan.estimate import growth_bytes_per_token, window_counts

from kvchat.app.dashboard.registry import Page, register
from kvchat.app.dashboard.bar_widgets import FORMAT_COLOURS, Column, ColumnChart, Line, format_family, format_mib
from kvchat.app.i18n import cache_label, value_name

# (name shown, K format, V format)
PLAN_FORMATS = (("full precision", "auto", "auto"), ("int8", "int8", "int8"), ("fp8", "fp8", "fp8"),
                ("int4", "int4", "int4"), ("int8/int4", "int8", "int4"))
BUDGET_COLOUR = "#dc2626"
DEFAULT_CONTEXT = 2048


@dataclass(frozen=True, slots=True)
class PlanBar:
    name: str
    cache: CacheConfig
    num_bytes: int                      # KV bytes for `tokens` tokens in this format
    now_bytes: int                      # the same for the open conversation's tokens now
    bytes_per_token: float
    max_tokens: int | None              # longest context that fits the budget; None: a window bounds it
    full_dtype: str = ""                # what full precision is on this model and device ("bf16")


def plan_bars(model_config, model_dtype: str, device: str, cache: CacheConfig, tokens: int, now_tokens: int,
              budget_bytes: int) -> list[PlanBar]:
    """Each format of PLAN_FORMATS with the rest of `cache` (window, sinks, block size, layers kept) unchanged."""
    bars = []
    for name, k, v in PLAN_FORMATS:
        option = cache.with_(k_format=k, v_format=v)
        layout = kv_layout(model_config, option, model_dtype, device)
        groups = kv_groups(model_config, option, model_dtype, device)
        if k == "auto":                 # named as Settings and the status line name it; its dtype in the tooltip
            name = value_name("auto")
        # a hybrid model's sliding layers stay flat at their window: a token adds only its global layers' bytes
        per_token = layout.bytes_per_token if len(groups) == 1 else growth_bytes_per_token(groups)
        bars.append(PlanBar(name, option, conversation_bytes(model_config, option, tokens, model_dtype, device),
                            conversation_bytes(model_config, option, now_tokens, model_dtype, device), per_token,
                            max_conversation_tokens(model_config, option, budget_bytes, model_dtype, device),
                            layout.full_dtype))
    return bars


def format_index(cache: CacheConfig) -> int | None:
    """Which of PLAN_FORMATS `cache` uses; None for a mix the plan does not list."""
    return next((i for i, (_, k, v) in enumerate(PLAN_FORMATS) if (k, v) == (cache.k_format, cache.v_format)), None)


class MarkedSlider(QSlider):
    """A horizontal slider with a second, fixed mark: where the open conversation sits."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(Qt.Orientation.Horizontal, parent)
        self.mark: int | None = None

    def set_mark(self, value: int | None) -> None:
        if value != self.mark:
            self.mark = value
            self.update()

    def mark_x(self) -> float | None:
        if self.mark is None:
            return None
        option = QStyleOptionSlider()
        self.initStyleOption(option)
        groove = self.style().subControlRect(QStyle.ComplexControl.CC_Slider, option,
                                             QStyle.SubControl.SC_SliderGroove, self)
        handle = self.style().subControlRect(QStyle.ComplexControl.CC_Slider, option,
                                             QStyle.SubControl.SC_SliderHandle, self)
        span = groove.width() - handle.width()
        value = min(max(self.mark, self.minimum()), self.maximum())
        offset = QStyle.sliderPositionFromValue(self.minimum(), self.maximum(), value, span)
        return groove.x() + handle.width() / 2 + offset

    def paintEvent(self, event) -> None:
        super().paintEvent(event)
        x = self.mark_x()
        if x is None:
            return
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(QPen(QColor("#0f172a"), 1))
        painter.setBrush(QColor("#0f172a"))
        painter.drawPolygon(QPolygonF([QPointF(x - 4, self.height()), QPointF(x + 4, self.height()),
                                       QPointF(x, self.height() - 6)]))
        painter.end()


class PlanPanel(QWidget):
    apply_requested = Signal(object)    # CacheConfig: the open chat's config with the chosen K/V formats

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("planPanel")
        self.model_config = None
        self.model_dtype, self.device = "fp32", "cpu"
        self.cache = CacheConfig()
        self.budget_bytes = int(self.cache.budget_mb * MIB)
        self.now_tokens = self.now_held = 0
        self.can_apply = False
        self.bars: list[PlanBar] = []
        self.chosen = 0

        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(4)
        self.summary = QLabel(self.tr("Load a model to plan its cache."), objectName="dashboardSummary")
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)
        row = QHBoxLayout()
        self.context_label = QLabel("", objectName="dashboardSection")
        self.context_label.setWordWrap(True)    # a window's " · window 256 + 4 sinks" made it wider than the dock
        row.addWidget(self.context_label, 1)
        self.now_button = QPushButton(self.tr("Open chat"), objectName="planNowButton")
        self.now_button.setToolTip(self.tr("Move the slider to the open conversation's length"))
        self.now_button.clicked.connect(self.slide_to_now)
        row.addWidget(self.now_button)
        layout.addLayout(row)
        self.slider = MarkedSlider()
        self.slider.setObjectName("planContext")
        self.slider.setMinimumHeight(28)
        self.slider.valueChanged.connect(lambda _v: self.refresh())
        layout.addWidget(self.slider)
        self.chart = ColumnChart(min_height=150)
        self.chart.clicked.connect(self.choose)
        layout.addWidget(self.chart, 1)
        self.legend = QLabel("", objectName="plotLegend")
        self.legend.setWordWrap(True)
        layout.addWidget(self.legend)
        apply_row = QHBoxLayout()
        self.format_box = QComboBox(objectName="planFormat")
        self.format_box.currentIndexChanged.connect(self.choose)
        apply_row.addWidget(self.format_box, 1)
        self.apply_button = QPushButton(self.tr("Apply to this chat"), objectName="planApply")
        self.apply_button.clicked.connect(self._apply)
        apply_row.addWidget(self.apply_button)
        layout.addLayout(apply_row)
        self._set_context_range(DEFAULT_CONTEXT)
        self.slider.setValue(1024)
        self._update_apply()

    # --- inputs ---

    def set_model(self, model_config, model_dtype: str, device: str) -> None:
        self.model_config, self.model_dtype, self.device = model_config, model_dtype, device
        context = getattr(model_config, "max_position_embeddings", 0) or DEFAULT_CONTEXT
        self._set_context_range(context)
        self.refresh()

    def set_conversation(self, cache: CacheConfig, tokens_in_context: int, tokens_held: int, budget_bytes: int,
                         can_apply: bool) -> None:
        """The open chat: its cache config, its length now, the engine's budget, whether a switch can go now."""
        state = (cache, int(tokens_in_context), int(tokens_held), int(budget_bytes), bool(can_apply))
        if state == (self.cache, self.now_tokens, self.now_held, self.budget_bytes, self.can_apply):
            return
        if format_index(cache) not in (None, format_index(self.cache)):
            self.chosen = format_index(cache)   # another chat, or its mode switched: the choice starts at its mode
        self.cache, self.now_tokens, self.now_held, self.budget_bytes, self.can_apply = state
        self.slider.set_mark(self.now_tokens if self.now_tokens else None)
        self.refresh()

    def _set_context_range(self, context: int) -> None:
        self.slider.blockSignals(True)
        self.slider.setRange(1, max(2, int(context)))
        self.slider.setSingleStep(16)
        self.slider.setPageStep(max(16, context // 16))
        self.slider.blockSignals(False)

    def slide_to_now(self) -> None:
        self.slider.setValue(max(1, self.now_tokens))

    def choose(self, index: int) -> None:
        if 0 <= index < len(PLAN_FORMATS) and index != self.chosen:
            self.chosen = index
            self.refresh()

    @property
    def tokens(self) -> int:
        return self.slider.value()

    def chosen_cache(self) -> CacheConfig:
        _, k, v = PLAN_FORMATS[self.chosen]
        return self.cache.with_(k_format=k, v_format=v)

    # --- drawing ---

    def refresh(self) -> None:
        n = self.tokens
        self.context_label.setText(self.tr("KV bytes at {n} of {total} tokens").format(
            n=f"{n:,}", total=f"{self.slider.maximum():,}") + self._window_text())
        if self.model_config is None:
            self.bars = []
            self.chart.set_data([], 1.0)
            self._update_apply()
            return
        try:
            self.bars = plan_bars(self.model_config, self.model_dtype, self.device, self.cache, n, self.now_tokens,
                                  self.budget_bytes)
        except ConfigError as exc:
            self.bars = []
            self.chart.set_data([], 1.0)
            self.summary.setText(self.tr("Cannot plan this cache on this model: {error}").format(error=exc))
            self._update_apply()
            return
        current = self._current_index()
        columns = [Column(bar.name, (float(bar.num_bytes),),
                          (FORMAT_COLOURS[format_family(bar.cache.k_format)][0],),
                          self._tip(bar, n), format_mib(bar.num_bytes),
                          float(bar.now_bytes) if self.now_tokens else None, i == self.chosen)
                   for i, bar in enumerate(self.bars)]
        highest = max(bar.num_bytes for bar in self.bars) or 1
        top = max(highest, self.budget_bytes) if self.budget_bytes <= 3 * highest else highest
        self.chart.set_data(columns, top * 1.15, Line(float(self.budget_bytes), BUDGET_COLOUR,
                                                      self.tr("budget {size}").format(
                                                          size=format_mib(self.budget_bytes))))
        held = self.tr(" ({n} held)").format(n=f"{self.now_held:,}") if self.now_held != self.now_tokens else ""
        open_text = (self.tr("The open chat has <b>{n} tokens</b>{held} in <b>{cache}</b>").format(
                         n=f"{self.now_tokens:,}", held=held,
                         cache=self.bars[current].name if current is not None else cache_label(self.cache))
                     if self.now_tokens else self.tr("The open chat holds nothing yet"))
        self.summary.setText(self.tr("{open} · KV budget {budget}. Click a format, then apply it to this chat: a live "
                                     "switch, no reload.").format(open=open_text,
                                                                  budget=format_mib(self.budget_bytes)))
        self.legend.setText(self.tr("Bar: KV bytes at the slider's context · black tick: the open chat now · "
                                    "▲ on the slider: the open chat's length · red dashed: the budget"))
        if self.format_box.count() != len(self.bars) or self.format_box.itemText(0) != self.bars[0].name:
            self.format_box.blockSignals(True)
            self.format_box.clear()
            self.format_box.addItems([bar.name for bar in self.bars])
            self.format_box.blockSignals(False)
        if self.format_box.currentIndex() != self.chosen:
            self.format_box.blockSignals(True)
            self.format_box.setCurrentIndex(self.chosen)
            self.format_box.blockSignals(False)
        self._update_apply()

    def _window_text(self) -> str:
        text = ""
        # the layers that hold K and V: a linear-attention layer or one reading another layer's KV never grows
        own = self.model_config.attention_layers if self.model_config else ()
        counts = window_counts(self.model_config.layers[i].window for i in own)
        if len(counts) > 1:             # a hybrid model: say which layers stay flat before the bars do
            sliding = sum(n for w, n in counts if w is not None)
            fields = dict(sliding=sliding, layers=len(own), rest=len(own) - sliding,
                          window=", ".join(f"{w:,}" for w, _ in counts if w is not None))
            text = self.tr(" · {sliding} of {layers} layers slide (window {window}): only the other {rest} grow").format(
                **fields) if len(own) == self.model_config.num_layers else self.tr(
                " · {sliding} of the {layers} layers holding KV slide (window {window}): only the other {rest} "
                "grow").format(**fields)
        if self.cache.window is None:
            return text
        return text + self.tr(" · window {window} + {sinks} sinks").format(window=f"{self.cache.window:,}",
                                                                            sinks=self.cache.sinks)

    def _tip(self, bar: PlanBar, n: int) -> str:
        lines = [self.tr("{name}: K and V as the model holds them ({dtype})").format(name=bar.name, dtype=bar.full_dtype)
                 if bar.cache.k_format == "auto" else
                 f"{bar.name}: K {value_name(bar.cache.k_format)}, V {value_name(bar.cache.v_format)}",
                 self.tr("{n} tokens: {size} ({bytes} B, {per_token} B/token in full blocks)").format(
                     n=f"{n:,}", size=format_mib(bar.num_bytes), bytes=f"{bar.num_bytes:,}",
                     per_token=f"{bar.bytes_per_token:,.0f}")]
        if self.now_tokens:
            lines.append(self.tr("The open chat now ({n} tokens): {size}").format(n=f"{self.now_tokens:,}",
                                                                                   size=format_mib(bar.now_bytes)))
        lines.append(self.tr("A window bounds it: it never fills the budget") if bar.max_tokens is None else
                     self.tr("Longest context in the budget: {n} tokens").format(n=f"{bar.max_tokens:,}"))
        return "\n".join(lines)

    def _current_index(self) -> int | None:
        return format_index(self.cache)

    def _update_apply(self) -> None:
        name = PLAN_FORMATS[self.chosen][0] if not self.bars else self.bars[self.chosen].name
        same = self._current_index() == self.chosen
        self.apply_button.setText(self.tr("In use by this chat") if same else
                                  self.tr("Apply {name} to this chat").format(name=name))
        self.apply_button.setEnabled(bool(self.bars) and self.can_apply and not same)

    def _apply(self) -> None:
        if self.apply_button.isEnabled():
            self.apply_requested.emit(self.chosen_cache())


register(Page("Plan", QT_TRANSLATE_NOOP("Dashboard", "Plan"),
              QT_TRANSLATE_NOOP("Dashboard", "KV bytes of each cache format for a context you choose; apply one to "
                                "this chat"),
              lambda _data: PlanPanel(), order=30,
              local_only=QT_TRANSLATE_NOOP("Dashboard", "Planning and switching cache formats for this chat")))
