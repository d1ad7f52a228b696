"""Saved caches on disk, said and asked (issue 37, item 10): Settings' Clear asks first, naming how many caches and how
many bytes would go; a chat whose cache is larger than the disk budget says in the status line that it is not saved
and why, and indeed no file is kept for it. Real tiny engine, real files, a real window offscreen."""
from __future__ import annotations

import threading

import pytest
from PySide6.QtWidgets import QMessageBox

from kvchat.app.bridge.messages import format_bytes
from kvchat.app.store.settings_store import SettingsStore
from kvchat.engine.config import SamplingParams
from fakes import isolate_app, real_window, saved_files, send

pytestmark = pytest.mark.gui
SHORT = SamplingParams(temperature=0, max_new_tokens=8)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))



def test_clear_asks_first_with_the_count_and_the_size(qtbot, tiny_llama, tmp_path):
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    send(qtbot, window, "Hello there, how are you doing today?")
    window.host.worker._save(window.host.worker._session)
    (path,) = saved_files(tmp_path)
    store = window.host.worker._engine.warm_store
    cleared_in = []
    clear = store.clear
    store.clear = lambda: (cleared_in.append(threading.current_thread()), clear())[1]
    dialog = window.open_settings()
    qtbot.waitUntil(lambda: dialog.saved_caches.text().startswith("1 saved"), timeout=5000)   # counted by the engine
    box = dialog._clear_saved_caches()                  # what the Clear button does
    assert box.isVisible() and saved_files(tmp_path) == [path]      # nothing is deleted before the answer
    assert f"Delete the saved chat cache on disk ({format_bytes(path.stat().st_size)})?" in box.text()
    assert box.defaultButton() is box.button(QMessageBox.StandardButton.Cancel)
    box.button(QMessageBox.StandardButton.Cancel).click()
    qtbot.wait(100)
    assert saved_files(tmp_path) == [path] and dialog.saved_caches.text().startswith("1 saved") and not cleared_in
    box = dialog._clear_saved_caches()
    box.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: dialog.saved_caches.text().startswith("0 saved"), timeout=5000)
    assert saved_files(tmp_path) == [] and not dialog.clear_saved.isEnabled()
    # deleted by the engine's own store on the engine thread, never beside a save from the GUI thread
    assert len(cleared_in) == 1 and cleared_in[0] is not threading.main_thread()


def test_saved_caches_are_counted_and_deleted_with_no_engine_loaded(tmp_path):
    """Before a model loads (or with a server) the engine thread still counts and clears the caches folder."""
    from kvchat.app.bridge import warm_chats
    folder = tmp_path / "cache" / "kv"
    folder.mkdir(parents=True)
    (folder / "7-abc.kvcache").write_bytes(b"x" * 300)
    (folder / "note.txt").write_bytes(b"not a cache")
    counted = warm_chats.count_saved(None, None)
    assert (counted.num_files, counted.total_bytes) == (1, 300)
    after = warm_chats.delete_saved(None, None)
    assert (after.num_files, after.total_bytes, after.deleted_bytes) == (0, 0, 300)
    assert [p.name for p in folder.iterdir()] == ["note.txt"]


def test_a_chat_larger_than_the_disk_budget_says_it_is_not_saved(qtbot, tiny_llama, tmp_path):
    """A 10 KiB disk budget and a chat whose KV takes more: the status line says so with both sizes, and closing the
    app (which saves every open chat) indeed leaves no file for it."""
    SettingsStore().set_kv_disk_budget_mb(10 / 1024)
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    finished = send(qtbot, window, "Hello there, tell me a long story about the sea and the ships on it")
    kv = finished.stats.kv_bytes
    assert kv > 10 * 1024
    assert (f"cache not saved on disk: {format_bytes(kv)} is over the disk budget ({format_bytes(10 * 1024)})"
            in window.status_label.text()), window.status_label.text()
    window.close()
    qtbot.waitUntil(lambda: not window.host.thread.isRunning(), timeout=30_000)
    assert saved_files(tmp_path) == []


def test_a_chat_within_the_budget_says_nothing_of_it(qtbot, tiny_llama, tmp_path):
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    send(qtbot, window, "Hello there, tell me a long story about the sea and the ships on it")
    assert "not saved on disk" not in window.status_label.text()
    window.close()
    qtbot.waitUntil(lambda: not window.host.thread.isRunning(), timeout=30_000)
    assert len(saved_files(tmp_path)) == 1
