"""Past 450 lines on purpose: the one place that wires every room's signals to the engine host's events.

The main window: conversation list, chat, input, dashboard dock; wires the GUI to the engine thread.

The GUI thread never waits on the engine: every command is a queued signal through EngineHost,
and every answer comes back as a signal carrying a frozen dataclass.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QApplication, QDockWidget, QLabel, QMainWindow, QProgressBar,
                               QPushButton, QSplitter, QVBoxLayout, QWidget)

from kvchat.engine.config import EngineConfig
from kvchat.engine.events import PrefillProgress, StatsSnapshot, TokenDelta, TurnFinished

from kvchat.app.shell.banner import Banner
from kvchat.app.chat.chat_actions import ChatActions
from kvchat.app.shell.button_row import ButtonRow, ColumnWidth
from kvchat.app.chat.chat_input import ChatInput
from kvchat.app.chat.chat_view import ChatView
from kvchat.app.chat.conversation_list import ConversationList
from kvchat.app.dashboard.dock import Dashboard
from kvchat.app.dashboard.dock_width import DockWidth
from kvchat.app.dashboard.bar_widgets import format_mib
from kvchat.app.dashboard.dashboard_data import switch_notice
from kvchat.app.store.history import HistoryError, HistoryStore
from kvchat.app.bridge.engine_facts import family_text
from kvchat.app.engine_text import engine_text
from kvchat.app.i18n import cache_label, weights_text
from kvchat.app.bridge.messages import (ActivationsSet, EngineReady, ErrorEvent, LoadProgress, MessageCounted,
                                        ModeSwitched, PrefillSet, ReadingHistory, ResetDone, SavingCaches, SessionOpened,
                                        format_bytes)
from kvchat.app.dashboard.quality_view import QualityController
from kvchat.app.dashboard.attention_controller import AttentionController
from kvchat.app.dialogs.models_page import ModelsDialog
from kvchat.app.dashboard.panels import DashboardPanels
from kvchat.app.dialogs.settings_dialog import SettingsDialog
from kvchat.app.store.settings_store import AppSettings, SettingsStore
from kvchat.app.chat.turn_record import ReplyRecord, TurnRecord, is_refused, stopped_before_reply
from kvchat.app.bridge.host import EngineHost, may_pass_context
from kvchat.app.bridge.loader import default_loader


def engine_threads() -> int:
    """Torch threads for the engine: all cores but one, which stays free for painting the GUI."""
    override = os.environ.get("KVCHAT_THREADS")
    return int(override) if override else max(1, (os.cpu_count() or 2) - 1)


CLOSE_WAIT_MS = 50                      # the GUI thread never waits longer than this for the engine on close
CLOSE_LIMIT_S = 30.0                    # a close ends the process by then, the engine thread's saves done or not


class MainWindow(QMainWindow):
    def __init__(self, store: SettingsStore, history: HistoryStore, loader=default_loader, autoload: bool = True):
        super().__init__()
        self.setWindowTitle("kvchat")
        self.store, self.history = store, history
        self.settings: AppSettings = store.load()
        self.engine_info: EngineReady | None = None
        self.session_ready = False
        self.generating = False
        self.conversation_id: int | None = None
        self.turn_conversation_id: int | None = None
        self.session_cache = self.settings.cache
        self.latest_stats: StatsSnapshot | None = None
        self.last_error: ErrorEvent | None = None
        self.turn: TurnRecord | None = None
        self._pending_settings: tuple[AppSettings, AppSettings] | None = None   # (new, last accepted)
        self._session_failed = False
        self._reading_chat = False      # the turn being read in is the whole chat (an empty cache), not one message
        self._closing = False
        self._close_pending = False
        self._counting: tuple | None = None     # a long message the engine counts before it is sent
        self.close_deadline: float | None = None    # time.monotonic() by which a close ends the process
        self._build()
        self._connect_host(EngineHost(loader, self))
        self.panels = DashboardPanels(self)     # the dashboard's Pool, Plan and Lengths tabs
        self.quality = QualityController(self.host, self.dashboard.live.quality_row,
                                         busy=lambda: self.generating or not self.session_ready, parent=self)
        self.attention = AttentionController(self)  # the Attention page's maps, clicks and replays
        self.actions = ChatActions(self)    # regenerate, edit, continue, copy/delete, export, search, undo, About
        self._restore_layout()
        self.show_conversation(store.last_conversation(), open_session=False)
        self._update_controls()
        if history.recovered is not None:
            self.banner.show_message(self.tr("Chat history was damaged and has been moved aside"),
                                     self.tr("The old file ({reason}) is now {moved_to}; a fresh history was "
                                             "started at {path}.").format(reason=history.recovered.reason,
                                                                           moved_to=history.recovered.moved_to,
                                                                           path=history.path))
        if history.read_only_reason:        # the saved chats can still be read; say at once why none is saved
            self.banner.show_message(self.tr("Chat history is read-only"), history.read_only_message())
        if autoload:
            self.load_engine()

    # --- construction ---

    def _build(self) -> None:
        self.conversations = ConversationList(self.history)
        self.conversations.chosen.connect(self.show_conversation)
        self.conversations.deleted.connect(self._conversation_deleted)
        self.new_button = QPushButton(self.tr("New chat"), objectName="newChatButton")
        left = QWidget(objectName="sidePanel")
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(8, 8, 4, 8)
        left.setMinimumWidth(150)       # room for a readable title at 1024 px
        left_layout.addWidget(self.new_button)
        left_layout.addWidget(self.conversations, 1)

        self.banner = Banner()
        self.banner.settings_requested.connect(self.open_settings)
        self.chat = ChatView()
        self.chat.setMinimumHeight(40)      # a 640x480 window with a banner still has room for every button
        self.input = ChatInput()
        self.input.submitted.connect(self.send)
        self.send_button = QPushButton(self.tr("Send"), objectName="sendButton")
        self.stop_button = QPushButton(self.tr("Stop"), objectName="stopButton")
        self.reset_button = QPushButton(self.tr("Reset session"), objectName="resetButton")
        self.settings_button = QPushButton(self.tr("Settings…"), objectName="settingsButton")
        self.models_button = QPushButton(self.tr("Models…"), objectName="modelsButton")
        buttons = ButtonRow([self.settings_button, self.models_button, self.reset_button],
                            [self.stop_button, self.send_button])
        center = QWidget(objectName="chatPanel")
        center_layout = QVBoxLayout(center)
        center_layout.setContentsMargins(4, 8, 8, 8)
        center_layout.addWidget(self.banner)
        center_layout.addWidget(self.chat, 1)
        center_layout.addWidget(self.input)
        center_layout.addLayout(buttons)

        self.setMinimumSize(640, 480)       # the smallest screen: every button keeps its text (app/shell/button_row.py)
        self.splitter = QSplitter(Qt.Orientation.Horizontal, objectName="mainSplitter")
        self.splitter.addWidget(left)
        self.splitter.addWidget(center)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([220, 600])
        self.setCentralWidget(self.splitter)

        self.dashboard = Dashboard()
        self.dock = QDockWidget(self.tr("KV memory"), self, objectName="dashboardDock")
        self.dock.setWidget(self.dashboard)
        self.dock.setTitleBarWidget(self.dashboard.title_bar(self.dock))
        self.dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                              | QDockWidget.DockWidgetFeature.DockWidgetFloatable
                              | QDockWidget.DockWidgetFeature.DockWidgetClosable)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.dock)
        self.resizeDocks([self.dock], [540], Qt.Orientation.Horizontal)
        self.dock_width = DockWidth(self, self.dock)    # given back after the window was made small
        self.column_width = ColumnWidth(self, center, buttons, left, self.dock)    # the dock gives way first

        self.status_label = QLabel(self.tr("Starting…"), objectName="statusLine")
        self.load_bar = QProgressBar(maximumWidth=220, textVisible=True)
        self.load_bar.setVisible(False)
        self.statusBar().addWidget(self.status_label, 1)     # a transient message (reset, stop) shows in its place
        self.statusBar().addPermanentWidget(self.load_bar)
        self._build_actions()

    def _build_actions(self) -> None:
        def action(text, shortcuts, slot, button=None):
            act = QAction(text, self)
            act.setShortcuts([QKeySequence(s) for s in shortcuts])
            act.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
            act.triggered.connect(slot)
            self.addAction(act)
            if button is not None:
                button.clicked.connect(act.trigger)
                button.setToolTip(f"{text} ({QKeySequence(shortcuts[0]).toString(QKeySequence.SequenceFormat.NativeText)})")
            return act

        self.send_action = action(self.tr("Send"), ["Ctrl+Return"], self.input.submit, self.send_button)
        self.stop_action = action(self.tr("Stop"), ["Esc", "Ctrl+."], self.stop, self.stop_button)
        self.new_action = action(self.tr("New chat"), ["Ctrl+N"], self.new_chat, self.new_button)
        self.settings_action = action(self.tr("Settings…"), ["Ctrl+,", "Ctrl+P"], self.open_settings,
                                      self.settings_button)
        self.reset_action = action(self.tr("Reset session"), ["Ctrl+Shift+R"], self.reset_session, self.reset_button)
        self.models_action = action(self.tr("Models…"), ["Ctrl+M"], self.open_models, self.models_button)
        quit_action = action(self.tr("Quit"), ["Ctrl+Q"], self.close)
        menu = self.menuBar()
        chat_menu = self.chat_menu = menu.addMenu(self.tr("&Chat"))
        for act in (self.new_action, self.send_action, self.stop_action, self.reset_action):
            chat_menu.addAction(act)
        chat_menu.addSeparator()
        chat_menu.addAction(self.settings_action)
        chat_menu.addAction(self.models_action)
        chat_menu.addAction(quit_action)
        view_menu = menu.addMenu(self.tr("&View"))
        view_menu.addAction(self.dock.toggleViewAction())

    def _connect_host(self, host: EngineHost) -> None:
        self.host = host
        host.set_disk_budget(self.store.kv_disk_budget_mb())     # queued before any load: applied to each engine
        host.set_speculative(*self.store.speculative())
        host.set_prefill(self.store.prefill())
        host.set_activations(self.store.activations())
        worker = host                   # its signals arrive in the GUI thread
        worker.progress.connect(self._on_progress)
        worker.ready.connect(self._on_ready)
        worker.prefill_set.connect(self._on_prefill_set)
        worker.session_opened.connect(self._on_session_opened)
        worker.token.connect(self._on_token)
        worker.turn_finished.connect(self._on_turn_finished)
        worker.stats.connect(self._on_stats)
        worker.mode_switched.connect(self._on_mode_switched)
        worker.reset_done.connect(self._on_reset_done)
        worker.error.connect(self._on_error)
        worker.reading.connect(self._on_reading)
        worker.saving.connect(self._on_saving)
        worker.message_counted.connect(self._on_message_counted)
        # connected once, here: a connection made while `finished` is being emitted (the thread saving as it
        # ended) was never called, and the app ran on, hidden, with the model in memory
        host.thread.finished.connect(self._close_after_engine)

    def _restore_layout(self) -> None:
        self.resize(1320, 820)
        for key, restore in (("geometry", self.restoreGeometry), ("state", self.restoreState),
                             ("splitter", self.splitter.restoreState)):
            state = self.store.layout(key)
            if state is not None:
                restore(state)

    # --- commands ---

    def load_engine(self) -> None:
        self.session_ready = False
        self.load_bar.setRange(0, 0)
        self.load_bar.setVisible(True)
        self._update_controls()
        if self.settings.remote is not None:    # a server does the work: connect to it instead of loading
            self.status_label.setText(self.tr("Connecting to {url}…").format(url=self.settings.remote.base_url))
            self.host.load(self.settings.remote)
            return
        self.status_label.setText(self.tr("Loading {model}…").format(model=self.settings.model))
        self.host.load(EngineConfig(model=self.settings.model, cache=self.settings.cache, num_threads=engine_threads()))

    def send(self, text: str, rewind_to: list[dict] | None = None, counted: bool = False) -> None:
        """Send a message; with `rewind_to` (the messages before an edited one) the session goes back there first.
        One that may pass the model's context is counted by the engine first, and shown as sent only if it fits."""
        text = text.strip()
        if not text or not self.session_ready or self.generating:
            return
        history = rewind_to if rewind_to is not None else \
            self.history.messages(self.conversation_id) if self.conversation_id is not None else []
        if not counted and may_pass_context(text, history, self.settings.system_prompt, self.latest_stats,
                                            self.session_cache):
            self._counting = (text, rewind_to, self.conversation_id, bool(history))
            self.host.count_message(text, history)
            self.statusBar().showMessage(self.tr("Counting the tokens of this long message…"))
            return
        self.banner.hide_message()
        new_conversation = self.conversation_id is None
        try:
            self.history.check_writable()
            if new_conversation:
                self.conversation_id = self.history.create(text, self.session_cache, self.settings.system_prompt)
                self.store.set_last_conversation(self.conversation_id)
                self.host.adopt(self.conversation_id)      # its session stays warm under the new id
        except HistoryError as exc:         # the text stays in the input box
            self.banner.show_message(self.tr("Cannot save this chat"), str(exc))
            return
        self.turn = TurnRecord(self.history, self.conversation_id, text, new_conversation,
                               model=self.engine_info.model_name if self.engine_info is not None else None)
        self.conversations.refresh(self.conversation_id)
        if rewind_to is None:
            self.input.clear()
        self.chat.add_message("user", text)
        self.chat.begin_reply()
        self.generating = True
        self.turn_conversation_id = self.conversation_id
        self._update_controls()
        if rewind_to is None:
            self.host.send(text, self.settings.sampling)
        else:
            self.host.edit_resend(rewind_to, text, self.settings.sampling)

    def _on_message_counted(self, event: MessageCounted) -> None:
        """A long message counted: sent if it fits, else it stays in the input box and the banner says why."""
        pending, self._counting = self._counting, None
        if pending is None or pending[0] != event.text or pending[2] != self.conversation_id:
            return                      # sent or left since (another chat)
        text, rewind_to, _, has_history = pending
        self.statusBar().clearMessage()
        if not event.context or event.tokens <= event.context:
            self.send(text, rewind_to, counted=True)
            return
        if not self.input.toPlainText().strip():
            self.input.setPlainText(text)       # an edited message: here it can be shortened
        model = self.engine_info.model_name if self.engine_info is not None else ""
        reason = self.tr("With the chat before it, it makes {tokens} tokens, more than {model}'s context of "
                         "{context} tokens: shorten it, start a new chat, or set a sliding window in Settings (a "
                         "window bounds the cache).") if has_history else \
            self.tr("It is {tokens} tokens long, more than {model}'s context of {context} tokens: shorten it, or set "
                    "a sliding window in Settings (a window bounds the cache).")
        self.banner.show_message(self.tr("Message not sent"), reason.format(
            tokens=f"{event.tokens:,}", model=model, context=f"{event.context:,}"))

    def stop(self) -> None:
        if self.generating:
            self.host.stop()
            self.statusBar().showMessage(self.tr("Stopping…"), 2000)

    def new_chat(self) -> None:
        self.stop()
        self.show_conversation(None)
        self.input.setFocus()

    def show_conversation(self, conversation_id: int | None, open_session: bool = True) -> None:
        """Show a saved conversation (or an empty new one) and, once the engine is up, open its session."""
        self.stop()
        conversation = self.history.get(conversation_id) if conversation_id is not None else None
        self.conversation_id = conversation.id if conversation else None
        self.store.set_last_conversation(self.conversation_id)
        self.chat.clear()
        self.dashboard.live.hide_notice()        # it spoke of the chat shown before
        self.chat.set_system_prompt(conversation.system_prompt if conversation else self.settings.system_prompt)
        messages = self._restore_messages(conversation) if conversation else []
        self.session_cache = (conversation.cache if conversation and conversation.cache else self.settings.cache)
        if conversation and conversation.cache is None:
            self.chat.add_notice(self.tr("This chat's saved cache settings could not be read; it uses your default "
                                         "settings ({cache}).").format(cache=cache_label(self.session_cache)))
        self.conversations.refresh(self.conversation_id)
        if open_session and self.engine_info is not None:
            self._open_session(messages)

    def _restore_messages(self, conversation) -> list[dict]:
        """Show a saved chat; user messages left without a reply (a refused or lost turn) are dropped."""
        try:
            dropped = self.history.drop_unanswered(conversation.id)
        except HistoryError:
            dropped = []                # read-only: they stay, and the next Send explains why nothing saves
        entries = self.history.entries(conversation.id)
        for entry in entries:
            if entry.role == "assistant" and not entry.content and not entry.reasoning and \
                    not (entry.finish == "stopped" or entry.interrupted):
                continue                # an empty reply is shown only when it was cut off: marked, to send again
            widget = self.chat.add_message(entry.role, entry.content, entry.model)
            widget.set_reasoning(entry.reasoning)
            self.actions.show_entry(widget, entry)
            if entry.interrupted:
                self.chat.mark_interrupted(widget)
        if dropped:
            if not self.input.toPlainText().strip():
                self.input.setPlainText(dropped[-1])
            self.chat.add_notice(self.tr("{n} message(s) at the end of this chat never got a reply and were "
                                         "removed; the last one is back in the input box.").format(n=len(dropped)))
        return [{"role": e.role, "content": e.content} for e in entries]

    def _open_session(self, messages: list[dict]) -> None:
        self.session_ready = False
        self._update_controls()
        conversation = self.history.get(self.conversation_id) if self.conversation_id is not None else None
        prompt = conversation.system_prompt if conversation else self.settings.system_prompt
        self.chat.set_system_prompt(prompt)
        self.host.open_session(self.conversation_id, prompt, self.session_cache, messages)

    def reset_session(self) -> None:
        if self.session_ready and not self.generating:
            self.host.reset()

    def open_settings(self) -> SettingsDialog:
        """Open the dialog (non-blocking); its result is applied when the user presses OK."""
        num_layers = self.engine_info.num_layers if self.engine_info else None
        current = replace(self.settings, cache=self.session_cache)
        dialog = SettingsDialog(current, num_layers, self, last_server=self.store.last_server(),
                                model_config=self.engine_info.model_config if self.engine_info else None,
                                model_dtype=self.engine_info.dtype if self.engine_info else "fp32",
                                device=self.engine_info.device if self.engine_info else "cpu",
                                language=self.store.language(), disk_budget_mb=self.store.kv_disk_budget_mb(),
                                speculative=self.store.speculative(), prefill=self.store.prefill(),
                                activations=self.store.activations(),
                                linear_layers=self.engine_info.linear_layers if self.engine_info else 0,
                                shared_kv_layers=self.engine_info.shared_kv_layers if self.engine_info else 0)
        dialog.accepted.connect(lambda: self.store.set_language(dialog.language()))     # applies on restart
        dialog.accepted.connect(lambda: self._set_disk_budget(dialog.disk_budget_mb()))
        dialog.accepted.connect(lambda: self._set_speculative(*dialog.speculative()))
        dialog.accepted.connect(lambda: self._set_prefill(dialog.prefill()))
        dialog.accepted.connect(lambda: self._set_activations(dialog.activations()))
        dialog.accepted.connect(lambda: self.apply_settings(dialog.result_settings()))
        dialog.delete_saved.connect(self.host.delete_saved_caches)
        self.host.saved_caches.connect(dialog.show_saved_caches)
        self.host.count_saved_caches()
        dialog.finished.connect(dialog.deleteLater)
        dialog.open()
        self.settings_dialog = dialog
        return dialog

    def _set_disk_budget(self, mb: float) -> None:
        self.store.set_kv_disk_budget_mb(mb)
        self.host.set_disk_budget(mb)

    def _set_speculative(self, method: str, k: int) -> None:
        self.store.set_speculative(method, k)
        self.host.set_speculative(method, k)

    def _set_prefill(self, mode: str) -> None:
        self.store.set_prefill(mode)
        self.host.set_prefill(mode)

    def _set_activations(self, mode: str) -> None:
        self.store.set_activations(mode)
        self.host.set_activations(mode)

    def _on_prefill_set(self, event: PrefillSet | ActivationsSet) -> None:
        precision = event.precision
        if isinstance(event, ActivationsSet):   # decode rows' activations: the status line names int8
            if self.engine_info is not None:
                self.engine_info = replace(self.engine_info, activations=precision)
                self._update_status()
            return
        if self.engine_info is not None:        # the status line names what the engine now reads prompts in
            self.engine_info = replace(self.engine_info, prefill=precision)
            self._update_status()
        self.dashboard.live.set_prompt_precision(precision)

    def open_models(self) -> ModelsDialog:
        """The Models page (non-blocking): Load there reloads through apply_settings, which saves the choice."""
        dialog = ModelsDialog(self.store.library_folders(), self.settings.model, parent=self)
        dialog.folders_changed.connect(self.store.set_library_folders)
        dialog.model_chosen.connect(lambda path: self.apply_settings(replace(self.settings, model=path, remote=None)))
        dialog.finished.connect(dialog.deleteLater)
        dialog.open()
        self.models_dialog = dialog
        return dialog

    def apply_settings(self, new: AppSettings | None) -> None:
        if new is None:
            return
        old = self._pending_settings[1] if self._pending_settings else self.settings
        self.settings = new
        # saved once the engine has accepted them (a session opened, a switch done); refused ones are not
        if new.model != old.model or new.remote != old.remote or self.engine_info is None:
            self._pending_settings = (new, old)
            self.session_cache = new.cache      # the reload opens the session in the chosen mode
            self.load_engine()
        elif self._session_failed and not self.generating:
            # the conversation whose session failed to open (a new chat) is the one to fix, not the previous one
            self._pending_settings = (new, old)
            self.session_cache = new.cache
            self._open_session(self.history.messages(self.conversation_id) if self.conversation_id is not None else [])
        elif new.cache != self.session_cache:
            self._pending_settings = (new, old)
            self.host.set_cache(new.cache)      # queued behind any reply in flight; applied live
        else:
            self.store.save(new)

    def _settings_accepted(self) -> None:
        if self._pending_settings is not None:
            self.store.save(self._pending_settings[0])
            self._pending_settings = None

    def _settings_refused(self, field: str | None = None) -> None:
        """Refused settings are not saved: back to the accepted ones (all, or just `field`)."""
        if self._pending_settings is not None:
            new, accepted = self._pending_settings
            self.settings = replace(new, **{field: getattr(accepted, field)}) if field else accepted
            self._pending_settings = None

    # --- engine events ---

    def _on_progress(self, event: LoadProgress) -> None:
        if event.fraction is None:
            self.load_bar.setRange(0, 0)
        else:
            self.load_bar.setRange(0, 100)
            self.load_bar.setValue(int(event.fraction * 100))
        self.status_label.setText(event.message)
        self.dashboard.live.summary.setText(event.message)

    def _on_ready(self, event: EngineReady) -> None:
        self.engine_info = event
        self._loaded_model = self.settings.model
        self._loaded_remote = self.settings.remote
        self.dashboard.set_remote(event.server_url if event.capabilities.remote else "", event.model_name)
        self.dashboard.set_model(event.model_config)    # a mixture of experts gets the Experts page
        self.dashboard.live.set_prompt_precision(event.prefill)
        self.load_bar.setVisible(False)
        self.chat.set_assistant_name(event.model_name)
        self.dashboard.data.mark("load", self.tr("model loaded"))
        weights = f" ({weights_text(event.weights_label)}, {format_bytes(event.weight_bytes)})" if event.weight_bytes else ""
        notice = f" · {event.notice}" if event.notice else ""
        if event.capabilities.remote:
            self.statusBar().showMessage(self.tr("Connected to {model} on {url}").format(
                model=event.model_name, url=event.server_url), 5000)
        else:
            self.statusBar().showMessage(self.tr("Loaded {model}{weights} on {device} in {seconds} s").format(
                model=event.model_name, weights=weights, device=event.device, seconds=f"{event.load_s:.1f}")
                + notice, 15000 if notice else 5000)
        if event.chat_format_notice:    # a base model: said before the first message, never a silent template
            self.banner.show_message(self.tr("This model has no chat template"), engine_text(event.chat_format_notice),
                                     topic="chat_format")
        else:
            self.banner.hide_topic("chat_format")   # it spoke of the model loaded before
        messages = self.history.messages(self.conversation_id) if self.conversation_id is not None else []
        self._open_session(messages)

    def _on_session_opened(self, event: SessionOpened) -> None:
        self.session_ready = True
        self._session_failed = False
        self._settings_accepted()
        self.session_cache = event.cache
        if event.stats is not None:
            self._on_stats(event.stats)
        self.dashboard.data.reset_scales()     # another conversation: the per-layer scale starts from it
        self._update_controls()
        if event.stats is not None:
            self.actions._on_stats(event.stats)     # what the open said (a cache restored from disk, or why not)
        if event.restored_tokens:
            self.dashboard.data.mark("restore", self.tr("restored {n} tokens from disk").format(
                n=f"{event.restored_tokens:,}"))

    def _on_token(self, event: TokenDelta) -> None:
        if self.turn is not None:
            self._save(self.turn.delta, event.text, event.reasoning)
        if self.turn_conversation_id == self.conversation_id:
            if event.reasoning:
                self.chat.append_reasoning(event.reasoning)
            if event.text or not event.reasoning:
                self.chat.append_reply(event.text)

    def _save(self, write, *args):
        """A history write; a failure shows in the banner (the chat goes on, unsaved)."""
        try:
            return write(*args)
        except HistoryError as exc:
            self.banner.show_message(self.tr("Cannot save this chat"), str(exc))
            return None

    def _on_turn_finished(self, event: TurnFinished) -> None:
        visible = self.turn_conversation_id == self.conversation_id
        turn, self.turn = self.turn, None
        if turn is not None and self._save(turn.finish, event) is False:
            if visible and not self.input.toPlainText().strip():
                self.input.setPlainText(turn.user_text)     # refused and not saved: the text is not lost
            asked = [m for m in self.chat.chat_messages() if m.role == "user"]
            if visible and asked and asked[-1].message_id is None:
                self.chat.remove_message(asked[-1])         # refused (or no server took it): in the input box, not sent
            if turn.new_conversation and self.history.get(turn.conversation_id) is None:
                if self.conversation_id == turn.conversation_id:
                    self.conversation_id = None
                    self.store.set_last_conversation(None)
        reply = None
        if visible:
            reply = self.chat.end_reply(event.text, event.reasoning)
            came = bool(event.text or event.reasoning)
            if reply is not None and stopped_before_reply(turn, event):
                reply.set_text("")      # kept, marked: the message stays saved, to regenerate or edit
            elif reply is not None and not came and not isinstance(turn, ReplyRecord):
                self.chat.remove_message(reply)
                reply = None
            if reply is not None and came:      # a reply came through: earlier notices and errors are stale
                self.chat.remove_notices()
                self.dashboard.live.hide_notice()
            if event.message:
                self.chat.add_notice(engine_text(event.message))
            if event.finish_reason == "stopped":
                self.statusBar().showMessage(self.tr("Stopped."), 3000)
        self.generating = False
        self.turn_conversation_id = None
        self.dashboard.live.turn_ended()
        self.conversations.refresh(self.conversation_id)
        self._update_controls()
        self.actions.turn_ended(turn, reply, event)

    def _on_stats(self, snapshot: StatsSnapshot) -> None:
        self.latest_stats = snapshot
        self.dashboard.data.add(snapshot, generating=self.generating)
        self._update_status()

    def _on_mode_switched(self, event: ModeSwitched) -> None:
        before = self.latest_stats
        self.session_cache = event.new
        self._settings_accepted()
        if self.conversation_id is not None:
            self._save(self.history.set_cache, self.conversation_id, event.new)
            self.conversations.refresh(self.conversation_id)
        self.dashboard.data.mark("mode", f"→ {cache_label(event.new)}")
        if event.stats is not None:
            self._on_stats(event.stats)
        self.statusBar().showMessage(self.tr("Cache switched to {cache}").format(cache=cache_label(event.new)), 5000)
        if before is not None and event.stats is not None:
            self.dashboard.live.show_notice(switch_notice(cache_label(event.new), before, event.stats))

    def _on_reset_done(self, event: ResetDone) -> None:
        self.dashboard.data.mark("reset", self.tr("reset −{freed}").format(freed=format_bytes(event.freed_bytes)))
        if event.stats is not None:
            self._on_stats(event.stats)
        self.dashboard.data.reset_scales()
        self.last_reset_message = self.tr("Session reset: returned {freed} of KV memory").format(
            freed=format_mib(event.freed_bytes))
        self.statusBar().showMessage(self.last_reset_message, 8000)
        self.dashboard.live.show_notice(self.tr("{message}. The chat text stays; your next message reads it into the "
                                           "cache again.").format(message=self.last_reset_message)
                                   if event.freed_bytes else
                                   self.tr("Session reset: the cache was already empty, nothing to return."))

    def _on_reading(self, event: ReadingHistory | PrefillProgress) -> None:
        """Before a turn's first token: a reopened chat read into an empty cache, a long prompt read chunk by chunk
        (how far, as the engine counts it). Said where the reply will come and in the dashboard."""
        if isinstance(event, PrefillProgress):
            what = self.tr("reading this chat: {done} / {total} tokens…") if self._reading_chat else \
                self.tr("reading your message: {done} / {total} tokens…")
            text = what.format(done=f"{event.done:,}", total=f"{event.total:,}") if event.done < event.total else ""
        else:
            self._reading_chat = event.tokens > 0
            text = self.tr("reading {n} tokens of this chat…").format(n=f"{event.tokens:,}") if event.tokens else ""
        if self.turn_conversation_id == self.conversation_id:
            self.chat.show_reply_status(text)
        self.dashboard.live.set_reading(text)

    def _on_error(self, event: ErrorEvent) -> None:
        self.last_error = event
        if event.kind == "load":
            self.load_bar.setVisible(False)
            self.dashboard.live.show_load_failed(event.title, event.message)
            if self.engine_info is None:
                self._pending_settings = None   # kept unsaved, for the user to fix in Settings
                self.status_label.setText(self.tr("No model loaded"))
            else:                       # the previous model is still loaded; keep using it
                self._settings_refused()
                self.settings = replace(self.settings, model=self._loaded_model, remote=self._loaded_remote)
                self.session_ready = True
        elif event.kind in ("session", "cache"):
            self._session_failed = self._session_failed or event.kind == "session"
            self._settings_refused("cache")
        if event.kind == "send":
            failed = self.turn
            if self.turn is not None:
                self._save(self.turn.fail)
                self.turn = None
            reply = self.chat.end_reply()
            if reply is not None and not reply.text().strip("…") and not isinstance(failed, ReplyRecord):
                self.chat.remove_message(reply)
            self.generating = False
            self.turn_conversation_id = None
            self.dashboard.live.turn_ended()
            self.actions.turn_failed(failed, reply)
        if event.kind == "send":
            self.chat.add_notice(self.tr("{title}: {message}").format(title=event.title,
                                                                      message=engine_text(event.message)))
        else:
            self.banner.show_message(event.title, engine_text(event.message),
                                     settings_button=event.kind in ("load", "cache", "session"))
        self._update_controls()

    def _conversation_deleted(self, conversation_id: int) -> None:
        if conversation_id == self.conversation_id:
            self.new_chat()

    # --- view state ---

    def _update_status(self) -> None:
        parts = []
        if self.engine_info is not None:
            parts += [self.engine_info.model_name, self.tr("server {url}").format(url=self.engine_info.server_url)
                      if self.engine_info.capabilities.remote else self.engine_info.device]
            if self.engine_info.model_config is not None:
                parts.append(family_text(self.engine_info.model_config))
            if self.engine_info.weight_bytes:
                parts.append(self.tr("weights {label} {size}").format(
                    label=weights_text(self.engine_info.weights_label), size=format_bytes(self.engine_info.weight_bytes)))
            if self.engine_info.chat_format_notice:
                parts.append(self.tr("plain-text chat (no template)"))
            if self.engine_info.prefill == "bf16":  # the prompt path that is not exact is named
                parts.append(self.tr("prompts in bf16"))
            elif self.engine_info.prefill == "int8":
                parts.append(self.tr("prompts in int8"))
            if self.engine_info.activations == "int8":     # decoding with llama.cpp's rounding, not the exact path
                parts.append(self.tr("decoding with int8 activations"))
            if self.engine_info.kernel_status:      # the slow torch fallback is said, not silent
                parts.append(engine_text(self.engine_info.kernel_status))
        remote = self.engine_info is not None and self.engine_info.capabilities.remote
        if not remote:                  # the server chooses its own cache
            parts.append(cache_label(self.session_cache))
        if self.latest_stats is not None and remote:
            server = self.latest_stats.server
            if server is not None and not server.reachable:
                parts.append(self.tr("disconnected: the server does not answer"))
            elif server is not None and server.kv_usage is not None:
                parts.append(self.tr("server KV {share} used").format(share=f"{server.kv_usage:.0%}"))
        elif self.latest_stats is not None:
            parts.append(self.tr("{tokens} tokens in cache").format(tokens=f"{self.latest_stats.tokens_held:,}"))
            disk_budget = int(self.store.kv_disk_budget_mb() * 2**20)
            if self.conversation_id is not None and self.latest_stats.kv_bytes > disk_budget:
                # its file holds at least these bytes, and a file over the budget is not kept: said first, where
                # the line's end is cut off in a narrow window
                parts.insert(0, self.tr("cache not saved on disk: {size} is over the disk budget ({budget})").format(
                    size=format_bytes(self.latest_stats.kv_bytes), budget=format_bytes(disk_budget)))
        if self.latest_stats is not None:
            rate = f"{self.latest_stats.decode_tok_s:.1f} tok/s"
            if self.generating:
                parts.append(rate)
            elif self.latest_stats.decode_tok_s:        # a rate after the reply ended is the last reply's
                parts.append(self.tr("last reply {rate}").format(rate=rate))
        text = "  ·  ".join(parts)
        self.status_label.setText(text)
        self.status_label.setToolTip(text)      # the whole line, where a narrow window cuts it off

    def _update_controls(self) -> None:
        can_send = self.session_ready and not self.generating
        self.send_button.setEnabled(can_send)
        self.send_action.setEnabled(can_send)
        self.stop_button.setEnabled(self.generating)
        self.stop_action.setEnabled(self.generating)
        # a remote server frees a request's cache itself: this app holds none to reset
        can_reset = can_send and not (self.engine_info is not None and self.engine_info.capabilities.remote)
        self.reset_button.setEnabled(can_reset)
        self.reset_action.setEnabled(can_reset)
        if hasattr(self, "actions"):
            self.actions.refresh()
        if self.session_ready:
            self._update_status()

    def closeEvent(self, event) -> None:
        if not self._closing:
            self._closing = True
            self.store.set_layout("geometry", self.saveGeometry())
            self.store.set_layout("state", self.saveState())
            self.store.set_layout("splitter", self.splitter.saveState())
            self.store.sync()
            self.dashboard.timer.stop()
            self.close_deadline = time.monotonic() + CLOSE_LIMIT_S
        if not self.host.shutdown(timeout_ms=CLOSE_WAIT_MS):
            # the engine ends the step it is in (a prefill chunk, a decode step), saves the open chats' caches and
            # ends; the window closes for good then, the thread never killed. Meanwhile it shows what it saves,
            # or, with nothing to save, goes away at once
            event.ignore()
            if not self._close_pending:
                self._close_pending = True
                if self.engine_info is not None and self.engine_info.saves_caches:
                    for part in (self.centralWidget(), self.dock, self.menuBar()):
                        part.setEnabled(False)
                    self.statusBar().showMessage(self.tr("Closing…"))
                else:
                    self.hide()
                QTimer.singleShot(int(CLOSE_LIMIT_S * 1000), self, self._give_up_on_engine)
            return
        super().closeEvent(event)

    def _on_saving(self, event: SavingCaches) -> None:
        if event.num_chats:
            self.statusBar().showMessage(self.tr("Saving 1 chat's cache…") if event.num_chats == 1 else
                                         self.tr("Saving {n} chats' caches…").format(n=event.num_chats))

    def wait_for_engine(self) -> bool:
        """After the event loop: the engine thread's end, waited for until the close's deadline; False if it runs
        on (then the process must end without it: a cache file is written whole or not at all)."""
        deadline = self.close_deadline or time.monotonic() + CLOSE_LIMIT_S
        return self.host.shutdown(timeout_ms=max(0, int((deadline - time.monotonic()) * 1000)))

    def _give_up_on_engine(self) -> None:
        if self.host.thread.isRunning():    # a save on a stalled disk, a model still loading
            logging.getLogger(__name__).warning("closing: the engine thread did not end in %.0f s", CLOSE_LIMIT_S)
            self.hide()
            QApplication.instance().quit()

    def _close_after_engine(self) -> None:
        """The deferred close: a window closed while hidden never counts as the last window closed, so the
        application would run on with the model in memory and no window; quit it here instead."""
        if not self._close_pending:
            return
        self.close()
        app = QApplication.instance()
        if app is not None and app.quitOnLastWindowClosed() and not any(
                w.isVisible() for w in app.topLevelWidgets()):
            app.quit()
