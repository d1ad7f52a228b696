"""The Models page: lists what the library finds, loads the chosen model through the window's load path."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
import shiboken6
from PySide6.QtCore import Qt

from kvchat.engine.plan.library import ModelEntry
from fakes import FakeLoader, isolate_app, open_window

pytestmark = pytest.mark.gui


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: home))
    for var in ("HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)


def _entry(name, params, fits, error=""):
    return ModelEntry(name, f"/models/{name}", "Folder", "gguf", "llama", params, "Q4_K", params // 2, 8192,
                      tuple(fits), error)


def test_table_shows_and_sorts_by_value(qtbot):
    from kvchat.app.dialogs.models_page import COLUMNS, SORT_ROLE, ModelTable
    table = ModelTable()
    small = _entry("small", 135_000_000, [("fp16", 90_000), ("int8", 170_000), ("int4", None)])
    big = _entry("big", 8_030_000_000, [("fp16", 2048), ("int8", 4000), ("int4", 9000)])
    broken = _entry("broken", 0, [], error="unsupported architecture 'gemma3'")
    table.set_entries([small, big, broken], current="/models/big")
    assert table.rowCount() == 3 and table.columnCount() == len(COLUMNS)

    def cell(row, column, role=Qt.ItemDataRole.DisplayRole):
        return table.data(table.index(row, COLUMNS.index(column)), role)

    assert [cell(0, c) for c in ("Name", "Parameters", "Fits fp16", "Fits int4")] == \
        ["small", "135M", "90k (past trained 8,192)", "any"]            # memory holds more than the model knows
    assert [cell(1, c) for c in ("Parameters", "Fits fp16", "Trained context")] == ["8.03B", "2,048", "8,192"]
    assert cell(2, "Quantization") == "cannot load: unsupported architecture 'gemma3'"
    assert cell(1, "Fits int8", SORT_ROLE) == 4000 and cell(0, "Fits int4", SORT_ROLE) == float("inf")
    assert table.current_row == 1


def test_load_from_models_page_reloads_and_is_remembered(qtbot, tiny_llama, tmp_path):
    from kvchat.app.store.settings_store import SettingsStore
    mine = tmp_path / "my-models" / "tiny-llama"
    shutil.copytree(tiny_llama, mine)
    loader = FakeLoader()
    window = open_window(qtbot, loader)
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)

    dialog = window.open_models()
    qtbot.waitUntil(lambda: not dialog.scanning, timeout=20_000)
    assert dialog.table.rowCount() == 1 and "1 model found" in dialog.summary.text()     # the built-in model
    with qtbot.waitSignal(dialog.folders_changed):
        dialog.add_folder(str(tmp_path / "my-models"))
    qtbot.waitUntil(lambda: not dialog.scanning and dialog.table.rowCount() == 2, timeout=20_000)
    entry = dialog.table.entries[1]
    assert (entry.name, entry.source, entry.architecture, entry.trained_context) == ("tiny-llama", "Folder", "llama", 4096)
    assert "2 models found (2 loadable)" in dialog.summary.text()
    dialog.grab().save(str(tmp_path / "models.png"))

    dialog.view.selectRow(dialog.proxy.mapFromSource(dialog.table.index(1, 0)).row())
    assert dialog.load_button.isEnabled()
    qtbot.mouseClick(dialog.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(loader.engines) == 2 and window.session_ready, timeout=5000)
    assert loader.engines[-1].config.model == str(mine)
    assert not shiboken6.isValid(dialog)            # closed and deleted

    store = SettingsStore()                          # a fresh read of the same QSettings file
    assert store.load().model == str(mine)
    assert store.library_folders() == [str(tmp_path / "my-models")]
    again = window.open_models()
    assert again.folder_list.count() == 1
    qtbot.waitUntil(lambda: not again.scanning, timeout=20_000)
    assert again.table.current_row == 1 and again.selected_entry().path == str(mine)
    again.folder_list.setCurrentRow(0)
    again.remove_selected_folder()
    assert SettingsStore().library_folders() == []
    again.reject()


def test_unloadable_entry_cannot_be_loaded(qtbot, tmp_path):
    from kvchat.app.dialogs.models_page import ModelsDialog
    broken = _entry("broken", 0, [], error="bad file")
    dialog = ModelsDialog([], scan=lambda folders, memory_bytes, **_: [broken])
    qtbot.addWidget(dialog)
    qtbot.waitUntil(lambda: not dialog.scanning, timeout=10_000)
    dialog.view.selectRow(0)
    assert not dialog.load_button.isEnabled()
    with qtbot.assertNotEmitted(dialog.model_chosen):
        dialog.load_selected()


def _header_only_gguf(path: Path, arch: str) -> Path:
    """A GGUF whose header names `arch`, with one small tensor: enough for the library's header read."""
    import numpy as np
    from gguf import GGUFWriter
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(2048)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    if arch.endswith("moe"):
        writer.add_expert_count(8)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_family_kvchat_does_not_run_says_so_before_loading(qtbot, tmp_path):
    from kvchat.app.dialogs.models_page import ModelsDialog
    from kvchat.engine.plan import library
    folder = tmp_path / "models"
    folder.mkdir()
    for arch in ("qwen2moe", "bert"):
        _header_only_gguf(folder / f"{arch}-tiny.gguf", arch)
    entries = {e.name: e for e in library.scan([folder], memory_bytes=8 << 30)}
    for arch in ("qwen2moe", "bert"):
        entry = entries[f"{arch}-tiny"]
        assert not entry.loadable
        assert repr(arch) in entry.error and "llama" in entry.error      # the architecture and what kvchat runs
    assert "mixture-of-experts" in entries["qwen2moe-tiny"].error
    dialog = ModelsDialog([str(folder)], scan=lambda folders, memory_bytes, **_: list(entries.values()))
    qtbot.addWidget(dialog)
    qtbot.waitUntil(lambda: not dialog.scanning, timeout=10_000)
    row = next(r for r in range(dialog.proxy.rowCount())
               if dialog.proxy.index(r, 0).data() == "qwen2moe-tiny")
    dialog.view.selectRow(row)
    assert not dialog.load_button.isEnabled()
    with qtbot.assertNotEmitted(dialog.model_chosen):
        dialog.load_selected()
    assert dialog.summary.text().startswith("qwen2moe-tiny cannot load: ") and "qwen2moe" in dialog.summary.text()


