"""Warm conversations in the app: a local engine keeps each saved chat's KV cache on disk
(engine/runtime/warm.py). The engine thread calls these; a remote engine has no cache of its own, so
each is a no-op there."""
from __future__ import annotations

import logging

from kvchat.engine.api import capabilities_of

log = logging.getLogger(__name__)


def supported(engine) -> bool:
    """The engine keeps chats' caches on disk (a local one; a server keeps its own)."""
    return engine is not None and capabilities_of(engine).saves_caches


def to_save(sessions) -> list:
    """The sessions, each once and in order, whose cache a save would write: kept warm, open, and not released
    (a released chat's cache went to its file when it was released, or holds nothing now)."""
    out = []
    for session in sessions:
        if session is None or getattr(session, "warm", None) is None or getattr(session, "is_closed", False) \
                or getattr(session, "released", False) or any(session is s for s in out):
            continue
        out.append(session)
    return out


def keep(engine, session, conversation_id) -> None:
    """The session's cache is kept under its chat's id."""
    if conversation_id is not None and supported(engine):
        engine.keep_warm(session, conversation_id)


def restore(engine, session) -> int:
    """A reopened chat reads its saved cache back instead of its text, and says so in its notice; a cache that
    cannot be used says why (the history is then read again with the next message). Returns the tokens restored."""
    if getattr(session, "warm", None) is None or not session.messages:
        return 0
    from kvchat.engine.runtime.warm import CacheFileError, NoSavedCache
    try:
        got = engine.restore_warm(session)
    except NoSavedCache:             # a chat never saved is no news to the user
        return 0
    except CacheFileError as exc:
        session.notice = f"The saved cache was not used ({exc}); the history is read again."
        return 0
    except Exception as exc:  # noqa: BLE001 - a restore that fails leaves the chat to be read again
        session.notice = f"The saved cache was not used ({type(exc).__name__}: {exc}); the history is read again."
        return 0
    session.notice = f"Cache restored from disk: {got.tokens:,} tokens in {got.seconds:.1f} s."
    return got.tokens


def save(engine, session) -> None:
    if session is None or getattr(session, "warm", None) is None or getattr(session, "is_closed", False):
        return
    from kvchat.engine.runtime.warm import CacheFileError
    try:
        engine.save_warm(session)
    except CacheFileError as exc:    # refused on purpose (blocks on disk past the budget): read again next time
        log.info("a conversation's cache is not saved: %s", exc)
    except Exception:  # noqa: BLE001 - a cache that could not be saved is read again next time
        log.exception("could not save a conversation's cache")


def set_disk_budget(engine, mb: float) -> None:
    """The saved caches' disk budget (Settings); the least recently used files go now if they exceed it."""
    if supported(engine):
        store = engine.warm_store
        store.budget_bytes = int(mb * 2**20)
        store.trim()


def forget(engine, conversation_id) -> None:
    """A chat deleted for good: its saved caches go too."""
    if supported(engine) and conversation_id is not None:
        engine.warm_store.delete(str(conversation_id))


def saved_store(engine, budget_mb: float | None):
    """The store of saved caches: a local engine's own, so counting and deleting go through the object that writes
    them; with no local engine (none loaded yet, a server) the same folder, opened here on the engine thread."""
    if supported(engine):
        return engine.warm_store
    from kvchat.engine.paths import kv_cache_dir
    from kvchat.engine.runtime.warm import DEFAULT_DISK_BUDGET_MB, WarmStore
    return WarmStore(kv_cache_dir(), DEFAULT_DISK_BUDGET_MB if budget_mb is None else budget_mb)


def count_saved(engine, budget_mb: float | None, deleted_bytes: int = 0):
    from kvchat.app.bridge.messages import SavedCaches
    store = saved_store(engine, budget_mb)
    return SavedCaches(len(store.files()), store.total_bytes(), deleted_bytes)


def delete_saved(engine, budget_mb: float | None):
    """Every chat's saved cache goes (the chats' text stays); answered with what is left, normally nothing."""
    deleted = saved_store(engine, budget_mb).clear()
    return count_saved(engine, budget_mb, deleted)
