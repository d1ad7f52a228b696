"""Issue 21, item 22: what a new user met in the window, each in a real window offscreen: deleting a reply,
Undo for a deleted message, where Export starts and what it writes, the system prompt in the chat, stale
notices, the dock's width after a small window, and the Chinese interface."""
from __future__ import annotations

import os
import re

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from dataclasses import replace

import pytest
from PySide6.QtCore import Qt

from kvchat.engine.config import SamplingParams
from fakes import FakeLoader, isolate_app, open_window, send

pytestmark = pytest.mark.gui
SHORT = SamplingParams(max_new_tokens=3)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import tiny_model_dir
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", hidden=64, heads=2, kv_heads=2, layers=2)


def ready_window(qtbot, loader=None, sampling=SHORT, model=None, system_prompt=None):
    window = open_window(qtbot, loader or FakeLoader(), autoload=False)
    changes = dict(sampling=sampling)
    if model is not None:
        changes["model"] = model
    if system_prompt is not None:
        changes["system_prompt"] = system_prompt
    window.apply_settings(replace(window.settings, **changes))
    qtbot.waitUntil(lambda: window.session_ready or window.last_error is not None, timeout=30_000)
    assert window.last_error is None, window.last_error
    return window


def saved(window):
    return [(e.role, e.content) for e in window.history.entries(window.conversation_id)]


def shown(window):
    return [(m.role, m.text()) for m in window.chat.chat_messages()]


def session(window):
    return window.host.worker._session


def switch_away_and_back(qtbot, window):
    chat = window.conversation_id
    window.new_chat()
    qtbot.waitUntil(lambda: window.session_ready, timeout=10_000)
    window.show_conversation(chat)
    qtbot.waitUntil(lambda: window.session_ready, timeout=10_000)


# --- deleting a message ---

def test_deleting_the_last_reply_takes_its_question_and_reopening_keeps_chat_and_cache(qtbot, tiny_dir):
    """Over the real engine: Delete on a reply removes it with its question; the cache rewinds to the
    exchange before, and leaving and reopening the chat drops nothing and reads nothing again."""
    window = ready_window(qtbot, sampling=GREEDY, model=tiny_dir)
    send(qtbot, window, "first question")
    send(qtbot, window, "second question")
    kept = saved(window)[:2]
    reply = window.chat.chat_messages()[-1]
    qtbot.mouseClick(reply.delete_button, Qt.MouseButton.LeftButton)
    assert saved(window) == kept and shown(window) == kept
    qtbot.waitUntil(lambda: session(window).messages == [{"role": r, "content": c} for r, c in kept], timeout=5000)
    live = session(window)
    held_after_first = live.stats().tokens_held
    assert held_after_first > 0                 # rewound, not rebuilt from nothing

    switch_away_and_back(qtbot, window)
    assert saved(window) == kept and shown(window) == kept
    assert window.input.toPlainText() == ""
    assert not [m for m in window.chat.messages() if m.role == "notice"]
    assert session(window) is live and live.stats().tokens_held == held_after_first


def test_undo_puts_a_deleted_exchange_back_in_place_with_its_versions(qtbot):
    """Undo in the status bar returns the question and its reply (regenerated versions too) where they were,
    in the view, the database and the session."""
    window = ready_window(qtbot)
    send(qtbot, window, "one")
    send(qtbot, window, "two")
    ids = [e.id for e in window.history.entries(window.conversation_id)]
    with qtbot.waitSignal(window.host.turn_finished, timeout=10_000):
        window.actions.regenerate(window.chat.chat_messages()[-1])
    qtbot.waitUntil(lambda: not window.generating, timeout=2000)
    before = saved(window)
    versions = [v.content for v in window.history.versions(ids[3])]
    assert len(versions) == 2

    question = window.chat.chat_messages()[0]
    qtbot.mouseClick(question.delete_button, Qt.MouseButton.LeftButton)
    assert saved(window) == before[2:] and shown(window) == before[2:]
    bar = window.actions.undo_bar
    assert bar.isVisible() and "question and its reply" in bar.label.text()
    qtbot.waitUntil(lambda: len(session(window).messages) == 2, timeout=3000)

    qtbot.mouseClick(bar.button, Qt.MouseButton.LeftButton)
    assert not bar.isVisible()
    assert saved(window) == before and shown(window) == before
    assert [e.id for e in window.history.entries(window.conversation_id)] == ids
    assert [v.content for v in window.history.versions(ids[3])] == versions
    assert window.chat.chat_messages()[-1].version_label.text() == "2/2"
    qtbot.waitUntil(lambda: session(window).messages == [{"role": r, "content": c} for r, c in before],
                    timeout=3000)


