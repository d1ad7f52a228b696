"""Models: every model on this machine (user folders, LM Studio, Jan, Hugging Face cache, Ollama) and what fits.

The scan reads headers only and runs off the GUI thread; Load hands the chosen path to the window's
ordinary load path (Settings' model, saved in QSettings, so the last used model comes back).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import (QT_TRANSLATE_NOOP, QAbstractTableModel, QCoreApplication, QModelIndex, QObject,
                            QSortFilterProxyModel, Qt, Signal)
from PySide6.QtWidgets import (QAbstractItemView, QDialog, QFileDialog, QHBoxLayout, QHeaderView, QLabel, QListWidget,
                               QPushButton, QTableView, QVBoxLayout, QWidget)

from kvchat.engine.plan import library
from kvchat.engine.plan.fit import RUNTIME_BYTES
from kvchat.engine.plan.library import ModelEntry, format_parameters, format_tokens

from kvchat.app.engine_text import engine_text
from kvchat.app.bridge.messages import format_bytes

SHOWN_FITS = ("fp16", "int8", "int4")
COLUMNS = ("Name", "Source", "Architecture", "Parameters", "Quantization", "Size", "Trained context",
           *(f"Fits {f}" for f in SHOWN_FITS), "Path")       # keys; the headers are shown translated
COLUMN_TITLES = {"Name": QT_TRANSLATE_NOOP("ModelTable", "Name"), "Source": QT_TRANSLATE_NOOP("ModelTable", "Source"),
                 "Architecture": QT_TRANSLATE_NOOP("ModelTable", "Architecture"),
                 "Parameters": QT_TRANSLATE_NOOP("ModelTable", "Parameters"),
                 "Quantization": QT_TRANSLATE_NOOP("ModelTable", "Quantization"),
                 "Size": QT_TRANSLATE_NOOP("ModelTable", "Size"),
                 "Trained context": QT_TRANSLATE_NOOP("ModelTable", "Trained context"),
                 "Path": QT_TRANSLATE_NOOP("ModelTable", "Path")}
# the library's words shown in cells and the summary (engine/plan/library.py, engine/plan/estimate.py)
BUILT_IN = "Built in"                   # the source of the model that ships with kvchat ("default" in Settings)
ENGINE_WORDS = {"Folder": QT_TRANSLATE_NOOP("ModelTable", "Folder"), "any": QT_TRANSLATE_NOOP("ModelTable", "any"),
                BUILT_IN: QT_TRANSLATE_NOOP("ModelTable", "Built in"),
                "available RAM (psutil)": QT_TRANSLATE_NOOP("ModelTable", "available RAM (psutil)"),
                "free GPU memory (pynvml)": QT_TRANSLATE_NOOP("ModelTable", "free GPU memory (pynvml)")}


def engine_word(text: str) -> str:
    """A word of the model library in the interface language (others as they are)."""
    return QCoreApplication.translate("ModelTable", ENGINE_WORDS[text]) if text in ENGINE_WORDS else text
SORT_ROLE = Qt.ItemDataRole.UserRole + 1


def scan_with_builtin(folders, memory_bytes: int, memory=None) -> list[ModelEntry]:
    """The library's scan with the built-in model first (it lives in a Python package, in no folder a scan reads).
    memory: the device to plan for (plan/fit.DeviceMemory: a GPU's free memory with a GPU's arithmetic), else
    memory_bytes of the CPU."""
    from kvchat.engine.model.source import default_gguf_path
    from kvchat.engine.errors import ModelLoadError
    entries = list(library.scan(folders, memory_bytes=memory_bytes, memory=memory))
    try:
        path = default_gguf_path()
    except ModelLoadError:
        return entries                  # not installed: nothing to list
    if not any(same_file(e.path, str(path)) for e in entries):
        entries.insert(0, library.describe("SmolLM2-135M-Instruct", path, BUILT_IN, memory_bytes, memory=memory))
    return entries


def is_current(entry: ModelEntry, current: str) -> bool:
    return same_file(entry.path, current) or (current == "default" and entry.source == BUILT_IN)


def same_file(a: str, b: str) -> bool:
    """Whether two model paths name the same file or folder (an Ollama link and its blob do)."""
    try:
        return bool(a and b) and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def past_trained(e: ModelEntry, column: str) -> bool:
    """A "Fits" cell whose tokens run past the model's trained context (memory is then not what limits a chat)."""
    tokens = dict(e.fits).get(column[5:]) if column.startswith("Fits ") else None
    return tokens is not None and bool(e.trained_context) and tokens > e.trained_context


