"""Wires the Attention page to the window: the engine's maps to the page, a click on the page to the chat, and a
replay of the open chat (the dialog, the engine host's command, its progress and Cancel, the marks it leaves in the
chat).

The engine thread reads the maps after every turn (app/bridge/attention_work.py) and replays there too; here only
their frozen events arrive, and the chat itself is never changed: a replay's marks are drawn over the replies' text.
"""
from __future__ import annotations

from PySide6.QtCore import QObject

from kvchat.app.bridge.attention_events import (EMPTY, REMOTE, UNSUPPORTED, AttentionShown, ReplayFailed,
                                                ReplayProgress, ReplayShown)
from kvchat.app.chat.divergence_mark import DivergenceMarks
from kvchat.app.i18n import cache_label


class AttentionController(QObject):
    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.page = window.dashboard.attention
        self.marks = DivergenceMarks(self)
        self.dialog = None              # the open "Replay with…" dialog
        self.replaying = False
        self.last_replay: ReplayShown | None = None
        host = window.host
        host.ready.connect(self._on_ready)
        host.attention.connect(self._on_attention)
        host.replay.connect(self._on_replay)
        host.session_opened.connect(lambda _event: self.marks.clear())
        self.page.message_clicked.connect(self.go_to_message)
        self.page.replay.replay_requested.connect(self.open_dialog)
        self.page.replay.cancel_requested.connect(host.cancel_replay)

    def _on_ready(self, event) -> None:
        caps = event.capabilities
        missing = REMOTE if caps.remote else EMPTY if caps.attention else UNSUPPORTED
        self.page.set_missing(missing)
        self.page.replay.set_available(not caps.remote, self.tr("Replay needs a model kvchat runs itself, not a "
                                                                "remote server."))

    def _on_attention(self, shown: AttentionShown) -> None:
        if shown.conversation_id == self.window.conversation_id:    # a turn of a chat left since is not drawn
            self.page.show_attention(shown)

    def go_to_message(self, index: int) -> None:
        self.window.chat.scroll_to_message(index)

    # --- replay ---

    def open_dialog(self):
        """"Replay with…": the mode to replay the open chat under, once the chat is idle."""
        from kvchat.app.dialogs.replay_dialog import ReplayDialog
        w = self.window
        if not w.session_ready or w.generating or self.replaying:
            self.page.replay.status.setText(self.tr("The chat is busy: replay it once the reply has finished."))
            return None
        self.dialog = ReplayDialog(w.session_cache, w)
        self.dialog.accepted.connect(lambda dialog=self.dialog: self.start(dialog.mode()))
        self.dialog.finished.connect(self.dialog.deleteLater)
        self.dialog.open()
        return self.dialog

    def start(self, mode) -> None:
        """Replay the open chat under `mode` in the engine thread (it waits behind anything queued there)."""
        self.marks.clear()
        self.replaying = True
        self.page.replay.started(mode)
        self.window.host.replay_chat(mode)

    def _on_replay(self, event) -> None:
        if isinstance(event, ReplayProgress):
            self.page.replay.show_progress(event.done, event.total)
            return
        self.replaying = False
        if isinstance(event, ReplayFailed):
            self.page.replay.failed(event.error, event.cancelled)
            return
        self.last_replay = event
        self.page.replay.shown(event)
        if event.conversation_id == self.window.conversation_id:
            self._mark(event)

    def _mark(self, result: ReplayShown) -> None:
        """The first token each reply would have had otherwise, marked where it stands in the chat."""
        chat = self.window.chat.chat_messages()
        mode = cache_label(result.mode)
        for reply in result.replies:
            if reply.first_divergence is None or not 0 <= reply.index < len(chat) \
                    or chat[reply.index].role != "assistant":
                continue
            tip = self.tr("Under {mode} the model would have said «{replayed}» here, not «{expected}».").format(
                mode=mode, replayed=reply.replayed, expected=reply.expected)
            self.marks.place(chat[reply.index], reply.offset, reply.length, tip)
