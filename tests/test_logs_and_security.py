"""Logs in the user log dir (rotated, 0600), `kvchat --version`, a dialog for uncaught exceptions, and
no network port opened by the app."""
from __future__ import annotations

import logging
import stat
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import psutil
import pytest
from PySide6.QtWidgets import QApplication, QMessageBox

from kvchat.app.shell import logs
from kvchat.engine.config import SamplingParams
from fakes import FakeLoader, isolate_app, open_window

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def log_setup(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCHAT_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    yield tmp_path / "logs"
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logs.PrivateRotatingFileHandler):
            root.removeHandler(handler)
            handler.close()


def test_version_prints_the_package_version():
    """`kvchat --version` prints the version from pyproject without starting the app."""
    out = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert out.returncode == 0 and out.stdout.strip() == f"kvchat {expected}"


def test_logs_rotate_in_a_private_folder(log_setup, monkeypatch):
    """The log folder is 0700; the log and every rotated file are 0600; old files rotate out."""
    monkeypatch.setattr(logs, "MAX_BYTES", 2000)
    path = logs.setup_logging()
    assert path.parent == log_setup
    for i in range(200):
        logging.getLogger("kvchat.test").warning("line %d %s", i, "x" * 50)
    files = sorted(log_setup.iterdir())
    assert [f.name for f in files] == ["kvchat.log", "kvchat.log.1", "kvchat.log.2", "kvchat.log.3"]
    assert stat.S_IMODE(log_setup.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert "line 199" in path.read_text()


def crash_dialogs():
    return [w for w in QApplication.topLevelWidgets()
            if isinstance(w, QMessageBox) and w.objectName() == "crashDialog" and w.isVisible()]


def test_uncaught_exception_shows_a_dialog_with_the_log_path(qtbot, log_setup):
    """An exception nobody catches (GUI thread or another) is logged and shown in a dialog naming the log."""
    path = logs.setup_logging()
    hook = logs.install_excepthook(path)
    assert sys.excepthook is hook
    try:
        raise ValueError("boom in a slot")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    [box] = crash_dialogs()
    assert "boom in a slot" in box.text() and str(path) in box.text()
    assert "ValueError: boom in a slot" in path.read_text()
    box.done(0)
    qtbot.waitUntil(lambda: crash_dialogs() == [])
    worker = threading.Thread(target=lambda: 1 / 0)
    worker.start()
    worker.join()
    qtbot.waitUntil(lambda: len(crash_dialogs()) == 1, timeout=3000)
    assert "ZeroDivisionError" in crash_dialogs()[0].text()
    crash_dialogs()[0].done(0)


def _listening(process: psutil.Process):
    connections = process.net_connections(kind="inet") if hasattr(process, "net_connections") \
        else process.connections(kind="inet")
    return [c for c in connections if c.status == psutil.CONN_LISTEN or not c.raddr]


@pytest.mark.gui
def test_app_opens_no_network_port(qtbot, monkeypatch, tmp_path):
    """The main window, loaded and answering, holds no listening (or unconnected bound) inet socket."""
    isolate_app(monkeypatch, tmp_path)
    window = open_window(qtbot, FakeLoader(), autoload=True)
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    window.settings = type(window.settings)(window.settings.model, window.settings.cache,
                                            SamplingParams(max_new_tokens=3), "")
    with qtbot.waitSignal(window.host.turn_finished, timeout=5000):
        window.send("hello")
    assert _listening(psutil.Process()) == []