def test_without_undo_a_deleted_exchange_stays_deleted(qtbot):
    """Undo waits while a reply streams (it would put messages back under a turn in flight); when its time is
    up the offer ends and the deleted messages stay gone."""
    window = ready_window(qtbot)
    send(qtbot, window, "keep")
    send(qtbot, window, "drop")
    qtbot.mouseClick(window.chat.chat_messages()[-1].delete_button, Qt.MouseButton.LeftButton)
    bar = window.actions.undo_bar
    with qtbot.waitSignal(window.host.turn_finished, timeout=10_000):
        window.input.setPlainText("again")
        window.input.submit()
        assert window.generating and bar.isVisible() and not bar.button.isEnabled()    # not into a turn in flight
    qtbot.waitUntil(lambda: not window.generating, timeout=2000)
    assert bar.button.isEnabled()
    bar.timer.start(50)
    qtbot.waitUntil(lambda: not bar.isVisible(), timeout=2000)
    assert window.actions.pending_messages == []
    assert [c for _, c in saved(window)][::2] == ["keep", "again"] and len(saved(window)) == 4


# --- export ---

def saved_chat(window, turns):
    """A chat written straight into the history database, then opened in the window."""
    from kvchat.app.store.history import DONE
    conversation = window.history.create(turns[0], window.settings.cache)
    for question, answer in zip(turns[::2], turns[1::2]):
        window.history.add_turn(conversation, [("user", question, DONE), ("assistant", answer, DONE)])
    window.show_conversation(conversation)
    return conversation


def test_export_starts_in_documents_or_home_then_where_the_last_export_went(qtbot, tmp_path, monkeypatch):
    """Not in the folder kvchat was started from: Documents (or home) first, then the last export's folder,
    which a restart keeps."""
    from PySide6.QtCore import QStandardPaths
    from PySide6.QtWidgets import QFileDialog
    from kvchat.app.store.settings_store import SettingsStore

    started_in = tmp_path / "started-here"
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    window = ready_window(qtbot)
    send(qtbot, window, "export me")
    asked = []
    out = tmp_path / "exports"
    out.mkdir()

    def save_as(parent, caption, start, kind):
        asked.append(start)
        return str(out / "mine.md"), kind
    monkeypatch.setattr(QFileDialog, "getSaveFileName", save_as)
    window.actions.export_markdown_action.trigger()
    documents = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    first = os.path.dirname(asked[0])
    assert first in (documents, os.path.expanduser("~")) and first != str(started_in)
    assert os.path.basename(asked[0]) == "export-me.md"
    assert (out / "mine.md").is_file()
    window.actions.export_json_action.trigger()
    assert os.path.dirname(asked[1]) == str(out)
    assert SettingsStore().export_dir() == str(out)


def test_markdown_export_keeps_code_blocks_as_the_chat_showed_them(qtbot, tmp_path):
    """Code the view showed as a block without a fence in the text, and a fence a cut reply left open, are
    fenced code in the Markdown; the open fence does not swallow the messages after it."""
    from kvchat.app.chat.export import export_conversation

    window = ready_window(qtbot)
    unfenced = "Here is how:\n\nimport os\nimport sys\nprint(os.getcwd())\n\nThat prints the folder."
    cut = "Start:\n```python\ndef f():\n    return 1"
    chat = saved_chat(window, ["how?", unfenced, "and a function?", cut, "thanks", "You are welcome."])
    replies = [m for m in window.chat.chat_messages() if m.role == "assistant"]
    assert [len(r.code_blocks()) for r in replies] == [1, 1, 0]     # what the view shows
    text = export_conversation(window.history, chat, tmp_path / "c.md", "markdown").read_text()
    assert "```\nimport os\nimport sys\nprint(os.getcwd())\n```" in text
    assert "```python\ndef f():\n    return 1\n```" in text
    after_cut = text.split("return 1\n```", 1)[1]
    assert after_cut.count("```") == 0 and "## You\n\nthanks" in after_cut
    assert text.count("```") % 2 == 0


