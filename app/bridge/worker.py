"""The engine thread: one QObject, moved to a QThread, owns the engine and its session.

Commands arrive as typed dataclasses (commands.py) through one queued signal, so they run in the worker thread
one after another, each by its row in HANDLERS; events leave through one signal as frozen dataclasses, and
EngineHost (host.py) re-emits them by type. Stop is a thread-safe flag the decode loop checks
before every step, not a queued command: the worker is busy in that loop when Stop matters.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref

from PySide6.QtCore import QObject, QThread, Signal, Slot

from kvchat.engine.api import capabilities_of
from kvchat.engine.config import CacheConfig, ConfigError, EngineConfig, SamplingParams, SpeculativeConfig

from kvchat.app.bridge import attention_work, warm_chats
from kvchat.app.bridge.commands import (Adopt, ClearPrefixCache, Close, Command, ContinueReply, CountMessage,
                                        CountSavedCaches, CountTokens, DeleteSavedCaches, EditResend, ForgetCache, Load, MeasureQuality, OpenSession,
                                        PollStats, Regenerate, ReplayChat, Reset, Send, SetActivations, SetCache,
                                        SetDiskBudget, SetPrefill, SetSpeculative, SyncHistory)
from kvchat.app.bridge.engine_facts import model_facts
from kvchat.app.bridge.loader import default_loader, error_message, progress_text
from kvchat.app.bridge.messages import (ActivationsSet, EngineReady, ErrorEvent, LoadProgress, MessageCounted,
                                        ModeSwitched, PrefillSet, PrefixCleared, ResetDone, SavingCaches, SessionOpened)
from kvchat.app.bridge.turn_stream import TurnStreaming

log = logging.getLogger(__name__)

WORKER_NICE = 5
MAX_OPEN_SESSIONS = 16              # conversations kept warm; the KV budget may release them sooner (LRU)


def _close(session) -> None:
    close = getattr(session, "close", None)
    if close is not None:
        close()


class EngineWorker(QObject, TurnStreaming):
    """Lives in the engine thread. Every slot runs there; nothing here touches a widget."""

    event = Signal(object)              # every event, a frozen dataclass; EngineHost re-emits it by its type

    def __init__(self, loader=default_loader):
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
        self._activations: str | None = None                # decode rows' activations from Settings
        self._watched = weakref.WeakSet()   # sessions whose attention is measured (attention_work.watch)

    # --- called from the GUI thread (thread-safe, never blocks) ---

    def request_stop(self) -> None:
        self._stop.set()

    def clear_stop(self) -> None:
        self._stop.clear()

    def cancel_measure(self, cancel: bool = True) -> None:
        self._cancel_measure.set() if cancel else self._cancel_measure.clear()

    # --- run in the engine thread ---

    @Slot(object)
    def run(self, command: Command) -> None:
        """Every command from EngineHost, one at a time, in the order sent."""
        HANDLERS[type(command)](self, *command.args())

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

    def load(self, config: EngineConfig) -> None:
        """Load a model. On failure the previous engine and session, if any, stay in use."""
        start = time.monotonic()

        def report(message: str, fraction: float | None = None) -> None:
            self.event.emit(LoadProgress(progress_text(str(message)), fraction))

        report(self.tr("Loading model…"), None)
        try:
            engine = self._loader(config, report)
        except Exception as exc:  # noqa: BLE001 - every load failure becomes a message for the user
            title = self.tr("Could not connect to the server") if hasattr(config, "base_url") else \
                self.tr("Could not load the model")
            self.event.emit(ErrorEvent("load", title, error_message(exc)))
            return
        self._engine, self._session, self._open = engine, None, {}
        if self._disk_budget_mb is not None:
            self.set_disk_budget(self._disk_budget_mb)
        if self._speculative is not None:
            self.set_speculative(*self._speculative)
        if self._prefill is not None:
            self.set_prefill(self._prefill)
        if self._activations is not None:
            self.set_activations(self._activations)
        self._released_chats = set()
        caps = capabilities_of(engine)
        # a server's model is not here: no shape, dtype or prompt precision of its own to tell
        config, dtype = (None, "fp32") if caps.remote else (engine.model.config, engine.dtype_name)
        self._facts = model_facts(config, dtype, str(engine.device))
        facts = engine.describe()
        self.event.emit(EngineReady(facts.model_name, facts.device, facts.num_layers, time.monotonic() - start,
                                    facts.weights_label, facts.weight_bytes, facts.notice,
                                    config, dtype, caps, engine.base_url if caps.remote else "",
                                    kernel_status=facts.kernel_status,
                                    prefill=engine.prefill if caps.prefill_precision else "",
                                    activations=engine.activations if caps.decode_precision else "",
                                    chat_format_notice=facts.chat_format_notice,
                                    saves_caches=warm_chats.supported(engine), linear_layers=facts.linear_layers,
                                    shared_kv_layers=len(config.kv_sources) if config is not None else 0))

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
            self.event.emit(ErrorEvent("session", self.tr("These cache settings do not work"), str(exc)))
            return
        except Exception as exc:  # noqa: BLE001
            self.event.emit(ErrorEvent("session", self.tr("Could not open the conversation"),
                                       f"{type(exc).__name__}: {exc}"))
            return
        attention_work.watch(self._engine, self._session, self._watched)
        self.event.emit(SessionOpened(conversation_id, self._session.cache_config,
                                               len(self._session.messages), self._snapshot(), restored))
        self._report_attention()

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

    def send(self, text: str, sampling: SamplingParams) -> None:
        if self._session is None:
            self.event.emit(ErrorEvent("send", self.tr("No model loaded"),
                                       self.tr("Wait for the model to load, or pick one in Settings.")))
            return
        self._stream(lambda: self._session.send(text, sampling, should_stop=self._stop.is_set),
                     self.tr("The reply failed"), reading=text)

    def regenerate(self, sampling: SamplingParams, messages=None) -> None:
        """A new reply to the last user message (of `messages`, the chat as shown, when given); the engine keeps
        the old one as an alternative."""
        if self._supports(self.tr("Cannot regenerate")) and (messages is None or self._sync_history(messages)):
            self._stream(lambda: self._session.regenerate(sampling, should_stop=self._stop.is_set),
                         self.tr("Cannot regenerate"), reading="")

    def continue_reply(self, sampling: SamplingParams, messages=None) -> None:
        """More of the last reply (cut at max tokens, or stopped)."""
        if self._supports(self.tr("Cannot continue this reply")) \
                and (messages is None or self._sync_history(messages)):
            self._stream(lambda: self._session.continue_reply(sampling, should_stop=self._stop.is_set),
                         self.tr("Cannot continue this reply"), reading="")

    def _supports(self, title: str) -> bool:
        if self._session is None:
            self.event.emit(ErrorEvent("send", title,
                                       self.tr("No model is loaded yet: wait for it, or pick one in Settings.")))
            return False
        if not capabilities_of(self._engine).edits_history:
            self.event.emit(ErrorEvent("send", title, self.tr("This works with a model kvchat runs itself, not "
                                                              "with a remote server.")))
            return False
        return True

    def edit_resend(self, messages, text: str, sampling: SamplingParams) -> None:
        """Go back to `messages` (the chat before the edited message) and send `text` from there."""
        if self._session is not None and self._sync_history(messages):
            self.send(text, sampling)

    def sync_history(self, messages) -> None:
        """Make the session hold `messages` ((role, content) pairs): after a delete or a switch between replies."""
        if self._session is not None and self._sync_history(messages):
            self._emit_stats()
            self._report_attention()

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
            if len(wanted) < len(have) and have[:len(wanted)] == wanted \
                    and capabilities_of(self._engine).edits_history:
                session.rewind(len(wanted))
                return True
            if wanted and have and len(wanted) == len(have) and have[:-1] == wanted[:-1] \
                    and wanted[-1]["role"] == "assistant" and capabilities_of(self._engine).edits_history:
                texts = [alt.text for alt in session.alternatives]
                if wanted[-1]["content"] in texts:
                    session.select_alternative(texts.index(wanted[-1]["content"]))
                    return True
            replacement = self._engine.new_session(system_prompt=getattr(session, "system_prompt", None),
                                                   cache=session.cache_config, history=wanted or None)
        except Exception as exc:  # noqa: BLE001 - the chat stays as it was; the user hears why
            self.event.emit(ErrorEvent("send", self.tr("Could not change the conversation"),
                                       error_message(exc)))
            return False
        _close(session)
        self._session = replacement
        self._warm(replacement, self._conversation_id)
        attention_work.watch(self._engine, replacement, self._watched)
        if self._conversation_id is not None:
            self._open[self._conversation_id] = replacement
        return True

    # --- warm conversations (app/bridge/warm_chats.py) ---

    def _warm(self, session, conversation_id) -> None:
        warm_chats.keep(self._engine, session, conversation_id)

    def _restore(self, session) -> int:
        return warm_chats.restore(self._engine, session)

    def _save(self, session) -> None:
        warm_chats.save(self._engine, session)

    def _retire(self, session) -> None:
        self._save(session)
        _close(session)

    def close(self, deadline: float) -> None:
        """The app is closing: each open chat's cache to disk, the open one first, then the last one used, started
        only before `deadline` (time.monotonic()): a chat not saved by then keeps its last file, or is read again
        next time (a file is written whole or not at all). Then the thread ends."""
        sessions = warm_chats.to_save([self._session, *reversed(self._open.values())])
        self._session, self._open = None, {}
        self.event.emit(SavingCaches(len(sessions)))
        for i, session in enumerate(sessions):
            if time.monotonic() > deadline:
                log.warning("closing: %d of %d chats' caches not saved in time", len(sessions) - i, len(sessions))
                break
            self._save(session)
        QThread.currentThread().quit()

    def count_message(self, text: str, history) -> None:
        """Tokens of the open chat as `history` ((role, content) pairs) with `text` added, against the model's
        context: the window shows a long message as sent only once it fits. A window never passes the context, a
        server counts for itself: nothing is counted there (context 0)."""
        session, tokens, context = self._session, 0, 0
        if session is not None and not capabilities_of(self._engine).remote and session.cache_config.window is None:
            from kvchat.app.bridge.measure import count_tokens
            try:
                context = session.stats().context_tokens
                turns = [*history, ("user", text)]
                tokens = count_tokens(self._engine.tokenizer, getattr(session, "system_prompt", None), turns)
            except Exception:  # noqa: BLE001 - not counted: the engine itself refuses what does not fit
                context = 0
        self.event.emit(MessageCounted(text, tokens, context))

    def set_disk_budget(self, mb: float) -> None:
        self._disk_budget_mb = mb
        warm_chats.set_disk_budget(self._engine, mb)

    def set_speculative(self, method: str, k: int) -> None:
        """Speculative decoding from Settings, live: every chat's next turn uses it. A server decodes its own way."""
        self._speculative = (method, k)
        if self._engine is None or not capabilities_of(self._engine).speculative:
            return
        try:
            self._engine.set_speculative(SpeculativeConfig(method, k=k))
        except Exception as exc:  # noqa: BLE001 - ConfigError says what to change; the last setting stays
            self.event.emit(ErrorEvent("speculative", self.tr("Cannot change speculative decoding"),
                                       error_message(exc)))

    def set_prefill(self, mode: str) -> None:
        """The prompt GEMM's precision from Settings, live: the next prompt read uses it. A server reads its own way."""
        self._prefill = mode
        if self._engine is not None and capabilities_of(self._engine).prefill_precision:
            self._engine.set_prefill(mode)      # one of PREFILL_MODES: Settings offers no other
            self.event.emit(PrefillSet(self._engine.prefill))

    def set_activations(self, mode: str) -> None:
        """Decode rows' activations from Settings, live: the next token uses them. A server decodes its own way."""
        self._activations = mode
        if self._engine is not None and capabilities_of(self._engine).decode_precision:
            self._engine.set_activations(mode)     # one of ACTIVATION_MODES: Settings offers no other
            self.event.emit(ActivationsSet(self._engine.activations))

    def forget_cache(self, conversation_id) -> None:
        warm_chats.forget(self._engine, conversation_id)

    def count_saved_caches(self) -> None:
        """Settings shows the saved caches: counted here, where they are written, never beside a save."""
        self.event.emit(warm_chats.count_saved(self._engine, self._disk_budget_mb))

    def delete_saved_caches(self) -> None:
        """Answered with what is left, so a file that could not go (permissions) still shows in Settings."""
        try:
            self.event.emit(warm_chats.delete_saved(self._engine, self._disk_budget_mb))
        except OSError:
            log.exception("could not delete the saved caches")
            self.count_saved_caches()

    def clear_prefix_cache(self) -> None:
        """Free the blocks kept only for prefix reuse (conversations keep theirs)."""
        if self._engine is None or not capabilities_of(self._engine).prefix_cache:
            return
        try:
            freed = int(self._engine.clear_prefix_cache())
        except Exception as exc:  # noqa: BLE001
            self.event.emit(ErrorEvent("reset", self.tr("Could not clear the prefix cache"),
                                       f"{type(exc).__name__}: {exc}"))
            return
        self.event.emit(PrefixCleared(freed, self._snapshot()))

    def set_cache(self, cache: CacheConfig) -> None:
        if self._session is None:
            return
        old = self._session.cache_config
        try:
            self._session.set_cache(cache)
        except ConfigError as exc:
            self.event.emit(ErrorEvent("cache", self.tr("Cannot switch the cache mode"), str(exc)))
            return
        except Exception as exc:  # noqa: BLE001
            self.event.emit(ErrorEvent("cache", self.tr("Cannot switch the cache mode"),
                                       f"{type(exc).__name__}: {exc}"))
            return
        self.event.emit(ModeSwitched(old, self._session.cache_config, self._snapshot()))
        self._report_attention()

    def reset(self) -> None:
        if self._session is None:
            return
        try:
            freed = int(self._session.reset())
            # Reset is how the user gets memory back: the blocks it freed that were kept for prefix reuse
            # (and other closed chats' ones) go too, so the page storage shrinks; open chats keep theirs. Both
            # figures are falls of the pool's held bytes, so their sum is what the pool got back
            if capabilities_of(self._engine).prefix_cache:
                freed += int(self._engine.clear_prefix_cache())
        except Exception as exc:  # noqa: BLE001
            self.event.emit(ErrorEvent("reset", self.tr("Reset failed"), f"{type(exc).__name__}: {exc}"))
            return
        self.event.emit(ResetDone(freed, self._snapshot()))
        self._report_attention()

    def poll_stats(self) -> None:
        self._emit_stats()

    def measure_quality(self, cache: CacheConfig) -> None:
        """What `cache` costs against full precision on this model; yields to any command sent meanwhile."""
        from kvchat.engine.runtime.fidelity import Cancelled

        from kvchat.app.bridge.measure import engine_key, measure
        from kvchat.app.store.quality import QualityCancelled, result_key
        if self._engine is None or capabilities_of(self._engine).remote:
            return
        model, mode = engine_key(self._engine), result_key(cache)
        try:
            result = measure(self._engine, cache, should_stop=self._cancel_measure.is_set)
        except Cancelled:
            self.event.emit(QualityCancelled(model, mode))
            return
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not take the chat down
            self.event.emit(QualityCancelled(model, mode, error_message(exc)))
            return
        self.event.emit(result)

    # --- where attention goes, and replaying the chat (app/bridge/attention_work.py) ---

    def _stream(self, start, failure: str, reading: str | None = None) -> None:
        """A turn, then the chat's attention maps as it left them."""
        TurnStreaming._stream(self, start, failure, reading)
        self._report_attention()

    def _report_attention(self) -> None:
        if self._engine is not None and self._session is not None:
            attention_work.report(self._engine, self._session, self._conversation_id, self.event.emit)

    def replay_chat(self, mode: CacheConfig) -> None:
        """The open chat under `mode` beside its own cache mode; yields to any command sent meanwhile."""
        attention_work.replay_chat(self._engine, self._session, mode, self._conversation_id,
                                   should_stop=self._cancel_measure.is_set, emit=self.event.emit)

    def count_tokens(self, requests) -> None:
        if self._engine is not None and not capabilities_of(self._engine).remote:   # no tokenizer here
            from kvchat.app.bridge.measure import count_conversations
            self.event.emit(count_conversations(self._engine, requests))


