"""Chat actions in the real window over the fake engine: regenerate and reply versions, edit and resend,
continue and finish marks, copy and delete, export, search, delete with undo, About, Clear prefix cache."""
from __future__ import annotations

import json
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from dataclasses import replace

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QFileDialog, QMessageBox

from kvchat.engine.config import SamplingParams
from kvchat.engine.events import PoolStats
from fakes import FakeLoader, isolate_app, open_window, send

pytestmark = pytest.mark.gui
SHORT = SamplingParams(max_new_tokens=3)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def ready_window(qtbot, loader=None, sampling=SHORT):
    window = open_window(qtbot, loader or FakeLoader(), autoload=False)
    window.apply_settings(replace(window.settings, sampling=sampling))
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    return window


def click(qtbot, window, button, timeout=10_000):
    """Click an action under a message and wait for the turn it starts."""
    with qtbot.waitSignal(window.host.turn_finished, timeout=timeout) as blocker:
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not window.generating, timeout=2000)
    return blocker.args[0]


def session_of(loader):
    return loader.engines[-1].sessions[-1]


def last_reply(window):
    return window.chat.chat_messages()[-1]


def test_regenerate_keeps_versions_arrows_switch_and_choice_survives_restart(qtbot):
    """Regenerate writes a new last reply; '‹ 2/2 ›' switches back (the session too) and the choice is saved."""
    loader = FakeLoader()
    window = ready_window(qtbot, loader)
    first = send(qtbot, window, "Hi").text
    reply = last_reply(window)
    assert reply.regenerate_button.isVisible() and not reply.version_label.isVisible()
    second = click(qtbot, window, reply.regenerate_button).text
    assert second != first
    assert last_reply(window) is reply and reply.text() == second
    assert reply.version_label.text() == "2/2" and reply.previous_button.isEnabled()
    assert not reply.next_button.isEnabled()
    third = click(qtbot, window, reply.regenerate_button).text
    assert reply.version_label.text() == "3/3"
    assert [v.content for v in window.history.versions(reply.message_id)] == [first, second, third]
    assert sorted(a.text for a in session_of(loader).alternatives) == sorted([first, second])

    qtbot.mouseClick(reply.previous_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(reply.previous_button, Qt.MouseButton.LeftButton)
    assert reply.text() == first and reply.version_label.text() == "1/3"
    qtbot.waitUntil(lambda: session_of(loader).messages[-1]["content"] == first, timeout=3000)
    assert len(loader.engines[-1].sessions) == 1, "switching replies uses the session's alternatives"
    assert window.history.messages(window.conversation_id)[-1]["content"] == first

    conversation_id = window.conversation_id
    window.close()
    window.history.close()
    loader = FakeLoader()
    again = open_window(qtbot, loader)
    shown = again.chat.chat_messages()[-1]
    assert again.conversation_id == conversation_id
    assert shown.text() == first and shown.version_label.text() == "1/3"
    qtbot.waitUntil(lambda: again.session_ready, timeout=5000)
    qtbot.mouseClick(shown.next_button, Qt.MouseButton.LeftButton)
    assert shown.text() == second
    # a resumed session has no alternatives: it is given the chosen reply as its history
    qtbot.waitUntil(lambda: session_of(loader).messages[-1]["content"] == second, timeout=3000)


def test_edit_and_resend_drops_later_messages_in_view_db_and_session(qtbot):
    """Editing the first message removes everything after it and sends the new text from that point."""
    loader = FakeLoader()
    window = ready_window(qtbot, loader)
    send(qtbot, window, "first question")
    send(qtbot, window, "second question")
    assert len(window.chat.chat_messages()) == 4
    message = window.chat.chat_messages()[0]
    assert message.edit_button.isVisible()
    qtbot.mouseClick(message.edit_button, Qt.MouseButton.LeftButton)
    assert message.editor is not None and message.editor.toPlainText() == "first question"
    message.editor.setPlainText("a better question")
    send_button = message._edit_buttons.findChild(type(message.edit_button), "editSend")
    finished = click(qtbot, window, send_button)
    assert [m.text() for m in window.chat.chat_messages()] == ["a better question", finished.text]
    assert window.history.messages(window.conversation_id) == [
        {"role": "user", "content": "a better question"}, {"role": "assistant", "content": finished.text}]
    session = session_of(loader)
    assert session.rewound == [0], "the session went back to where the edited message began"
    assert session.messages == window.history.messages(window.conversation_id)
    assert all(m.message_id is not None for m in window.chat.chat_messages())


def test_continue_a_cut_reply_and_marks_persist(qtbot):
    """A reply cut at max tokens is marked, Continue makes it grow; a stopped reply is marked 'Stopped'."""
    loader = FakeLoader()
    window = ready_window(qtbot, loader)
    finished = send(qtbot, window, "Tell me")
    reply = last_reply(window)
    assert finished.finish_reason == "length"
    assert reply.finish_label.isVisible() and reply.finish_label.text() == "Cut at max tokens"
    assert reply.continue_button.isVisible()
    more = click(qtbot, window, reply.continue_button)
    assert more.text.startswith(finished.text) and len(more.text) > len(finished.text)
    assert reply.text() == more.text
    assert window.history.messages(window.conversation_id)[-1]["content"] == more.text
    assert session_of(loader).messages[-1]["content"] == more.text
    assert len(window.chat.chat_messages()) == 2, "Continue grows the reply; it adds no message"

    window.apply_settings(replace(window.settings, sampling=SamplingParams(max_new_tokens=5000)))
    loader.engines[-1].step_s = 0.02
    window.input.setPlainText("Go on and on")
    window.input.submit()
    qtbot.waitUntil(lambda: len(window.chat.reply_text()) > 10, timeout=5000)
    with qtbot.waitSignal(window.host.turn_finished, timeout=2000):
        window.stop()
    qtbot.waitUntil(lambda: not window.generating, timeout=2000)
    assert last_reply(window).finish_label.text() == "Stopped"
    assert last_reply(window).continue_button.isVisible()
    assert not window.chat.chat_messages()[1].continue_button.isVisible(), "only the last reply continues"
    finishes = [e.finish for e in window.history.entries(window.conversation_id) if e.role == "assistant"]
    assert finishes == ["length", "stopped"]

    window.close()
    window.history.close()
    again = open_window(qtbot, FakeLoader(), autoload=False)
    marks = [m.finish_label.text() for m in again.chat.chat_messages() if m.role == "assistant"]
    assert marks == ["Cut at max tokens", "Stopped"]


def test_copy_and_delete_one_message(qtbot):
    """Copy puts the message on the clipboard; Delete removes it with its reply from view, database and session."""
    loader = FakeLoader()
    window = ready_window(qtbot, loader)
    send(qtbot, window, "one")
    send(qtbot, window, "two")
    user, reply = window.chat.chat_messages()[:2]
    qtbot.mouseClick(reply.copy_message_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == reply.text()
    qtbot.mouseClick(user.delete_button, Qt.MouseButton.LeftButton)
    saved = window.history.messages(window.conversation_id)
    assert [m["content"] for m in saved] == [m.text() for m in window.chat.chat_messages()]
    assert "one" not in [m["content"] for m in saved] and len(saved) == 2
    qtbot.waitUntil(lambda: session_of(loader).messages == saved, timeout=3000)


def test_export_markdown_and_json(qtbot, tmp_path, monkeypatch):
    """Export writes the chat (with reply versions and marks); the menu action asks for a path first."""
    from kvchat.app.chat.export import export_conversation

    window = ready_window(qtbot)
    finished = send(qtbot, window, "Export *me*")
    click(qtbot, window, last_reply(window).regenerate_button)
    md = export_conversation(window.history, window.conversation_id, tmp_path / "chat.md", "markdown", "fake-model")
    text = md.read_text()
    assert text.startswith("# Export *me*") and "## You\n\nExport *me*" in text
    assert "reply 2 of 2" in text and "cut at max tokens" in text
    data = json.loads(export_conversation(window.history, window.conversation_id, tmp_path / "c.json", "json").read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][1]["versions"][0] == finished.text and data["messages"][1]["chosen_version"] == 1

    target = tmp_path / "picked"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(target), "JSON (*.json)"))
    window.actions.export_json_action.trigger()
    assert json.loads((tmp_path / "picked.json").read_text())["title"] == "Export *me*"
    target = tmp_path / "from-sidebar.md"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(target), ""))
    window.conversations.export_requested.emit(window.conversation_id, "markdown")    # the sidebar's context menu
    assert target.read_text().startswith("# Export *me*")
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(tmp_path / "no" / "dir.md"), ""))
    window.actions.export_markdown_action.trigger()
    assert "Could not export" in window.banner.text() and "folder you can write to" in window.banner.text()


