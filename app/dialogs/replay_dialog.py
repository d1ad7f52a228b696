"""Choose the cache mode to replay the open chat under: the K and V formats, a window and its sinks, or one of the
Settings dialog's presets. The rest of the chat's cache settings (block size, budget, full-precision layers) stay.
"""
from __future__ import annotations

import html

from PySide6.QtCore import QCoreApplication, Qt
from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QFormLayout, QHBoxLayout, QLabel, QSpinBox,
                               QVBoxLayout, QWidget)

from kvchat.engine.config import FORMATS, CacheConfig, ConfigError

from kvchat.app.dialogs.settings_dialog import PRESETS, apply_preset, formats_row
from kvchat.app.engine_text import engine_text
from kvchat.app.i18n import cache_label, choice, fill_choices


class ReplayDialog(QDialog):
    def __init__(self, baseline: CacheConfig, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("replayDialog")
        self.setWindowTitle(self.tr("Replay this chat"))
        self.baseline = baseline
        layout = QVBoxLayout(self)
        intro = QLabel(self.tr("The chat is read again under its own cache mode (<b>{mode}</b>) and under the one "
                               "chosen here, side by side; the chat is not changed.").format(
            mode=html.escape(cache_label(baseline))), wordWrap=True)
        intro.setTextFormat(Qt.TextFormat.RichText)
        layout.addWidget(intro)
        form = QFormLayout()
        self.preset = QComboBox(objectName="replayPreset")
        self.preset.addItem(self.tr("Presets…"))
        for name in PRESETS:
            self.preset.addItem(QCoreApplication.translate("SettingsDialog", name), name)
        self.preset.activated.connect(self._apply_preset)
        form.addRow(self.tr("Quick choice"), self.preset)
        self.k_format, self.v_format = QComboBox(objectName="replayK"), QComboBox(objectName="replayV")
        lossy = "int4" if baseline.k_format != "int4" else "int8"
        fill_choices(self.k_format, FORMATS, lossy)
        fill_choices(self.v_format, FORMATS, lossy)
        form.addRow(self.tr("Formats"), formats_row(self.k_format, self.v_format))
        self.window = QSpinBox(objectName="replayWindow", minimum=0, maximum=1_000_000, singleStep=64,
                               specialValueText=self.tr("no window"))
        self.window.setValue(baseline.window or 0)
        self.sinks = QSpinBox(objectName="replaySinks", minimum=0, maximum=1024)
        self.sinks.setValue(baseline.sinks)
        window_row = QHBoxLayout()
        window_row.addWidget(self.window, 1)
        window_row.addWidget(QLabel(self.tr("sinks")))
        window_row.addWidget(self.sinks)
        form.addRow(self.tr("Window (tokens)"), window_row)
        layout.addLayout(form)
        self.error = QLabel("", objectName="replayDialogError", wordWrap=True)
        self.error.setStyleSheet("color: #b91c1c;")
        layout.addWidget(self.error)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setText(self.tr("Replay"))
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        layout.addWidget(self.buttons)
        for combo in (self.k_format, self.v_format):
            combo.currentIndexChanged.connect(self.validate)
        for spin in (self.window, self.sinks):
            spin.valueChanged.connect(self.validate)
        self.validate()

    def _apply_preset(self, index: int) -> None:
        apply_preset(self, index)

    def mode(self) -> CacheConfig:
        """The chat's own cache settings with the formats and window chosen here (ConfigError: not a mode)."""
        window = self.window.value() or None
        # a window replaces retrieval (which reads every block it keeps); without one nothing is kept by attention
        return self.baseline.with_(k_format=choice(self.k_format), v_format=choice(self.v_format),
                                   window=window, sinks=self.sinks.value(),
                                   eviction=self.baseline.eviction if window else "window",
                                   retrieval_blocks=None if window else self.baseline.retrieval_blocks)

    def validate(self, *_args) -> str | None:
        """Why the choice is not a mode (OK is off), or None."""
        try:
            mode = self.mode()
            why = self.tr("That is this chat's own mode: choose another to compare.") if mode == self.baseline \
                else None
        except ConfigError as exc:
            why = engine_text(str(exc))
        self.error.setText(why or "")
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(why is None)
        return why
