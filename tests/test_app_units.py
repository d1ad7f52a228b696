"""Pieces of the app that need no engine: markdown splitting, the SQLite store, settings validation."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from kvchat.app.chat.message_view import split_segments
from kvchat.app.dashboard.dashboard_data import nice_ceiling
from kvchat.app.store.history import HistoryStore
from kvchat.app.bridge.messages import format_bytes
from kvchat.engine.config import CacheConfig


def test_split_segments_finds_fenced_code_and_streaming_tail():
    """Fenced blocks become code segments with their language; an unclosed fence is code to the end."""
    text = "Intro\n\n```python\nprint(1)\n```\nOutro"
    assert split_segments(text) == [("text", "", "Intro"), ("code", "python", "print(1)"), ("text", "", "Outro")]
    assert split_segments("Look:\n```sh\nls -l") == [("text", "", "Look:"), ("code", "sh", "ls -l")]
    assert split_segments("plain") == [("text", "", "plain")]


def test_history_store_round_trip(tmp_path):
    """Conversations keep title, messages in order, and the cache config used, across reopening the file."""
    store = HistoryStore(tmp_path / "h.sqlite3")
    cache = CacheConfig(k_format="int4", v_format="int8", full_precision_layers=(0, 3), window=64)
    first = store.create("A first chat about caches", cache, "be brief")
    store.add_message(first, "user", "hi")
    store.add_message(first, "assistant", "hello")
    second = store.create("x" * 200, CacheConfig())
    store.add_message(second, "user", "newer")
    store.close()
    store = HistoryStore(tmp_path / "h.sqlite3")
    assert [c.id for c in store.conversations()] == [second, first]
    again = store.get(first)
    assert again.cache == cache and again.system_prompt == "be brief"
    assert store.messages(first) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert len(store.get(second).title) <= 60
    store.delete(first)
    assert store.get(first) is None and store.messages(first) == []
    store.close()


def test_settings_dialog_explains_invalid_combinations(qtbot):
    """An invalid cache combination is explained inside the dialog and OK is disabled until fixed."""
    from PySide6.QtWidgets import QDialogButtonBox

    from kvchat.app.dialogs.settings_dialog import SettingsDialog
    from kvchat.app.store.settings_store import AppSettings

    dialog = SettingsDialog(AppSettings(), num_layers=30)
    qtbot.addWidget(dialog)
    ok = dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)
    assert ok.isEnabled() and dialog.error_label.isHidden()
    dialog.block_size.setValue(32)
    dialog.window.setValue(16)
    assert "smaller than one block" in dialog.error_label.text() and not ok.isEnabled()
    dialog.window.setValue(256)
    dialog.full_layers.setText("0, 40")
    assert "layers 0-29" in dialog.error_label.text() and not ok.isEnabled()
    dialog.full_layers.setText("0-1, 29")
    assert ok.isEnabled()
    dialog.k_format.setCurrentText("int4")
    settings = dialog.result_settings()
    assert settings.cache.full_precision_layers == (0, 1, 29) and settings.cache.k_format == "int4"
    assert settings.cache.window == 256 and settings.cache.block_size == 32


@pytest.mark.parametrize("value, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (5 * 2**20, "5.00 MiB"),
                                         (3 * 2**30, "3.00 GiB")])
def test_format_bytes_uses_binary_units(value, text):
    """Byte counts read in binary units, as the dashboard axes are labelled."""
    assert format_bytes(value) == text


def test_nice_ceiling_steps():
    """Axis tops move in 1-2-5 steps so the cached axes are rarely redrawn."""
    assert [nice_ceiling(v) for v in (0.3, 1, 1.1, 3, 7, 4500)] == [0.5, 1, 2, 5, 10, 5000]


def test_gui_thread_collector_collects_cycles_on_its_timer(qtbot):
    """The app's collection policy (app/shell/gc_guard.py): automatic collection off, cyclic garbage still collected, on
    the GUI thread's timer; stop() gives collection back."""
    import gc
    import weakref

    from kvchat.app.shell.gc_guard import GuiThreadCollector
    gc.enable()
    collector = GuiThreadCollector(interval_ms=10)
    try:
        assert not gc.isenabled()

        class Node:
            pass
        node = Node()
        node.me = node
        ref = weakref.ref(node)
        del node
        junk = [[] for _ in range(2 * gc.get_threshold()[0])]       # past the first generation's threshold
        qtbot.waitUntil(lambda: ref() is None, timeout=5000)
        del junk
    finally:
        collector.stop()
    assert gc.isenabled()
    gc.disable()              # as the autouse fixture left it; it enables collection at teardown


def test_gui_thread_collector_freezes_only_what_no_one_froze_before(qtbot):
    """Python unfreezes all or nothing: a collector under a caller's frozen objects (the suite's, conftest.py) leaves
    them frozen when it stops; alone, it freezes at its start and unfreezes at its stop."""
    import gc

    from kvchat.app.shell.gc_guard import GuiThreadCollector
    frozen = gc.get_freeze_count()
    assert frozen > 0
    GuiThreadCollector().stop()
    assert gc.get_freeze_count() == frozen
    gc.unfreeze()
    try:
        collector = GuiThreadCollector()
        assert gc.get_freeze_count() > 0
        collector.stop()
        assert gc.get_freeze_count() == 0
    finally:
        gc.freeze()