def test_search_filters_by_title_and_text(qtbot):
    """The search box lists chats whose title or any message contains every word typed."""
    window = ready_window(qtbot)
    send(qtbot, window, "Recipes for pancakes")
    pancakes = window.conversation_id
    window.new_chat()
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    send(qtbot, window, "Trains in Europe")
    trains = window.conversation_id
    qtbot.keyClicks(window.actions.search, "pancake")
    assert window.conversations.ids() == [pancakes]
    window.actions.search.setText("hello")       # a word of the replies, not of the titles
    assert sorted(window.conversations.ids()) == sorted([pancakes, trains])
    window.actions.search.setText("europe HELLO")
    assert window.conversations.ids() == [trains]
    window.actions.search.setText("100%")
    assert window.conversations.ids() == []
    window.actions.search.clear()
    assert len(window.conversations.ids()) == 2


def test_delete_conversation_asks_and_undo_restores_it(qtbot):
    """Delete asks first; Undo in the status bar brings the chat back with its messages; Cancel keeps it."""
    window = ready_window(qtbot)
    finished = send(qtbot, window, "keep me")
    conversation_id = window.conversation_id
    box = window.actions.ask_delete_conversation(conversation_id)
    box.button(QMessageBox.StandardButton.Cancel).click()
    assert window.conversations.ids() == [conversation_id]
    window.conversations.delete_requested.emit(conversation_id)       # the sidebar's context menu
    box = window.actions.delete_box
    assert "2 messages" in box.text()
    box.button(QMessageBox.StandardButton.Yes).click()
    assert window.conversations.ids() == [] and window.conversation_id is None
    assert window.chat.messages() == []
    assert window.actions.undo_bar.isVisible() and "keep me" in window.actions.undo_bar.label.text()
    qtbot.mouseClick(window.actions.undo_bar.button, Qt.MouseButton.LeftButton)
    assert window.conversations.ids() == [conversation_id]
    assert window.conversation_id == conversation_id
    assert [m.text() for m in window.chat.chat_messages()] == ["keep me", finished.text]
    assert not window.actions.undo_bar.isVisible()


