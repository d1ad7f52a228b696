"""A process for the crash tests to kill: `window` runs the real main window over the fake engine and
streams a long reply; `writer` saves large messages as fast as it can, printing each committed count."""
from __future__ import annotations

import sys
from dataclasses import replace


def run_window() -> int:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from app.history import HistoryStore
    from app.main_window import MainWindow
    from app.settings_store import SettingsStore
    from engine.config import SamplingParams
    from fakes import FakeLoader

    app = QApplication([])
    window = MainWindow(SettingsStore(), HistoryStore(), loader=FakeLoader(step_s=0.01))
    window.settings = replace(window.settings, sampling=SamplingParams(max_new_tokens=3))
    stage = {"n": 0}

    def opened(_event) -> None:
        if stage["n"] == 0:
            stage["n"] = 1
            QTimer.singleShot(0, lambda: window.send("first question"))

    def finished(_event) -> None:
        if stage["n"] == 1:
            stage["n"] = 2
            window.settings = replace(window.settings, sampling=SamplingParams(max_new_tokens=1_000_000))
            QTimer.singleShot(0, lambda: window.send("second question"))

    window.host.session_opened.connect(opened)
    window.host.turn_finished.connect(finished)
    window.show()
    return app.exec()


def run_writer() -> int:
    from app.history import STREAMING, HistoryStore
    from engine.config import CacheConfig

    store = HistoryStore()
    cid = store.create("writer", CacheConfig())
    reply = store.add_turn(cid, [("user", "go", "done"), ("assistant", "", STREAMING)])[1]
    for i in range(1_000_000):
        body = f"{i:08d}" + "x" * 1_000_000
        store.add_message(cid, "user", body)
        store.update_message(reply, body, STREAMING)
        print(i, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_window() if sys.argv[1] == "window" else run_writer())
