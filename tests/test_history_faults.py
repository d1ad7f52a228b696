"""The history database under damage, read-only files, odd rows and refused turns; the app's answer to each."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from kvchat.app.store.history import INTERRUPTED, STREAMING, HistoryError, HistoryStore
from kvchat.engine.config import CacheConfig, SamplingParams
from fakes import FakeLoader, isolate_app, open_window

pytestmark = pytest.mark.gui
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def db_path(tmp_path) -> Path:
    return tmp_path / "data" / "history.sqlite3"


def ready_window(qtbot, loader=None, **changes):
    window = open_window(qtbot, loader or FakeLoader(), autoload=False)
    fields = {n: getattr(window.settings, n) for n in ("model", "cache", "sampling", "system_prompt")}
    window.apply_settings(type(window.settings)(**{**fields, **changes}))
    qtbot.waitUntil(lambda: window.session_ready, timeout=10_000)
    return window


def send_and_wait(qtbot, window, text, timeout=10_000):
    with qtbot.waitSignal(window.host.turn_finished, timeout=timeout) as blocker:
        window.input.setPlainText(text)
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not window.generating, timeout=2000)
    return blocker.args[0]


def moved_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if ".damaged-" in p.name and not p.name.endswith(("-wal", "-shm")))


# ---- damaged, unreadable, read-only --------------------------------------------------------------

def test_garbage_database_is_moved_aside_and_the_window_says_where(qtbot, tmp_path):
    """A file of garbage bytes is renamed (not overwritten), a fresh history starts, the banner names the old file."""
    path = db_path(tmp_path)
    path.parent.mkdir(parents=True)
    garbage = os.urandom(8192)
    path.write_bytes(garbage)
    window = open_window(qtbot, FakeLoader(), autoload=False)
    [moved] = moved_files(path.parent)
    assert moved.read_bytes() == garbage
    assert window.banner.isVisible() and str(moved) in window.banner.text()
    assert window.history.integrity() == "ok" and window.history.conversations() == []
    window.load_engine()
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    send_and_wait(qtbot, window, "fresh start")
    assert [m["content"] for m in window.history.messages(window.conversation_id)][0] == "fresh start"


def test_malformed_database_is_moved_aside_with_its_bytes(tmp_path):
    """A database whose pages are damaged (a valid header, broken b-trees) is detected at open and kept aside intact."""
    path = db_path(tmp_path)
    store = HistoryStore(path)
    cid = store.create("hello", CacheConfig())
    for i in range(300):
        store.add_message(cid, "user", f"message {i} " * 20)
    store.close()
    data = bytearray(path.read_bytes())
    page = 4096
    data[2 * page:6 * page] = os.urandom(4 * page)      # overwrite b-tree pages, keep the header
    path.write_bytes(bytes(data))
    store = HistoryStore(path)
    assert store.recovered is not None and store.recovered.moved_to.read_bytes() == bytes(data)
    assert store.integrity() == "ok" and store.conversations() == []
    store.close()


def test_unreadable_database_is_moved_aside(tmp_path):
    """A history path that cannot be opened as a file (here: a folder stands there) is moved aside, not deleted."""
    path = db_path(tmp_path)
    path.mkdir(parents=True)
    (path / "keep.txt").write_text("mine")
    store = HistoryStore(path)
    assert store.recovered is not None and (store.recovered.moved_to / "keep.txt").read_text() == "mine"
    assert "cannot be opened" in store.recovered.reason
    store.create("works", CacheConfig())
    store.close()


def _run_as_nobody(code: str, folder: Path) -> subprocess.CompletedProcess:
    """Run code in a child that drops to uid 'nobody' after its imports (root ignores file modes)."""
    prelude = "import os, sys\nfrom kvchat.app.store.history import *\nfrom kvchat.engine.config import CacheConfig\n"
    if os.geteuid() == 0:
        prelude += "os.setgid(65534); os.setuid(65534)\n"
    folder.chmod(0o777)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, cwd=folder)


def test_read_only_file_reads_and_refuses_writes_with_a_clear_error(tmp_path):
    """A 0444 database (enforced for a non-root user) opens, lists its chats, and every save says what to do."""
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvchat-ro-{os.getpid()}"
    folder.mkdir(mode=0o777, exist_ok=True)
    try:
        store = HistoryStore(folder / "history.sqlite3")
        store.add_message(store.create("kept", CacheConfig()), "user", "kept")
        store.close()
        for f in folder.iterdir():
            f.chmod(0o444)
        result = _run_as_nobody("""
            store = HistoryStore("history.sqlite3")
            print([c.title for c in store.conversations()], store.recovered)
            for write in (store.check_writable, lambda: store.add_message(1, "user", "x")):
                try:
                    write()
                    print("WROTE")
                except HistoryError as exc:
                    print("ERROR", exc)
        """, folder)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == "['kept'] None"
        assert lines[1].startswith("ERROR") and "read-only" in lines[1] and "chmod" in lines[1]
        assert lines[2].startswith("ERROR")
    finally:
        for f in folder.iterdir():
            f.chmod(0o644)
            f.unlink()
        folder.rmdir()


def test_send_on_read_only_history_shows_the_error_and_keeps_the_text(qtbot, tmp_path):
    """Send with a history SQLite refuses to write shows why in the banner; nothing is sent, the text stays."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=3))
    if os.geteuid() == 0:   # root writes any file: make SQLite itself refuse writes (the same SQLITE_READONLY)
        window.history._db.execute("PRAGMA query_only = 1")
    else:
        window.history.close()
        db_path(tmp_path).chmod(0o444)
        window.history.__init__(db_path(tmp_path))
    window.input.setPlainText("please save me")
    qtbot.keyClick(window.input, Qt.Key.Key_Return)
    assert window.banner.isVisible() and "read-only" in window.banner.text()
    assert not window.generating
    assert window.input.toPlainText() == "please save me"
    assert window.chat.messages() == []


