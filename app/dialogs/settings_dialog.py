"""Past 450 lines on purpose: one form whose every field is validated together against the engine's configs.

Settings: where the model runs (this computer or a server), model, cache formats and policies, sampling,
speculative decoding, system prompt.

Every edit is validated by building the engine's own frozen configs and, once a model is loaded,
by the engine's own check of a cache config against that model (kv_layout.check_cache_for_model); a
ConfigError's message is shown in the dialog and OK stays disabled until the combination works.
"""
from __future__ import annotations

import threading
from pathlib import Path

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog, QFormLayout,
                               QFrame, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QMessageBox, QPlainTextEdit,
                               QPushButton, QScrollArea, QSpinBox, QVBoxLayout, QWidget)

from kvchat.engine.config import FORMATS, KEY_SCHEMES, MAX_DRAFTS, OVERFLOW_POLICIES, CacheConfig, ConfigError, SamplingParams
from kvchat.engine.kv.layout import SUMMARY_BYTES, check_cache_for_model, full_dtype, kv_layout
from kvchat.engine.units import DTYPE_BYTES

from kvchat.app.engine_text import engine_text
from kvchat.app.i18n import choice, choose, fill_choices, language_names, value_name
from kvchat.app.bridge.messages import format_bytes
from kvchat.app.store.settings_store import DEFAULT_SPECULATIVE, AppSettings, RemoteSettings

LOCAL_CHOICE, SERVER_CHOICE = "This computer", "Server"     # the engine choice's item data (shown translated)


def fetch_models(base_url: str, api_key: str) -> list[str]:
    """The models an OpenAI-compatible server lists (GET /v1/models); RemoteError/ConfigError say what to check."""
    from kvchat.engine.serve.remote import RemoteEngine
    engine = RemoteEngine.connect(base_url, api_key or None)
    engine.http.close()
    return list(engine.models)