def _turns(messages: list[dict]) -> list[dict]:
    """Messages as {"role", "content"} alone (a session keeps a reply's reasoning beside them)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


# each command's handler, called with the command's fields in order
HANDLERS = {Load: EngineWorker.load, OpenSession: EngineWorker.open_session, Adopt: EngineWorker.adopt,
            Send: EngineWorker.send, Regenerate: EngineWorker.regenerate, ContinueReply: EngineWorker.continue_reply,
            EditResend: EngineWorker.edit_resend, SyncHistory: EngineWorker.sync_history,
            SetCache: EngineWorker.set_cache, Reset: EngineWorker.reset, ClearPrefixCache: EngineWorker.clear_prefix_cache,
            PollStats: EngineWorker.poll_stats, MeasureQuality: EngineWorker.measure_quality,
            ReplayChat: EngineWorker.replay_chat,
            CountTokens: EngineWorker.count_tokens, CountMessage: EngineWorker.count_message,
            ForgetCache: EngineWorker.forget_cache, SetDiskBudget: EngineWorker.set_disk_budget,
            CountSavedCaches: EngineWorker.count_saved_caches, DeleteSavedCaches: EngineWorker.delete_saved_caches,
            SetSpeculative: EngineWorker.set_speculative, SetPrefill: EngineWorker.set_prefill,
            SetActivations: EngineWorker.set_activations,
            Close: EngineWorker.close}