class ModelTable(QAbstractTableModel):
    """The scanned entries as rows; the display text and a sortable value per cell."""

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.entries: list[ModelEntry] = []
        self.current_row = -1

    def set_entries(self, entries, current: str = "") -> None:
        self.beginResetModel()
        self.entries = list(entries)
        self.current_row = next((i for i, e in enumerate(self.entries) if is_current(e, current)), -1)
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.entries)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            column = COLUMNS[section]
            if column.startswith("Fits "):
                return self.tr("Fits {format}").format(format=column[5:])
            return self.tr(COLUMN_TITLES[column])
        return None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        e = self.entries[index.row()]
        column = COLUMNS[index.column()]
        if role == Qt.ItemDataRole.DisplayRole:
            return self._text(e, column)
        if role == SORT_ROLE:
            return self._value(e, column)
        if role == Qt.ItemDataRole.ToolTipRole:
            if past_trained(e, column):
                return QCoreApplication.translate(
                    "ModelTable", "The memory would hold {tokens} tokens, but the model was trained on {trained}: past "
                    "that its replies usually fall apart, as `kvchat estimate` says too.").format(
                    tokens=f"{dict(e.fits)[column[5:]]:,}", trained=f"{e.trained_context:,}")
            return engine_text(e.error) if e.error else e.path
        if role == Qt.ItemDataRole.ForegroundRole and not e.loadable:
            return Qt.GlobalColor.gray
        if role == Qt.ItemDataRole.FontRole and index.row() == self.current_row:
            from PySide6.QtGui import QFont
            font = QFont()
            font.setBold(True)
            return font
        return None

    @staticmethod
    def _text(e: ModelEntry, column: str) -> str:
        if column == "Name":
            return e.name
        if column == "Source":
            return engine_word(e.source)
        if column == "Architecture":
            return e.architecture or "—"
        if column == "Parameters":
            return format_parameters(e.parameters)
        if column == "Quantization":
            return e.quantization if e.loadable else \
                QCoreApplication.translate("ModelTable", "cannot load: {error}").format(error=engine_text(e.error))
        if column == "Size":
            return format_bytes(e.file_bytes)
        if column == "Trained context":
            return f"{e.trained_context:,}" if e.trained_context else ""
        if column.startswith("Fits "):
            fits = dict(e.fits)
            if column[5:] not in fits:
                return ""
            text = engine_word(format_tokens(fits[column[5:]]))
            if past_trained(e, column):
                return QCoreApplication.translate("ModelTable", "{tokens} (past trained {trained})").format(
                    tokens=text, trained=f"{e.trained_context:,}")
            return text
        return e.path

    @staticmethod
    def _value(e: ModelEntry, column: str):
        if column == "Parameters":
            return e.parameters
        if column == "Size":
            return e.file_bytes
        if column == "Trained context":
            return e.trained_context
        if column.startswith("Fits "):
            tokens = dict(e.fits).get(column[5:], -1)
            return float("inf") if tokens is None else tokens
        return ModelTable._text(e, column).lower()


@dataclass(frozen=True, slots=True)
class ScanResult:
    entries: tuple[ModelEntry, ...]
    memory_bytes: int                          # what "fits" was computed against; 0 when the scan failed
    memory_source: str                         # where it was read, or why the scan failed


class _ScanDone(QObject):
    finished = Signal(ScanResult)


