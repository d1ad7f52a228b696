"""Past 450 lines on purpose: every SQL statement on the history file sits in one class, beside its schema.

Saved conversations in SQLite: titles, messages, the cache config used, timestamps. No Qt.

The file is the user's: created 0600 in a 0700 folder. A damaged file is moved aside (renamed with a
timestamp, never overwritten or deleted) and a fresh one started; `recovered` says where the old one went.
A file that can only be read (a read-only file, folder or file system) opens for reading, never taken for
damage: `read_only_reason` says why, and every write raises HistoryError with a message the user can act on.
How the file is opened is app/store/history_open.py.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from PySide6.QtCore import QCoreApplication

from kvchat.engine import paths
from kvchat.engine.config import CacheConfig, ConfigError

from kvchat.app.store.history_open import Recovered, is_read_only, open_history

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
    created_at REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'done'
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE TABLE IF NOT EXISTS reply_versions (
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    content TEXT NOT NULL,
    finish TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (message_id, position)
);
"""

TITLE_CHARS = 60
# messages.state: "done"; "streaming" while a reply is being written (saved as it grows); a
# "streaming" row found when the file is opened belonged to a process that died: "interrupted"
DONE, STREAMING, INTERRUPTED = "done", "streaming", "interrupted"


class _RolledBack(Exception):
    """Ends a transaction that only probed whether writing works."""


class HistoryError(RuntimeError):
    """The history database cannot do what was asked; the message says why and what to do."""


def data_dir() -> Path:
    """KVCHAT_DATA_DIR if set (tests use it), else the platform's user data dir (engine/paths.py)."""
    return paths.data_dir()


def cache_to_json(cache: CacheConfig) -> str:
    return json.dumps(asdict(cache), sort_keys=True)


def cache_from_json(text) -> CacheConfig | None:
    """The stored config, or None when it no longer parses (an older or hand-edited row)."""
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            return None
        fields["full_precision_layers"] = tuple(fields.get("full_precision_layers", ()))
        return CacheConfig(**fields)
    except (ValueError, TypeError, ConfigError):
        return None


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


@dataclass(frozen=True, slots=True)
class Message:
    id: int
    role: str
    content: str
    state: str                  # DONE, STREAMING or INTERRUPTED
    finish: str = ""            # the engine's finish_reason for a reply ("length", "stopped", ...); "" unknown
    model: str | None = None    # the model that wrote a reply; None for one saved before models were stored
    reasoning: str = ""         # a reply's reasoning, kept apart from its text (gpt-oss's analysis); "" for none

    @property
    def interrupted(self) -> bool:
        return self.state == INTERRUPTED


@dataclass(frozen=True, slots=True)
class Version:
    """One of the replies a regenerated message has had, oldest first."""
    content: str
    finish: str
    model: str | None = None    # the model that wrote it; None when unknown (saved by an earlier version)
    reasoning: str = ""         # its reasoning, kept apart from its text


@dataclass(frozen=True, slots=True)
class TakenMessage:
    """A deleted message as it was stored, so an Undo can put it back under its own id."""
    row: tuple                  # (id, conversation_id, role, content, created_at, state, finish, chosen, model,
                                #  reasoning)
    versions: tuple             # its reply_versions rows: (position, content, finish, model, reasoning)


@dataclass(frozen=True, slots=True)
class Conversation:
    id: int
    title: str
    cache: CacheConfig | None
    system_prompt: str
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class ConversationLength:
    """How big a saved conversation is, without its text (the Lengths view)."""
    id: int
    title: str
    num_messages: int
    num_chars: int              # characters of its messages and system prompt
    updated_at: float


