"""A turn as the GUI sees it: tokens in small batches, stats at most ~10 Hz, and first how much history an empty
cache must read. EngineWorker runs turns through this; it holds the session, engine and model facts the snapshots
are completed with.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Callable

from kvchat.engine.config import ConfigError
from kvchat.engine.events import PrefillProgress, StatsSnapshot, TokenDelta, TurnFinished

from kvchat.app.bridge.engine_facts import complete
from kvchat.app.bridge.loader import error_message
from kvchat.app.bridge.messages import ErrorEvent, ReadingHistory

STATS_INTERVAL_S = 0.1                  # session.stats() is cheap, but no more than ~10 Hz
TOKEN_BATCH_S = 0.02                    # at most ~50 token signals a second reach the GUI
ATTENTION_LIVE_S = 2.0                  # the Attention page's maps while a reply streams (a few ms each, 30k tokens
                                        # ~40 ms): every 2 s, and once more when the turn ends


class TurnStreaming:
    """EngineWorker's turn loop and snapshots; expects event (a Signal), _session, _engine, _facts, _open and
    _released_chats on the worker."""

    def _stream(self, start, failure: str, reading: str | None = None) -> None:
        """Run one turn (send, regenerate, continue), batching its tokens and stats for the GUI. `reading` (the
        new message, "" for none) asks to say first how much history an empty cache must read."""
        last_stats = last_token = 0.0
        last_map = time.monotonic()
        rate = _DecodeRate()
        pending: list[TokenDelta] = []
        done_reading = self._announce_reading(reading) if reading is not None else (lambda: None)
        try:
            for event in start():
                if isinstance(event, PrefillProgress):      # a long prompt read chunk by chunk: the window says how far
                    self.event.emit(event)
                    continue
                done_reading()
                if isinstance(event, TokenDelta):
                    now = time.monotonic()
                    rate.add(now, len(event.token_ids))
                    pending.append(event)
                    if now - last_token >= TOKEN_BATCH_S:     # a fast model's tokens go out in small batches
                        last_token = now
                        self._emit_tokens(pending)
                    if now - last_stats >= STATS_INTERVAL_S:
                        last_stats = now
                        self._emit_stats(rate.tok_s())
                    if now - last_map >= ATTENTION_LIVE_S:
                        last_map = now
                        self._report_attention()
                elif isinstance(event, TurnFinished):
                    self._emit_tokens(pending)
                    event = replace(event, stats=self._complete(event.stats))
                    self.event.emit(event.stats)
                    self.event.emit(event)
        except ConfigError as exc:      # a refusal in the user's words (nothing to regenerate, nothing to continue)
            done_reading()
            self.event.emit(ErrorEvent("send", failure, str(exc)))
        except Exception as exc:  # noqa: BLE001 - the conversation must stay usable after a failed turn
            done_reading()
            self.event.emit(ErrorEvent("send", failure, error_message(exc)))    # a server's words: one line

    def _report_attention(self) -> None:
        """The open chat's attention maps to the window (EngineWorker: where the engine measures them)."""

    def _announce_reading(self, new_text: str) -> Callable[[], None]:
        """A chat reopened or released holds no cache: its first turn reads the whole history before any token
        (seconds for a long chat), so say how much; the returned callable says once that the reading is done."""
        session = self._session
        try:
            empty = bool(session.messages) and (getattr(session, "released", False)
                                                or not session.stats().tokens_in_context)
            if not empty:
                return lambda: None
            from kvchat.app.bridge.measure import count_tokens
            turns = [(m["role"], m["content"]) for m in session.messages] + ([("user", new_text)] if new_text else [])
            tokens = count_tokens(self._engine.tokenizer, getattr(session, "system_prompt", None), turns)
        except Exception:  # noqa: BLE001 - only the progress line is lost; the turn itself says what went wrong
            return lambda: None
        self.event.emit(ReadingHistory(max(1, tokens)))
        state = {"reading": True}

        def done() -> None:
            if state.pop("reading", False):
                self.event.emit(ReadingHistory(0))
        return done

    def _snapshot(self) -> StatsSnapshot | None:
        if self._session is None:
            return None
        try:
            return self._complete(self._session.stats())
        except Exception:  # noqa: BLE001 - a missing snapshot only leaves the dashboard one frame behind
            return None

    def _complete(self, snapshot: StatsSnapshot) -> StatsSnapshot:
        """The engine's snapshot with the model facts, and with `released` counting chats: the engine counts every
        sequence it released (kept replies, forks, quality measurements), and the user hears about chats."""
        snapshot = complete(snapshot, self._facts)
        if snapshot.pool is None:
            return snapshot
        self._released_chats.update(cid for cid, session in self._open.items() if getattr(session, "released", False))
        return replace(snapshot, pool=replace(snapshot.pool, released=len(self._released_chats)))

    def _emit_tokens(self, pending: list[TokenDelta]) -> None:
        if pending:
            self.event.emit(pending[0] if len(pending) == 1 else
                            TokenDelta("".join(d.text for d in pending), tuple(i for d in pending for i in d.token_ids),
                                       "".join(d.reasoning for d in pending)))
            pending.clear()

    def _emit_stats(self, live_decode_tok_s: float | None = None) -> None:
        snapshot = self._snapshot()
        if snapshot is None:
            return
        if live_decode_tok_s is not None and not snapshot.decode_tok_s:
            # the engine reports a turn's decode rate when the turn ends; mid-turn we measure it here
            snapshot = replace(snapshot, decode_tok_s=live_decode_tok_s)
        self.event.emit(snapshot)


class _DecodeRate:
    """Tokens per second over the last WINDOW_S of a streaming reply."""

    WINDOW_S = 2.0

    def __init__(self):
        self._events: deque[tuple[float, int]] = deque()

    def add(self, now: float, num_tokens: int) -> None:
        self._events.append((now, num_tokens))
        while self._events and now - self._events[0][0] > self.WINDOW_S:
            self._events.popleft()

    def tok_s(self) -> float:
        if len(self._events) < 2:
            return 0.0
        span = self._events[-1][0] - self._events[0][0]
        return sum(n for _, n in list(self._events)[1:]) / span if span > 0 else 0.0