# --- the system prompt, stale notices ---

def test_the_system_prompt_shows_above_the_chat_it_belongs_to(qtbot):
    """A muted "System prompt: …" line sits above the first message: the new chat's from Settings, a saved
    chat's own; a chat without one shows none; a long one is shortened, the tooltip has it all."""
    long_prompt = "You are a careful pirate. " * 20
    window = ready_window(qtbot, system_prompt=long_prompt)
    line = window.chat.system_prompt_line
    assert line.isVisible() and line.text().startswith("System prompt: You are a careful pirate.")
    assert line.text().endswith("…") and len(line.text()) < len(long_prompt) and line.toolTip() == long_prompt.strip()
    send(qtbot, window, "ahoy")
    first = window.chat.chat_messages()[0]
    assert line.isVisible() and line.geometry().bottom() < first.geometry().top()
    pirate_chat = window.conversation_id
    plain = window.history.create("plain", window.settings.cache, "")
    window.show_conversation(plain)
    assert not line.isVisible()
    window.show_conversation(pirate_chat)
    assert line.isVisible() and line.toolTip() == long_prompt.strip()


def test_error_bubbles_go_with_the_next_reply_and_dashboard_notices_with_a_chat_switch(qtbot):
    window = ready_window(qtbot)
    with qtbot.waitSignal(window.host.error, timeout=5000):
        window.host.regenerate(window.settings.sampling, [])      # nothing to regenerate: an error bubble
    notices = lambda: [m.text() for m in window.chat.messages() if m.role == "notice"]     # noqa: E731
    assert notices() and "Cannot regenerate" in notices()[0]
    send(qtbot, window, "hello")
    assert notices() == []
    assert window.chat.chat_messages()[-1].text()

    with qtbot.waitSignal(window.host.prefix_cleared, timeout=5000):
        window.actions.clear_prefix_cache()
    assert window.dashboard.live.notice.isVisible()
    window.new_chat()
    assert not window.dashboard.live.notice.isVisible()


# --- the dock's width ---

def test_the_dock_gets_its_width_back_after_the_window_was_small(qtbot):
    """1320 px wide, 1024x700, and back: the dock is as wide as before, the one the user chose included."""
    window = ready_window(qtbot)
    window.resize(1320, 820)
    qtbot.waitUntil(lambda: window.width() == 1320, timeout=2000)
    qtbot.wait(50)
    wide = window.dock.width()

    def round_trip():
        window.resize(1024, 700)
        qtbot.waitUntil(lambda: window.width() == 1024, timeout=2000)
        qtbot.wait(50)
        squeezed = window.dock.width()
        window.resize(1320, 820)
        qtbot.waitUntil(lambda: window.width() == 1320, timeout=2000)
        qtbot.wait(50)
        return squeezed

    assert round_trip() < wide                  # the small window really squeezed it
    assert window.dock.width() == wide
    window.resizeDocks([window.dock], [wide - 200], Qt.Orientation.Horizontal)     # the layout, not the user
    qtbot.waitUntil(lambda: window.dock.width() == wide - 200, timeout=2000)
    round_trip()
    assert window.dock.width() == wide

    from PySide6.QtCore import QPoint
    separator = QPoint(window.dock.geometry().left() - 2, window.dock.geometry().center().y())
    qtbot.mousePress(window, Qt.MouseButton.LeftButton, pos=separator)
    for step in (60, 120):
        qtbot.mouseMove(window, separator + QPoint(step, 0))
        qtbot.wait(20)
    qtbot.mouseRelease(window, Qt.MouseButton.LeftButton, pos=separator + QPoint(120, 0))
    qtbot.wait(50)
    chosen = window.dock.width()
    assert chosen < wide - 60                   # the user's own choice
    round_trip()
    assert window.dock.width() == chosen


# --- the Chinese interface: the engine's values and messages ---

@pytest.fixture
def chinese(qtbot, monkeypatch, tmp_path):
    """The zh_CN catalog installed as app.main does it, removed afterwards (other tests read English)."""
    monkeypatch.setenv("KVCHAT_LANG", "zh_CN")
    from PySide6.QtWidgets import QApplication
    from kvchat.app import i18n
    app = QApplication.instance()
    assert i18n.install(app, "en") == "zh_CN"
    yield app
    for translator in app._kvchat_translators:
        app.removeTranslator(translator)
    app._kvchat_translators = []