def test_deleted_conversation_is_gone_when_undo_times_out(qtbot):
    """Without Undo, the chat and its messages leave the database when the Undo offer ends."""
    window = ready_window(qtbot)
    send(qtbot, window, "forget me")
    conversation_id = window.conversation_id
    window.actions.undo_bar.timer.setInterval(50)
    window.actions.delete_conversation(conversation_id)
    qtbot.waitUntil(lambda: not window.actions.undo_bar.isVisible(), timeout=2000)
    count = window.history._db.execute("SELECT count(*) FROM conversations").fetchone()[0]
    assert count == 0 and window.history.messages(conversation_id) == []


def test_about_names_version_model_and_licences(qtbot):
    window = ready_window(qtbot)
    window.engine_info = replace(window.engine_info, weights_label="Q4_1, packed")
    dialog = window.actions.show_about()
    text = dialog.text.text()
    assert "kvchat 0.1.0" in text or "kvchat development copy" in text
    assert "fake-model (Q4_1, packed)" in text
    assert "SmolLM2-135M-Instruct" in text and "Apache-2.0" in text
    assert "GPL 3" in text and "FDL 1.3" in text and "README" in text


def test_clear_prefix_cache_shows_freed_mib(qtbot):
    """Clear prefix cache runs in the engine thread; the dashboard and the status line say what it freed."""
    loader = FakeLoader()
    window = ready_window(qtbot, loader)
    with qtbot.waitSignal(window.host.prefix_cleared, timeout=5000) as blocker:
        window.actions.clear_prefix_action.trigger()
    assert blocker.args[0].freed_bytes == 3 * 1024 * 1024
    assert "3.00 MiB" in window.dashboard.live.notice_label.text()
    with qtbot.waitSignal(window.host.prefix_cleared, timeout=5000):
        window.actions.clear_prefix_action.trigger()
    assert "already empty" in window.statusBar().currentMessage()