def test_a_hybrid_folder_is_listed_with_what_fits_in_the_hybrid_arithmetic(tmp_path):
    from kvchat.engine.kv.layout import max_conversation_tokens
    from kvchat.engine.plan import library
    from kvchat.engine.plan.estimate import cache_for, estimate, model_facts_from
    from tiny_models import tiny_family_dir
    from kvchat.bench.gguf_hf import write_gguf_from_hf
    folder = tmp_path / "models"
    tiny_family_dir(folder / "gemma3-tiny", "gemma3", query_pre_attn_scalar=32)     # what llama.cpp derives
    write_gguf_from_hf(folder / "gemma3-tiny", folder / "gemma3-tiny-q8.gguf", "Q8_0")
    memory = 1 << 30
    entries = {e.name: e for e in library.scan([folder], memory_bytes=memory)}
    assert {e.architecture for e in entries.values()} == {"gemma3"}        # the GGUF and the folder: one family
    for name, path in (("gemma3-tiny", folder / "gemma3-tiny"), ("gemma3-tiny-q8", folder / "gemma3-tiny-q8.gguf")):
        entry = entries[name]
        assert entry.loadable
        facts = model_facts_from(path)
        assert [layer.window for layer in facts.config.layers] == [16] * 5 + [None]
        room = estimate(facts, 1, formats=("int8",), memory_bytes=memory, device="cpu").kv_room_bytes
        assert dict(entry.fits)["int8"] == max_conversation_tokens(facts.config, cache_for("int8"), room)
