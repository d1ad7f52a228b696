"""Saved conversations in SQLite: titles, messages, the cache config used, timestamps. No Qt."""
from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.config import CacheConfig

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    cache_config TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""

TITLE_CHARS = 60


def data_dir() -> Path:
    """KVCHAT_DATA_DIR if set (tests use it), else the platform's user data dir."""
    override = os.environ.get("KVCHAT_DATA_DIR")
    if override:
        return Path(override)
    from platformdirs import user_data_dir

    return Path(user_data_dir("kvchat", appauthor=False))


def cache_to_json(cache: CacheConfig) -> str:
    return json.dumps(asdict(cache), sort_keys=True)


def cache_from_json(text: str) -> CacheConfig | None:
    """The stored config, or None when it no longer parses (an older or hand-edited row)."""
    try:
        fields = json.loads(text)
        fields["full_precision_layers"] = tuple(fields.get("full_precision_layers", ()))
        return CacheConfig(**fields)
    except (ValueError, TypeError):
        return None


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


@dataclass(frozen=True, slots=True)
class Conversation:
    id: int
    title: str
    cache: CacheConfig | None
    system_prompt: str
    created_at: float
    updated_at: float


class HistoryStore:
    """One SQLite file. Every write commits at once, so a crash loses at most the turn in flight."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else data_dir() / "history.sqlite3"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path)
        self._db.execute("PRAGMA foreign_keys = ON")
        # WAL + NORMAL: a commit needs no fsync, so saving a message never stalls the GUI thread;
        # a power cut can lose the last commits but never corrupts the file
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.executescript(_SCHEMA)
        self._db.commit()

    def close(self) -> None:
        self._db.close()

    def create(self, title: str, cache: CacheConfig, system_prompt: str = "") -> int:
        now = time.time()
        with self._db:
            cursor = self._db.execute(
                "INSERT INTO conversations (title, cache_config, system_prompt, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?)", (title_from(title) or "New chat", cache_to_json(cache), system_prompt, now, now))
        return int(cursor.lastrowid)

    def add_message(self, conversation_id: int, role: str, content: str) -> None:
        now = time.time()
        with self._db:
            self._db.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES (?, ?, ?, ?)",
                             (conversation_id, role, content, now))
            self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))

    def set_cache(self, conversation_id: int, cache: CacheConfig) -> None:
        with self._db:
            self._db.execute("UPDATE conversations SET cache_config = ? WHERE id = ?",
                             (cache_to_json(cache), conversation_id))

    def rename(self, conversation_id: int, title: str) -> None:
        with self._db:
            self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title_from(title), conversation_id))

    def delete(self, conversation_id: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def get(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute("SELECT id, title, cache_config, system_prompt, created_at, updated_at "
                               "FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        return _conversation(row) if row else None

    def conversations(self) -> list[Conversation]:
        """Newest activity first."""
        rows = self._db.execute("SELECT id, title, cache_config, system_prompt, created_at, updated_at "
                                "FROM conversations ORDER BY updated_at DESC, id DESC").fetchall()
        return [_conversation(row) for row in rows]

    def messages(self, conversation_id: int) -> list[dict]:
        rows = self._db.execute("SELECT role, content FROM messages WHERE conversation_id = ? ORDER BY id",
                                (conversation_id,)).fetchall()
        return [{"role": role, "content": content} for role, content in rows]


def _conversation(row) -> Conversation:
    id_, title, cache_json, system_prompt, created_at, updated_at = row
    return Conversation(int(id_), title, cache_from_json(cache_json), system_prompt, created_at, updated_at)