def test_database_folder_is_0700_and_files_0600(qtbot, tmp_path):
    """The history folder and every SQLite file in it are readable by the user only."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=3))
    send_and_wait(qtbot, window, "private")
    folder = db_path(tmp_path).parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(folder.iterdir())
    assert {f.name for f in files} >= {"history.sqlite3", "history.sqlite3-wal", "history.sqlite3-shm"}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


# ---- odd rows ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("row", ['[1, 2]', '"int8"', 'null', '{"budget_mb": Infinity}', '{"sinks": 2.5}',
                                 '{"window": "big"}', 'not json'])
def test_cache_config_row_that_is_not_a_valid_object_falls_back_to_defaults(qtbot, tmp_path, row):
    """A hand-edited cache_config row neither breaks the conversation list nor the chat: defaults, with a notice."""
    store = HistoryStore(db_path(tmp_path))
    good = store.create("good chat", CacheConfig(k_format="int8", v_format="int8"))
    odd = store.create("odd chat", CacheConfig())
    store.add_message(odd, "user", "hi")
    store.add_message(odd, "assistant", "hello")
    store._db.execute("UPDATE conversations SET cache_config = ? WHERE id = ?", (row, odd))
    store._db.commit()
    store.close()
    window = ready_window(qtbot)
    assert sorted(window.conversations.ids()) == sorted([good, odd])
    window.show_conversation(odd)
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    texts = [m.text() for m in window.chat.messages()]
    assert texts[:2] == ["hi", "hello"]
    assert "could not be read" in texts[-1] and "default" in texts[-1]
    assert window.session_cache == window.settings.cache


# ---- refused turns -------------------------------------------------------------------------------

def test_refused_first_turn_leaves_nothing_in_the_history(qtbot):
    """A prompt over the budget ends with advice; neither the message nor an empty chat is saved; the text is back."""
    window = ready_window(qtbot, cache=CacheConfig(budget_mb=0.05), sampling=SamplingParams(max_new_tokens=3))
    text = "word " * 50
    finished = send_and_wait(qtbot, window, text)
    assert finished.finish_reason == "budget" and finished.text == ""
    assert window.history.conversations() == []
    assert window.conversation_id is None
    assert window.input.toPlainText() == text.strip()
    finished = send_and_wait(qtbot, window, "short")
    assert finished.finish_reason == "length"
    assert [m["role"] for m in window.history.messages(window.conversation_id)] == ["user", "assistant"]


def test_refused_later_turn_keeps_the_earlier_ones_only(qtbot):
    """In a saved chat, a refused message is not added; restarting does not replay it."""
    window = ready_window(qtbot, cache=CacheConfig(budget_mb=0.05), sampling=SamplingParams(max_new_tokens=3))
    send_and_wait(qtbot, window, "hello")
    cid = window.conversation_id
    assert send_and_wait(qtbot, window, "word " * 50).finish_reason == "budget"
    assert [m["content"] for m in window.history.messages(cid)][0] == "hello"
    assert len(window.history.messages(cid)) == 2
    assert window.history.conversations()[0].id == cid


def test_refused_turn_with_the_real_engine_is_not_saved(qtbot, tiny_llama):
    """The same with the real engine on a tiny model: a prompt over the KV budget is refused and not persisted."""
    from kvchat.engine import Engine

    def loader(config, progress):
        return Engine.load(config, progress=progress)

    window = ready_window(qtbot, loader, model=tiny_llama, cache=CacheConfig(budget_mb=0.1),
                          sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
    finished = send_and_wait(qtbot, window, "The quick brown fox jumps over the lazy dog. " * 30)
    assert finished.finish_reason == "budget"
    assert window.history.conversations() == []
    finished = send_and_wait(qtbot, window, "Hi")
    assert finished.finish_reason != "budget"
    assert [m["role"] for m in window.history.messages(window.conversation_id)] == ["user", "assistant"]


def test_resumed_chat_drops_trailing_unanswered_messages_with_a_notice(qtbot, tmp_path):
    """User messages after the last reply (left by an older version) are dropped, said so, the last one refilled."""
    store = HistoryStore(db_path(tmp_path))
    cid = store.create("chat", CacheConfig())
    for role, text in (("user", "q1"), ("assistant", "a1"), ("user", "refused 1"), ("user", "refused 2")):
        store.add_message(cid, role, text)
    store.close()
    from kvchat.app.store.settings_store import SettingsStore
    SettingsStore().set_last_conversation(cid)
    loader = FakeLoader()
    window = ready_window(qtbot, loader)
    texts = [m.text() for m in window.chat.messages()]
    assert texts[:2] == ["q1", "a1"] and "2 message(s)" in texts[2] and "never got a reply" in texts[2]
    assert window.history.messages(cid) == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert window.input.toPlainText() == "refused 2"
    assert [m["content"] for m in loader.engines[-1].sessions[-1].messages] == ["q1", "a1"]


# ---- saved while streaming ----------------------------------------------------------------------------

def test_reply_is_saved_while_it_streams_then_marked_done(qtbot):
    """During a long reply the database already holds the user message and the partial reply ("streaming")."""
    window = ready_window(qtbot, FakeLoader(step_s=0.02), sampling=SamplingParams(max_new_tokens=2000))
    window.input.setPlainText("tell me a long story")
    window.input.submit()

    def partial_saved():
        entries = window.history.entries(window.conversation_id) if window.conversation_id else []
        return len(entries) == 2 and entries[1].state == STREAMING and len(entries[1].content) > 40

    qtbot.waitUntil(partial_saved, timeout=10_000)
    assert window.generating
    with qtbot.waitSignal(window.host.turn_finished, timeout=5000) as blocker:
        window.stop()
    entries = window.history.entries(window.conversation_id)
    assert entries[1].state == "done" and entries[1].content == blocker.args[0].text


def test_interrupted_reply_is_kept_and_marked_in_the_chat(qtbot, tmp_path):
    """A reply row left "streaming" by a dead process is marked interrupted at open and shown with the mark."""
    store = HistoryStore(db_path(tmp_path))
    cid = store.create("chat", CacheConfig())
    store.add_turn(cid, [("user", "q", "done"), ("assistant", "half an ans", STREAMING)])
    store.close()
    from kvchat.app.store.settings_store import SettingsStore
    SettingsStore().set_last_conversation(cid)
    window = open_window(qtbot, FakeLoader(), autoload=False)
    assert window.history.entries(cid)[1].state == INTERRUPTED
    reply = window.chat.messages()[1]
    assert reply.text() == "half an ans" and reply.is_interrupted()
    assert "Interrupted" in reply.interrupted_label.text()
    assert window.chat.messages()[0].is_interrupted() is False