def engine_messages(tiny_dir, tmp_path) -> list[str]:
    """Messages the real engine sends a user: refused cache settings, refused turns, rewrites with nothing to
    rewrite."""
    from kvchat.engine import Engine, EngineConfig
    from kvchat.engine.config import CacheConfig, ConfigError
    from kvchat.engine.kv.layout import check_cache_for_model
    from tiny_models import tiny_model_dir

    messages = []
    engine = Engine.load(EngineConfig(model=tiny_dir, cache=CacheConfig(budget_mb=0.1)))
    model = engine.model.config
    for cache in (CacheConfig(window=model.max_position_embeddings, sinks=4), CacheConfig(budget_mb=0.001),
                  CacheConfig(window=128, sinks=4, budget_mb=0.05), CacheConfig(full_precision_layers=(7,))):
        with pytest.raises(ConfigError) as refused:
            check_cache_for_model(cache, model)
        messages.append(str(refused.value))
    session = engine.new_session()
    for rewrite in (session.regenerate, session.continue_reply):
        with pytest.raises(ConfigError) as refused:
            next(rewrite(GREEDY))
        messages.append(str(refused.value))

    def turn(session, text):
        return [event for event in session.send(text, GREEDY)][-1]
    refused = turn(session, "word " * 40)                                # a message too big for the budget
    assert refused.finish_reason == "budget"
    messages.append(refused.message)
    assert turn(session, "word " * 4).finish_reason == "length"
    messages.append(turn(session, "word " * 40).message)                  # ... and with tokens held
    short = Engine.load(EngineConfig(model=tiny_model_dir(tmp_path / "short" / "model", hidden=64, heads=2, kv_heads=2,
                                                          layers=2, max_positions=128)))
    messages.append(turn(short.new_session(), "word " * 60).message)      # past the model's context
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    for path in (tmp_path / "nowhere", tmp_path / "empty", tmp_path / "weights.bin", tmp_path / "notes.txt"):
        with pytest.raises(Exception) as refused:       # the loader's refusals, as the worker shows them
            Engine.load(EngineConfig(model=str(path)))
        messages.append(str(refused.value))
    return messages


def test_the_engines_messages_are_shown_in_chinese(qtbot, tiny_dir, tmp_path, chinese):
    """Each message is translated whole, its numbers and names kept; English stays the engine's text."""
    from PySide6.QtWidgets import QApplication
    from kvchat.app.engine_text import engine_text
    from test_i18n import english_words

    messages = engine_messages(tiny_dir, tmp_path)
    assert len(messages) == 13 and all(messages)
    for message in messages:
        translated = engine_text(message)
        names = re.sub(r"\b(weights\.bin|notes\.txt)\b", "", translated)      # the test's own file names
        assert not english_words(names), (message, translated)
        assert sorted(re.findall(r"\d[\d,.]*", translated)) == sorted(re.findall(r"\d[\d,.]*", message))
    app = QApplication.instance()
    for translator in app._kvchat_translators:
        app.removeTranslator(translator)
    # English keeps the engine's words, but for "auto", which the interface calls "full precision" everywhere
    assert [engine_text(m) for m in messages] == [re.sub(r"\bauto\b", "full precision", m) for m in messages]
    assert engine_text("Something the table does not know: 42") == "Something the table does not know: 42"


