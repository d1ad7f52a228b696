"""The app's log: a rotating file in the user log dir, readable by the user only; and what an uncaught
exception does (logged, then a dialog that says where the log is, instead of the window vanishing)."""
from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import threading
import traceback
from pathlib import Path

from kvchat.engine import paths

LOG_NAME = "kvchat.log"
MAX_BYTES = 1_000_000
BACKUPS = 3


def log_dir() -> Path:
    """KVCHAT_LOG_DIR if set (tests use it), else the platform's user log dir (engine/paths.py)."""
    return paths.log_dir()


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """Every file it opens, the rotated ones included, is created 0600."""

    def _open(self):
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.chmod(self.baseFilename, 0o600)      # an older file made with another mode
        return os.fdopen(fd, self.mode if "a" in self.mode else "a", encoding=self.encoding)


def setup_logging(level: int = logging.INFO) -> Path:
    """Send the root logger to the rotating log file; returns its path."""
    folder = log_dir()
    existed = folder.is_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not existed:
        os.chmod(folder, 0o700)
    path = folder / LOG_NAME
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, PrivateRotatingFileHandler):
            root.removeHandler(handler)
            handler.close()
    handler = PrivateRotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(min(root.level or level, level))
    return path


def install_excepthook(log_path: Path):
    """sys.excepthook (and threading.excepthook): log the traceback, then show a dialog naming the log.

    The dialog is shown from the GUI thread whatever thread raised (a queued signal carries it)."""
    from PySide6.QtCore import QObject, Signal, Slot

    class _Reporter(QObject):       # lives in the GUI thread: a report from another thread is queued to it
        report = Signal(str)

        @Slot(str)
        def show(self, text: str) -> None:
            show_crash_dialog(text, log_path)

    reporter = _Reporter()
    reporter.report.connect(reporter.show)

    def hook(exc_type, exc, tb) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            sys.__excepthook__(exc_type, exc, tb)
            return
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        logging.getLogger("kvchat").error("uncaught exception:\n%s", text)
        if sys.__stderr__ is not None:
            sys.__stderr__.write(text)
        reporter.report.emit(f"{exc_type.__name__}: {exc}")

    def thread_hook(args) -> None:
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    hook.reporter = reporter            # kept alive with the hook
    sys.excepthook = hook
    threading.excepthook = thread_hook
    return hook


def show_crash_dialog(summary: str, log_path: Path):
    from PySide6.QtCore import QCoreApplication, Qt
    from PySide6.QtWidgets import QApplication, QMessageBox
    if QApplication.instance() is None:
        return None
    box = QMessageBox(QMessageBox.Icon.Critical, QCoreApplication.translate("Crash", "kvchat hit an unexpected error"),
                      QCoreApplication.translate("Crash", "{summary}\n\nkvchat keeps running, but the last action may "
                                                 "not have finished. The details are in the log:\n{log}").format(
                          summary=summary, log=log_path), QMessageBox.StandardButton.Ok)
    box.setObjectName("crashDialog")
    box.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    _open_dialogs.append(box)           # held until closed: a parentless dialog needs a Python reference
    box.finished.connect(lambda _result: _open_dialogs.remove(box))
    box.open()
    return box


_open_dialogs: list = []

