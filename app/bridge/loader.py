"""Getting an engine: a model loaded here or a server connected to, and what its load says to the user."""
from __future__ import annotations

from typing import Callable

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication

from kvchat.engine.errors import UserError

from kvchat.app.store.settings_store import RemoteSettings


def default_loader(config, progress: Callable[[str, float | None], None]):
    """An EngineConfig loads a model here; RemoteSettings connect to a server (the app's Settings choose)."""
    if isinstance(config, RemoteSettings):
        from kvchat.engine.serve.remote import RemoteEngine
        progress(QCoreApplication.translate("EngineWorker", "Connecting to {url}…").format(url=config.base_url), None)
        return RemoteEngine.connect(config.base_url, config.api_key or None, config.model or None)
    from kvchat.engine import Engine

    return Engine.load(config, progress=progress)


# the engine's load steps (engine/runtime/engine.py), shown in the status line in the interface language
PROGRESS_STEPS = {"locating model": QT_TRANSLATE_NOOP("EngineProgress", "locating model"),
                  "mapping weights": QT_TRANSLATE_NOOP("EngineProgress", "mapping weights"),
                  "reading weights": QT_TRANSLATE_NOOP("EngineProgress", "reading weights"),
                  "ready": QT_TRANSLATE_NOOP("EngineProgress", "ready")}


def progress_text(message: str) -> str:
    """A known engine step in the interface language; any other engine text as it is."""
    step = PROGRESS_STEPS.get(message)
    return QCoreApplication.translate("EngineProgress", step) if step else message


def error_message(exc: BaseException) -> str:
    """One line for the user: a UserError already says what to do; anything else is named by its type."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, UserError):
        return text.splitlines()[0]
    return f"{type(exc).__name__}: {text}"
