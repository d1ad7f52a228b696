"""A history file the user cannot read (issue 37, item 20): the app starts on an empty history that saves nothing
and says the real reason (the file is unreadable, or a folder stands at its path), instead of stopping with "check
that the folder is writable"; the file itself is left as it was. Run as 'nobody' where the tests run as root, which
reads any file."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvchat.app.store.history import HistoryStore
from kvchat.engine.config import CacheConfig
from test_history_faults import _run_as_nobody

pytestmark = pytest.mark.gui

CHILD = """
    store = HistoryStore("history.sqlite3")
    print(store.recovered, store.conversations())
    print(store.read_only_reason)
    try:
        store.create("x", CacheConfig())
        print("WROTE")
    except HistoryError as exc:
        print("ERROR", exc)
"""


@pytest.fixture
def folder():
    """A folder 'nobody' can reach (pytest's tmp_path is root's own)."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvchat-r3-history-{os.getpid()}"
    path.mkdir(mode=0o777)
    yield path
    path.chmod(0o777)
    inside = sorted(path.rglob("*"), reverse=True)          # children before their folders
    for p in inside:
        os.chmod(p, 0o700)
    for p in inside:
        p.rmdir() if p.is_dir() else p.unlink()
    path.rmdir()


def test_an_unreadable_history_file_opens_empty_with_the_real_reason(folder):
    store = HistoryStore(folder / "history.sqlite3")
    store.add_message(store.create("kept", CacheConfig()), "user", "kept")
    store.close()
    data = (folder / "history.sqlite3").read_bytes()
    (folder / "history.sqlite3").chmod(0o000)
    run = _run_as_nobody(CHILD, folder)
    assert run.returncode == 0, run.stderr
    opened, reason, write = run.stdout.splitlines()
    assert opened == "None []"
    assert reason == "you cannot read history.sqlite3, so its chats are not shown (chmod u+rw)"
    assert write.startswith("ERROR") and reason in write
    assert sorted(p.name for p in folder.iterdir()) == ["history.sqlite3"]        # nothing moved or added
    os.chmod(folder / "history.sqlite3", 0o600)
    assert (folder / "history.sqlite3").read_bytes() == data


def test_a_folder_at_the_history_path_that_cannot_be_moved_aside_is_not_called_damaged(folder):
    """A folder stands at the file's path, in a folder the user cannot write: nothing is moved, and the reason says
    what stands there (not that a database is damaged)."""
    sub = folder / "data"
    (sub / "history.sqlite3").mkdir(parents=True)
    (sub / "history.sqlite3" / "mine.txt").write_text("mine")
    sub.chmod(0o555)
    run = _run_as_nobody(CHILD.replace('"history.sqlite3"', '"data/history.sqlite3"'), folder)
    assert run.returncode == 0, run.stderr
    opened, reason, write = run.stdout.splitlines()
    assert opened == "None []"
    assert reason == ("it cannot be opened: a folder or another kind of file stands at its path, and it could not be "
                      "moved aside (Permission denied)")
    assert write.startswith("ERROR") and reason in write
    assert sorted(p.name for p in sub.iterdir()) == ["history.sqlite3"]
    assert (sub / "history.sqlite3" / "mine.txt").read_text() == "mine"