def test_status_line_says_when_an_idle_chat_was_released(qtbot):
    """A rising pool.released count, and the engine's notice, reach the status line."""
    window = ready_window(qtbot)
    base = window.dashboard.data.latest
    pool = PoolStats(budget_bytes=1, held_bytes=0, free_bytes=1, evictable_blocks=0, evictable_bytes=0,
                     shared_blocks=0, blocks_in_use=0, prefix_queries=0, prefix_hits=0, released=0)
    window.host.stats.emit(replace(base, pool=pool))
    assert "Released" not in window.statusBar().currentMessage()
    window.host.stats.emit(replace(base, pool=replace(pool, released=2)))
    assert "Released the cache of 2 idle chats" in window.statusBar().currentMessage()
    assert window.dashboard.data.markers[-1].kind == "offload"          # the timeline marks it too
    kept = replace(pool, released=3, saved_budget_bytes=2**31)          # chats kept warm: their caches went to disk
    window.host.stats.emit(replace(base, pool=kept))
    assert "Moved the cache of 1 idle chat to disk" in window.statusBar().currentMessage()
    assert [m.kind for m in list(window.dashboard.data.markers)[-2:]] == ["offload", "offload"]
    pool = kept
    notice = "This conversation's cache was released to make room for another; its history is read again."
    window.host.stats.emit(replace(base, pool=replace(pool, released=3), notice=notice))
    assert window.statusBar().currentMessage() == notice


def test_unfenced_code_keeps_newlines_and_indentation(qtbot):
    """Code written without a fence renders as a code block, lines and indentation intact."""
    window = ready_window(qtbot)
    message = window.chat.add_message("assistant", "Here it is:\ndef f():\n    return 1\n")
    blocks = message.code_blocks()
    assert len(blocks) == 1 and blocks[0].code() == "def f():\n    return 1"
    prose = window.chat.add_message("assistant", "Roses are red\nviolets are blue")
    assert prose.code_blocks() == []
    assert prose._widgets[0].text() == "Roses are red  \nviolets are blue", "a line break stays a line break"


def test_real_engine_regenerate_forks_without_prefill_and_arrows_keep_the_cache(qtbot, tiny_llama):
    """On the real (tiny) engine: Regenerate reads 0 prompt tokens; switching back re-uses the old reply's
    cache (the next turn reads only its own message); edit and resend reads only the edited message."""
    from kvchat.app.bridge.loader import default_loader as _default_loader

    window = open_window(qtbot, _default_loader, autoload=False)
    window.apply_settings(replace(window.settings, model=tiny_llama,
                                  sampling=SamplingParams(temperature=0.8, seed=None, max_new_tokens=8)))
    qtbot.waitUntil(lambda: window.session_ready or window.last_error is not None, timeout=60_000)
    assert window.last_error is None, window.last_error
    first = send(qtbot, window, "Tell me about caches")
    assert first.stats.prefill_tokens > 0
    reply = last_reply(window)
    regenerated = click(qtbot, window, reply.regenerate_button, timeout=30_000)
    assert regenerated.stats.prefill_tokens == 0, "regenerate forks the cache: nothing is read again"
    assert reply.version_label.text() == "2/2"
    session = window.host.worker._session
    assert [a.text for a in session.alternatives] == [first.text]

    qtbot.mouseClick(reply.previous_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.host.worker._session.messages[-1]["content"] == first.text, timeout=5000)
    assert window.host.worker._session is session, "the same session switched to its alternative"
    nxt = send(qtbot, window, "And then?")
    held_before = first.stats.tokens_in_context
    assert 0 < nxt.stats.prefill_tokens < held_before, "the old reply's cache was kept: only the new message is read"

    user = window.chat.chat_messages()[2]
    user.start_edit()
    user.editor.setPlainText("And after that?")
    # an edit while the window is busy is ignored by design: wait for the session, ready again after the turn (a
    # busy host once sent the edit before it was, and the test read the old messages back)
    qtbot.waitUntil(lambda: not window.actions.busy(), timeout=30_000)
    window.actions.edit_and_resend(user)
    qtbot.waitUntil(lambda: not window.generating, timeout=30_000)
    edited = window.dashboard.data.latest
    assert [m["content"] for m in window.history.messages(window.conversation_id)][:3] == [
        "Tell me about caches", first.text, "And after that?"]
    assert 0 < edited.prefill_tokens < held_before, "edit and resend rewinds the cache: earlier turns stay"


def test_a_new_chat_stays_warm_when_switching_back(qtbot):
    """A chat started in this run keeps its session under its new id: switching back reuses it (no prefill)."""
    loader = FakeLoader()
    window = ready_window(qtbot, loader)
    send(qtbot, window, "first chat")
    first_id = window.conversation_id
    first_session = session_of(loader)
    window.new_chat()
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    send(qtbot, window, "second chat")
    window.show_conversation(first_id)
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    assert window.host.worker._session is first_session
    assert first_session.tokens_held > 0, "its cache was kept"
