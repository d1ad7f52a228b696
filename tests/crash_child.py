"""A process for the crash tests to kill: `window` runs the real main window over the fake engine and
streams a long reply; `writer` saves large messages as fast as it can, printing each committed count;
`switch` runs the real main window over the real engine (the tiny model in KVCHAT_TEST_MODEL), chats once,
then switches the cache mode live back to back, printing each switch the app has saved; `resume` starts
the app again on the same files, prints what it shows and sends one more message."""
from __future__ import annotations

import sys
from dataclasses import replace


def run_window() -> int:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from kvchat.app.store.history import HistoryStore
    from kvchat.app.shell.main_window import MainWindow
    from kvchat.app.store.settings_store import SettingsStore
    from kvchat.engine.config import SamplingParams
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
    from kvchat.app.store.history import STREAMING, HistoryStore
    from kvchat.engine.config import CacheConfig

    store = HistoryStore()
    cid = store.create("writer", CacheConfig())
    reply = store.add_turn(cid, [("user", "go", "done"), ("assistant", "", STREAMING)])[1]
    for i in range(1_000_000):
        body = f"{i:08d}" + "x" * 1_000_000
        store.add_message(cid, "user", body)
        store.update_message(reply, body, STREAMING)
        print(i, flush=True)
    return 0


SWITCH_MODES = [dict(k_format="int8", v_format="int8"), dict(k_format="int4", v_format="int4"),
                dict(k_format="fp32", v_format="fp32", window=64, sinks=4), dict(k_format="int4", v_format="int8"),
                dict(k_format="bf16", v_format="bf16"), dict(k_format="fp8", v_format="fp8")]
FIRST_QUESTION = "first question: " + "The quick brown fox jumps over the lazy dog. " * 40


def _real_window():
    import os

    from PySide6.QtWidgets import QApplication

    from kvchat.app.store.history import HistoryStore
    from kvchat.app.shell.main_window import MainWindow
    from kvchat.app.store.settings_store import SettingsStore
    from kvchat.engine import Engine

    def loader(config, progress):
        return Engine.load(replace(config, model=os.environ["KVCHAT_TEST_MODEL"]), progress=progress)

    app = QApplication([])
    window = MainWindow(SettingsStore(), HistoryStore(), loader=loader)
    window.host.error.connect(lambda e: print(f"error {e}", file=sys.stderr, flush=True))
    return app, window


def run_switch() -> int:
    import json

    from PySide6.QtCore import QTimer

    from kvchat.engine.config import CacheConfig, SamplingParams

    app, window = _real_window()
    window.settings = replace(window.settings, sampling=SamplingParams(temperature=0.0, max_new_tokens=6))
    state = {"stage": 0, "switches": 0}

    def switch() -> None:
        mode = SWITCH_MODES[state["switches"] % len(SWITCH_MODES)]
        window.apply_settings(replace(window.settings, cache=CacheConfig(**mode)))

    def opened(_event) -> None:
        if state["stage"] == 0:
            state["stage"] = 1
            QTimer.singleShot(0, lambda: window.send(FIRST_QUESTION))

    def finished(event) -> None:
        if state["stage"] == 1:
            state["stage"] = 2
            print("turn " + json.dumps(event.text), flush=True)
            QTimer.singleShot(0, switch)

    def switched(event) -> None:
        print(f"switched {state['switches']} {event.stats.tokens_held}", flush=True)
        state["switches"] += 1
        QTimer.singleShot(0, switch)

    window.host.session_opened.connect(opened)
    window.host.turn_finished.connect(finished)
    window.host.mode_switched.connect(switched)
    window.show()
    return app.exec()


def run_resume() -> int:
    import json

    from PySide6.QtCore import QTimer

    from kvchat.app.store.history import cache_to_json

    app, window = _real_window()
    out = {}

    def opened(event) -> None:
        if "messages" not in out:
            out["messages"] = window.history.messages(window.conversation_id)
            out["cache"] = cache_to_json(event.cache)
            out["engine_messages"] = event.num_messages
            QTimer.singleShot(0, lambda: window.send("after restart"))

    def finished(event) -> None:
        out["reply"] = [event.finish_reason, event.text]
        out["after"] = window.history.messages(window.conversation_id)
        print(json.dumps(out), flush=True)
        app.quit()

    window.host.session_opened.connect(opened)
    window.host.turn_finished.connect(finished)
    window.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit({"window": run_window, "writer": run_writer, "switch": run_switch, "resume": run_resume}[sys.argv[1]]())
