"""SIGKILL in the middle of a streamed reply and in the middle of a save: nothing finished is lost,
the partial reply is kept and marked interrupted, and SQLite's integrity check passes."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchat.app.store.history import INTERRUPTED, HistoryStore

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def start_child(mode: str, tmp_path: Path, **extra_env) -> subprocess.Popen:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", KVCHAT_DATA_DIR=str(tmp_path / "data"),
               KVCHAT_SETTINGS_FILE=str(tmp_path / "settings.ini"), KVCHAT_LOG_DIR=str(tmp_path / "logs"),
               PYTHONPATH=str(HERE), **extra_env)
    return subprocess.Popen([sys.executable, str(HERE / "crash_child.py"), mode], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def read_only(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)


def test_sigkill_mid_stream_keeps_finished_turns_and_the_marked_partial_reply(tmp_path):
    """Kill -9 while a reply streams: the first turn is whole, the second's partial reply is there, interrupted."""
    child = start_child("window", tmp_path)
    path = tmp_path / "data" / "history.sqlite3"
    deadline = time.monotonic() + 60
    partial = ""
    try:
        while time.monotonic() < deadline and len(partial) < 200:
            time.sleep(0.1)
            assert child.poll() is None, child.stderr.read()
            if not path.exists():
                continue
            try:
                with read_only(path) as db:
                    rows = db.execute("SELECT content FROM messages WHERE state = 'streaming'").fetchall()
            except sqlite3.OperationalError:
                continue
            partial = rows[0][0] if rows else ""
        assert len(partial) >= 200, "the reply was not being saved while it streamed"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    store = HistoryStore(path)
    assert store.integrity() == "ok"
    [conversation] = store.conversations()
    entries = store.entries(conversation.id)
    assert [(e.role, e.state) for e in entries] == [("user", "done"), ("assistant", "done"), ("user", "done"),
                                                     ("assistant", INTERRUPTED)]
    assert entries[0].content == "first question" and entries[1].content
    assert entries[2].content == "second question"
    assert entries[3].content.startswith(partial) and len(entries[3].content) >= len(partial)
    store.close()


@pytest.mark.parametrize("round_", range(3))
def test_sigkill_during_saves_loses_no_committed_message(tmp_path, round_):
    """Kill -9 while 1 MB messages are being written back to back: every save reported committed is there, whole."""
    child = start_child("writer", tmp_path)
    committed = -1
    try:
        target = 5 + 7 * round_
        while committed < target:
            line = child.stdout.readline()
            assert line, child.stderr.read()
            committed = int(line)
        time.sleep(0.003 * round_)           # land at different points of the next write
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    store = HistoryStore(tmp_path / "data" / "history.sqlite3")
    assert store.integrity() == "ok"
    [conversation] = store.conversations()
    entries = store.entries(conversation.id)
    saved = [e for e in entries[2:]]
    assert len(saved) >= committed + 1
    for i, entry in enumerate(saved):
        assert entry.content == f"{i:08d}" + "x" * 1_000_000
    reply = entries[1]
    assert reply.state == INTERRUPTED and reply.content in {e.content for e in saved}
    store.close()


@pytest.mark.parametrize("round_", range(2))
def test_sigkill_during_live_cache_switches_loses_nothing(tmp_path, tiny_llama, round_):
    """Kill -9 while the real app (real engine, tiny model) switches a conversation's cache mode live, back to back,
    each switch saved to the history and the settings: the database is intact, the chat is whole, its saved mode is
    the last switch reported or the one in flight, and a restarted app resumes it in that mode and chats on."""
    import json

    from kvchat.app.store.history import cache_from_json
    from kvchat.app.store.settings_store import SettingsStore
    from crash_child import FIRST_QUESTION, SWITCH_MODES
    from kvchat.engine.config import CacheConfig

    child = start_child("switch", tmp_path, KVCHAT_TEST_MODEL=tiny_llama)
    reply, switches = None, -1
    try:
        target = 2 + 7 * round_
        while switches < target:
            line = child.stdout.readline()
            assert line, child.stderr.read()
            if line.startswith("turn "):
                reply = json.loads(line[5:])
            elif line.startswith("switched "):
                switches = int(line.split()[1])
        time.sleep(0.003 * round_)            # land at different points of the next switch
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    path = tmp_path / "data" / "history.sqlite3"
    store = HistoryStore(path)
    assert store.integrity() == "ok"
    [conversation] = store.conversations()
    entries = store.entries(conversation.id)
    assert [(e.role, e.state, e.content) for e in entries] == [("user", "done", FIRST_QUESTION.strip()),
                                                              ("assistant", "done", reply)]
    possible = {CacheConfig(**SWITCH_MODES[i % len(SWITCH_MODES)]) for i in (switches, switches + 1)}
    saved = conversation.cache
    assert saved in possible, saved
    assert SettingsStore(tmp_path / "settings.ini").load().cache in possible
    store.close()

    resumed = start_child("resume", tmp_path, KVCHAT_TEST_MODEL=tiny_llama)
    try:
        out, err = resumed.communicate(timeout=120)
    finally:
        resumed.kill()
    assert resumed.returncode == 0, err
    shown = json.loads(out.strip().splitlines()[-1])
    assert shown["messages"] == [{"role": "user", "content": FIRST_QUESTION.strip()},
                                 {"role": "assistant", "content": reply}]
    assert cache_from_json(shown["cache"]) == saved and shown["engine_messages"] == 2
    assert shown["reply"][0] in ("eos", "length")
    assert shown["after"][:2] == shown["messages"] and shown["after"][2]["content"] == "after restart"
    with read_only(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
