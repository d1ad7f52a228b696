"""The GUI side of the bridge: EngineHost owns the engine thread, queues typed commands to it, and re-emits the
worker's events from the GUI thread.

The re-emission matters: a plain Python callable connected straight to the worker would run in the engine thread,
so listeners (the window, tests) connect here, to one named signal per kind of event.
"""
from __future__ import annotations

import time

from PySide6.QtCore import QObject, Qt, QThread, Signal

from kvchat.engine.config import CacheConfig, EngineConfig, SamplingParams
from kvchat.engine.events import PrefillProgress, StatsSnapshot, TokenDelta, TurnFinished

from kvchat.app.bridge.attention_events import AttentionShown, ReplayFailed, ReplayProgress, ReplayShown
from kvchat.app.bridge.commands import (Adopt, ClearPrefixCache, Close, Command, ContinueReply, CountMessage,
                                        CountSavedCaches, CountTokens, DeleteSavedCaches, EditResend, ForgetCache, Load, MeasureQuality,
                                        OpenSession, PollStats, Regenerate, ReplayChat, Reset, Send, SetActivations, SetCache,
                                        SetDiskBudget, SetPrefill, SetSpeculative, SyncHistory, pairs)
from kvchat.app.bridge.loader import default_loader
from kvchat.app.bridge.messages import (ActivationsSet, EngineReady, ErrorEvent, LoadProgress, MessageCounted,
                                        ModeSwitched, PrefillSet, PrefixCleared, ReadingHistory, ResetDone, SavedCaches,
                                        SavingCaches, SessionOpened, TokenCounts)
from kvchat.app.bridge.worker import EngineWorker
from kvchat.app.store.quality import QualityCancelled, QualityResult

SAVE_LIMIT_S = 20.0                 # closing: no chat's cache starts saving later than this after the close

# which of EngineHost's signals carries each event the worker sends
EVENT_SIGNALS = {LoadProgress: "progress", EngineReady: "ready", SessionOpened: "session_opened", TokenDelta: "token",
                 TurnFinished: "turn_finished", StatsSnapshot: "stats", ModeSwitched: "mode_switched",
                 ResetDone: "reset_done", ErrorEvent: "error", QualityResult: "quality", QualityCancelled: "quality",
                 PrefixCleared: "prefix_cleared", TokenCounts: "token_counts", ReadingHistory: "reading",
                 PrefillProgress: "reading", PrefillSet: "prefill_set", ActivationsSet: "prefill_set",
                 SavingCaches: "saving",
                 MessageCounted: "message_counted", SavedCaches: "saved_caches", AttentionShown: "attention",
                 ReplayProgress: "replay", ReplayShown: "replay", ReplayFailed: "replay"}

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


