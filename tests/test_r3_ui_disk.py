"""Saved caches on disk, said and asked (issue 37, item 10): Settings' Clear asks first, naming how many caches and how
many bytes would go; a chat whose cache is larger than the disk budget says in the status line that it is not saved
and why, and indeed no file is kept for it. Real tiny engine, real files, a real window offscreen."""
from __future__ import annotations

import pytest
from PySide6.QtWidgets import QMessageBox

from kvchat.app.messages import format_bytes
from kvchat.app.settings_store import SettingsStore
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
    dialog = window.open_settings()
    box = dialog._clear_saved_caches()                  # what the Clear button does
    assert box.isVisible() and saved_files(tmp_path) == [path]      # nothing is deleted before the answer
    assert f"Delete the saved chat cache on disk ({format_bytes(path.stat().st_size)})?" in box.text()
    assert box.defaultButton() is box.button(QMessageBox.StandardButton.Cancel)
    box.button(QMessageBox.StandardButton.Cancel).click()
    assert saved_files(tmp_path) == [path] and dialog.saved_caches.text().startswith("1 saved")
    box = dialog._clear_saved_caches()
    box.button(QMessageBox.StandardButton.Yes).click()
    assert saved_files(tmp_path) == [] and dialog.saved_caches.text().startswith("0 saved")
    assert not dialog.clear_saved.isEnabled()


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