PRESETS = {                             # names shown through QCoreApplication.translate("SettingsDialog", name)
    QT_TRANSLATE_NOOP("SettingsDialog", "Full precision"): dict(k_format="auto", v_format="auto", window=None),
    QT_TRANSLATE_NOOP("SettingsDialog", "int8 K and V"): dict(k_format="int8", v_format="int8", window=None),
    QT_TRANSLATE_NOOP("SettingsDialog", "fp8 K and V"): dict(k_format="fp8", v_format="fp8", window=None),
    QT_TRANSLATE_NOOP("SettingsDialog", "int4 K and V"): dict(k_format="int4", v_format="int4", window=None),
    QT_TRANSLATE_NOOP("SettingsDialog", "Window 256 + 4 sinks"): dict(window=256, sinks=4),
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
            raise ConfigError(QCoreApplication.translate(
                "SettingsDialog", "full-precision layers: {part} is not a layer number or range like 0-3").format(
                part=repr(part))) from None
    return tuple(layers)


MAX_RETRIEVAL_BLOCKS = 4096        # Fetch what is needed: the most blocks a token may read beside the sinks and newest
QUANT_BYTES = {"int8": 1.0, "fp8": 1.0, "int4": 0.5}     # per value, scales left out: an estimate before a model loads


def key_summary_share(k_format: str, v_format: str, block_size: int, model_dtype: str = "fp32", device: str = "cpu",
                      model_config=None) -> float:
    """What the key summary Fetch what is needed keeps adds to each block, as a share of the block: the engine's own
    layout on the loaded model, else an estimate from the formats (per key channel a bf16 max and min per block,
    against block_size keys and values)."""
    if model_config is not None:
        try:
            layout = kv_layout(model_config, CacheConfig(k_format=k_format, v_format=v_format, block_size=block_size,
                                                         retrieval_blocks=1), model_dtype, device)
            if layout.block_bytes > layout.summary_bytes:
                return layout.summary_bytes / (layout.block_bytes - layout.summary_bytes)
        except ConfigError:
            pass
    full = DTYPE_BYTES.get(full_dtype(model_dtype, device), 2)
    k, v = (QUANT_BYTES.get(f, DTYPE_BYTES.get(f, full)) for f in (k_format, v_format))
    return 2 * SUMMARY_BYTES / (block_size * (k + v))


def _spin(box, value):
    box.setValue(value)
    return box


class SettingsDialog(QDialog):
    models_fetched = Signal(object, str)    # (model ids or None, error): from the fetching thread
    # the saved caches on disk are the engine thread's: the dialog asks (the window sends DeleteSavedCaches) and
    # shows what it is told (show_saved_caches, from EngineHost.saved_caches)
    delete_saved = Signal()

    def __init__(self, settings: AppSettings, num_layers: int | None = None, parent: QWidget | None = None,
                 model_config=None, model_dtype: str = "fp32", device: str = "cpu",
                 last_server: RemoteSettings | None = None, language: str = "system", disk_budget_mb: float = 2048.0,
                 speculative: tuple[str, int] = DEFAULT_SPECULATIVE, prefill: str = "auto", linear_layers: int = 0,
                 shared_kv_layers: int = 0, activations: str = "int16"):
        super().__init__(parent)
        self.linear_layers = linear_layers      # of the loaded model's layers, those keeping a recurrent state
        self.shared_kv_layers = shared_kv_layers    # and those reading an earlier layer's K and V
        self._disk_budget_mb = disk_budget_mb
        self._speculative = speculative
        self._prefill = prefill
        self._activations = activations
        self.setWindowTitle(self.tr("kvchat settings"))
        self.setObjectName("settingsDialog")
        self.num_layers = num_layers
        self.model_config = model_config        # the loaded model's ModelConfig; None before a model loads
        self.model_dtype = model_dtype
        self.device = device
        self.loaded_model = settings.model
        self._result: AppSettings | None = None
        self._initial_cache = settings.cache
        outer = QVBoxLayout(self)
        content = QWidget(objectName="settingsContent")
        layout = QVBoxLayout(content)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self._engine_group(settings.remote or last_server, settings.remote is not None))
        layout.addWidget(self._model_group(settings.model))
        layout.addWidget(self._cache_group(settings.cache))
        layout.addWidget(self._sampling_group(settings.sampling))
        self.system_prompt = QPlainTextEdit(settings.system_prompt)
        self.system_prompt.setPlaceholderText(self.tr("Optional: instructions the model sees before every new chat"))
        self.system_prompt.setFixedHeight(64)
        prompt_box = QGroupBox(self.tr("System prompt (new chats)"))
        QVBoxLayout(prompt_box).addWidget(self.system_prompt)
        layout.addWidget(prompt_box)
        layout.addWidget(self._language_group(language))
        layout.addStretch(1)
        # the groups scroll on a short screen; the error and OK / Cancel stay in sight under them
        self.scroll = QScrollArea(objectName="settingsScroll", widgetResizable=True, frameShape=QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.setWidget(content)
        outer.addWidget(self.scroll, 1)
        self.error_label = QLabel(objectName="settingsError")
        self.error_label.setWordWrap(True)
        self.error_label.setVisible(False)
        outer.addWidget(self.error_label)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        outer.addWidget(self.buttons)
        self._engine_changed()
        for kind, signal in ((QComboBox, "currentIndexChanged"), (QComboBox, "currentTextChanged"), (QSpinBox, "valueChanged"),
                             (QDoubleSpinBox, "valueChanged"), (QLineEdit, "textChanged"),
                             (QPlainTextEdit, "textChanged")):
            for widget in self.findChildren(kind):
                getattr(widget, signal).connect(self.validate)
        self.models_fetched.connect(self._on_models_fetched)
        self.validate()

    # --- groups ---

    def _language_group(self, language: str) -> QGroupBox:
        box = QGroupBox(self.tr("Interface"))
        form = QFormLayout(box)
        self.language_choice = QComboBox(objectName="languageChoice")
        for code, name in language_names().items():
            self.language_choice.addItem(name, code)
        self.language_choice.setCurrentIndex(max(0, self.language_choice.findData(language)))
        self.language_choice.setToolTip(self.tr("System follows the computer's language. "
                                                "A change applies when kvchat starts again."))
        form.addRow(self.tr("Language (applies on restart)"), self.language_choice)
        return box

    def language(self) -> str:
        """The chosen interface language: "system", "en" or "zh_CN"."""
        return str(self.language_choice.currentData() or "system")

    def _engine_group(self, server: RemoteSettings | None, use_server: bool) -> QGroupBox:
        box = QGroupBox(self.tr("Where the model runs"))
        form = QFormLayout(box)
        self.engine_choice = QComboBox(objectName="engineChoice")
        self.engine_choice.addItem(self.tr("This computer"), LOCAL_CHOICE)
        self.engine_choice.addItem(self.tr("Server"), SERVER_CHOICE)
        self.engine_choice.setToolTip(self.tr("This computer: kvchat loads the model itself. Server: an "
                                              "OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, kvchat "
                                              "serve) runs it."))
        form.addRow(self.tr("Engine"), self.engine_choice)
        self.server_box = QWidget()
        server_form = QFormLayout(self.server_box)
        server_form.setContentsMargins(0, 0, 0, 0)
        self.server_url = QLineEdit(server.base_url if server else "", objectName="serverUrl")
        self.server_url.setPlaceholderText("http://127.0.0.1:8000/v1")
        server_form.addRow(self.tr("Base URL"), self.server_url)
        self.api_key = QLineEdit(server.api_key if server else "", objectName="serverKey")
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.api_key.setPlaceholderText(self.tr("empty if the server needs none"))
        server_form.addRow(self.tr("API key"), self.api_key)
        self.server_model = QComboBox(objectName="serverModel", editable=True)
        self.server_model.lineEdit().setPlaceholderText(self.tr("the server's first model"))
        if server and server.model:
            self.server_model.addItem(server.model)
        self.fetch_button = QPushButton(self.tr("Fetch models"), objectName="fetchModels")
        self.fetch_button.setToolTip(self.tr("Ask the server which models it serves (GET /v1/models)"))
        self.fetch_button.clicked.connect(self.fetch_models)
        model_row = QHBoxLayout()
        model_row.addWidget(self.server_model, 1)
        model_row.addWidget(self.fetch_button)
        server_form.addRow(self.tr("Model"), model_row)
        self.server_status = QLabel("", objectName="serverStatus")
        self.server_status.setWordWrap(True)
        server_form.addRow(self.server_status)
        form.addRow(self.server_box)
        self.engine_choice.setCurrentIndex(self.engine_choice.findData(SERVER_CHOICE if use_server else LOCAL_CHOICE))
        self.engine_choice.currentIndexChanged.connect(self._engine_changed)
        return box

    def uses_server(self) -> bool:
        return self.engine_choice.currentData() == SERVER_CHOICE

    def _fit_to_screen(self) -> None:
        """As tall as the groups need, but never taller than the screen (they scroll then)."""
        content = self.scroll.widget()
        content.adjustSize()
        bar = self.scroll.verticalScrollBar().sizeHint().width()
        self.scroll.setMinimumWidth(content.minimumSizeHint().width() + bar)
        screen = (self.screen() or QCoreApplication.instance().primaryScreen()).availableGeometry()
        chrome = self.sizeHint().height() - self.scroll.sizeHint().height()
        height = min(content.sizeHint().height() + chrome + 4, int(screen.height() * 0.9))
        self.resize(self.sizeHint().width(), height)

    def _engine_changed(self, *_args) -> None:
        server = self.uses_server()
        self.server_box.setVisible(server)
        for part in (self.model_box, self.cache_box, self.spec_row):     # the model box holds the prompt precision
            part.setEnabled(not server)
        self.cache_box.setTitle(self.tr("KV cache (the server chooses its own)") if server
                                else self.tr("KV cache (applies to the open chat live)"))
        self._fit_to_screen()

    def fetch_models(self) -> None:
        """Ask the server for its models in a thread of its own; the answer lands in the Model list."""
        url, key = self.server_url.text().strip(), self.api_key.text().strip()
        self.fetch_button.setEnabled(False)
        self.server_status.setText(self.tr("Asking {url} for its models…").format(url=url))

        def work():
            try:
                models, error = fetch_models(url, key), ""
            except Exception as exc:  # noqa: BLE001 - RemoteError and ConfigError say what to check
                models, error = None, str(exc).strip() or type(exc).__name__
            try:
                self.models_fetched.emit(models, error)
            except RuntimeError:        # the dialog was closed meanwhile
                pass

        threading.Thread(target=work, name="kvchat-fetch-models", daemon=True).start()

    def _on_models_fetched(self, models, error: str) -> None:
        self.fetch_button.setEnabled(True)
        if models is None:
            self.server_status.setText(self.tr("Could not get the models: {error}").format(error=error))
            self.server_status.setProperty("error", True)
            return
        chosen = self.server_model.currentText().strip()
        self.server_model.clear()
        self.server_model.addItems(models)
        self.server_model.setCurrentText(chosen if chosen in models else models[0])
        self.server_status.setProperty("error", False)
        serves = self.tr("The server serves 1 model: {models}.") if len(models) == 1 else \
            self.tr("The server serves {n} models: {models}.")
        self.server_status.setText(serves.format(n=len(models), models=", ".join(models)) + " "
                                   + self.tr("OK connects to it; it is saved once the connection works."))

    def _model_group(self, model: str) -> QGroupBox:
        box = self.model_box = QGroupBox(self.tr("Model"))
        column = QVBoxLayout(box)
        row = QHBoxLayout()
        column.addLayout(row)
        self.model_edit = QLineEdit(model)
        self.model_edit.setPlaceholderText(self.tr("default (SmolLM2-135M-Instruct), a model folder or a .gguf file"))
        self.model_edit.setToolTip(self.tr("'default', a local Hugging Face folder (config.json + safetensors) or a "
                                           ".gguf file of the Llama family. Changing it reloads the model."))
        folder = QPushButton(self.tr("Folder…"))
        folder.clicked.connect(self._choose_folder)
        gguf = QPushButton(".gguf…")
        gguf.clicked.connect(self._choose_gguf)
        default = QPushButton(self.tr("Default"))
        default.clicked.connect(lambda: self.model_edit.setText("default"))
        for widget in (self.model_edit, folder, gguf, default):
            row.addWidget(widget)
        row.setStretch(0, 1)
        form = QFormLayout()
        column.addLayout(form)
        form.addRow(self.tr("Read prompts in"), self._prefill_combo())
        form.addRow(self.tr("Decode with"), self._activations_combo())
        return box

    def _prefill_combo(self) -> QComboBox:
        """The prompt GEMM's precision (EngineConfig.prefill), applied live to the next prompt."""
        from kvchat.engine.runtime.engine import auto_prefill   # the engine's answer; the app does not ask kernels/
        auto, _why = auto_prefill()
        self.prefill_combo = _choices("prefillMode", [
            (self.tr("Automatic ({precision} on this CPU)").format(precision=auto), "auto"),
            (self.tr("fp32 (exact)"), "fp32"),
            (self.tr("bf16 (about 5x faster on a CPU with AMX)"), "bf16"),
            (self.tr("int8 (rows rounded as llama.cpp does; CPUs with AVX2)"), "int8")], self._prefill, self.tr(
            "How the model reads a prompt over packed weights. fp32 is exact; bf16 agreed with it on 97.7% of next-token "
            "choices over 512 tokens of prose (llama.cpp's own prompt path: 95.9%). Replies are decoded the same way "
            "either way."))
        return self.prefill_combo

    def _activations_combo(self) -> QComboBox:
        """Decode rows' activations (EngineConfig.activations), applied live to the next token."""
        self.activations_combo = _choices("activationsMode", [
            (self.tr("int16 activations (exact to about 1e-5)"), "int16"),
            (self.tr("int8 activations (rounded as llama.cpp does; faster from memory)"), "int8")], self._activations,
            self.tr("How a reply's tokens are computed over packed weights. int16 follows the exact product; int8 rounds "
                    "each group of 32 activations as llama.cpp does and reads a large model's weights faster (its "
                    "next-token choices agreed with the exact path on 95.5% of 512 tokens of prose, llama.cpp's on "
                    "95.9%)."))
        return self.activations_combo

    def _cache_group(self, cache: CacheConfig) -> QGroupBox:
        box = self.cache_box = QGroupBox(self.tr("KV cache (applies to the open chat live)"))
        form = QFormLayout(box)
        self.preset = QComboBox()
        self.preset.addItem(self.tr("Presets…"))
        for name in PRESETS:
            self.preset.addItem(self.tr(name), name)
        self.preset.activated.connect(self._apply_preset)
        form.addRow(self.tr("Quick choice"), self.preset)
        self.k_format, self.v_format = QComboBox(), QComboBox()
        for combo, value in ((self.k_format, cache.k_format), (self.v_format, cache.v_format)):
            fill_choices(combo, FORMATS, value)
        form.addRow(self.tr("Formats"), formats_row(self.k_format, self.v_format))
        self.k_scheme = QComboBox()
        fill_choices(self.k_scheme, KEY_SCHEMES, cache.k_scheme)
        self.k_scheme.setToolTip(self.tr("channel: keys quantized per channel over each block (more accurate); "
                                         "token: per token"))
        form.addRow(self.tr("Key quantization"), self.k_scheme)
        self.full_layers = QLineEdit(", ".join(str(i) for i in cache.full_precision_layers))
        self.full_layers.setPlaceholderText(self.tr("none, or e.g. 0, 1, 28-29"))
        form.addRow(self.tr("Full-precision layers"), self.full_layers)
        self.window = QSpinBox(minimum=0, maximum=1_000_000, singleStep=64, specialValueText=self.tr("no window"))
        self.window.setValue(cache.window or 0)
        self.sinks = _spin(QSpinBox(minimum=0, maximum=1024), cache.sinks)
        window_row = QHBoxLayout()
        window_row.addWidget(self.window, 1)
        window_row.addWidget(QLabel(self.tr("sinks")))
        window_row.addWidget(self.sinks)
        form.addRow(self.tr("Window (tokens)"), window_row)
        self._keep_fetch_rows(form, cache)
        # a model with linear-attention or KV-sharing layers: what the formats and the window above do not reach
        self.state_note = QLabel(objectName="stateLayersNote")
        self.state_note.setWordWrap(True)
        own = (self.num_layers or 0) - self.linear_layers - self.shared_kv_layers
        notes = []
        if self.linear_layers and self.num_layers:
            notes.append(self.tr(
                "The formats and the window apply to this model's {n} attention layers only; its {m} linear-attention "
                "layers keep an fp32 state of fixed size.").format(n=own, m=self.linear_layers))
        if self.shared_kv_layers and self.num_layers:
            notes.append(self.tr(
                "The formats and the window apply to the {n} layers that hold K and V of their own; this model's other "
                "{m} layers read the K and V of an earlier layer, in that layer's format.").format(
                    n=own, m=self.shared_kv_layers))
        self.state_note.setText(" ".join(notes))
        self.state_note.setVisible(bool(self.state_note.text()))
        form.addRow(self.state_note)
        self.block_size = _spin(QSpinBox(minimum=1, maximum=256), cache.block_size)
        form.addRow(self.tr("Block size (tokens)"), self.block_size)
        self.budget = QDoubleSpinBox(minimum=0.0, maximum=1_048_576.0, decimals=1, suffix=" MiB", singleStep=64.0)
        self.budget.setValue(cache.budget_mb)
        form.addRow(self.tr("KV budget"), self.budget)
        # warm conversations: each chat's KV saved in the user cache dir, least recently used first out
        self.disk_budget = QDoubleSpinBox(minimum=0.0, maximum=1_048_576.0, decimals=0, suffix=" MiB", singleStep=256.0,
                                          objectName="diskBudget")
        self.disk_budget.setValue(self._disk_budget_mb)
        self.disk_budget.setToolTip(self.tr("Each chat's KV cache is saved here when you switch away or close the "
                                            "app, so reopening it does not read the whole chat again"))
        self.saved_caches = QLabel(objectName="savedCaches")
        self.clear_saved = QPushButton(self.tr("Clear"), objectName="clearSavedCaches")
        self.clear_saved.clicked.connect(self._clear_saved_caches)
        disk_row = QHBoxLayout()
        disk_row.addWidget(self.disk_budget, 1)
        disk_row.addWidget(self.saved_caches)
        disk_row.addWidget(self.clear_saved)
        form.addRow(self.tr("Saved caches on disk"), disk_row)
        self._saved: tuple[int, int] | None = None     # (files, bytes) as the engine thread last counted them
        self.clear_saved.setEnabled(False)      # until that count comes
        self.overflow = QComboBox()
        fill_choices(self.overflow, OVERFLOW_POLICIES, cache.overflow)
        self.overflow.setToolTip(self.tr("stop: end the reply with a message when the budget is full; "
                                         "slide: keep going in a window"))
        form.addRow(self.tr("When the budget is full"), self.overflow)
        return box

    def _keep_fetch_rows(self, form: QFormLayout, cache: CacheConfig) -> None:
        """Keep what matters (eviction="importance", within a window) and Fetch what is needed (retrieval_blocks,
        without one), each with what it costs; a window and Fetch exclude each other, so each is off while the
        other is set."""
        self.keep_important = QCheckBox(self.tr("Keep what matters"), objectName="keepWhatMatters")
        self.keep_important.setChecked(cache.eviction == "importance")
        self.keep_cost = QLabel(self.tr("Drops the least-attended blocks instead of the oldest: costs about 2% of "
                                        "decode speed to measure attention; cannot know a question asked later."),
                                objectName="keepCost", wordWrap=True)
        form.addRow("", self.keep_important)
        form.addRow("", self.keep_cost)
        self.fetch_blocks = QSpinBox(minimum=0, maximum=MAX_RETRIEVAL_BLOCKS, singleStep=8, objectName="fetchBlocks",
                                     specialValueText=self.tr("off"), suffix=self.tr(" blocks read per token"))
        self.fetch_blocks.setValue(cache.retrieval_blocks or 0)
        self.fetch_cost = QLabel(objectName="fetchCost", wordWrap=True)
        form.addRow(self.tr("Fetch what is needed"), self.fetch_blocks)
        form.addRow("", self.fetch_cost)
        for cost in (self.keep_cost, self.fetch_cost):
            cost.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        self.keep_important.toggled.connect(self.validate)
        self.window.valueChanged.connect(self._keep_fetch_changed)
        self.fetch_blocks.valueChanged.connect(self._keep_fetch_changed)
        self._keep_fetch_changed()

    def _keep_fetch_changed(self, *_args) -> None:
        """A window set turns Fetch what is needed off and lets Keep what matters be chosen; Fetch set turns the
        window off. Keep what matters keeps its tick while there is no window, unused."""
        window, fetch = self.window.value() > 0, self.fetch_blocks.value() > 0
        if window and fetch:            # set from outside (a preset): the window wins, as Settings shows it
            self.fetch_blocks.setValue(0)
            fetch = False
        self.fetch_blocks.setEnabled(not window)
        self.window.setEnabled(not fetch)
        self.keep_important.setEnabled(window)
        self.keep_cost.setEnabled(window)
        self.keep_important.setToolTip("" if window else self.tr("Needs a window: set Window (tokens) above."))
        self.fetch_blocks.setToolTip(self.tr("Needs no window: set Window (tokens) to no window first.")
                                     if window else "")

    def _show_fetch_cost(self) -> None:
        """The cost line under Fetch what is needed, with the key summary's share of memory for these formats."""
        same = self.model_config is not None and self._same_model()
        share = 100 * key_summary_share(choice(self.k_format), choice(self.v_format), self.block_size.value(),
                                        self.model_dtype, self.device, self.model_config if same else None)
        pct = f"{share:.0f}" if share >= 1 else f"{share:.1g}"
        self.fetch_cost.setText(self.tr("Keeps every block plus a small key summary (about {pct}% more memory) and "
                                        "reads only the chosen blocks: faster at long context, may miss what a "
                                        "summary ranks low.").format(pct=pct))
        self.fetch_cost.setEnabled(self.window.value() == 0)

    def _sampling_group(self, sampling: SamplingParams) -> QGroupBox:
        box = QGroupBox(self.tr("Sampling"))
        form = QFormLayout(box)
        self.temperature = _spin(QDoubleSpinBox(minimum=0.0, maximum=5.0, decimals=2, singleStep=0.05,
                                                specialValueText=self.tr("0 (greedy)")), sampling.temperature)
        self.top_p = _spin(QDoubleSpinBox(minimum=0.0, maximum=1.0, decimals=2, singleStep=0.05), sampling.top_p)
        self.top_k = _spin(QSpinBox(minimum=0, maximum=100_000, specialValueText=self.tr("off")), sampling.top_k)
        self.max_new_tokens = _spin(QSpinBox(minimum=0, maximum=1_000_000, singleStep=64), sampling.max_new_tokens)
        form.addRow(self.tr("Temperature"), self.temperature)
        form.addRow(self.tr("Top-p"), self.top_p)
        form.addRow(self.tr("Top-k"), self.top_k)
        form.addRow(self.tr("Max new tokens"), self.max_new_tokens)
        form.addRow(self.tr("Speculative decoding"), self._speculative_row())
        return box

    def _speculative_row(self) -> QWidget:
        """Local engines only: a server decodes its own way."""
        method, k = self._speculative
        self.spec_method = QComboBox(objectName="specMethod")
        self.spec_method.addItem(self.tr("Off"), "off")
        self.spec_method.addItem(self.tr("Prompt lookup"), "lookup")
        self.spec_method.setCurrentIndex(max(0, self.spec_method.findData(method)))
        self.spec_tokens = _spin(QSpinBox(minimum=1, maximum=MAX_DRAFTS, suffix=self.tr(" tokens a step"),
                                          objectName="specTokens"), k)
        tip = self.tr("Prompt lookup guesses the next tokens from text already in the chat (code, quotes), and the "
                      "model checks them all in one step. The reply is the same; it comes sooner when it copies, and "
                      "kvchat drafts only as many as pay on this machine.")
        self.spec_row = QWidget()
        row = QHBoxLayout(self.spec_row)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.spec_method, 1)
        row.addWidget(QLabel(self.tr("up to")))
        row.addWidget(self.spec_tokens)
        for widget in (self.spec_row, self.spec_method, self.spec_tokens):
            widget.setToolTip(tip)
        self.spec_method.currentIndexChanged.connect(self._spec_method_changed)
        self._spec_method_changed()
        return self.spec_row

    # --- behaviour ---

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, self.tr("Choose a model folder"), str(Path.home()))
        if folder:
            self.model_edit.setText(folder)

    def _choose_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, self.tr("Choose a GGUF model"), str(Path.home()),
                                              self.tr("GGUF models (*.gguf)"))
        if path:
            self.model_edit.setText(path)

    def _apply_preset(self, index: int) -> None:
        apply_preset(self, index)

    def cache_config(self) -> CacheConfig:
        layers = parse_layers(self.full_layers.text())
        if self.model_config is None and self.num_layers is not None and any(i >= self.num_layers for i in layers):
            raise ConfigError(self.tr("full-precision layers: this model has layers 0-{last}").format(
                last=self.num_layers - 1))
        fields = dict(k_format=choice(self.k_format), v_format=choice(self.v_format),
                      k_scheme=choice(self.k_scheme), full_precision_layers=layers,
                      window=self.window.value() or None, sinks=self.sinks.value(),
                      block_size=self.block_size.value(), budget_mb=self.budget.value(),
                      overflow=choice(self.overflow))
        choices = self.keep_fetch()
        try:
            cache = CacheConfig(**fields, **choices)
        except ConfigError as exc:
            raise self._keep_fetch_error(fields, choices) or exc from None
        if self.model_config is not None and self._same_model():    # another model is checked when it loads
            check_cache_for_model(cache, self.model_config, self.model_dtype, self.device)
        return cache

    def keep_fetch(self) -> dict:
        """The CacheConfig fields of Keep what matters and Fetch what is needed: eviction ("importance" only while
        a window is set) and retrieval_blocks (None when off)."""
        window = self.window.value() > 0
        return dict(eviction="importance" if window and self.keep_important.isChecked() else "window",
                    retrieval_blocks=(self.fetch_blocks.value() or None) if not window else None)

    def _keep_fetch_error(self, fields: dict, choices: dict) -> ConfigError | None:
        """The engine refused the cache because of Keep what matters or Fetch what is needed (it takes the same
        cache without them): what to change, said with this dialog's names. None: the refusal is another's."""
        try:
            CacheConfig(**fields)
        except ConfigError:
            return None
        if choices["eviction"] == "importance":
            block = fields["block_size"]
            least = (max(1, -(-fields["sinks"] // block)) + 2) * block
            return ConfigError(self.tr("Keep what matters holds the sinks, the newest block and at least one chosen "
                                       "block: use a window of at least {least} tokens, or untick it").format(
                least=least))
        if fields["overflow"] == "slide":
            return ConfigError(self.tr("Fetch what is needed keeps every block, so the budget cannot slide into a "
                                       "window: choose \"{stop}\" when the budget is full, or turn Fetch off").format(
                stop=value_name("stop")))
        return None

    def _same_model(self) -> bool:
        return (self.model_edit.text().strip() or "default") == self.loaded_model

    def cache_config_unchecked(self) -> CacheConfig:
        """The cache fields as they are (kept for when the app runs locally again); a server ignores them."""
        try:
            return self.cache_config()
        except ConfigError:
            return self._initial_cache

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature.value(), top_p=self.top_p.value(),
                              top_k=self.top_k.value(), max_new_tokens=self.max_new_tokens.value())

    def settings(self) -> AppSettings:
        """The edited settings; raises ConfigError when they do not form a valid combination."""
        if self.uses_server():
            from kvchat.engine.serve.remote import _v1
            url = self.server_url.text().strip()
            if not url:
                raise ConfigError(self.tr("server: enter its base URL, e.g. http://127.0.0.1:8000/v1"))
            _v1(url)                    # says what is wrong with it
            remote = RemoteSettings(url, self.api_key.text().strip(), self.server_model.currentText().strip())
            return AppSettings(model=self.loaded_model, cache=self.cache_config_unchecked(),
                               sampling=self.sampling_params(),
                               system_prompt=self.system_prompt.toPlainText().strip(), remote=remote)
        model = self.model_edit.text().strip() or "default"
        if model != "default" and not Path(model).expanduser().exists():
            raise ConfigError(self.tr("model: {model} does not exist; choose a folder or .gguf file, or "
                                      "'default'").format(model=model))
        return AppSettings(model=model, cache=self.cache_config(), sampling=self.sampling_params(),
                           system_prompt=self.system_prompt.toPlainText().strip())

    def validate(self, *_args) -> str | None:
        # the note is about the loaded model: another one in the Model field may have no such layers
        self.state_note.setVisible(bool(self.state_note.text()) and self._same_model())
        self._show_fetch_cost()
        try:
            self._result = self.settings()
            error = None
        except ConfigError as exc:
            self._result, error = None, engine_text(str(exc))
        self.error_label.setText(error or "")
        self.error_label.setVisible(error is not None)
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(error is None)
        return error

    def show_saved_caches(self, event) -> None:
        """The engine thread's count of the saved caches (a SavedCaches event), after Settings opened or a Clear."""
        self._saved = (event.num_files, event.total_bytes)
        self.saved_caches.setText(self.tr("{n} saved, {mib:.0f} MiB").format(n=event.num_files,
                                                                              mib=event.total_bytes / 2**20))
        self.clear_saved.setEnabled(event.num_files > 0)

    def _clear_saved_caches(self) -> QMessageBox:
        """Asks first, with what would go: every chat's saved cache, of every model (the chats' text stays). The
        engine thread deletes them, so no save is half-written when its file goes."""
        n, total = self._saved or (0, 0)
        buttons = QMessageBox.StandardButton
        question = self.tr("Delete the saved chat cache on disk ({size})? The chat itself stays; it reads its whole "
                           "history again the next time you write in it.") if n == 1 else \
            self.tr("Delete the {n} saved chat caches on disk ({size})? The chats themselves stay; each reads its "
                    "whole history again the next time you write in it.")
        box = QMessageBox(QMessageBox.Icon.Question, self.tr("Delete saved caches"),
                          question.format(n=n, size=format_bytes(total)), buttons.Yes | buttons.Cancel, self)
        box.setObjectName("confirmClearSaved")
        box.button(buttons.Yes).setText(self.tr("Delete"))
        box.setDefaultButton(buttons.Cancel)

        def answered() -> None:
            if box.clickedButton() is box.button(buttons.Yes):
                self.clear_saved.setEnabled(False)      # until the engine thread says what is left
                self.delete_saved.emit()
        box.finished.connect(answered)
        box.open()
        self.clear_confirm = box
        return box

    def disk_budget_mb(self) -> float:
        return float(self.disk_budget.value())

    def _spec_method_changed(self, *_args) -> None:
        self.spec_tokens.setEnabled(self.speculative()[0] != "off")

    def prefill(self) -> str:
        """The prompt precision chosen: auto, fp32, bf16 or int8."""
        return str(self.prefill_combo.currentData())

    def activations(self) -> str:
        """Decode rows' activations chosen: int16 or int8."""
        return str(self.activations_combo.currentData())

    def speculative(self) -> tuple[str, int]:
        """(method, most draft tokens per step): "off" or "lookup", 1 to 32."""
        return str(self.spec_method.currentData()), int(self.spec_tokens.value())

    def result_settings(self) -> AppSettings | None:
        return self._result


def apply_preset(dialog, index: int) -> None:
    """A preset chosen in `dialog`'s preset box (this dialog's, or Replay with...'s) sets its formats and window;
    the box goes back to its prompt."""
    changes = PRESETS.get(dialog.preset.itemData(index))
    if not changes:
        return
    if "k_format" in changes:
        choose(dialog.k_format, changes["k_format"])
        choose(dialog.v_format, changes["v_format"])
    if "window" in changes:
        dialog.window.setValue(changes["window"] or 0)
    if "sinks" in changes:
        dialog.sinks.setValue(changes["sinks"])
    # Keep what matters and Fetch what is needed (Settings only) go back to their defaults unless the preset sets them
    if hasattr(dialog, "keep_important"):
        dialog.keep_important.setChecked(changes.get("eviction", "window") == "importance")
    if hasattr(dialog, "fetch_blocks"):
        dialog.fetch_blocks.setValue(changes.get("retrieval_blocks") or 0)
    dialog.preset.setCurrentIndex(0)


def formats_row(k_format, v_format) -> QHBoxLayout:
    """The K and V format boxes side by side (Settings and Replay with...)."""
    row = QHBoxLayout()
    for label, combo in (("K", k_format), ("V", v_format)):
        row.addWidget(QLabel(label))
        row.addWidget(combo, 1)
    return row


def _choices(name: str, items: list[tuple[str, str]], current: str, tooltip: str) -> QComboBox:
    """A combo of (label, value) items with `current` chosen (the first where it is not among them)."""
    combo = QComboBox(objectName=name)
    for label, value in items:
        combo.addItem(label, value)
    combo.setCurrentIndex(max(0, combo.findData(current)))
    combo.setToolTip(tooltip)
    return combo