class HistoryStore:
    """One SQLite file. Every write commits at once, so a crash loses at most the turn in flight."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else data_dir() / "history.sqlite3"
        opened = open_history(self.path, _prepare)
        self._db, self.recovered = opened.db, opened.recovered
        self.read_only_reason = opened.read_only        # "" while writes work
        self.read_only = bool(opened.read_only)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(messages)")}
        self._has_state, self._has_finish = "state" in columns, "finish" in columns
        self._has_model = "model" in columns
        self._has_reasoning = "reasoning" in columns
        self._has_deleted = "deleted_at" in {row[1] for row in self._db.execute("PRAGMA table_info(conversations)")}

    def read_only_message(self) -> str:
        return QCoreApplication.translate(
            "HistoryStore", "the chat history at {path} is read-only: {reason}; new messages are not saved").format(
            path=self.path, reason=self.read_only_reason)

    @contextmanager
    def _writing(self):
        """One transaction; SQLite's refusals become a HistoryError that says what to do."""
        try:
            with self._db:
                yield self._db
        except sqlite3.OperationalError as exc:
            if is_read_only(exc):
                self.read_only = True
                if self.read_only_reason:
                    raise HistoryError(self.read_only_message()) from exc
                raise HistoryError(QCoreApplication.translate(
                    "HistoryStore", "the chat history at {path} is read-only, so nothing can be saved: make the file "
                    "and its folder writable (chmod u+w), then try again").format(path=self.path)) from exc
            raise HistoryError(QCoreApplication.translate(
                "HistoryStore", "could not save to the chat history at {path}: {error}").format(
                path=self.path, error=exc)) from exc
        except sqlite3.DatabaseError as exc:
            raise HistoryError(QCoreApplication.translate(
                "HistoryStore", "the chat history at {path} is damaged ({error}): restart kvchat to move it aside and "
                "start a fresh one").format(path=self.path, error=exc)) from exc

    def _write(self, statements: list[tuple[str, tuple]]) -> sqlite3.Cursor | None:
        cursor = None
        with self._writing() as db:
            for sql, args in statements:
                cursor = db.execute(sql, args)
        return cursor

    def check_writable(self) -> None:
        """Raise HistoryError now if a save would fail (a read-only file or folder)."""
        probe = "INSERT INTO conversations (title, cache_config, created_at, updated_at) VALUES ('', '', 0, 0)"
        try:
            with self._writing() as db:
                db.execute(probe)
                raise _RolledBack
        except _RolledBack:
            pass

    def close(self) -> None:
        self._db.close()

    def create(self, title: str, cache: CacheConfig, system_prompt: str = "") -> int:
        now = time.time()
        cursor = self._write([(
            "INSERT INTO conversations (title, cache_config, system_prompt, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?)", (title_from(title) or "New chat", cache_to_json(cache), system_prompt, now, now))])
        return int(cursor.lastrowid)

    def add_message(self, conversation_id: int, role: str, content: str) -> int:
        return self.add_turn(conversation_id, [(role, content, DONE)])[0]

    def add_turn(self, conversation_id: int, rows: list[tuple[str, str, str]], model: str | None = None,
                 reasoning: str = "") -> list[int]:
        """Insert (role, content, state) rows in one transaction; their ids, in order. `model` (the loaded
        model's name) and `reasoning` (what the model reasoned before its answer) are stored with the replies
        among them."""
        now = time.time()
        ids = []
        with self._writing() as db:
            for role, content, state in rows:
                author = model if role == "assistant" else None
                cursor = db.execute("INSERT INTO messages (conversation_id, role, content, created_at, state, model) "
                                    "VALUES (?, ?, ?, ?, ?, ?)", (conversation_id, role, content, now, state, author))
                ids.append(int(cursor.lastrowid))
                if role == "assistant" and reasoning and self._has_reasoning:
                    db.execute("UPDATE messages SET reasoning = ? WHERE id = ?", (reasoning, ids[-1]))
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return ids

    def update_message(self, message_id: int, content: str, state: str, finish: str | None = None,
                       model: str | None = None, reasoning: str | None = None) -> None:
        """`model`, when given, becomes the reply's author (a regenerate written over an empty reply); `reasoning`,
        when given, its reasoning."""
        if finish is None or not self._has_finish:
            statements = [("UPDATE messages SET content = ?, state = ? WHERE id = ?", (content, state, message_id))]
        else:
            statements = [("UPDATE messages SET content = ?, state = ?, finish = ? WHERE id = ?",
                           (content, state, finish, message_id))]
        if model is not None:
            statements.append(("UPDATE messages SET model = ? WHERE id = ?", (model, message_id)))
        if reasoning is not None and self._has_reasoning:
            statements.append(("UPDATE messages SET reasoning = ? WHERE id = ?", (reasoning, message_id)))
        self._write(statements)

    def delete_message(self, message_id: int) -> None:
        """One message (with its reply versions)."""
        self._write([("DELETE FROM messages WHERE id = ?", (message_id,))])

    def delete_from(self, conversation_id: int, message_id: int) -> None:
        """The message and every later one in its conversation (edit and resend drops the old branch)."""
        self._write([("DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id))])

    def take_messages(self, message_ids: list[int]) -> list[TakenMessage]:
        """Delete these messages in one transaction and return what they held, for `put_back`."""
        taken = []
        with self._writing() as db:
            for id_ in message_ids:
                row = db.execute("SELECT id, conversation_id, role, content, created_at, state, finish, chosen, "
                                 f"model, {self._reasoning()} FROM messages WHERE id = ?", (id_,)).fetchone()
                if row is None:
                    continue
                versions = db.execute(f"SELECT position, content, finish, model, {self._reasoning()} FROM "
                                      "reply_versions WHERE message_id = ? ORDER BY position", (id_,)).fetchall()
                taken.append(TakenMessage(tuple(row), tuple(map(tuple, versions))))
                db.execute("DELETE FROM messages WHERE id = ?", (id_,))
        return taken

    def put_back(self, taken: list[TakenMessage]) -> None:
        """Undo `take_messages`: the rows return under their old ids, so they sort where they were."""
        with self._writing() as db:
            for message in taken:
                db.execute("INSERT INTO messages (id, conversation_id, role, content, created_at, state, finish, "
                           "chosen, model, reasoning) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", message.row)
                db.executemany("INSERT INTO reply_versions (message_id, position, content, finish, model, reasoning) "
                               "VALUES (?, ?, ?, ?, ?, ?)",
                               [(message.row[0], *version) for version in message.versions])

    # --- reply versions (regenerate) ---

    def versions(self, message_id: int) -> list[Version]:
        """Every reply this message has had, oldest first; [] when it was never regenerated."""
        if not self._has_finish:        # a read-only file from an earlier version
            return []
        model = "model" if self._has_model else "NULL"
        rows = self._db.execute(f"SELECT content, finish, {model}, {self._reasoning()} FROM reply_versions "
                                f"WHERE message_id = ? ORDER BY position", (message_id,)).fetchall()
        return [Version(*row) for row in rows]

    def chosen_version(self, message_id: int) -> int:
        if not self._has_finish:
            return 0
        row = self._db.execute("SELECT chosen FROM messages WHERE id = ?", (message_id,)).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def keep_as_version(self, message_id: int) -> None:
        """Before a regenerate: the message's reply becomes its first version (if it has none yet)."""
        self._write([("INSERT INTO reply_versions (message_id, position, content, finish, model, reasoning) "
                      "SELECT id, 0, content, finish, model, reasoning FROM messages WHERE id = ? AND NOT EXISTS "
                      "(SELECT 1 FROM reply_versions WHERE message_id = ?)", (message_id, message_id))])

    def add_version(self, message_id: int, content: str, finish: str, model: str | None = None,
                    reasoning: str = "") -> int:
        """Add a reply (written by `model`) to a regenerated message, now the chosen one (the message row holds
        it); its position.

        The reply it replaces is kept as the first version if it was not one yet."""
        self.keep_as_version(message_id)
        with self._writing() as db:
            count = db.execute("SELECT count(*) FROM reply_versions WHERE message_id = ?", (message_id,)).fetchone()[0]
            db.execute("INSERT INTO reply_versions (message_id, position, content, finish, model, reasoning) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (message_id, count, content, finish, model, reasoning))
            db.execute("UPDATE messages SET content = ?, finish = ?, state = ?, chosen = ?, model = ?, reasoning = ? "
                       "WHERE id = ?", (content, finish, DONE, count, model, reasoning, message_id))
        return count

    def update_version(self, message_id: int, content: str, finish: str, reasoning: str | None = None) -> None:
        """The chosen version grew (a Continue): the message and its version row both."""
        statements = [("UPDATE reply_versions SET content = ?, finish = ? WHERE message_id = ? AND position = "
                       "(SELECT chosen FROM messages WHERE id = ?)", (content, finish, message_id, message_id))]
        if reasoning is not None and self._has_reasoning:
            statements.append(("UPDATE reply_versions SET reasoning = ? WHERE message_id = ? AND position = "
                               "(SELECT chosen FROM messages WHERE id = ?)", (reasoning, message_id, message_id)))
        self._write(statements)

    def choose_version(self, message_id: int, position: int) -> Version:
        """Show version `position` of a regenerated reply from now on (it survives a restart)."""
        model = "model" if self._has_model else "NULL"
        row = self._db.execute(f"SELECT content, finish, {model}, {self._reasoning()} FROM reply_versions WHERE "
                               f"message_id = ? AND position = ?", (message_id, position)).fetchone()
        if row is None:
            raise HistoryError(QCoreApplication.translate("HistoryStore", "this reply has no version {n}").format(
                n=position + 1))
        self._write([("UPDATE messages SET content = ?, finish = ?, state = ?, chosen = ?, model = ?, reasoning = ? "
                      "WHERE id = ?", (row[0], row[1], DONE, position, row[2], row[3], message_id))])
        return Version(*row)

    def drop_unanswered(self, conversation_id: int) -> list[str]:
        """Delete the user messages after the conversation's last reply (a turn that never got one); their texts."""
        rows = self._db.execute("SELECT id, role, content FROM messages WHERE conversation_id = ? ORDER BY id",
                                (conversation_id,)).fetchall()
        trailing = []
        for id_, role, content in reversed(rows):
            if role != "user":
                break
            trailing.append((id_, content))
        if trailing:
            self._write([("DELETE FROM messages WHERE id = ?", (id_,)) for id_, _ in trailing])
        return [content for _, content in reversed(trailing)]

    def set_cache(self, conversation_id: int, cache: CacheConfig) -> None:
        self._write([("UPDATE conversations SET cache_config = ? WHERE id = ?", (cache_to_json(cache), conversation_id))])

    def rename(self, conversation_id: int, title: str) -> None:
        self._write([("UPDATE conversations SET title = ? WHERE id = ?", (title_from(title), conversation_id))])

    def delete(self, conversation_id: int) -> None:
        self._write([("DELETE FROM conversations WHERE id = ?", (conversation_id,))])

    def hide(self, conversation_id: int) -> None:
        """Delete with undo: the conversation leaves every list but stays in the file until `purge` (or the
        next start); `restore` brings it back with its messages."""
        self._write([("UPDATE conversations SET deleted_at = ? WHERE id = ?", (time.time(), conversation_id))])

    def restore(self, conversation_id: int) -> None:
        self._write([("UPDATE conversations SET deleted_at = NULL WHERE id = ?", (conversation_id,))])

    def purge(self, conversation_id: int) -> None:
        """Delete a hidden conversation for good (an undo that was not taken)."""
        self._write([("DELETE FROM conversations WHERE id = ? AND deleted_at IS NOT NULL", (conversation_id,))])

    def search(self, query: str) -> list[Conversation]:
        """Conversations whose title or any message contains `query` (case-insensitive), newest first."""
        words = query.split()
        if not words:
            return self.conversations()
        where, args = [], []
        for word in words:          # every word must occur, in the title or in some message
            pattern = "%" + word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where.append("(c.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m WHERE "
                         "m.conversation_id = c.id AND m.content LIKE ? ESCAPE '\\'))")
            args += [pattern, pattern]
        rows = self._db.execute(f"SELECT c.id, c.title, c.cache_config, c.system_prompt, c.created_at, c.updated_at "
                                f"FROM conversations c WHERE {self._visible('c')} AND {' AND '.join(where)} "
                                f"ORDER BY c.updated_at DESC, c.id DESC", args).fetchall()
        return [_conversation(row) for row in rows]

    def _visible(self, alias: str = "conversations") -> str:
        return f"{alias}.deleted_at IS NULL" if self._has_deleted else "1"

    def get(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute("SELECT id, title, cache_config, system_prompt, created_at, updated_at "
                               f"FROM conversations WHERE id = ? AND {self._visible()}", (conversation_id,)).fetchone()
        return _conversation(row) if row else None

    def conversations(self) -> list[Conversation]:
        """Newest activity first."""
        rows = self._db.execute("SELECT id, title, cache_config, system_prompt, created_at, updated_at "
                                f"FROM conversations WHERE {self._visible()} ORDER BY updated_at DESC, id DESC").fetchall()
        return [_conversation(row) for row in rows]

    def messages(self, conversation_id: int) -> list[dict]:
        rows = self._db.execute("SELECT role, content FROM messages WHERE conversation_id = ? ORDER BY id",
                                (conversation_id,)).fetchall()
        return [{"role": role, "content": content} for role, content in rows]

    def lengths(self) -> list[ConversationLength]:
        """Every saved conversation's message and character count, oldest first (read only)."""
        rows = self._db.execute(
            "SELECT c.id, c.title, count(m.id), coalesce(sum(length(m.content)), 0) + length(c.system_prompt), "
            "c.updated_at FROM conversations c LEFT JOIN messages m ON m.conversation_id = c.id "
            "GROUP BY c.id ORDER BY c.id").fetchall()
        return [ConversationLength(int(i), title, int(n), int(chars), float(t)) for i, title, n, chars, t in rows]

    def entries(self, conversation_id: int) -> list[Message]:
        """The messages with their ids and states (an interrupted reply is marked)."""
        state = "state" if self._has_state else f"'{DONE}'"
        finish = "finish" if self._has_finish else "''"
        model = "model" if self._has_model else "NULL"
        rows = self._db.execute(f"SELECT id, role, content, {state}, {finish}, {model}, {self._reasoning()} FROM "
                                f"messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)).fetchall()
        return [Message(int(id_), *rest) for id_, *rest in rows]

    def _reasoning(self) -> str:
        """The reasoning column in a SELECT; '' on a read-only file from before it was added."""
        return "reasoning" if self._has_reasoning else "''"

    def integrity(self) -> str:
        """SQLite's integrity_check verdict: 'ok' or the first problem found."""
        return str(self._db.execute("PRAGMA integrity_check").fetchone()[0])


def _prepare(db: sqlite3.Connection) -> None:
    """The schema, and what a file from an earlier version lacks; the last run's leftovers settled."""
    db.executescript(_SCHEMA)
    columns = {row[1] for row in db.execute("PRAGMA table_info(messages)")}
    if "state" not in columns:          # a file written by an earlier version
        db.execute(f"ALTER TABLE messages ADD COLUMN state TEXT NOT NULL DEFAULT '{DONE}'")
    _add_columns(db)
    # deleted but not undone when the app last closed: gone for good now
    db.execute("DELETE FROM conversations WHERE deleted_at IS NOT NULL")
    db.execute("UPDATE messages SET state = ? WHERE state = ?", (INTERRUPTED, STREAMING))


def _add_columns(db: sqlite3.Connection) -> None:
    """Columns later versions added, on a file written by an earlier one."""
    messages = {row[1] for row in db.execute("PRAGMA table_info(messages)")}
    if "finish" not in messages:        # why a reply ended: "length" and "stopped" are marked under it
        db.execute("ALTER TABLE messages ADD COLUMN finish TEXT NOT NULL DEFAULT ''")
    if "chosen" not in messages:        # which of reply_versions the message shows
        db.execute("ALTER TABLE messages ADD COLUMN chosen INTEGER NOT NULL DEFAULT 0")
    if "model" not in messages:         # the model that wrote a reply; NULL on older rows (unknown)
        db.execute("ALTER TABLE messages ADD COLUMN model TEXT")
    if "reasoning" not in messages:     # a reply's reasoning, apart from its text (gpt-oss's analysis channel)
        db.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''")
    if "model" not in {row[1] for row in db.execute("PRAGMA table_info(reply_versions)")}:
        db.execute("ALTER TABLE reply_versions ADD COLUMN model TEXT")
    if "reasoning" not in {row[1] for row in db.execute("PRAGMA table_info(reply_versions)")}:
        db.execute("ALTER TABLE reply_versions ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''")
    if "deleted_at" not in {row[1] for row in db.execute("PRAGMA table_info(conversations)")}:
        db.execute("ALTER TABLE conversations ADD COLUMN deleted_at REAL")


def _conversation(row) -> Conversation:
    id_, title, cache_json, system_prompt, created_at, updated_at = row
    return Conversation(int(id_), title, cache_from_json(cache_json), system_prompt, created_at, updated_at)
