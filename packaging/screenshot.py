"""A screenshot of the app in one language: the default model, one short exchange, the window grabbed to a PNG.

    KVCHAT_LANG=zh_CN QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/screenshot.py resources/screenshot-zh_CN.png

Settings and history go to a temporary folder (nothing of the user's is shown or changed). The reply is
greedy, so the same model gives the same picture. Not part of `make test`.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("--text", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--size", default="1320x820", help="window size, WIDTHxHEIGHT")
    parser.add_argument("--page", default="Live", help="dashboard page: Live, Pool, Plan or Lengths")
    parser.add_argument("--model", default="default", help="the model to load (a .gguf or a Hugging Face folder)")
    parser.add_argument("--dashboard-only", action="store_true", help="grab the dashboard, not the whole window")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvchat-shot-") as tmp:
        os.environ.update(KVCHAT_DATA_DIR=f"{tmp}/data", KVCHAT_SETTINGS_FILE=f"{tmp}/settings.ini",
                          HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        from dataclasses import replace

        from PySide6.QtCore import QTimer
        from PySide6.QtWidgets import QApplication

        from kvchat.app.store.history import HistoryStore
        from kvchat.app.i18n import install
        from kvchat.app.shell.main import load_style
        from kvchat.app.shell.main_window import MainWindow
        from kvchat.app.store.settings_store import SettingsStore
        from kvchat.engine.config import SamplingParams

        app = QApplication([sys.argv[0]])
        app.setApplicationName("kvchat")
        load_style(app)
        store = SettingsStore()
        store.save(replace(store.load(), model=args.model))
        language = install(app, store.language())
        history = HistoryStore()
        window = MainWindow(store, history)
        window.settings = replace(window.settings, sampling=SamplingParams(temperature=0.0, max_new_tokens=48))
        width, height = (int(n) for n in args.size.lower().split("x"))
        window.resize(width, height)
        window.show()
        state = {"sent": False, "code": 2}

        def shoot() -> None:
            window.dashboard.show_page(args.page)
            window.dashboard.redraw()
            window.statusBar().clearMessage()   # the status line (model, family, cache), not the load message
            shown = window.dashboard if args.dashboard_only else window
            QTimer.singleShot(600, lambda: finish(shown.grab().save(args.out)))

        def finish(saved: bool) -> None:
            print(f"{language}: {'wrote' if saved else 'could not write'} {args.out}")
            state["code"] = 0 if saved else 1
            window.close()
            app.quit()

        def tick() -> None:
            if window.last_error is not None:
                print(f"screenshot: {window.last_error.title}: {window.last_error.message}", file=sys.stderr)
                state["code"] = 1
                app.quit()
            elif not state["sent"] and window.session_ready:
                state["sent"] = True
                window.send(args.text)

        window.host.turn_finished.connect(lambda _event: QTimer.singleShot(1500, shoot))
        timer = QTimer(interval=100)
        timer.timeout.connect(tick)
        timer.start()
        QTimer.singleShot(300_000, app.quit)
        app.exec()
        history.close()
        return state["code"]


if __name__ == "__main__":
    raise SystemExit(main())
