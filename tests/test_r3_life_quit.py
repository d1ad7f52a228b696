"""Issue 37, item 1: Quit ends the process. The real app (`kvchat`'s main, a real window, the real engine) with three
chats whose KV caches it keeps on disk: Ctrl+Q says "Saving 3 chats' caches…" in the status line, writes each file
whole, and the process exits with 0. It used to hide, write the files and run on for good: the close connected to
the engine thread's `finished` while that signal was being emitted (the saves ran inside it), so it was never called.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kernel_cache import seeded
from tiny_models import tiny_model_dir

pytestmark = pytest.mark.gui
ROOT = Path(__file__).resolve().parent.parent
QUIT_BOUND_S = 60

CHILD = textwrap.dedent("""
    import sys, time
    from dataclasses import replace
    from PySide6.QtCore import Qt, QTimer
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication
    app = QApplication([sys.argv[0]])
    from kvchat.app.shell.main import main
    from kvchat.app.shell.main_window import MainWindow
    from kvchat.engine.config import SamplingParams
    steps = ["send", "new", "send", "new", "send", "quit"]

    def window():
        return next((w for w in app.topLevelWidgets() if isinstance(w, MainWindow)), None)

    def saving(event):
        w = window()
        print("saving:", event.num_chats, w.isVisible(), w.statusBar().currentMessage(), flush=True)

    def tick():
        w = window()
        if w is None or not w.session_ready or w.generating or not steps:
            return
        if steps[0] == "send" and not hasattr(w, "_hooked"):
            w._hooked = True
            w.host.saving.connect(saving)
            w.settings = replace(w.settings, sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
        step = steps.pop(0)
        if step == "send":              # about 2,400 tokens each: tens of MB of cache to write per chat
            w.input.setPlainText(f"chat {len(steps)}: " + "word " * 480)
            w.input.submit()
        elif step == "new":
            w.new_chat()
        else:
            print("quitting", flush=True)
            QTest.keyClick(w, Qt.Key.Key_Q, Qt.KeyboardModifier.ControlModifier)
            print("closed", "deferred" if w.host.thread.isRunning() else "joined", flush=True)

    timer = QTimer(interval=50)
    timer.timeout.connect(tick)
    timer.start()
    sys.exit(main(["--model", sys.argv[1]]))
""")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    # 32 KiB of fp32 K/V a token (16 layers x 4 KV heads x 64): each chat's file is ~75 MB, written past the
    # 50 ms the window waits for the engine on close
    return tiny_model_dir(tmp_path_factory.mktemp("quit") / "model", hidden=256, heads=4, kv_heads=4, layers=16,
                          max_positions=4096)


def run_until_exit(args: list[str], env: dict) -> tuple[subprocess.Popen, list[str], float | None]:
    """Start the child, and wait for it to exit within QUIT_BOUND_S of printing "quitting"; (child, its lines, how
    long it took to exit after quitting, None if it did not)."""
    child = subprocess.Popen(args, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    quitting = threading.Event()

    def read() -> None:
        for line in child.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("quitting"):
                quitting.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not quitting.wait(240):
        child.kill()
        pytest.fail("the app never got to quitting:\n" + "\n".join(lines[-40:]))
    started = time.monotonic()
    try:
        child.wait(QUIT_BOUND_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        reader.join(5)
        return child, lines, None
    reader.join(5)
    return child, lines, time.monotonic() - started


def test_ctrl_q_with_three_warm_chats_saves_them_and_ends_the_process(wide_model, tmp_path, monkeypatch):
    cache_dir = seeded(tmp_path / "cache")          # the kernels the session built: not compiled again in the child
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", KVCHAT_DATA_DIR=str(tmp_path / "data"),
               KVCHAT_SETTINGS_FILE=str(tmp_path / "settings.ini"), KVCHAT_QUALITY_FILE=str(tmp_path / "q.json"),
               KVCHAT_LOG_DIR=str(tmp_path / "log"), KVCHAT_CACHE_DIR=str(cache_dir), KVCHAT_THREADS="1")
    child, lines, took = run_until_exit([sys.executable, "-c", CHILD, wide_model], env)
    out = "\n".join([line for line in lines if not line.startswith("qt.")][-40:])
    assert took is not None, f"the process did not exit within {QUIT_BOUND_S} s of Ctrl+Q:\n{out}"
    assert child.returncode == 0, out
    assert "closed deferred" in lines, out          # the saves outlasted the window's wait: the path that hung
    assert "saving: 3 True Saving 3 chats' caches…" in lines, out     # said, in the window still shown

    # each file is whole: the restore path reads it back into the chat it belongs to
    folder = cache_dir / "kv"
    assert sorted(p.suffix for p in folder.iterdir()) == [".kvcache"] * 3, "no partial (.tmp) file is left"
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    from kvchat.app.store.history import HistoryStore
    from kvchat.engine import Engine, EngineConfig
    history = HistoryStore()
    engine = Engine.load(EngineConfig(model=wide_model))
    conversations = history.conversations()
    assert len(conversations) == 3
    for conversation in conversations:
        session = engine.new_session(system_prompt=conversation.system_prompt or None,
                                     history=history.messages(conversation.id))
        engine.keep_warm(session, str(conversation.id))
        assert engine.restore_warm(session).tokens > 2000
        session.close()
    history.close()


def test_a_save_abandoned_mid_write_leaves_no_cache_file_and_its_leftover_goes(tmp_path):
    """A process ended mid-write (a close past its deadline) leaves only the save's temporary file, which no
    restore reads; the next trim deletes it once it is an hour old, and leaves a fresh one (another process's
    save in progress) alone."""
    from kvchat.engine.runtime.warm import LEFTOVER_AGE_S, SUFFIX, WarmStore
    store = WarmStore(tmp_path / "kv")
    store.folder.mkdir()
    old, fresh = store.folder / f"7-abc{SUFFIX}.k2j4.tmp", store.folder / f"8-abc{SUFFIX}.x9q1.tmp"
    for p in (old, fresh):
        p.write_bytes(b"\0" * 4096)             # a half-written file
    os.utime(old, (time.time() - LEFTOVER_AGE_S - 60,) * 2)
    assert store.files() == [] and store.total_bytes() == 0
    store.trim()
    assert not old.exists() and fresh.exists()


def test_past_the_save_limit_a_closing_engine_saves_nothing_more_and_ends(qtbot, tiny_llama, tmp_path, monkeypatch):
    """The engine thread starts no save after the close's limit (here 0 s): the chat keeps the file written when it
    was left, whole, and the thread ends at once."""
    from fakes import isolate_app, real_window, send
    from kvchat.engine.config import SamplingParams
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    window = real_window(qtbot, str(tiny_llama), sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
    send(qtbot, window, "The first chat, about the sea")
    window.new_chat()                               # the chat left goes to disk now
    qtbot.waitUntil(lambda: window.session_ready, timeout=30_000)
    send(qtbot, window, "The second chat, about the mountains")
    (first,) = (tmp_path / "cache" / "kv").glob("*.kvcache")
    before = first.read_bytes()
    with qtbot.waitSignal(window.host.saving, timeout=10_000) as saving:
        assert window.host.shutdown(timeout_ms=10_000, save_limit_s=0.0)
    assert saving.args[0].num_chats == 2
    assert [p.name for p in (tmp_path / "cache" / "kv").iterdir()] == [first.name]
    assert first.read_bytes() == before
