"""The engine thread's part of the Attention page: watching a session's attention, reading its maps after a turn,
and replaying the open chat under another cache mode. They hold the engine and the session, so they live beside
the worker; what they hand over are the frozen events of attention_events.py.

The session API (watch_attention, attention) and engine.runtime.replay are asked for only where the engine's
capabilities say it has them, and looked up with hasattr / a lazy import, so an engine without them reads "not
measured" instead of failing.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from PySide6.QtCore import QCoreApplication

from kvchat.engine.api import capabilities_of
from kvchat.engine.config import CacheConfig

from kvchat.app.bridge.attention_events import (EMPTY, REMOTE, UNSUPPORTED, AttentionShown, ReplayFailed,
                                                ReplayProgress, ReplayShown, ReplyMark)

MAX_COLUMNS = 2048                  # a 30,000-token chat in blocks of 16 is ~1,900 columns: bucketed past this
HEAD_TOKENS, TAIL_TOKENS = 10, 4    # a column's words as hovered: its first tokens, "…", its last ones
TEXT_CHARS = 72
PROGRESS_S = 0.1                    # replay progress at most ~10 Hz
log = logging.getLogger(__name__)


def can_watch(engine, session) -> bool:
    return session is not None and capabilities_of(engine).attention and hasattr(session, "watch_attention") \
        and hasattr(session, "attention")


def watch(engine, session, watched) -> None:
    """Measure the session's attention from its next step on, once per session (watching again would start its
    log over). `watched`: a WeakSet of the sessions already watched."""
    if can_watch(engine, session) and session not in watched:
        session.watch_attention("blocks")
        watched.add(session)


def attention_shown(engine, session, conversation_id) -> AttentionShown:
    """The session's maps as they are now, with the words of each column for hovering."""
    caps = capabilities_of(engine)
    if caps.remote:
        return AttentionShown(conversation_id, None, None, missing=REMOTE)
    if not can_watch(engine, session):
        return AttentionShown(conversation_id, None, None, missing=UNSUPPORTED)
    newest = session.attention(over="newest", max_columns=MAX_COLUMNS)
    reply = session.attention(over="reply", max_columns=MAX_COLUMNS)
    if newest is None and reply is None:
        return AttentionShown(conversation_id, None, None, missing=EMPTY)
    tokenizer = getattr(session, "tokenizer", None) or engine.tokenizer
    newest_texts = column_texts(tokenizer, newest)
    same = newest is not None and reply is not None and newest.tokens == reply.tokens \
        and list(newest.block_positions) == list(reply.block_positions)
    reply_texts = newest_texts if same else column_texts(tokenizer, reply)
    roles = tuple(m.get("role", "") for m in session.messages)
    return AttentionShown(conversation_id, newest, reply, newest_texts, reply_texts, roles)


def report(engine, session, conversation_id, emit) -> None:
    """emit(attention_shown(...)); a failure is logged and the page keeps its last map: the chat goes on."""
    try:
        shown = attention_shown(engine, session, conversation_id)
    except Exception:  # noqa: BLE001
        log.exception("could not read the attention map")
        return
    emit(shown)


def column_texts(tokenizer, m) -> tuple[str, ...]:
    """Each column's words, short: a long column gives its first and last tokens around "…"."""
    if m is None:
        return ()
    out = []
    for c in range(m.num_columns):
        start, end = int(m.block_positions[c]), m.column_end(c)
        ids = list(m.tokens[start:end])
        if len(ids) > HEAD_TOKENS + TAIL_TOKENS:
            text = _decode(tokenizer, ids[:HEAD_TOKENS]) + " … " + _decode(tokenizer, ids[-TAIL_TOKENS:])
        else:
            text = _decode(tokenizer, ids)
        out.append(text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS - 1] + "…")
    return tuple(out)


def _decode(tokenizer, ids, skip_special: bool = False) -> str:
    try:
        text = tokenizer.decode(list(ids), skip_special_tokens=skip_special)
    except Exception:  # noqa: BLE001 - a hover without words is better than no map
        return ""
    return " ".join(text.replace("\n", " ⏎ ").split())


# --- replay ---


def reply_spans(session, num_tokens: int) -> list[tuple[int, int, int]]:
    """(message index, start, end) of each assistant reply within the first num_tokens: a reply runs from its start
    through its end-of-turn token (the model chose it too), or to the next message's start, as `kvchat replay` cuts
    a saved chat (engine/runtime/replay.conversation_tokens). Replies whose start is not known are left out."""
    starts = list(getattr(session.state, "starts", ()))
    stops = getattr(getattr(session, "info", None), "stop_ids", frozenset())
    ids = session.token_ids
    spans = []
    for i, message in enumerate(session.messages):
        start = starts[i] if i < len(starts) else None
        if message.get("role") != "assistant" or start is None or start >= num_tokens:
            continue
        later = [s for s in starts[i + 1:] if s is not None]
        end = min(later[0], num_tokens) if later else num_tokens
        end = next((k + 1 for k in range(start, end) if ids[k] in stops), end)
        spans.append((i, start, end))
    return spans


