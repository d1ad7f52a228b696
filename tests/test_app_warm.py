"""Warm conversations in the app (issue 25): a chat's KV is saved when the app closes and when the user
switches away; after a restart, reopening it reads the cache back (the status line says so) and the next
message reads only itself; Reset and deleting the chat delete its saved cache. Real tiny engine, real SQLite,
a real window offscreen."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from kvchat.engine.config import CacheConfig, SamplingParams
from fakes import isolate_app, real_window, saved_files, send

pytestmark = pytest.mark.gui
SHORT = SamplingParams(temperature=0, max_new_tokens=8)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))



def test_a_chat_reopened_after_a_restart_reads_its_cache_back(qtbot, tiny_llama, tmp_path):
    cache = CacheConfig(k_format="int8", v_format="int8")
    window = real_window(qtbot, str(tiny_llama), cache=cache, sampling=SHORT)
    first = send(qtbot, window, "Hello there, tell me a long story about the sea and the ships on it")
    send(qtbot, window, "And then what happened?")
    chat_id = window.conversation_id
    held = window.host.worker._session.seq.num_tokens
    window.close()                                  # the engine thread saves every open chat as it ends
    qtbot.waitUntil(lambda: not window.host.thread.isRunning(), timeout=30_000)
    assert len(saved_files(tmp_path)) == 1

    again = real_window(qtbot, str(tiny_llama), cache=cache, sampling=SHORT)   # a restart: a new engine
    again.show_conversation(chat_id)
    qtbot.waitUntil(lambda: again.session_ready, timeout=30_000)
    session = again.host.worker._session
    assert session.seq.num_tokens == held, "the cache came back from disk"
    qtbot.waitUntil(lambda: "restored from disk" in again.statusBar().currentMessage(), timeout=5000)
    assert [m.kind for m in again.dashboard.data.markers][-1] == "restore"       # the timeline marks it
    nxt = send(qtbot, again, "Thanks!")
    assert 0 < nxt.stats.prefill_tokens < first.stats.prefill_tokens, "only the new message was read"

    # Reset deletes the saved cache; so does deleting the chat for good
    again.host.worker._save(session)
    assert saved_files(tmp_path)
    with qtbot.waitSignal(again.host.reset_done, timeout=10_000):
        again.host.reset()
    assert saved_files(tmp_path) == []
    send(qtbot, again, "One more")
    again.host.worker._save(again.host.worker._session)
    assert saved_files(tmp_path)
    again.actions.undo_bar.timer.setInterval(50)
    again.actions.delete_conversation(chat_id)
    qtbot.waitUntil(lambda: not again.actions.undo_bar.isVisible(), timeout=5000)
    qtbot.waitUntil(lambda: saved_files(tmp_path) == [], timeout=5000)


def test_a_damaged_saved_cache_is_read_again_with_a_notice(qtbot, tiny_llama, tmp_path):
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    first = send(qtbot, window, "Hello there, how are you doing today?")
    chat_id = window.conversation_id
    window.close()
    qtbot.waitUntil(lambda: not window.host.thread.isRunning(), timeout=30_000)
    (path,) = saved_files(tmp_path)
    path.write_bytes(path.read_bytes()[:1000])      # a crash mid-copy, a full disk: a truncated file

    again = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    again.show_conversation(chat_id)
    qtbot.waitUntil(lambda: again.session_ready, timeout=30_000)
    qtbot.waitUntil(lambda: "saved cache was not used" in again.statusBar().currentMessage(), timeout=5000)
    nxt = send(qtbot, again, "And again?")
    assert nxt.stats.prefill_tokens > first.stats.prefill_tokens, "the history was read again"
    assert [m["role"] for m in again.history.messages(chat_id)] == ["user", "assistant"] * 2


def test_settings_show_the_saved_caches_set_their_budget_and_clear_them(qtbot, tiny_llama, tmp_path):
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    send(qtbot, window, "Hello there, how are you doing today?")
    window.host.worker._save(window.host.worker._session)
    assert len(saved_files(tmp_path)) == 1
    dialog = window.open_settings()
    assert dialog.disk_budget.value() == 2048
    # the engine thread counts them and answers (SavedCaches): the dialog opens no store of its own
    qtbot.waitUntil(lambda: dialog.saved_caches.text().startswith("1 saved"), timeout=5000)
    dialog.disk_budget.setValue(512)
    qtbot.mouseClick(dialog.clear_saved, Qt.MouseButton.LeftButton)
    dialog.clear_confirm.button(QMessageBox.StandardButton.Yes).click()       # it asks first (test_r3_ui_disk.py)
    qtbot.waitUntil(lambda: dialog.saved_caches.text().startswith("0 saved"), timeout=5000)
    assert saved_files(tmp_path) == []
    assert not dialog.clear_saved.isEnabled()
    dialog.accept()
    assert window.store.kv_disk_budget_mb() == 512
    qtbot.waitUntil(lambda: window.host.worker._engine.warm_store.budget_bytes == 512 * 2**20, timeout=5000)


def test_the_pool_page_shows_a_chat_whose_cache_is_only_on_disk(qtbot, tiny_llama, tmp_path):
    """After a restart, with one saved chat reopened, the Pool page has a row for the other: on disk, its size."""
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    send(qtbot, window, "The first chat, about the sea")
    first = window.conversation_id
    window.new_chat()
    qtbot.waitUntil(lambda: window.session_ready, timeout=30_000)
    send(qtbot, window, "The second chat, about the mountains")
    second = window.conversation_id
    window.close()
    qtbot.waitUntil(lambda: not window.host.thread.isRunning(), timeout=30_000)
    assert len(saved_files(tmp_path)) == 2

    again = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    again.show_conversation(second)
    qtbot.waitUntil(lambda: again.session_ready, timeout=30_000)
    send(qtbot, again, "And the rivers?")
    again.dashboard.show_page("Pool")
    again.panels.refresh()
    rows = again.panels.rows()
    disk = [r for r in rows if r.where == "disk"]
    assert [r.conversation_id for r in disk] == [first] and disk[0].num_bytes > 0
    assert any(r.current and r.where == "pool" for r in rows)
    texts = [row.text for row in again.dashboard.pool_view.conversation_bars.rows]
    assert any(t.endswith("on disk") for t in texts), texts
