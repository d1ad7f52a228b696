"""`kvchat` with no subcommand: the desktop app."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

RESOURCES = Path(__file__).resolve().parents[2] / "resources"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvchat", description="Desktop chat that shows and controls its KV cache")
    parser.add_argument("--model", help="'default', a local Hugging Face folder or a .gguf file (saved in Settings)")
    parser.add_argument("--version", action="version", version=f"kvchat {version()}")
    parser.add_argument("--self-test", metavar="TEXT", help="send TEXT once the model is loaded, print the reply and "
                        "quit (greedy; checks an installed app)")
    return parser.parse_args(argv)


def version() -> str:
    """The installed package's version, or pyproject's when run from a source tree."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    try:
        return installed("kvchat")
    except PackageNotFoundError:
        import tomllib
        with open(RESOURCES.parent / "pyproject.toml", "rb") as f:
            return tomllib.load(f)["project"]["version"]


def load_style(app) -> None:
    style = RESOURCES / "style.qss"
    if style.is_file():
        app.setStyleSheet(style.read_text(encoding="utf-8"))


def no_display_reason(env=os.environ, platform: str = sys.platform) -> str | None:
    """Why the window cannot open here, before Qt aborts the process with a longer message: a Linux session with
    no X or Wayland display (over ssh, in a container) and no Qt platform chosen."""
    if not platform.startswith("linux") or env.get("QT_QPA_PLATFORM"):
        return None
    if env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"):
        return None
    return ("kvchat: no display to open the window on (neither DISPLAY nor WAYLAND_DISPLAY is set). "
            "Start it from a desktop session, or chat in this terminal with `kvchat chat`.")


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    reason = no_display_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    from PySide6.QtWidgets import QApplication

    from kvchat.app.store.history import HistoryStore
    from kvchat.app.shell.logs import install_excepthook, setup_logging
    from kvchat.app.shell.main_window import MainWindow
    from kvchat.app.store.settings_store import SettingsStore

    log_path = setup_logging()

    app = QApplication.instance() or QApplication([sys.argv[0] if sys.argv else "kvchat"])
    from kvchat.app.shell.gc_guard import GuiThreadCollector
    app._collector = GuiThreadCollector(app)      # never collect Qt objects on the engine's threads
    app.setApplicationName("kvchat")
    app.setOrganizationName("kvchat")
    app.setApplicationDisplayName("kvchat")
    load_style(app)
    install_excepthook(log_path)
    from PySide6.QtGui import QIcon
    app.setWindowIcon(QIcon(str(RESOURCES / "kvchat.png")))
    app.setDesktopFileName("kvchat")
    store = SettingsStore()
    from kvchat.app.i18n import install as install_language
    install_language(app, store.language())     # before any window is built
    if args.model:
        settings = store.load()
        store.save(type(settings)(args.model, settings.cache, settings.sampling, settings.system_prompt))
    try:
        history = HistoryStore()
    except Exception as exc:  # noqa: BLE001 - a history that cannot even be moved aside: say so and stop
        from PySide6.QtCore import QCoreApplication
        from PySide6.QtWidgets import QMessageBox
        logging.getLogger("kvchat").exception("cannot open the chat history")
        QMessageBox.critical(None, QCoreApplication.translate("main", "kvchat cannot open its chat history"),
                             QCoreApplication.translate("main", "{error}\n\nCheck that the folder is writable. "
                                                        "Details are in {log}.").format(error=exc, log=log_path))
        return 1
    window = MainWindow(store, history)
    window.show()
    interrupted = _close_on_ctrl_c(app, window)
    check = None
    if args.self_test:
        from kvchat.app.shell.self_test import SelfTest
        check = SelfTest(app, window, args.self_test)     # greedy for this run only; Settings stay as saved
    code = app.exec()
    ended = window.wait_for_engine()    # the caches it saves as the window closes, for a bounded time
    history.close()
    code = 130 if interrupted else check.code if check else int(code)
    if not ended:           # past the close's deadline: the process ends without the engine thread
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code


def _close_on_ctrl_c(app, window) -> list:
    """Ctrl+C in the terminal closes the window as its close button does (a model being loaded finishes first),
    with one line instead of a KeyboardInterrupt traceback; a second Ctrl+C ends the process at once.
    Returns a list that is not empty once it happened."""
    from PySide6.QtCore import QTimer
    hits = []

    def on_sigint(*_) -> None:
        if hits:
            os._exit(130)
        hits.append(True)
        print("kvchat: stopping (Ctrl+C); press it again to quit at once", file=sys.stderr, flush=True)
        window.close()
    signal.signal(signal.SIGINT, on_sigint)
    # Python runs a signal handler only between bytecodes of the GUI thread: a timer gives it some while Qt waits
    timer = QTimer(app)
    timer.timeout.connect(lambda: None)
    timer.start(200)
    return hits


if __name__ == "__main__":
    raise SystemExit(main())