def test_chinese_window_names_formats_schemes_policies_and_weights(qtbot, tiny_dir, chinese):
    """Over the real engine in Chinese: a refused turn's notice, the Settings choices (which still give the
    engine its own values), the chat list's cache mode and the weights label carry no English words."""
    from kvchat.engine.config import CacheConfig
    from kvchat.app.i18n import weights_text
    from test_i18n import english_in, english_words

    from kvchat.app.bridge.loader import default_loader as _default_loader

    window = open_window(qtbot, _default_loader, autoload=False)
    window.apply_settings(replace(window.settings, model=tiny_dir, sampling=GREEDY, cache=CacheConfig(budget_mb=0.1)))
    qtbot.waitUntil(lambda: window.session_ready or window.last_error is not None, timeout=30_000)
    assert window.last_error is None, window.last_error
    send(qtbot, window, "word " * 40)                   # too big for this budget: refused, with the reason
    notices = [m.text() for m in window.chat.messages() if m.role == "notice"]
    assert notices and "KV 预算" in notices[-1] and not english_words(notices[-1])

    dialog = window.open_settings()
    shown = {combo: [combo.itemText(i) for i in range(combo.count())]
             for combo in (dialog.k_format, dialog.k_scheme, dialog.overflow)}
    assert "全精度" in shown[dialog.k_format] and shown[dialog.k_scheme] == ["按通道", "按 token"]
    assert shown[dialog.overflow] == ["停止", "滑动窗口"]
    dialog.k_scheme.setCurrentIndex(1)
    dialog.overflow.setCurrentIndex(1)
    cache = dialog.cache_config()
    assert (cache.k_format, cache.k_scheme, cache.overflow) == ("auto", "token", "slide")
    assert not english_in(dialog)
    dialog.close()
    send(qtbot, window, "你好")                         # a chat in the list, named with its cache mode
    assert "全精度" in window.conversations.item(0).text()
    assert not english_words(window.conversations.item(0).text())
    assert weights_text("Q4_1 (+Q8_0), packed") == "Q4_1 (+Q8_0)，按块打包"


@pytest.fixture
def styled(qapp):
    """The app's style sheet, as app.main loads it (button sizes follow it), removed afterwards."""
    from kvchat.app.shell.main import load_style
    load_style(qapp)
    yield qapp
    qapp.setStyleSheet("")


def test_chinese_window_at_1024_cuts_no_label(qtbot, chinese, styled):
    """At 1024x700 in Chinese, with a long cache mode and a reply cut at max tokens: the chat list shows the
    whole mode (over more lines), the Plan page fits the dock (its two buttons whole), and the reply's mark
    and buttons fit the chat column."""
    from PySide6.QtWidgets import QPushButton
    from kvchat.engine.config import CacheConfig

    window = ready_window(qtbot)
    window.apply_settings(replace(window.settings, cache=CacheConfig(k_format="int8", v_format="int4", window=256,
                                                                      sinks=4)))
    qtbot.waitUntil(lambda: window.session_cache.window == 256, timeout=5000)
    send(qtbot, window, "你好")
    assert window.chat.chat_messages()[-1].finish == "length"
    window.resize(1024, 700)
    qtbot.waitUntil(lambda: window.width() == 1024, timeout=2000)
    window.splitter.setSizes([0, window.splitter.width()])     # the chat list at its narrowest
    window.dashboard.show_page("Plan")
    qtbot.wait(100)

    listing = window.conversations
    row = listing.item(0).text()
    assert "…" not in row and "256 + 4 个锚点" in row.replace("\n", " ")
    # each line fits where the style draws an item's text (less the margin it keeps inside that rect), or
    # Qt would elide it again while painting
    from PySide6.QtWidgets import QStyle, QStyleOptionViewItem
    option = QStyleOptionViewItem()
    listing.initViewItemOption(option)
    option.index = listing.indexFromItem(listing.item(0))
    option.rect, option.text = listing.visualRect(option.index), row
    option.features |= QStyleOptionViewItem.ViewItemFeature.HasDisplay
    margin = listing.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None, listing) + 1
    room = listing.style().subElementRect(QStyle.SubElement.SE_ItemViewItemText, option, listing).width() - 2 * margin
    assert all(listing.fontMetrics().horizontalAdvance(line) <= room for line in row.split("\n"))
    panel = window.findChild(QPushButton, "planNowButton").parentWidget()
    viewport = panel.parentWidget()
    assert panel.width() <= viewport.width()
    for name in ("planNowButton", "planApply"):
        button = window.findChild(QPushButton, name)
        assert button.mapTo(viewport, button.rect().topRight()).x() < viewport.width(), name
    assert window.chat.widget().width() <= window.chat.viewport().width()
    reply = window.chat.chat_messages()[-1]
    assert reply.finish_label.isVisible()
    assert reply.minimumSizeHint().width() <= 300       # the mark wraps: the chat need not push the dock away
    assert window.dock.width() >= 380
    right = reply.delete_button.mapTo(window.chat.viewport(), reply.delete_button.rect().topRight()).x()
    assert right < window.chat.viewport().width()
