"""Each reply keeps the name of the model that wrote it: after another model loads, after a relaunch, and an older
history file (no author stored) labels its replies "Assistant", never with the model loaded now."""
from __future__ import annotations

import os
import sqlite3

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from fakes import FakeLoader, isolate_app, open_window, send

pytestmark = pytest.mark.gui


class NamedLoader(FakeLoader):
    """A FakeLoader whose engines carry `name` as their model name; change it, then load again: another model."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __call__(self, config, progress):
        engine = super().__call__(config, progress)
        engine.model_name = self.name
        return engine


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def _ready(qtbot, loader):
    window = open_window(qtbot, loader, autoload=False)
    window.load_engine()
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    return window


def _load(qtbot, window, loader, name: str) -> None:
    loader.name = name
    window.load_engine()
    qtbot.waitUntil(lambda: window.session_ready and window.engine_info.model_name == name, timeout=5000)


def _authors(window) -> list[str]:
    return [m.author_label.text() for m in window.chat.chat_messages() if m.role == "assistant"]


def _close(qtbot, window) -> None:
    window.close()
    qtbot.waitUntil(lambda: not window.host.thread.isRunning(), timeout=10_000)


def test_a_reply_keeps_its_models_name_after_another_loads_and_after_a_relaunch(qtbot):
    loader = NamedLoader("model-A")
    window = _ready(qtbot, loader)
    send(qtbot, window, "first question")
    _load(qtbot, window, loader, "model-B")
    assert _authors(window) == ["model-A"]
    send(qtbot, window, "second question")
    assert _authors(window) == ["model-A", "model-B"]
    chat = window.conversation_id
    _close(qtbot, window)

    again = _ready(qtbot, NamedLoader("model-C"))       # the same data dir and settings: a relaunch
    assert again.conversation_id == chat
    assert _authors(again) == ["model-A", "model-B"]


def test_a_regenerated_reply_is_named_by_each_versions_model(qtbot):
    loader = NamedLoader("model-A")
    window = _ready(qtbot, loader)
    send(qtbot, window, "a question")
    _load(qtbot, window, loader, "model-B")
    reply = window.chat.chat_messages()[-1]
    with qtbot.waitSignal(window.host.turn_finished, timeout=10_000):
        window.actions.regenerate(reply)
    qtbot.waitUntil(lambda: not window.generating, timeout=5000)
    assert _authors(window) == ["model-B"]
    window.actions.step_version(reply, -1)
    assert _authors(window) == ["model-A"]


def test_an_older_history_file_opens_and_its_replies_are_labelled_assistant(qtbot, tmp_path):
    """A file from before authors were stored (no `model` column) opens unchanged; its reply is "Assistant"."""
    (tmp_path / "data").mkdir()
    db = sqlite3.connect(tmp_path / "data" / "history.sqlite3")
    db.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL,
            cache_config TEXT NOT NULL, system_prompt TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL,
            updated_at REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id INTEGER NOT NULL,
            role TEXT NOT NULL, content TEXT NOT NULL, created_at REAL NOT NULL, state TEXT NOT NULL DEFAULT 'done');
        INSERT INTO conversations (title, cache_config, created_at, updated_at) VALUES ('old chat', '', 0, 0);
        INSERT INTO messages (conversation_id, role, content, created_at) VALUES (1, 'user', 'old question', 0);
        INSERT INTO messages (conversation_id, role, content, created_at) VALUES (1, 'assistant', 'old answer', 0);
    """)
    db.commit()
    db.close()

    window = _ready(qtbot, NamedLoader("model-B"))
    window.show_conversation(1)
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    assert [m.text() for m in window.chat.chat_messages()] == ["old question", "old answer"]
    assert _authors(window) == ["Assistant"]
    send(qtbot, window, "new question")
    assert _authors(window) == ["Assistant", "model-B"]
