"""`kvchat --self-test TEXT`: open the window, send TEXT once the model is loaded, print the reply, quit.

It goes through the real window, worker thread and engine, as a user's message does; the exit status
says how it went (0: a non-empty reply, 1: the load or the turn failed, 2: no reply in time).
packaging/smoke_test.py checks a built bundle with it.
"""
from __future__ import annotations

import sys
import time

from PySide6.QtCore import QTimer


class SelfTest:
    def __init__(self, app, window, text: str, timeout_s: float = 300.0):
        from dataclasses import replace

        from kvchat.engine.config import SamplingParams
        self.app, self.window, self.text = app, window, text
        window.settings = replace(window.settings, sampling=SamplingParams(temperature=0.0, max_new_tokens=32))
        self.deadline = time.monotonic() + timeout_s
        self.sent = False
        self.code = 2
        window.host.turn_finished.connect(self._finished)
        self.timer = QTimer(interval=100)
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    def _tick(self) -> None:
        w = self.window
        if w.last_error is not None:
            print(f"self-test: {w.last_error.title}: {w.last_error.message}", file=sys.stderr)
            return self._quit(1)
        if time.monotonic() > self.deadline:
            print("self-test: no reply in time", file=sys.stderr)
            return self._quit(2)
        if not self.sent and w.session_ready:
            self.sent = True
            w.input.setPlainText(self.text)
            w.input.submit()

    def _finished(self, event) -> None:
        print(f"reply: {event.text}", flush=True)
        if event.message:
            print(f"self-test: {event.message}", file=sys.stderr)
        self._quit(0 if event.text.strip() else 1)

    def _quit(self, code: int) -> None:
        self.code = code
        self.timer.stop()
        self.window.close()
        self.app.quit()