class EngineHost(QObject):
    """Owns the engine thread; every method returns at once, its answer comes later as a signal."""

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
    prefill_set = Signal(object)        # PrefillSet, ActivationsSet: the engine's arithmetic, after Settings
    saving = Signal(object)             # SavingCaches: the app is closing, these chats' caches go to disk
    message_counted = Signal(object)    # MessageCounted: a long message counted before it is shown as sent
    saved_caches = Signal(object)       # SavedCaches on disk (Settings), after a count or a delete
    attention = Signal(object)          # AttentionShown: the open chat's attention maps after a turn or a change
    replay = Signal(object)             # ReplayProgress, then ReplayShown or ReplayFailed

    _command = Signal(object)

    def __init__(self, loader=default_loader, parent: QObject | None = None):
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("kvchat-engine")
        self.worker = EngineWorker(loader)
        self.worker.moveToThread(self.thread)
        self._command.connect(self.worker.run)
        self.thread.started.connect(self.worker.lower_priority)
        self.worker.event.connect(self._relay, Qt.ConnectionType.QueuedConnection)
        self._closing = False           # the close command was sent: the thread saves and ends by itself
        self.thread.start()

    def submit(self, command: Command) -> None:
        """Queue `command` behind the ones already sent. The Stop and measurement flags are set here, in the GUI
        thread, so they hold from this moment on, not from when the engine thread gets to the command."""
        if command.starts_turn:
            self.worker.clear_stop()
        if command.cancel_measure is not None:
            self.worker.cancel_measure(command.cancel_measure)
        self._command.emit(command)

    def _relay(self, event) -> None:
        getattr(self, EVENT_SIGNALS[type(event)]).emit(event)

    def load(self, config: EngineConfig) -> None:
        self.submit(Load(config))

    def measure_quality(self, cache: CacheConfig) -> None:
        """Measure in the engine thread, behind whatever is queued; any later command cancels it."""
        self.submit(MeasureQuality(cache))

    def replay_chat(self, mode: CacheConfig) -> None:
        """Replay the open chat under `mode` in the engine thread, behind whatever is queued; Cancel (cancel_replay)
        or any later command stops it."""
        self.submit(ReplayChat(mode))

    def cancel_replay(self) -> None:
        self.worker.cancel_measure()

    def open_session(self, conversation_id: int | None, system_prompt: str | None,
                     cache: CacheConfig | None, history: list[dict] | None) -> None:
        self.submit(OpenSession(conversation_id, system_prompt, cache, pairs(history or [])))

    def send(self, text: str, sampling: SamplingParams) -> None:
        self.submit(Send(text, sampling))

    def regenerate(self, sampling: SamplingParams, history: list[dict] | None = None) -> None:
        """A new last reply; with `history` (the chat as shown) the session is brought in step with it first."""
        self.submit(Regenerate(sampling, pairs(history)))

    def continue_reply(self, sampling: SamplingParams, history: list[dict] | None = None) -> None:
        self.submit(ContinueReply(sampling, pairs(history)))

    def edit_resend(self, history: list[dict], text: str, sampling: SamplingParams) -> None:
        """Rewind the session to `history` (the messages before the edited one) and send `text`."""
        self.submit(EditResend(pairs(history), text, sampling))

    def sync_history(self, history: list[dict]) -> None:
        self.submit(SyncHistory(pairs(history)))

    def clear_prefix_cache(self) -> None:
        self.submit(ClearPrefixCache())

    def adopt(self, conversation_id: int) -> None:
        """The open new chat was saved as `conversation_id` (queued before its first send)."""
        self.submit(Adopt(conversation_id))

    def stop(self) -> None:
        self.worker.request_stop()

    def set_cache(self, cache: CacheConfig) -> None:
        self.submit(SetCache(cache))

    def reset(self) -> None:
        self.submit(Reset())

    def poll_stats(self) -> None:
        self.submit(PollStats())

    def count_tokens(self, requests: tuple) -> None:
        """Tokens of saved conversations, ((id, system prompt, ((role, content), ...)), ...), by the model's tokenizer."""
        self.submit(CountTokens(requests))

    def count_message(self, text: str, history: list[dict]) -> None:
        """Count `text` with the chat before it (`history`) in the engine thread: answered by message_counted."""
        self.submit(CountMessage(text, pairs(history)))

    def forget_cache(self, conversation_id: int) -> None:
        """A chat deleted for good: delete its saved KV caches too."""
        self.submit(ForgetCache(conversation_id))

    def set_disk_budget(self, mb: float) -> None:
        self.submit(SetDiskBudget(float(mb)))

    def count_saved_caches(self) -> None:
        """Count the chats' caches saved on disk in the engine thread: answered by saved_caches."""
        self.submit(CountSavedCaches())

    def delete_saved_caches(self) -> None:
        """Delete every chat's saved cache in the engine thread, which writes them: answered by saved_caches."""
        self.submit(DeleteSavedCaches())

    def set_speculative(self, method: str, k: int) -> None:
        """Speculative decoding for every chat's next turn; queued before any load, it applies to each engine."""
        self.submit(SetSpeculative(method, int(k)))

    def set_prefill(self, mode: str) -> None:
        """The prompt GEMM's precision (auto, fp32, bf16); queued before any load, it applies to each engine."""
        self.submit(SetPrefill(mode))

    def set_activations(self, mode: str) -> None:
        """Decode rows' activations (int16, int8); queued before any load, they apply to each engine."""
        self.submit(SetActivations(mode))

    def shutdown(self, timeout_ms: int = 120_000, save_limit_s: float = SAVE_LIMIT_S) -> bool:
        """Stop any reply; once the running command ends, the engine thread saves the open chats' caches (starting
        none after save_limit_s) and ends. Waits up to timeout_ms for that; True when the thread has ended."""
        if not self.thread.isRunning():
            return True
        self.worker.request_stop()
        if not self._closing:
            self._closing = True
            self.submit(Close(time.monotonic() + save_limit_s))
        else:
            self.worker.cancel_measure()
        return self.thread.wait(timeout_ms)
