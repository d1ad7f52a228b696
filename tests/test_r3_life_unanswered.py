"""Issue 37, item 9: a message that got no reply is marked, and a refused one never shows as sent. Closing while a
long prompt is read leaves, after a relaunch, the message with an empty reply marked "Interrupted: no reply" that
Regenerate answers; a 1 MB paste is counted and refused before any bubble or history row, the text staying in the
input box with the reason; a message the KV budget refuses takes its bubble back. Real tiny engine, real SQLite, a
real window offscreen."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from kvchat.app.chat.message_view import NO_REPLY_MARK
from kvchat.engine.config import CacheConfig, SamplingParams
from fakes import engine_of, isolate_app, real_window, send, slow_steps

pytestmark = pytest.mark.gui
SHORT = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))


def user_bubbles(window) -> list[str]:
    return [m.text() for m in window.chat.chat_messages() if m.role == "user"]


def test_a_message_left_unanswered_by_closing_is_marked_after_relaunch_and_regenerate_answers_it(
        qtbot, tiny_llama, monkeypatch):
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    first = send(qtbot, window, "Hello")
    chat_id = window.conversation_id
    slow_steps(monkeypatch, engine_of(window), 0.5)         # four prompt chunks of 512 tokens: two seconds
    long_text = "word " * 400
    window.input.setPlainText(long_text)
    window.input.submit()
    assert window.generating
    qtbot.wait(700)                                         # inside the prompt, no reply yet
    assert window.chat.reply_text() == ""
    window.close()
    qtbot.waitUntil(lambda: not window.host.thread.isRunning() and not window.isVisible(), timeout=30_000)
    window.history.close()

    again = real_window(qtbot, str(tiny_llama), sampling=SHORT)     # a relaunch: the last chat is shown
    assert again.conversation_id == chat_id
    chat = again.chat.chat_messages()
    assert [m.role for m in chat] == ["user", "assistant", "user", "assistant"]
    assert [chat[0].text(), chat[1].text(), chat[2].text()] == ["Hello", first.text, long_text.strip()]
    unanswered = chat[3]
    assert unanswered.text() == "" and not unanswered.finish_label.isHidden()
    assert unanswered.finish_label.text() == NO_REPLY_MARK[0]
    assert "Regenerate" in unanswered.finish_label.text() and unanswered.regenerate_button.isVisibleTo(again)

    with qtbot.waitSignal(again.host.turn_finished, timeout=60_000) as done:
        qtbot.mouseClick(unanswered.regenerate_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not again.generating, timeout=5000)
    assert done.args[0].text and unanswered.text() == done.args[0].text
    assert unanswered.finish_label.text() != NO_REPLY_MARK[0]
    assert unanswered.version_label.isHidden(), "the empty reply is no version to switch back to"
    entries = again.history.entries(chat_id)
    assert [(e.role, e.content) for e in entries] == [("user", "Hello"), ("assistant", first.text),
                                                     ("user", long_text.strip()), ("assistant", done.args[0].text)]
    assert again.history.versions(entries[3].id) == []


def test_stop_while_the_prompt_is_read_leaves_the_same_marked_reply_and_regenerate_answers_it(
        qtbot, tiny_llama, monkeypatch):
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    first = send(qtbot, window, "Hello")
    runner = engine_of(window).runner
    step = runner.step
    slow_steps(monkeypatch, engine_of(window), 0.5)
    long_text = "word " * 400
    window.input.setPlainText(long_text)
    window.input.submit()
    qtbot.wait(700)
    with qtbot.waitSignal(window.host.turn_finished, timeout=30_000) as stopped:
        window.stop()
    assert stopped.args[0].text == "" and stopped.args[0].finish_reason == "stopped"
    reply = window.chat.chat_messages()[-1]
    assert reply.role == "assistant" and reply.text() == "" and reply.finish_label.text() == NO_REPLY_MARK[0]
    monkeypatch.setattr(runner, "step", step)               # full speed again
    with qtbot.waitSignal(window.host.turn_finished, timeout=60_000) as done:
        qtbot.mouseClick(reply.regenerate_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not window.generating, timeout=5000)
    assert done.args[0].text and reply.text() == done.args[0].text
    assert window.history.messages(window.conversation_id) == [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.text},
        {"role": "user", "content": long_text.strip()}, {"role": "assistant", "content": done.args[0].text}]


def test_a_one_megabyte_paste_is_refused_before_it_shows_as_sent(qtbot, tiny_llama):
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    paste = ("The quick brown fox jumps over the lazy dog. " * 23000)[:1_000_000]
    window.input.setPlainText(paste)
    qtbot.mouseClick(window.send_button, Qt.MouseButton.LeftButton)
    assert user_bubbles(window) == [], "nothing shows as sent while it is counted"
    qtbot.waitUntil(window.banner.isVisible, timeout=60_000)
    assert user_bubbles(window) == [] and not window.generating
    assert window.history.conversations() == [] and window.conversation_id is None     # no chat, no row
    assert window.input.toPlainText() == paste
    assert window.banner.isVisible() and window.banner.title.text() == "Message not sent"
    assert f"tokens long, more than {window.engine_info.model_name}'s context of 4,096 tokens" \
        in window.banner.message.text()
    assert "shorten it" in window.banner.message.text()

    send(qtbot, window, "Hi")                               # a short one after it goes as ever
    assert user_bubbles(window) == ["Hi"] and not window.banner.isVisible()


def test_a_message_the_budget_refuses_takes_its_bubble_back(qtbot, tiny_llama):
    window = real_window(qtbot, str(tiny_llama), cache=CacheConfig(budget_mb=0.05), sampling=SHORT)
    finished = send(qtbot, window, "word " * 50)
    assert finished.finish_reason == "budget"
    assert user_bubbles(window) == [] and window.input.toPlainText() == ("word " * 50).strip()
    notices = [m.text() for m in window.chat.messages() if m.role == "notice"]
    assert notices and "raise the budget" in notices[-1]
    assert window.history.conversations() == []