class ModelsDialog(QDialog):
    """Lists the models found and loads the chosen one; the user's own folders are edited here too."""

    model_chosen = Signal(str)                 # a path for EngineConfig.model
    folders_changed = Signal(list)             # list[str]

    def __init__(self, folders: list[str], current_model: str = "", scan=scan_with_builtin,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle(self.tr("Models"))
        self.setObjectName("modelsDialog")
        self.resize(1100, 520)
        self.folders = list(folders)
        self.current_model = current_model
        self._scan = scan
        self._scan_done = _ScanDone()           # no parent: a scan still running may outlive a closed dialog
        self._scan_done.finished.connect(self._on_scanned)
        self.scanning = False

        self.summary = QLabel(self.tr("Scanning…"), objectName="modelsSummary")
        self.summary.setWordWrap(True)
        self.table = ModelTable(self)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.table)
        self.proxy.setSortRole(SORT_ROLE)
        self.view = QTableView(objectName="modelsTable")
        self.view.setModel(self.proxy)
        self.view.setSortingEnabled(True)
        self.view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.view.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.view.verticalHeader().setVisible(False)
        self.view.setWordWrap(False)
        self.view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.view.horizontalHeader().setStretchLastSection(True)
        self.view.doubleClicked.connect(lambda _: self.load_selected())
        self.view.selectionModel().selectionChanged.connect(lambda *_: self._update_buttons())

        self.folder_list = QListWidget(objectName="modelFolders")
        self.folder_list.setMaximumHeight(70)
        self.folder_list.addItems(self.folders)
        self.folder_list.itemSelectionChanged.connect(self._update_buttons)
        self.add_button = QPushButton(self.tr("Add folder…"))
        self.remove_button = QPushButton(self.tr("Remove folder"))
        self.rescan_button = QPushButton(self.tr("Rescan"))
        self.load_button = QPushButton(self.tr("Load"), objectName="loadModelButton")
        self.load_button.setDefault(True)
        close_button = QPushButton(self.tr("Close"))
        self.add_button.clicked.connect(self._choose_folder)
        self.remove_button.clicked.connect(self.remove_selected_folder)
        self.rescan_button.clicked.connect(self.rescan)
        self.load_button.clicked.connect(self.load_selected)
        close_button.clicked.connect(self.reject)

        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.view, 1)
        layout.addWidget(QLabel(self.tr("Your folders (LM Studio, Jan, the Hugging Face cache and Ollama are "
                                        "searched too):")))
        layout.addWidget(self.folder_list)
        buttons = QHBoxLayout()
        for b in (self.add_button, self.remove_button, self.rescan_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(close_button)
        buttons.addWidget(self.load_button)
        layout.addLayout(buttons)
        self._update_buttons()
        self.rescan()

    # --- scanning ---

    def rescan(self) -> None:
        if self.scanning:
            return
        self.scanning = True
        self.summary.setText(self.tr("Scanning model folders…"))
        self._update_buttons()
        folders, scan, done = list(self.folders), self._scan, self._scan_done

        def work():
            from kvchat.engine.plan.fit import device_memory
            try:
                planned = device_memory("auto")     # where a load would land, judged with that device's arithmetic
                memory, where = planned.free_bytes, planned.source
                entries = tuple(scan(folders, memory_bytes=memory, memory=planned))
            except Exception as exc:  # noqa: BLE001 - shown to the user, the dialog stays usable
                entries, memory, where = (), 0, self.tr("scan failed: {error}").format(
                    error=f"{type(exc).__name__}: {exc}")
            done.finished.emit(ScanResult(entries, memory, where))

        threading.Thread(target=work, name="kvchat-model-scan", daemon=True).start()

    def _on_scanned(self, result: ScanResult) -> None:
        entries, memory, where = result.entries, result.memory_bytes, result.memory_source
        self.scanning = False
        self.table.set_entries(entries, self.current_model)
        self.view.sortByColumn(COLUMNS.index("Name"), Qt.SortOrder.AscendingOrder)
        if memory:
            loadable = sum(e.loadable for e in entries)
            found = self.tr("1 model found ({loadable} loadable).") if len(entries) == 1 else \
                self.tr("{n} models found ({loadable} loadable).")
            self.summary.setText(found.format(n=len(entries), loadable=loadable) + " " + self.tr(
                "“Fits” is the longest context each KV cache format allows beside the weights in {memory} of {where}, "
                "keeping {reserve} + 5% for the runtime; “any” when nothing limits it.").format(
                memory=format_bytes(memory), where=engine_word(where), reserve=format_bytes(RUNTIME_BYTES)))
        else:
            self.summary.setText(where)
        self._select_current()
        self._update_buttons()

    def _select_current(self) -> None:
        if self.table.current_row >= 0:
            self.view.selectRow(self.proxy.mapFromSource(self.table.index(self.table.current_row, 0)).row())

    # --- folders ---

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, self.tr("Add a folder of models"))
        if folder:
            self.add_folder(folder)

    def add_folder(self, folder: str) -> None:
        if folder in self.folders:
            return
        self.folders.append(folder)
        self.folder_list.addItem(folder)
        self.folders_changed.emit(list(self.folders))
        self.rescan()

    def remove_selected_folder(self) -> None:
        row = self.folder_list.currentRow()
        if row < 0:
            return
        self.folders.pop(row)
        self.folder_list.takeItem(row)
        self.folders_changed.emit(list(self.folders))
        self.rescan()

    # --- choosing ---

    def selected_entry(self) -> ModelEntry | None:
        rows = self.view.selectionModel().selectedRows()
        if not rows:
            return None
        return self.table.entries[self.proxy.mapToSource(rows[0]).row()]

    def load_selected(self) -> None:
        entry = self.selected_entry()
        if entry is None:
            return
        if not entry.loadable:          # a double-click on a family kvchat does not run: say why, load nothing
            self.summary.setText(self.tr("{name} cannot load: {error}").format(name=entry.name,
                                                                               error=engine_text(entry.error)))
            return
        try:                            # the built-in model is saved as "default", as Settings names it
            path = "default" if entry.source == BUILT_IN else library.loadable_path(entry)
        except OSError as exc:
            self.summary.setText(self.tr("Cannot open {name}: {error}").format(name=entry.name, error=exc))
            return
        self.model_chosen.emit(path)
        self.accept()

    def _update_buttons(self) -> None:
        entry = self.selected_entry() if hasattr(self, "view") else None
        self.load_button.setEnabled(entry is not None and entry.loadable and not self.scanning)
        self.remove_button.setEnabled(self.folder_list.currentRow() >= 0)
        self.rescan_button.setEnabled(not self.scanning)
