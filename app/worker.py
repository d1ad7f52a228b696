"""The engine thread: one QObject, moved to a QThread, owns the engine and its session.

Commands arrive as queued signals (so they run in the worker thread, one after another); events
leave as signals carrying frozen dataclasses. Stop is a thread-safe flag the decode loop checks
before every step, not a queued command: the worker is busy in that loop when Stop matters.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, QObject, Qt, QThread, Signal, Slot

from kvchat.engine.api import capabilities_of
from kvchat.engine.config import CacheConfig, ConfigError, EngineConfig, SamplingParams, SpeculativeConfig
from kvchat.engine.errors import UserError
from kvchat.engine.events import PrefillProgress, StatsSnapshot, TokenDelta, TurnFinished

from kvchat.app import warm_chats
from kvchat.app.engine_facts import complete, model_facts
from kvchat.app.messages import (EngineReady, ErrorEvent, LoadProgress, MessageCounted, ModeSwitched, PrefixCleared,
                                 ReadingHistory, ResetDone, SavingCaches, SessionOpened)

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1                  # session.stats() is cheap, but no more than ~10 Hz
TOKEN_BATCH_S = 0.02                    # at most ~50 token signals a second reach the GUI
WORKER_NICE = 5


def _default_loader(config, progress: Callable[[str, float | None], None]):
    """An EngineConfig loads a model here; RemoteSettings connect to a server (the app's Settings choose)."""
    from kvchat.app.settings_store import RemoteSettings
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


def _load_error_message(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, UserError):
        return text.splitlines()[0]     # already a one-line message that says what to do
    return f"{type(exc).__name__}: {text}"


SAVE_LIMIT_S = 20.0                 # closing: no chat's cache starts saving later than this after the close
MAX_OPEN_SESSIONS = 16              # conversations kept warm; the KV budget may release them sooner (LRU)


TEMPLATE_TOKENS = 16                # a chat template's tokens around one message (role markers), generously
TEMPLATE_TEXT_TOKENS = 64           # and its own text (a default system prompt, a date line)


def may_pass_context(text: str, history: list[dict], system_prompt: str, stats: StatsSnapshot | None,
                     cache: CacheConfig) -> bool:
    """Could `text`, added to `history`, pass the model's context? Answered at once from its UTF-8 bytes (a token
    is at least one byte): False means surely not; True, that the engine should count it (EngineHost.count_message).
    With a window, or no known context, the engine never refuses for the context: False."""
    if stats is None or not stats.context_tokens or cache.window is not None:
        return False
    texts = [system_prompt or "", *(m["content"] for m in history), text]
    most = sum(len(t.encode("utf-8")) + TEMPLATE_TOKENS for t in texts) + TEMPLATE_TEXT_TOKENS
    return most > stats.context_tokens


def _close(session) -> None:
    close = getattr(session, "close", None)
    if close is not None:
        close()


class EngineWorker(QObject):
    """Lives in the engine thread. Every slot runs there; nothing here touches a widget."""

    progress = Signal(object)           # LoadProgress
    ready = Signal(object)              # EngineReady
    session_opened = Signal(object)     # SessionOpened
    token = Signal(object)              # TokenDelta
    turn_finished = Signal(object)      # TurnFinished
    stats = Signal(object)              # StatsSnapshot
    mode_switched = Signal(object)      # ModeSwitched
    reset_done = Signal(object)         # ResetDone
    error = Signal(object)              # ErrorEvent
    quality = Signal(object)            # QualityResult, or QualityCancelled when a command came first
    prefix_cleared = Signal(object)     # PrefixCleared
    token_counts = Signal(object)       # TokenCounts of saved conversations (the Lengths tab)
    reading = Signal(object)            # ReadingHistory (a chat read into an empty cache), PrefillProgress
    prefill_set = Signal(str)           # the prompt GEMM's precision after a change ("fp32", "bf16")
    saving = Signal(object)             # SavingCaches: the app is closing, these chats' caches go to disk
    message_counted = Signal(object)    # MessageCounted: a long message counted before it is shown as sent

    def __init__(self, loader=_default_loader):
        super().__init__()
        self._loader = loader
        self._engine = None
        self._session = None
        self._conversation_id = None    # whose session _session is
        self._open: dict = {}           # conversation id -> its session, kept warm in the engine's KV pool
        self._stop = threading.Event()
        self._cancel_measure = threading.Event()  # set by any command, so a quality measurement yields to it
        self._facts: dict[str, float] = {}
        self._released_chats: set = set()  # conversations whose cache the engine released for room
        self._disk_budget_mb: float | None = None   # saved caches' disk budget from Settings (None: the engine's)
        self._speculative: tuple[str, int] | None = None    # (method, k) from Settings (None: the engine's)
        self._prefill: str | None = None                    # the prompt GEMM's precision from Settings

    # --- called from the GUI thread (thread-safe, never blocks) ---

    def request_stop(self) -> None:
        self._stop.set()

    def clear_stop(self) -> None:
        self._stop.clear()

    def cancel_measure(self, cancel: bool = True) -> None:
        self._cancel_measure.set() if cancel else self._cancel_measure.clear()

    # --- slots, run in the engine thread ---

    @Slot()
    def lower_priority(self) -> None:
        """Let the GUI thread win the CPU whenever both want it (Linux: per-thread nice).

        The decoder still gets every cycle the GUI does not use; an interactive window does not
        stall behind it on a machine with few cores."""
        if hasattr(os, "setpriority") and sys.platform.startswith("linux"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
            except OSError:
                pass

    @Slot(object)
    def load(self, config: EngineConfig) -> None:
        """Load a model. On failure the previous engine and session, if any, stay in use."""
        start = time.monotonic()

        def report(message: str, fraction: float | None = None) -> None:
            self.progress.emit(LoadProgress(progress_text(str(message)), fraction))

        report(self.tr("Loading model…"), None)
        try:
            engine = self._loader(config, report)
        except Exception as exc:  # noqa: BLE001 - every load failure becomes a message for the user
            title = self.tr("Could not connect to the server") if hasattr(config, "base_url") else \
                self.tr("Could not load the model")
            self.error.emit(ErrorEvent("load", title, _load_error_message(exc)))
            return
        self._engine, self._session, self._open = engine, None, {}
        if self._disk_budget_mb is not None:
            self.set_disk_budget(self._disk_budget_mb)
        if self._speculative is not None:
            self.set_speculative(*self._speculative)
        if self._prefill is not None:
            self.set_prefill(self._prefill)
        self._released_chats = set()
        self._facts = model_facts(engine)
        self.ready.emit(EngineReady(engine.model_name, str(engine.device), int(engine.num_layers),
                                    time.monotonic() - start, getattr(engine, "weights_label", ""),
                                    int(getattr(engine, "weight_bytes", 0)), getattr(engine, "notice", None) or "",
                                    getattr(getattr(engine, "model", None), "config", None),
                                    getattr(engine, "dtype_name", "fp32"), capabilities_of(engine),
                                    getattr(engine, "base_url", ""),
                                    kernel_status=getattr(engine, "kernel_status", None) or "",
                                    prefill=getattr(engine, "prefill", ""),
                                    chat_format_notice=getattr(engine, "chat_format_notice", None) or "",
                                    saves_caches=warm_chats.supported(engine)))

    @Slot(object, object, object, object)
    def open_session(self, conversation_id, system_prompt, cache, history) -> None:
        """Start a conversation; `history` ((role, content) pairs) resumes a saved one."""
        if self._engine is None:
            return
        if self._session is not None:
            self._save(self._session)       # the chat being left goes idle: its cache goes to disk too
        self._session = None            # a failed open must not leave the previous conversation's session in use
        self._conversation_id = conversation_id
        try:
            turns = [{"role": role, "content": content} for role, content in history or ()]
            kept = self._open.pop(conversation_id, None) if conversation_id is not None else None
            restored = 0
            if kept is not None and _turns(kept.messages) == turns and kept.cache_config == cache \
                    and kept.system_prompt == (system_prompt or None):
                self._session = kept    # its blocks are still in the engine's pool: no prefill to go on
            else:
                if kept is not None:
                    _close(kept)
                self._session = self._engine.new_session(system_prompt=system_prompt or None, cache=cache,
                                                         history=turns or None)
                self._warm(self._session, conversation_id)
                restored = self._restore(self._session)
            if conversation_id is not None:
                self._open[conversation_id] = self._session
                while len(self._open) > MAX_OPEN_SESSIONS:          # the oldest opened gives its blocks back
                    self._retire(self._open.pop(next(iter(self._open))))
        except ConfigError as exc:
            self.error.emit(ErrorEvent("session", self.tr("These cache settings do not work"), str(exc)))
            return
        except Exception as exc:  # noqa: BLE001
            self.error.emit(ErrorEvent("session", self.tr("Could not open the conversation"),
                                       f"{type(exc).__name__}: {exc}"))
            return
        self.session_opened.emit(SessionOpened(conversation_id, self._session.cache_config,
                                               len(self._session.messages), self._snapshot(), restored))

    @Slot(object)
    def adopt(self, conversation_id) -> None:
        """A new chat got its id with its first message: keep its session warm under that id, so switching
        back to it later needs no prefill."""
        if self._session is None or self._conversation_id is not None or conversation_id is None:
            return
        self._conversation_id = conversation_id
        self._open[conversation_id] = self._session
        self._warm(self._session, conversation_id)
        while len(self._open) > MAX_OPEN_SESSIONS:
            self._retire(self._open.pop(next(iter(self._open))))

    @Slot(str, object)
    def send(self, text: str, sampling: SamplingParams) -> None:
        if self._session is None:
            self.error.emit(ErrorEvent("send", self.tr("No model loaded"),
                                       self.tr("Wait for the model to load, or pick one in Settings.")))
            return
        self._stream(lambda: self._session.send(text, sampling, should_stop=self._stop.is_set), reading=text)

    @Slot(object, object)
    def regenerate(self, sampling: SamplingParams, messages=None) -> None:
        """A new reply to the last user message (of `messages`, the chat as shown, when given); the engine keeps
        the old one as an alternative."""
        if self._supports("regenerate", self.tr("Cannot regenerate")) and (messages is None or self._sync_history(messages)):
            self._stream(lambda: self._session.regenerate(sampling, should_stop=self._stop.is_set),
                         self.tr("Cannot regenerate"), reading="")

    @Slot(object, object)
    def continue_reply(self, sampling: SamplingParams, messages=None) -> None:
        """More of the last reply (cut at max tokens, or stopped)."""
        if self._supports("continue_reply", self.tr("Cannot continue this reply")) \
                and (messages is None or self._sync_history(messages)):
            self._stream(lambda: self._session.continue_reply(sampling, should_stop=self._stop.is_set),
                         self.tr("Cannot continue this reply"), reading="")

    def _supports(self, method: str, title: str) -> bool:
        if self._session is None:
            self.error.emit(ErrorEvent("send", title,
                                       self.tr("No model is loaded yet: wait for it, or pick one in Settings.")))
            return False
        if not hasattr(self._session, method):
            self.error.emit(ErrorEvent("send", title, self.tr("This works with a model kvchat runs itself, not "
                                                              "with a remote server.")))
            return False
        return True

    @Slot(object, str, object)
    def edit_resend(self, messages, text: str, sampling: SamplingParams) -> None:
        """Go back to `messages` (the chat before the edited message) and send `text` from there."""
        if self._session is not None and self._sync_history(messages):
            self.send(text, sampling)

    @Slot(object)
    def sync_history(self, messages) -> None:
        """Make the session hold `messages` ((role, content) pairs): after a delete or a switch between replies."""
        if self._session is not None and self._sync_history(messages):
            self._emit_stats()

    def _sync_history(self, pairs) -> bool:
        """The cheapest way to the wanted messages: the same (nothing), a prefix (rewind: the cache goes back),
        another reply to the same question (select_alternative: its cache if still held), else a new session
        (the engine's prefix cache keeps what the old one shares with it)."""
        wanted = [{"role": role, "content": content} for role, content in pairs]
        session = self._session
        have = _turns(session.messages)       # a reply's reasoning is the session's own: not what the chat compares
        try:
            if have == wanted:
                return True
            if len(wanted) < len(have) and have[:len(wanted)] == wanted and hasattr(session, "rewind"):
                session.rewind(len(wanted))
                return True
            if wanted and have and len(wanted) == len(have) and have[:-1] == wanted[:-1] \
                    and wanted[-1]["role"] == "assistant":
                texts = [alt.text for alt in getattr(session, "alternatives", ())]
                if wanted[-1]["content"] in texts:
                    session.select_alternative(texts.index(wanted[-1]["content"]))
                    return True
            replacement = self._engine.new_session(system_prompt=getattr(session, "system_prompt", None),
                                                   cache=session.cache_config, history=wanted or None)
        except Exception as exc:  # noqa: BLE001 - the chat stays as it was; the user hears why
            self.error.emit(ErrorEvent("send", self.tr("Could not change the conversation"),
                                       _load_error_message(exc)))
            return False
        _close(session)
        self._session = replacement
        self._warm(replacement, self._conversation_id)
        if self._conversation_id is not None:
            self._open[self._conversation_id] = replacement
        return True

    # --- warm conversations (app/warm_chats.py) ---

    def _warm(self, session, conversation_id) -> None:
        warm_chats.keep(self._engine, session, conversation_id)

    def _restore(self, session) -> int:
        return warm_chats.restore(self._engine, session)

    def _save(self, session) -> None:
        warm_chats.save(self._engine, session)

    def _retire(self, session) -> None:
        self._save(session)
        _close(session)

    @Slot(float)
    def close(self, deadline: float) -> None:
        """The app is closing: each open chat's cache to disk, the open one first, then the last one used, started
        only before `deadline` (time.monotonic()): a chat not saved by then keeps its last file, or is read again
        next time (a file is written whole or not at all). Then the thread ends."""
        sessions = warm_chats.to_save([self._session, *reversed(self._open.values())])
        self._session, self._open = None, {}
        self.saving.emit(SavingCaches(len(sessions)))
        for i, session in enumerate(sessions):
            if time.monotonic() > deadline:
                log.warning("closing: %d of %d chats' caches not saved in time", len(sessions) - i, len(sessions))
                break
            self._save(session)
        QThread.currentThread().quit()

    @Slot(str, object)
    def count_message(self, text: str, history) -> None:
        """Tokens of the open chat as `history` ((role, content) pairs) with `text` added, against the model's
        context: the window shows a long message as sent only once it fits. A window never passes the context, a
        server counts for itself: nothing is counted there (context 0)."""
        session, tokens, context = self._session, 0, 0
        if session is not None and not capabilities_of(self._engine).remote and session.cache_config.window is None:
            from kvchat.app.lengths_data import count_tokens
            try:
                context = session.stats().context_tokens
                turns = [*history, ("user", text)]
                tokens = count_tokens(self._engine.tokenizer, getattr(session, "system_prompt", None), turns)
            except Exception:  # noqa: BLE001 - not counted: the engine itself refuses what does not fit
                context = 0
        self.message_counted.emit(MessageCounted(text, tokens, context))

    @Slot(float)
    def set_disk_budget(self, mb: float) -> None:
        self._disk_budget_mb = mb
        warm_chats.set_disk_budget(self._engine, mb)

    @Slot(str, int)
    def set_speculative(self, method: str, k: int) -> None:
        """Speculative decoding from Settings, live: every chat's next turn uses it. A server decodes its own way."""
        self._speculative = (method, k)
        if not hasattr(self._engine, "set_speculative"):
            return
        try:
            self._engine.set_speculative(SpeculativeConfig(method, k=k))
        except Exception as exc:  # noqa: BLE001 - ConfigError says what to change; the last setting stays
            self.error.emit(ErrorEvent("speculative", self.tr("Cannot change speculative decoding"),
                                       _load_error_message(exc)))

    @Slot(str)
    def set_prefill(self, mode: str) -> None:
        """The prompt GEMM's precision from Settings, live: the next prompt read uses it. A server reads its own way."""
        self._prefill = mode
        if hasattr(self._engine, "set_prefill"):
            self._engine.set_prefill(mode)      # one of PREFILL_MODES: Settings offers no other
            self.prefill_set.emit(self._engine.prefill)

    @Slot(object)
    def forget_cache(self, conversation_id) -> None:
        warm_chats.forget(self._engine, conversation_id)

    @Slot()
    def clear_prefix_cache(self) -> None:
        """Free the blocks kept only for prefix reuse (conversations keep theirs)."""
        if self._engine is None or not hasattr(self._engine, "clear_prefix_cache"):
            return
        try:
            freed = int(self._engine.clear_prefix_cache())
        except Exception as exc:  # noqa: BLE001
            self.error.emit(ErrorEvent("reset", self.tr("Could not clear the prefix cache"),
                                       f"{type(exc).__name__}: {exc}"))
            return
        self.prefix_cleared.emit(PrefixCleared(freed, self._snapshot()))

    def _stream(self, start, failure: str = "", reading: str | None = None) -> None:
        """Run one turn (send, regenerate, continue), batching its tokens and stats for the GUI. `reading` (the
        new message, "" for none) asks to say first how much history an empty cache must read."""
        failure = failure or self.tr("The reply failed")
        last_stats = last_token = 0.0
        rate = _DecodeRate()
        pending: list[TokenDelta] = []
        done_reading = self._announce_reading(reading) if reading is not None else (lambda: None)
        try:
            for event in start():
                if isinstance(event, PrefillProgress):      # a long prompt read chunk by chunk: the window says how far
                    self.reading.emit(event)
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
                elif isinstance(event, TurnFinished):
                    self._emit_tokens(pending)
                    event = replace(event, stats=self._complete(event.stats))
                    self.stats.emit(event.stats)
                    self.turn_finished.emit(event)
        except ConfigError as exc:      # a refusal in the user's words (nothing to regenerate, nothing to continue)
            done_reading()
            self.error.emit(ErrorEvent("send", failure, str(exc)))
        except Exception as exc:  # noqa: BLE001 - the conversation must stay usable after a failed turn
            done_reading()
            self.error.emit(ErrorEvent("send", failure, _load_error_message(exc)))    # a server's words: one line

    def _announce_reading(self, new_text: str) -> Callable[[], None]:
        """A chat reopened or released holds no cache: its first turn reads the whole history before any token
        (seconds for a long chat), so say how much; the returned callable says once that the reading is done."""
        session = self._session
        try:
            empty = bool(session.messages) and (getattr(session, "released", False)
                                                or not session.stats().tokens_in_context)
            if not empty:
                return lambda: None
            from kvchat.app.lengths_data import count_tokens
            turns = [(m["role"], m["content"]) for m in session.messages] + ([("user", new_text)] if new_text else [])
            tokens = count_tokens(self._engine.tokenizer, getattr(session, "system_prompt", None), turns)
        except Exception:  # noqa: BLE001 - only the progress line is lost; the turn itself says what went wrong
            return lambda: None
        self.reading.emit(ReadingHistory(max(1, tokens)))
        state = {"reading": True}

        def done() -> None:
            if state.pop("reading", False):
                self.reading.emit(ReadingHistory(0))
        return done

    @Slot(object)
    def set_cache(self, cache: CacheConfig) -> None:
        if self._session is None:
            return
        old = self._session.cache_config
        try:
            self._session.set_cache(cache)
        except ConfigError as exc:
            self.error.emit(ErrorEvent("cache", self.tr("Cannot switch the cache mode"), str(exc)))
            return
        except Exception as exc:  # noqa: BLE001
            self.error.emit(ErrorEvent("cache", self.tr("Cannot switch the cache mode"),
                                       f"{type(exc).__name__}: {exc}"))
            return
        self.mode_switched.emit(ModeSwitched(old, self._session.cache_config, self._snapshot()))

    @Slot()
    def reset(self) -> None:
        if self._session is None:
            return
        try:
            freed = int(self._session.reset())
            # Reset is how the user gets memory back: the blocks it freed that were kept for prefix reuse
            # (and other closed chats' ones) go too, so the page storage shrinks; open chats keep theirs. Both
            # figures are falls of the pool's held bytes, so their sum is what the pool got back
            clear = getattr(self._engine, "clear_prefix_cache", None)
            if clear is not None:
                freed += int(clear())
        except Exception as exc:  # noqa: BLE001
            self.error.emit(ErrorEvent("reset", self.tr("Reset failed"), f"{type(exc).__name__}: {exc}"))
            return
        self.reset_done.emit(ResetDone(freed, self._snapshot()))

    @Slot()
    def poll_stats(self) -> None:
        self._emit_stats()

    @Slot(object)
    def measure_quality(self, cache: CacheConfig) -> None:
        """What `cache` costs against full precision on this model; yields to any command sent meanwhile."""
        from kvchat.engine.runtime.fidelity import Cancelled

        from kvchat.app.quality import QualityCancelled, engine_key, measure, result_key
        if self._engine is None or capabilities_of(self._engine).remote:
            return
        model, mode = engine_key(self._engine), result_key(cache)
        try:
            result = measure(self._engine, cache, should_stop=self._cancel_measure.is_set)
        except Cancelled:
            self.quality.emit(QualityCancelled(model, mode))
            return
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not take the chat down
            self.quality.emit(QualityCancelled(model, mode, _load_error_message(exc)))
            return
        self.quality.emit(result)

    @Slot(object)
    def count_tokens(self, requests) -> None:
        if self._engine is not None and not capabilities_of(self._engine).remote:   # no tokenizer here
            from kvchat.app.lengths_data import count_conversations
            self.token_counts.emit(count_conversations(self._engine, requests))

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
            self.token.emit(pending[0] if len(pending) == 1 else
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
        self.stats.emit(snapshot)


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


EVENT_SIGNALS = ("progress", "ready", "session_opened", "token", "turn_finished", "stats", "mode_switched",
                 "reset_done", "error", "quality", "prefix_cleared", "token_counts", "reading", "prefill_set", "saving",
                 "message_counted")


def _turns(messages: list[dict]) -> list[dict]:
    """Messages as {"role", "content"} alone (a session keeps a reply's reasoning beside them)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _pairs(history: list[dict] | None):
    return None if history is None else tuple((m["role"], m["content"]) for m in history)


class EngineHost(QObject):
    """The GUI side of the bridge: owns the thread, forwards commands as queued signals.

    It re-emits every worker event from the GUI thread, so listeners (the window, tests) get them
    there; a plain Python callable connected straight to the worker would run in the engine thread.
    """

    progress = Signal(object)
    ready = Signal(object)
    session_opened = Signal(object)
    token = Signal(object)
    turn_finished = Signal(object)
    stats = Signal(object)
    mode_switched = Signal(object)
    reset_done = Signal(object)
    error = Signal(object)
    quality = Signal(object)
    prefix_cleared = Signal(object)
    token_counts = Signal(object)
    reading = Signal(object)
    prefill_set = Signal(str)
    saving = Signal(object)
    message_counted = Signal(object)

    _load = Signal(object)
    _open = Signal(object, object, object, object)
    _send = Signal(str, object)
    _set_cache = Signal(object)
    _reset = Signal()
    _poll = Signal()
    _measure = Signal(object)
    _regenerate = Signal(object, object)
    _continue = Signal(object, object)
    _edit_resend = Signal(object, str, object)
    _sync_history = Signal(object)
    _clear_prefix = Signal()
    _adopt = Signal(object)
    _count = Signal(object)
    _forget = Signal(object)
    _disk_budget = Signal(float)
    _speculative = Signal(str, int)
    _prefill = Signal(str)
    _close = Signal(float)
    _count_message = Signal(str, object)

    def __init__(self, loader=_default_loader, parent: QObject | None = None):
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("kvchat-engine")
        self.worker = EngineWorker(loader)
        self.worker.moveToThread(self.thread)
        self._load.connect(self.worker.load)
        self._open.connect(self.worker.open_session)
        self._send.connect(self.worker.send)
        self._set_cache.connect(self.worker.set_cache)
        self._reset.connect(self.worker.reset)
        self._poll.connect(self.worker.poll_stats)
        self._measure.connect(self.worker.measure_quality)
        self._regenerate.connect(self.worker.regenerate)
        self._continue.connect(self.worker.continue_reply)
        self._edit_resend.connect(self.worker.edit_resend)
        self._sync_history.connect(self.worker.sync_history)
        self._clear_prefix.connect(self.worker.clear_prefix_cache)
        self._adopt.connect(self.worker.adopt)
        self._count.connect(self.worker.count_tokens)
        self._forget.connect(self.worker.forget_cache)
        self._disk_budget.connect(self.worker.set_disk_budget)
        self._speculative.connect(self.worker.set_speculative)
        self._prefill.connect(self.worker.set_prefill)
        self._close.connect(self.worker.close)
        self._count_message.connect(self.worker.count_message)
        self.thread.started.connect(self.worker.lower_priority)
        for name in EVENT_SIGNALS:
            getattr(self.worker, name).connect(getattr(self, name), Qt.ConnectionType.QueuedConnection)
        self._closing = False           # the close command was sent: the thread saves and ends by itself
        self.thread.start()

    def load(self, config: EngineConfig) -> None:
        self.worker.cancel_measure()
        self._load.emit(config)

    def measure_quality(self, cache: CacheConfig) -> None:
        """Measure in the engine thread, behind whatever is queued; any later command cancels it."""
        self.worker.cancel_measure(False)
        self._measure.emit(cache)

    def open_session(self, conversation_id: int | None, system_prompt: str | None,
                     cache: CacheConfig | None, history: list[dict] | None) -> None:
        turns = tuple((m["role"], m["content"]) for m in history or ())
        self.worker.cancel_measure()
        self._open.emit(conversation_id, system_prompt, cache, turns)

    def send(self, text: str, sampling: SamplingParams) -> None:
        self.worker.clear_stop()        # here, not in the worker: a Stop pressed before the turn starts still counts
        self.worker.cancel_measure()
        self._send.emit(text, sampling)

    def regenerate(self, sampling: SamplingParams, history: list[dict] | None = None) -> None:
        """A new last reply; with `history` (the chat as shown) the session is brought in step with it first."""
        self.worker.clear_stop()
        self.worker.cancel_measure()
        self._regenerate.emit(sampling, _pairs(history))

    def continue_reply(self, sampling: SamplingParams, history: list[dict] | None = None) -> None:
        self.worker.clear_stop()
        self.worker.cancel_measure()
        self._continue.emit(sampling, _pairs(history))

    def edit_resend(self, history: list[dict], text: str, sampling: SamplingParams) -> None:
        """Rewind the session to `history` (the messages before the edited one) and send `text`."""
        self.worker.clear_stop()
        self.worker.cancel_measure()
        self._edit_resend.emit(tuple((m["role"], m["content"]) for m in history), text, sampling)

    def sync_history(self, history: list[dict]) -> None:
        self.worker.cancel_measure()
        self._sync_history.emit(tuple((m["role"], m["content"]) for m in history))

    def clear_prefix_cache(self) -> None:
        self.worker.cancel_measure()
        self._clear_prefix.emit()

    def adopt(self, conversation_id: int) -> None:
        """The open new chat was saved as `conversation_id` (queued before its first send)."""
        self._adopt.emit(conversation_id)

    def stop(self) -> None:
        self.worker.request_stop()

    def set_cache(self, cache: CacheConfig) -> None:
        self.worker.cancel_measure()
        self._set_cache.emit(cache)

    def reset(self) -> None:
        self.worker.cancel_measure()
        self._reset.emit()

    def poll_stats(self) -> None:
        self._poll.emit()

    def count_tokens(self, requests: tuple) -> None:
        """Tokens of saved conversations, ((id, system prompt, ((role, content), ...)), ...), by the model's tokenizer."""
        self._count.emit(requests)

    def shutdown(self, timeout_ms: int = 120_000, save_limit_s: float = SAVE_LIMIT_S) -> bool:
        """Stop any reply; once the running command ends, the engine thread saves the open chats' caches (starting
        none after save_limit_s) and ends. Waits up to timeout_ms for that; True when the thread has ended."""
        if not self.thread.isRunning():
            return True
        self.worker.request_stop()
        self.worker.cancel_measure()
        if not self._closing:
            self._closing = True
            self._close.emit(time.monotonic() + save_limit_s)
        return self.thread.wait(timeout_ms)

    def count_message(self, text: str, history: list[dict]) -> None:
        """Count `text` with the chat before it (`history`) in the engine thread: answered by message_counted."""
        self.worker.cancel_measure()
        self._count_message.emit(text, tuple((m["role"], m["content"]) for m in history))

    def forget_cache(self, conversation_id: int) -> None:
        """A chat deleted for good: delete its saved KV caches too."""
        self._forget.emit(conversation_id)

    def set_disk_budget(self, mb: float) -> None:
        self._disk_budget.emit(float(mb))

    def set_speculative(self, method: str, k: int) -> None:
        """Speculative decoding for every chat's next turn; queued before any load, it applies to each engine."""
        self._speculative.emit(method, int(k))

    def set_prefill(self, mode: str) -> None:
        """The prompt GEMM's precision (auto, fp32, bf16); queued before any load, it applies to each engine."""
        self._prefill.emit(mode)
