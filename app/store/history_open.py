"""Opening the history file: read-write when it can be, read-only when only reading works, moved aside only
when it is damaged. No Qt widgets.

A file that cannot be opened for writing (a read-only file system or folder, a file of another user, a -shm
file SQLite cannot create) is not damaged: it opens read-only, and `Opened.read_only` says why nothing can be
saved. Only a file SQLite itself finds damaged (or something that is not a file) is renamed aside. Where even
that fails, the app still starts, on an empty history that refuses every write and says why.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication

log = logging.getLogger(__name__)

CANNOT_CREATE = QT_TRANSLATE_NOOP("HistoryStore", "it could not be created ({error})")
CANNOT_WRITE = QT_TRANSLATE_NOOP("HistoryStore", "it cannot be opened for writing ({error})")
STUCK_DAMAGED = QT_TRANSLATE_NOOP("HistoryStore", "it is damaged ({reason}) and could not be moved aside ({error})")
READ_ONLY_FS = QT_TRANSLATE_NOOP("HistoryStore", "its file system is mounted read-only")
FILE_NOT_WRITABLE = QT_TRANSLATE_NOOP("HistoryStore", "you cannot write {path} (chmod u+w)")
FILE_NOT_READABLE = QT_TRANSLATE_NOOP("HistoryStore", "you cannot read {path}, so its chats are not shown "
                                      "(chmod u+rw)")
NOT_A_FILE = QT_TRANSLATE_NOOP("HistoryStore", "it cannot be opened: a folder or another kind of file stands at "
                               "its path")
STUCK_ASIDE = QT_TRANSLATE_NOOP("HistoryStore", "{reason}, and it could not be moved aside ({error})")
FOLDER_NOT_WRITABLE = QT_TRANSLATE_NOOP("HistoryStore", "you cannot write its folder {folder}, where SQLite keeps its "
                                        "-wal and -shm files (chmod u+w)")

Prepare = Callable[[sqlite3.Connection], None]      # creates the schema and migrates an older file, in one transaction


@dataclass(frozen=True, slots=True)
class Recovered:
    """A damaged or unreadable database that was moved aside at start."""
    moved_to: Path
    reason: str


@dataclass(frozen=True, slots=True)
class Opened:
    db: sqlite3.Connection
    recovered: Recovered | None = None
    read_only: str = ""         # why nothing can be saved, in the user's words; "" when writes work


class _Damaged(sqlite3.DatabaseError):
    """quick_check found the file damaged."""


def _tr(text: str) -> str:
    return QCoreApplication.translate("HistoryStore", text)


def open_history(path: Path, prepare: Prepare) -> Opened:
    try:
        _private_dir(path.parent)
        return _open(path, prepare)
    except sqlite3.DatabaseError as exc:
        if _not_a_file(path):
            return _recover(path, prepare, exc, _tr(NOT_A_FILE))
        if _is_damage(exc):
            return _recover(path, prepare, exc)
        return _open_read_only(path, prepare, exc)
    except OSError as exc:          # the folder or the file cannot be created
        return _unsaved(prepare, _tr(CANNOT_CREATE).format(error=exc.strerror or exc))


def _open(path: Path, prepare: Prepare) -> Opened:
    if not path.exists():
        # created 0600 before SQLite opens it: its -wal and -shm files take the same mode
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    db = sqlite3.connect(path)
    read_only = ""
    try:
        _quick_check(db)
        try:
            # WAL + NORMAL: a commit needs no fsync, so saving a message never stalls the GUI thread;
            # a power cut can lose the last commits but never corrupts the file
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            with db:
                prepare(db)
        except sqlite3.OperationalError as exc:
            if not is_read_only(exc):
                raise
            read_only = why_read_only(path) or str(exc)
        db.execute("SELECT count(*) FROM conversations").fetchone()
    except BaseException:
        db.close()
        raise
    return Opened(db, None, read_only)


def _open_read_only(path: Path, prepare: Prepare, first: sqlite3.DatabaseError) -> Opened:
    """SQLite's read-only open; `immutable` where it cannot create the -shm file beside the database (a read-only
    folder or file system), which also means nothing else can be writing there."""
    name = urllib.parse.quote(str(path.resolve()))
    uris = [f"file:{name}?mode=ro"]
    if not os.access(path.parent, os.W_OK):
        uris.append(f"file:{name}?immutable=1")
    unreadable = why_unreadable(path)
    if unreadable:              # not damaged, and not ours to move: the app runs on an empty history and says why
        return _unsaved(prepare, unreadable)
    reason = why_read_only(path) or _tr(CANNOT_WRITE).format(error=first)
    for uri in uris:
        try:
            db = sqlite3.connect(uri, uri=True)
        except sqlite3.DatabaseError:
            continue
        try:
            _quick_check(db)
            db.execute("SELECT count(*) FROM conversations").fetchone()
        except sqlite3.DatabaseError as exc:
            db.close()
            if _is_damage(exc):
                return _recover(path, prepare, exc)
            continue
        log.warning("history database %s opened read-only: %s", path, reason)
        return Opened(db, None, reason)
    return _unsaved(prepare, reason)


def _recover(path: Path, prepare: Prepare, exc: sqlite3.DatabaseError, why: str = "") -> Opened:
    """Move a damaged file (or what stands at its path, `why` saying what) aside and start a fresh one."""
    reason = why or _reason(exc)
    try:
        moved = _move_aside(path)
    except OSError as err:
        stuck = STUCK_ASIDE if why else STUCK_DAMAGED
        return _unsaved(prepare, _tr(stuck).format(reason=reason, error=err.strerror or err))
    log.warning("history database %s cannot be used (%s): moved to %s", path, reason, moved)
    try:
        opened = _open(path, prepare)
    except (sqlite3.DatabaseError, OSError) as err:
        return _unsaved(prepare, _tr(CANNOT_CREATE).format(error=err), Recovered(moved, reason))
    return Opened(opened.db, Recovered(moved, reason), opened.read_only)


def _unsaved(prepare: Prepare, reason: str, recovered: Recovered | None = None) -> Opened:
    """An empty history in memory that refuses every write, so the app runs and says why nothing is saved."""
    log.warning("chat history unavailable (%s): nothing is saved this session", reason)
    db = sqlite3.connect(":memory:")
    with db:
        prepare(db)
    db.execute("PRAGMA query_only = 1")
    return Opened(db, recovered, reason)


def _quick_check(db: sqlite3.Connection) -> None:
    check = db.execute("PRAGMA quick_check").fetchall()
    if check != [("ok",)]:
        raise _Damaged(f"database disk image is malformed ({check[0][0]})")
    db.execute("PRAGMA foreign_keys = ON")


def _move_aside(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while any(Path(f"{target}{suffix}").exists() for suffix in ("", "-wal", "-shm")):
        target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
        n += 1
    for suffix in ("-wal", "-shm", ""):           # the WAL may hold the newest commits: it goes too
        old = Path(f"{path}{suffix}")
        if old.exists() or old.is_symlink():
            os.rename(old, f"{target}{suffix}")
    return target


def _private_dir(folder: Path) -> None:
    """The data folder, readable by the user only (0700)."""
    existed = folder.is_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not existed:
        os.chmod(folder, 0o700)


def why_unreadable(path: Path) -> str:
    """Why the file at `path` cannot even be read, in words a user can act on; "" when nothing visible stops it."""
    if path.is_file() and not os.access(path, os.R_OK):
        return _tr(FILE_NOT_READABLE).format(path=path)
    return ""


def why_read_only(path: Path) -> str:
    """What stops writing to the history at `path`, in words a user can act on; "" when nothing visible does."""
    folder = path.parent
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return _tr(READ_ONLY_FS)
    except OSError:
        pass
    if path.exists() and not os.access(path, os.W_OK):
        return _tr(FILE_NOT_WRITABLE).format(path=path)
    if not os.access(folder, os.W_OK):
        return _tr(FOLDER_NOT_WRITABLE).format(folder=folder)
    return ""


def is_read_only(exc: BaseException) -> bool:
    name = getattr(exc, "sqlite_errorname", "") or ""      # sqlite3's errors carry their code by name (3.11+)
    return name.startswith("SQLITE_READONLY")


def _is_damage(exc: BaseException) -> bool:
    name = getattr(exc, "sqlite_errorname", "") or ""
    return isinstance(exc, _Damaged) or name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))


def _not_a_file(path: Path) -> bool:
    """Something other than a file stands at `path` (a folder): no database to protect there."""
    try:
        return not path.is_file() and path.exists()
    except OSError:
        return False


def _reason(exc: BaseException) -> str:
    text = str(exc)
    if "not a database" in text:
        return "it is not an SQLite database"
    if "malformed" in text:
        return "it is damaged"
    if "unable to open" in text:
        return "it cannot be opened"
    return text
