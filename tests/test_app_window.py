"""The main window driven through its real signals and worker thread, over the fake engine."""
from __future__ import annotations

import os
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from kvchat.engine.config import CacheConfig, SamplingParams
from fakes import FakeLoader, isolate_app, open_window

pytestmark = pytest.mark.gui


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def ready_window(qtbot, loader=None, **settings_changes):
    window = open_window(qtbot, loader or FakeLoader(), autoload=False)
    if settings_changes:
        window.apply_settings(type(window.settings)(**{**_fields(window.settings), **settings_changes}))
    else:
        window.load_engine()
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    return window


def _fields(settings):
    return {name: getattr(settings, name) for name in ("model", "cache", "sampling", "system_prompt")}


def send_and_wait(qtbot, window, text="Hello there", timeout=10_000):
    with qtbot.waitSignal(window.host.turn_finished, timeout=timeout) as blocker:
        window.input.setPlainText(text)
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not window.generating, timeout=2000)
    return blocker.args[0]


def test_send_streams_reply_into_chat_and_history(qtbot):
    """A sent message shows in the chat, the reply streams in, and both are saved in SQLite."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=6))
    finished = send_and_wait(qtbot, window, "Hi model")
    assert finished.finish_reason == "length"
    roles = [m.role for m in window.chat.messages()]
    assert roles == ["user", "assistant"]
    assert window.chat.messages()[1].text() == finished.text != ""
    assert window.history.messages(window.conversation_id) == [
        {"role": "user", "content": "Hi model"}, {"role": "assistant", "content": finished.text}]
    assert window.conversations.ids() == [window.conversation_id]
    assert window.input.toPlainText() == ""


def test_stop_ends_reply_within_one_step(qtbot):
    """Stop during a long reply ends it with finish_reason 'stopped' and keeps the partial text."""
    window = ready_window(qtbot, FakeLoader(step_s=0.02), sampling=SamplingParams(max_new_tokens=5000))
    window.input.setPlainText("Tell me everything")
    window.input.submit()
    qtbot.waitUntil(lambda: len(window.chat.reply_text()) > 20, timeout=5000)
    assert window.stop_button.isEnabled() and not window.send_button.isEnabled()
    with qtbot.waitSignal(window.host.turn_finished, timeout=1000) as blocker:
        qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
    assert blocker.args[0].finish_reason == "stopped"
    qtbot.waitUntil(lambda: window.send_button.isEnabled(), timeout=1000)
    assert window.history.messages(window.conversation_id)[-1]["content"] == blocker.args[0].text


def test_shift_enter_inserts_newline_and_enter_sends(qtbot):
    """Shift+Enter adds a line to the input; Enter sends the whole multi-line message."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=2))
    qtbot.keyClicks(window.input, "line one")
    qtbot.keyClick(window.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(window.input, "line two")
    assert window.input.toPlainText() == "line one\nline two"
    with qtbot.waitSignal(window.host.turn_finished, timeout=5000):
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
    assert window.chat.messages()[0].text() == "line one\nline two"


def test_mode_switch_applies_live_and_shrinks_layer_bytes(qtbot):
    """Switching the open chat to int4 converts its cache live: per-layer bytes drop, no reload, marker shown."""
    loader = FakeLoader()
    window = ready_window(qtbot, loader, sampling=SamplingParams(max_new_tokens=8))
    send_and_wait(qtbot, window)
    before = window.dashboard.data.latest
    int4 = CacheConfig(k_format="int4", v_format="int4")
    with qtbot.waitSignal(window.host.mode_switched, timeout=5000):
        window.apply_settings(type(window.settings)(**{**_fields(window.settings), "cache": int4}))
    after = window.dashboard.data.latest
    assert len(loader.engines) == 1, "a cache change must not reload the model"
    assert after.tokens_held == before.tokens_held
    for old, new in zip(before.layers, after.layers):
        assert new.k_bytes == old.k_bytes // 8 and new.k_format == "int4"
    window.dashboard.redraw()
    assert window.dashboard.live.k_bars.opts["height"][0] == pytest.approx(after.layers[0].k_bytes / 1024)
    assert [m.kind for m in window.dashboard.data.markers][-1] == "mode"
    assert "int4" in window.status_label.text()
    assert window.history.get(window.conversation_id).cache == int4


def test_reset_returns_memory_and_dashboard_shows_zero(qtbot):
    """Reset session frees every block: KV bytes go to 0, the status line says how much came back."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=8))
    send_and_wait(qtbot, window)
    held = window.dashboard.data.latest.kv_bytes
    assert held > 0
    kept_for_prefixes = window.host.worker._engine.prefix_cache_bytes     # Reset clears them too
    with qtbot.waitSignal(window.host.reset_done, timeout=5000) as blocker:
        qtbot.mouseClick(window.reset_button, Qt.MouseButton.LeftButton)
    assert blocker.args[0].freed_bytes == held + kept_for_prefixes
    assert window.dashboard.data.latest.kv_bytes == 0
    assert "returned" in window.statusBar().currentMessage()
    assert window.dashboard.data.markers[-1].kind == "reset"
    assert len(window.chat.messages()) == 2, "the conversation text stays after a reset"


def test_code_block_copy_button_fills_clipboard(qtbot):
    """A fenced code block in a reply renders with a Copy button that puts exactly the code on the clipboard."""
    window = ready_window(qtbot)
    message = window.chat.add_message("assistant", "Try this:\n\n```python\nprint('hi')\n```\nDone.")
    blocks = message.code_blocks()
    assert len(blocks) == 1 and blocks[0].language_label.text() == "python"
    qtbot.mouseClick(blocks[0].copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "print('hi')"


def test_settings_and_conversations_survive_restart(qtbot):
    """Closing and reopening the window restores settings, the conversation list, the chat and the splitter."""
    first = ready_window(qtbot, sampling=SamplingParams(temperature=0.3, max_new_tokens=4),
                         cache=CacheConfig(k_format="int8", v_format="int8", budget_mb=64.0))
    finished = send_and_wait(qtbot, first, "Remember me")
    first.resize(760, 560)              # inside the offscreen screen, so restoreGeometry need not clamp it
    first.splitter.setSizes([200, 300])
    qtbot.wait(50)
    sizes, size = first.splitter.sizes(), first.size()
    conversation_id = first.conversation_id
    first.close()
    assert not first.host.thread.isRunning()
    first.history.close()

    loader = FakeLoader()
    second = open_window(qtbot, loader)
    assert second.settings.sampling.temperature == pytest.approx(0.3)
    assert second.settings.cache.k_format == "int8" and second.settings.cache.budget_mb == 64.0
    assert second.conversations.ids() == [conversation_id]
    assert [m.text() for m in second.chat.messages()] == ["Remember me", finished.text]
    assert second.size() == size
    assert second.splitter.sizes() == sizes
    qtbot.waitUntil(lambda: second.session_ready, timeout=5000)
    session = loader.engines[0].sessions[-1]
    assert session.messages == [{"role": "user", "content": "Remember me"},
                                {"role": "assistant", "content": finished.text}]
    assert session.cache_config.k_format == "int8"


def test_new_chat_and_switching_conversations(qtbot):
    """New chat empties the view and starts a fresh session; picking an old chat resumes it with its history."""
    loader = FakeLoader()
    window = ready_window(qtbot, loader, sampling=SamplingParams(max_new_tokens=3))
    send_and_wait(qtbot, window, "first chat")
    first_id = window.conversation_id
    qtbot.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert window.chat.messages() == [] and window.conversation_id is None
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    send_and_wait(qtbot, window, "second chat")
    assert window.conversations.ids()[0] == window.conversation_id != first_id
    window.show_conversation(first_id)
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    assert window.chat.messages()[0].text() == "first chat"
    assert window.host.worker._session.messages[0]["content"] == "first chat"   # its warm session, kept under its id


def test_missing_model_shows_message_and_app_stays_usable(qtbot, tmp_path):
    """A model that cannot load shows what happened and what to do; the window and saved chats still work."""
    window = open_window(qtbot, FakeLoader(), autoload=False)
    with qtbot.waitSignal(window.host.error, timeout=5000):
        window.apply_settings(type(window.settings)(**{**_fields(window.settings), "model": str(tmp_path / "missing")}))
    assert window.banner.isVisible()
    assert "not found" in window.banner.text() and "Settings" in window.banner.text()
    assert window.banner.settings_button.isVisible()
    assert not window.send_button.isEnabled()
    assert window.input.isEnabled()
    assert window.status_label.text() == "No model loaded"


def test_failed_reload_keeps_previous_model(qtbot, tmp_path):
    """When a model change fails, the previous model and the open conversation stay in use."""
    loader = FakeLoader()
    window = ready_window(qtbot, loader, sampling=SamplingParams(max_new_tokens=3))
    send_and_wait(qtbot, window)
    with qtbot.waitSignal(window.host.error, timeout=5000):
        window.apply_settings(type(window.settings)(**{**_fields(window.settings), "model": str(tmp_path / "missing")}))
    assert window.settings.model == "default"
    assert window.session_ready
    finished = send_and_wait(qtbot, window, "still there?")
    assert finished.finish_reason == "length"
    assert len(loader.engines[0].sessions[-1].sent) == 2


def test_refused_cache_switch_is_explained_and_chat_continues(qtbot):
    """A cache mode the session refuses shows the engine's reason; the old mode and the chat stay."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=3))
    send_and_wait(qtbot, window)
    fp8 = CacheConfig(k_format="fp8", v_format="fp8")
    with qtbot.waitSignal(window.host.error, timeout=5000):
        window.apply_settings(type(window.settings)(**{**_fields(window.settings), "cache": fp8}))
    assert "fp8 keys are not supported" in window.banner.text()
    assert window.session_cache.k_format == "auto"
    assert send_and_wait(qtbot, window, "go on").finish_reason == "length"


def test_budget_too_small_for_prompt_says_what_to_do(qtbot):
    """A prompt larger than the KV budget ends the turn with advice in the chat; the chat stays usable."""
    tiny = CacheConfig(budget_mb=0.05)     # holds a block (so the session opens) but not 50 words
    window = ready_window(qtbot, cache=tiny, sampling=SamplingParams(max_new_tokens=3))
    finished = send_and_wait(qtbot, window, "word " * 50)
    assert finished.finish_reason == "budget"
    notices = [m for m in window.chat.messages() if m.role == "notice"]
    assert notices and "raise the KV budget" in notices[-1].text()
    assert all(m.role != "assistant" for m in window.chat.messages())
    assert window.send_button.isEnabled()


def test_close_mid_generation_shuts_down_cleanly(qtbot):
    """Closing the window during a reply stops it and joins the engine thread promptly."""
    window = ready_window(qtbot, FakeLoader(step_s=0.02), sampling=SamplingParams(max_new_tokens=5000))
    window.input.setPlainText("go")
    window.input.submit()
    qtbot.waitUntil(lambda: len(window.chat.reply_text()) > 10, timeout=5000)
    thread = window.host.thread
    window.close()
    assert thread.isFinished()


def test_window_stays_responsive_while_model_loads(qtbot):
    """Loading runs in the worker: the GUI thread keeps processing events and shows progress meanwhile."""
    window = open_window(qtbot, FakeLoader(load_s=1.0), autoload=True)
    qtbot.waitUntil(lambda: window.status_label.text() == "Reading weights", timeout=2000)
    assert window.load_bar.isVisible()
    window.input.setPlainText("typed while loading")
    assert not window.session_ready
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    assert not window.load_bar.isVisible()
    assert window.input.toPlainText() == "typed while loading"


def test_closing_during_a_long_step_never_blocks_the_gui_thread(qtbot):
    """Closing while the engine is inside a long step returns at once (the window hides) and closes for good
    once the engine thread has ended by itself: no wait past 100 ms, no thread destroyed while running."""
    window = ready_window(qtbot, FakeLoader(step_s=0.4), sampling=SamplingParams(max_new_tokens=5000))
    window.input.setPlainText("Tell me everything")
    window.input.submit()
    qtbot.waitUntil(lambda: len(window.chat.reply_text()) > 0, timeout=5000)
    thread = window.host.thread
    started = time.perf_counter()
    window.close()
    assert time.perf_counter() - started < 0.1
    assert not window.isVisible() and thread.isRunning()
    qtbot.waitUntil(lambda: not thread.isRunning(), timeout=5000)
    qtbot.waitUntil(lambda: window._close_pending and not window.isVisible(), timeout=1000)
    assert thread.isFinished()