def cached_ids(session) -> list[int]:
    """The conversation's tokens the cache has read (all of them where its cache was released to make room)."""
    held = getattr(getattr(session, "state", None), "num_cached", 0) or len(session.token_ids)
    return list(session.token_ids[:held])


def replay_chat(engine, session, mode: CacheConfig, conversation_id, should_stop: Callable[[], bool],
                emit: Callable[[object], None]) -> None:
    """Teacher-force the open chat through its own cache mode and `mode` (engine.runtime.replay), telling the window
    how far it got; the chat and its session are not changed. Emits ReplayShown, or ReplayFailed: the room check's
    ConfigError (nothing started), a stop (a new turn comes first, or Cancel), or any other failure."""
    from kvchat.engine.config import ConfigError
    from kvchat.engine.runtime.fidelity import Cancelled
    from kvchat.engine.runtime.replay import check_replay_room, replay

    from kvchat.app.bridge.loader import error_message
    translate = QCoreApplication.translate
    if session is None or capabilities_of(engine).remote:
        emit(ReplayFailed(conversation_id, translate("AttentionWork", "Replaying needs a model kvchat runs itself, "
                                                                       "with a chat open.")))
        return
    ids = cached_ids(session)
    baseline = session.cache_config
    replies = reply_spans(session, len(ids))
    if not replies:
        emit(ReplayFailed(conversation_id, translate("AttentionWork", "This chat has no reply to replay yet.")))
        return
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_S or done >= total:
            last[0] = now
            emit(ReplayProgress(int(done), int(total)))
    try:
        check_replay_room(engine, baseline, mode, len(ids))
        result = replay(engine, ids, mode, baseline, replies=replies, should_stop=should_stop, progress=progress)
    except ConfigError as exc:
        emit(ReplayFailed(conversation_id, str(exc)))
        return
    except Cancelled:
        emit(ReplayFailed(conversation_id, cancelled=True))
        return
    except Exception as exc:  # noqa: BLE001 - a failed replay must not take the chat down
        emit(ReplayFailed(conversation_id, error_message(exc)))
        return
    tokenizer = getattr(session, "tokenizer", None) or engine.tokenizer
    marks = tuple(reply_mark(tokenizer, ids, session.messages, r) for r in result.replies)
    emit(ReplayShown(conversation_id, mode, baseline, int(result.tokens), float(result.top1), float(result.kl),
                     result.first_divergence, marks, float(result.seconds), int(getattr(result, "kv_bytes", 0)),
                     int(getattr(result, "baseline_kv_bytes", 0))))


def reply_mark(tokenizer, ids: list[int], messages: list[dict], reply) -> ReplyMark:
    """A ReplyReplay in the window's terms: its first divergence placed in the message's text (characters)."""
    start, end = int(reply.start), int(reply.end)
    at = reply.first_divergence
    if at is not None and at < start:           # counted from the reply's start
        at += start
    offset, length = (None, 0)
    content = messages[reply.index].get("content", "") if 0 <= reply.index < len(messages) else ""
    if at is not None and start <= at < end:
        offset, length = _place(tokenizer, ids, start, end, at, content)
    return ReplyMark(int(reply.index), start, end, int(reply.tokens), float(reply.top1), float(reply.kl),
                     at, offset, length, _token_text(tokenizer, reply.expected), _token_text(tokenizer, reply.replayed))


def _token_text(tokenizer, token) -> str:
    if token is None:
        return ""
    if isinstance(token, str):
        return token
    return _decode(tokenizer, [int(token)]) or str(token)


def _place(tokenizer, ids, start: int, end: int, at: int, content: str) -> tuple[int | None, int]:
    """Where token `at` of the reply [start, end) falls in the message's text: (first character, characters), or
    (None, 0) when the decoded reply and the text do not line up (a reply format that hides part of it)."""
    def text(a: int, b: int) -> str:
        try:
            return tokenizer.decode(list(ids[a:b]), skip_special_tokens=True)
        except Exception:  # noqa: BLE001
            return ""
    whole = text(start, end)
    probe = content.strip()[:24]
    base = whole.find(probe) - (len(content) - len(content.lstrip())) if probe else -1
    if base < 0 and probe:
        return None, 0
    offset = len(text(start, at)) - max(0, base)
    length = len(text(start, at + 1)) - len(text(start, at))
    while length > 0 and offset < len(content) and content[offset].isspace():   # " word": mark the word
        offset, length = offset + 1, length - 1
    if not 0 <= offset < len(content) or length <= 0:
        return None, 0
    return offset, min(length, len(content) - offset)
