"""Settings: model, cache formats and policies, sampling, system prompt.

Every edit is validated by building the engine's own frozen configs and, once a model is loaded,
by the engine's own check of a cache config against that model (kv_layout.check_cache_for_model); a
ConfigError's message is shown in the dialog and OK stays disabled until the combination works.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog, QFormLayout,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QSpinBox,
                               QVBoxLayout, QWidget)

from engine.config import FORMATS, KEY_SCHEMES, OVERFLOW_POLICIES, CacheConfig, ConfigError, SamplingParams
from engine.kv_layout import check_cache_for_model

from .settings_store import AppSettings

PRESETS = {
    "Full precision": dict(k_format="auto", v_format="auto", window=None),
    "int8 K and V": dict(k_format="int8", v_format="int8", window=None),
    "fp8 K and V": dict(k_format="fp8", v_format="fp8", window=None),
    "int4 K and V": dict(k_format="int4", v_format="int4", window=None),
    "Window 256 + 4 sinks": dict(window=256, sinks=4),
}


def parse_layers(text: str) -> tuple[int, ...]:
    """'0, 1, 28-29' -> (0, 1, 28, 29). Raises ConfigError with a readable message."""
    layers: list[int] = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                first, last = (int(p) for p in part.split("-", 1))
                layers.extend(range(first, last + 1))
            else:
                layers.append(int(part))
        except ValueError:
            raise ConfigError(f"full-precision layers: {part!r} is not a layer number or range like 0-3") from None
    return tuple(layers)


def _spin(box, value):
    box.setValue(value)
    return box


class SettingsDialog(QDialog):
    def __init__(self, settings: AppSettings, num_layers: int | None = None, parent: QWidget | None = None,
                 model_config=None, model_dtype: str = "fp32", device: str = "cpu"):
        super().__init__(parent)
        self.setWindowTitle("kvchat settings")
        self.setObjectName("settingsDialog")
        self.num_layers = num_layers
        self.model_config = model_config        # the loaded model's ModelConfig; None before a model loads
        self.model_dtype = model_dtype
        self.device = device
        self.loaded_model = settings.model
        self._result: AppSettings | None = None
        layout = QVBoxLayout(self)
        layout.addWidget(self._model_group(settings.model))
        layout.addWidget(self._cache_group(settings.cache))
        layout.addWidget(self._sampling_group(settings.sampling))
        self.system_prompt = QPlainTextEdit(settings.system_prompt)
        self.system_prompt.setPlaceholderText("Optional: instructions the model sees before every new chat")
        self.system_prompt.setFixedHeight(64)
        prompt_box = QGroupBox("System prompt (new chats)")
        QVBoxLayout(prompt_box).addWidget(self.system_prompt)
        layout.addWidget(prompt_box)
        self.error_label = QLabel(objectName="settingsError")
        self.error_label.setWordWrap(True)
        self.error_label.setVisible(False)
        layout.addWidget(self.error_label)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        layout.addWidget(self.buttons)
        for kind, signal in ((QComboBox, "currentIndexChanged"), (QSpinBox, "valueChanged"),
                             (QDoubleSpinBox, "valueChanged"), (QLineEdit, "textChanged"),
                             (QPlainTextEdit, "textChanged")):
            for widget in self.findChildren(kind):
                getattr(widget, signal).connect(self.validate)
        self.validate()

    # --- groups ---

    def _model_group(self, model: str) -> QGroupBox:
        box = QGroupBox("Model")
        row = QHBoxLayout(box)
        self.model_edit = QLineEdit(model)
        self.model_edit.setPlaceholderText("default (SmolLM2-135M-Instruct), a model folder or a .gguf file")
        self.model_edit.setToolTip("'default', a local Hugging Face folder (config.json + safetensors) or a .gguf "
                                   "file of the Llama family. Changing it reloads the model.")
        folder = QPushButton("Folder…")
        folder.clicked.connect(self._choose_folder)
        gguf = QPushButton(".gguf…")
        gguf.clicked.connect(self._choose_gguf)
        default = QPushButton("Default")
        default.clicked.connect(lambda: self.model_edit.setText("default"))
        for widget in (self.model_edit, folder, gguf, default):
            row.addWidget(widget)
        row.setStretch(0, 1)
        return box

    def _cache_group(self, cache: CacheConfig) -> QGroupBox:
        box = QGroupBox("KV cache (applies to the open chat live)")
        form = QFormLayout(box)
        self.preset = QComboBox()
        self.preset.addItem("Presets…")
        self.preset.addItems(list(PRESETS))
        self.preset.activated.connect(self._apply_preset)
        form.addRow("Quick choice", self.preset)
        self.k_format, self.v_format = QComboBox(), QComboBox()
        for combo, value in ((self.k_format, cache.k_format), (self.v_format, cache.v_format)):
            combo.addItems(list(FORMATS))
            combo.setCurrentText(value)
        formats = QHBoxLayout()
        formats.addWidget(QLabel("K"))
        formats.addWidget(self.k_format, 1)
        formats.addWidget(QLabel("V"))
        formats.addWidget(self.v_format, 1)
        form.addRow("Formats", formats)
        self.k_scheme = QComboBox()
        self.k_scheme.addItems(list(KEY_SCHEMES))
        self.k_scheme.setCurrentText(cache.k_scheme)
        self.k_scheme.setToolTip("channel: keys quantized per channel over each block (more accurate); "
                                 "token: per token")
        form.addRow("Key quantization", self.k_scheme)
        self.full_layers = QLineEdit(", ".join(str(i) for i in cache.full_precision_layers))
        self.full_layers.setPlaceholderText("none, or e.g. 0, 1, 28-29")
        form.addRow("Full-precision layers", self.full_layers)
        self.window = QSpinBox(minimum=0, maximum=1_000_000, singleStep=64, specialValueText="no window")
        self.window.setValue(cache.window or 0)
        self.sinks = _spin(QSpinBox(minimum=0, maximum=1024), cache.sinks)
        window_row = QHBoxLayout()
        window_row.addWidget(self.window, 1)
        window_row.addWidget(QLabel("sinks"))
        window_row.addWidget(self.sinks)
        form.addRow("Window (tokens)", window_row)
        self.block_size = _spin(QSpinBox(minimum=1, maximum=256), cache.block_size)
        form.addRow("Block size (tokens)", self.block_size)
        self.budget = QDoubleSpinBox(minimum=0.0, maximum=1_048_576.0, decimals=1, suffix=" MiB", singleStep=64.0)
        self.budget.setValue(cache.budget_mb)
        form.addRow("KV budget", self.budget)
        self.overflow = QComboBox()
        self.overflow.addItems(list(OVERFLOW_POLICIES))
        self.overflow.setCurrentText(cache.overflow)
        self.overflow.setToolTip("stop: end the reply with a message when the budget is full; "
                                 "slide: keep going in a window")
        form.addRow("When the budget is full", self.overflow)
        return box

    def _sampling_group(self, sampling: SamplingParams) -> QGroupBox:
        box = QGroupBox("Sampling")
        form = QFormLayout(box)
        self.temperature = _spin(QDoubleSpinBox(minimum=0.0, maximum=5.0, decimals=2, singleStep=0.05,
                                                specialValueText="0 (greedy)"), sampling.temperature)
        self.top_p = _spin(QDoubleSpinBox(minimum=0.0, maximum=1.0, decimals=2, singleStep=0.05), sampling.top_p)
        self.top_k = _spin(QSpinBox(minimum=0, maximum=100_000, specialValueText="off"), sampling.top_k)
        self.max_new_tokens = _spin(QSpinBox(minimum=0, maximum=1_000_000, singleStep=64), sampling.max_new_tokens)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Max new tokens", self.max_new_tokens)
        return box

    # --- behaviour ---

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose a model folder", str(Path.home()))
        if folder:
            self.model_edit.setText(folder)

    def _choose_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model", str(Path.home()), "GGUF models (*.gguf)")
        if path:
            self.model_edit.setText(path)

    def _apply_preset(self, index: int) -> None:
        changes = PRESETS.get(self.preset.itemText(index))
        if not changes:
            return
        if "k_format" in changes:
            self.k_format.setCurrentText(changes["k_format"])
            self.v_format.setCurrentText(changes["v_format"])
        if "window" in changes:
            self.window.setValue(changes["window"] or 0)
        if "sinks" in changes:
            self.sinks.setValue(changes["sinks"])
        self.preset.setCurrentIndex(0)

    def cache_config(self) -> CacheConfig:
        layers = parse_layers(self.full_layers.text())
        if self.model_config is None and self.num_layers is not None and any(i >= self.num_layers for i in layers):
            raise ConfigError(f"full-precision layers: this model has layers 0-{self.num_layers - 1}")
        cache = CacheConfig(k_format=self.k_format.currentText(), v_format=self.v_format.currentText(),
                            k_scheme=self.k_scheme.currentText(), full_precision_layers=layers,
                            window=self.window.value() or None, sinks=self.sinks.value(),
                            block_size=self.block_size.value(), budget_mb=self.budget.value(),
                            overflow=self.overflow.currentText())
        same_model = (self.model_edit.text().strip() or "default") == self.loaded_model
        if self.model_config is not None and same_model:    # another model is checked when it loads
            check_cache_for_model(cache, self.model_config, self.model_dtype, self.device)
        return cache

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature.value(), top_p=self.top_p.value(),
                              top_k=self.top_k.value(), max_new_tokens=self.max_new_tokens.value())

    def settings(self) -> AppSettings:
        """The edited settings; raises ConfigError when they do not form a valid combination."""
        model = self.model_edit.text().strip() or "default"
        if model != "default" and not Path(model).expanduser().exists():
            raise ConfigError(f"model: {model} does not exist; choose a folder or .gguf file, or 'default'")
        return AppSettings(model=model, cache=self.cache_config(), sampling=self.sampling_params(),
                           system_prompt=self.system_prompt.toPlainText().strip())

    def validate(self, *_args) -> str | None:
        try:
            self._result = self.settings()
            error = None
        except ConfigError as exc:
            self._result, error = None, str(exc)
        self.error_label.setText(error or "")
        self.error_label.setVisible(error is not None)
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(error is None)
        return error

    def result_settings(self) -> AppSettings | None:
        return self._result
