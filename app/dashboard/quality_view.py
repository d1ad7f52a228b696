"""The dashboard row that says what the current cache mode costs in quality, with a Measure button."""
from __future__ import annotations

import html
from typing import Callable

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSizePolicy, QWidget

from kvchat.engine.config import CacheConfig

from kvchat.app.i18n import label_text
from kvchat.app.store.quality import (QualityResult, QualityStore, covers, is_reference, mode_key, model_key,
                               result_key)


class QualityRow(QWidget):
    measure_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("qualityRow")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.label = QLabel(self.tr("Quality of this mode: waiting for the model…"), objectName="qualityLabel")
        self.label.setWordWrap(True)
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.label.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.button = QPushButton(self.tr("Measure"), objectName="measureButton")
        self.button.setToolTip(self.tr("Compare this cache mode with full precision on a built-in text (a few "
                                       "seconds)"))
        self.button.clicked.connect(self.measure_requested)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.button, 0, Qt.AlignmentFlag.AlignTop)
        self.state = "waiting"
        self.button.setVisible(False)

    def show_mode(self, cache: CacheConfig, result: QualityResult | None, measuring: bool = False,
                  error: str = "", tokens_lost: int = 0) -> None:
        """tokens_lost: the chat's tokens the cache no longer holds (they left an earlier window)."""
        label = html.escape(label_text(mode_key(cache)))
        if is_reference(cache):
            self.state = "reference"
            if tokens_lost:
                self.label.setText(self.tr("Quality: <b>{mode}</b> is the reference, but {n} tokens of this chat left "
                                           "an earlier window and are not in the cache (Reset reads them again).").format(
                    mode=label, n=f"{tokens_lost:,}"))
            else:
                self.label.setText(self.tr("Quality: <b>{mode}</b> is the reference: nothing lost.").format(mode=label))
        elif result is not None:
            self.state = "measured"
            self.label.setText(self.tr(
                "Quality of <b>{mode}</b> against full precision: top-1 agreement <b>{agreement}</b> · KL {kl} "
                "nats/token <span style='color:#6b7280'>(measured on {tokens} tokens of built-in text)</span>").format(
                mode=label, agreement=f"{result.top1_agreement:.1%}", kl=f"{result.mean_kl:.4f}", tokens=result.tokens))
        elif error:
            self.state = "failed"
            self.label.setText(self.tr("Quality of <b>{mode}</b>: the measurement failed ({error}). Press Measure to "
                                       "try again.").format(mode=label, error=html.escape(error)))
        elif measuring:
            self.state = "measuring"
            self.label.setText(self.tr("Quality of <b>{mode}</b>: measuring against full precision…").format(mode=label))
        else:
            self.state = "not measured"
            self.label.setText(self.tr("Quality of <b>{mode}</b> against full precision: not measured yet.").format(
                mode=label))
        # a result can be measured again (another build of the model, a doubt): Measure stays, as "Measure again"
        self.button.setText(self.tr("Measure again") if self.state == "measured" else self.tr("Measure"))
        self.button.setVisible(self.state in ("not measured", "failed", "measured"))


AUTO_MEASURE_IDLE_MS = 8000             # measure on its own only after the chat has been quiet this long


class QualityController(QObject):
    """Keeps the quality row in step with the loaded model and the session's cache mode.

    Results come from the disk store when there; otherwise the engine thread measures after a quiet
    spell (or at once on Measure). Any command the user gives first cancels the measurement, which
    then waits for the next quiet spell."""

    def __init__(self, host, row: QualityRow, busy: Callable[[], bool], store: QualityStore | None = None,
                 parent: QObject | None = None):
        super().__init__(parent)
        self.host, self.row, self.busy = host, row, busy
        self.store = store or QualityStore()
        self.model: str | None = None
        self.cache: CacheConfig | None = None
        self.measuring: str | None = None   # mode key being measured
        self.remote = False                 # a remote server: no local model to measure
        self.failed: dict[str, str] = {}    # mode key -> why, not retried on its own
        self.tokens_lost = 0                # the chat's tokens no longer in the cache (StatsSnapshot.tokens_evicted)
        self.timer = QTimer(self, singleShot=True, interval=AUTO_MEASURE_IDLE_MS)
        self.timer.timeout.connect(self._auto)
        row.measure_requested.connect(self.measure)
        host.ready.connect(self._on_ready)
        host.session_opened.connect(lambda event: self._on_cache(event.cache, event.stats))
        host.mode_switched.connect(lambda event: self._on_cache(event.new, event.stats))
        host.stats.connect(self._on_stats)
        host.reset_done.connect(lambda event: self._on_stats(event.stats))
        host.turn_finished.connect(lambda _event: self._restart_timer())
        host.quality.connect(self._on_quality)

    def result(self) -> QualityResult | None:
        if self.model is None or self.cache is None:
            return None
        found = self.store.get(self.model, result_key(self.cache))
        return found if found is not None and covers(self.cache, found) else None   # kept by an older version

    def can_measure(self) -> bool:
        return self.model is not None and self.cache is not None and not is_reference(self.cache)

    def needs_measuring(self) -> bool:
        return self.can_measure() and self.result() is None

    def measure(self) -> None:
        """Measure the current mode now (queued behind anything the engine thread is doing); a stored result
        is measured again when asked."""
        if not self.can_measure() or self.measuring == result_key(self.cache):
            return
        self.measuring = result_key(self.cache)
        self.failed.pop(self.measuring, None)
        self.host.measure_quality(self.cache)
        self._show()

    def _auto(self) -> None:
        if self.busy():
            self._restart_timer()
        elif self.needs_measuring() and result_key(self.cache) not in self.failed:
            self.measure()

    def _restart_timer(self) -> None:
        if self.needs_measuring():
            self.timer.start()

    def _on_ready(self, event) -> None:
        self.model = model_key(event.model_name, event.weights_label, event.dtype, event.device)
        self.measuring = None
        self.remote = event.capabilities.remote
        if self.remote:                 # nothing to measure here; the dashboard says so in the row
            self.model = None

    def _on_cache(self, cache: CacheConfig, stats=None) -> None:
        self.cache = cache
        self.tokens_lost = stats.tokens_evicted if stats is not None else 0
        self._show()
        self._restart_timer()

    def _on_stats(self, stats) -> None:
        if stats is not None and stats.tokens_evicted != self.tokens_lost:
            self.tokens_lost = stats.tokens_evicted
            self._show()

    def _on_quality(self, outcome) -> None:
        if outcome.mode == self.measuring:
            self.measuring = None
        if isinstance(outcome, QualityResult):
            self.store.put(outcome)
        elif outcome.error:
            self.failed[outcome.mode] = outcome.error
        else:
            self._restart_timer()
        self._show()

    def _show(self) -> None:
        if self.cache is None or self.remote:
            return
        key = result_key(self.cache)
        self.row.show_mode(self.cache, self.result(), measuring=self.measuring == key, error=self.failed.get(key, ""),
                           tokens_lost=self.tokens_lost)
