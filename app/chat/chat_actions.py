"""What the user can do to a chat besides sending: regenerate, switch between replies, edit and resend,
continue, copy and delete a message; export, search, delete with undo (delete_undo.py); Clear prefix
cache; About.

One controller beside the main window. The history database is the record (message ids, reply
versions, finish marks); the engine session is kept in step with it through the worker.
"""
from __future__ import annotations

import os

from PySide6.QtCore import QObject, QStandardPaths
from PySide6.QtGui import QAction, QGuiApplication, QKeySequence
from PySide6.QtWidgets import QFileDialog, QLineEdit

from kvchat.engine.events import StatsSnapshot, TurnFinished

from kvchat.app.dialogs.about import AboutDialog
from kvchat.app.chat.message_view import FINISH_MARKS, MessageWidget
from kvchat.app.chat.delete_undo import DeleteWithUndo
from kvchat.app.engine_text import engine_text
from kvchat.app.chat.export import FORMATS, export_conversation, suggested_name
from kvchat.app.store.history import HistoryError
from kvchat.app.i18n import weights_text
from kvchat.app.dashboard.bar_widgets import format_mib
from kvchat.app.bridge.messages import PrefixCleared
from kvchat.app.chat.turn_record import ReplyRecord, TurnRecord


class ChatActions(DeleteWithUndo, QObject):
    def __init__(self, window):
        super().__init__(window)
        self.w = window
        self._last_notice = ""
        self._released: int | None = None
        window.chat.action_requested.connect(self.run)
        window.conversations.delete_requested.connect(self.ask_delete_conversation)
        window.conversations.export_requested.connect(self.export_dialog)
        window.host.prefix_cleared.connect(self._on_prefix_cleared)
        window.host.stats.connect(self._on_stats)
        window.host.session_opened.connect(lambda _event: self.refresh())
        self._build_search()
        self._build_undo()
        self._build_menus()

    # --- construction ---

    def _build_search(self) -> None:
        self.search = QLineEdit(objectName="conversationSearch")
        self.search.setPlaceholderText(self.tr("Search chats"))
        self.search.setClearButtonEnabled(True)
        self.search.setToolTip(self.tr("Lists the chats whose title or messages contain every word typed here"))
        self.search.textChanged.connect(self.w.conversations.set_query)
        panel = self.w.conversations.parentWidget().layout()
        panel.insertWidget(panel.indexOf(self.w.conversations), self.search)

    def _build_menus(self) -> None:
        w = self.w

        def action(text, slot, shortcut=None, tip=""):
            act = QAction(text, w)
            if shortcut:
                act.setShortcut(QKeySequence(shortcut))
            act.setStatusTip(tip)
            act.triggered.connect(slot)
            w.addAction(act)
            return act

        self.export_markdown_action = action(self.tr("Export chat as Markdown…"),
                                             lambda: self.export_dialog(None, "markdown"), "Ctrl+E")
        self.export_json_action = action(self.tr("Export chat as JSON…"), lambda: self.export_dialog(None, "json"))
        self.regenerate_action = action(self.tr("Regenerate reply"), self.regenerate_last, "Ctrl+Shift+G",
                                        self.tr("Write a new last reply; the old one is kept"))
        self.continue_action = action(self.tr("Continue reply"), self.continue_last, "Ctrl+Shift+C",
                                      self.tr("Write more of a reply that was cut at max tokens or stopped"))
        self.clear_prefix_action = action(self.tr("Clear prefix cache"), self.clear_prefix_cache, None,
                                          self.tr("Free the cache blocks kept only for reuse by new chats"))
        self.search_action = action(self.tr("Search chats"), self.search.setFocus, "Ctrl+F")
        self.about_action = action(self.tr("About kvchat"), self.show_about)
        menu = w.menuBar()
        file_menu = menu.addMenu(self.tr("&File"))
        menu.insertMenu(menu.actions()[0], file_menu)
        file_menu.addAction(self.export_markdown_action)
        file_menu.addAction(self.export_json_action)
        chat_menu = getattr(w, "chat_menu", None)
        if chat_menu is not None:
            first = chat_menu.actions()[4] if len(chat_menu.actions()) > 4 else None
            for act in (self.regenerate_action, self.continue_action, self.search_action, self.clear_prefix_action):
                chat_menu.insertAction(first, act)
        help_menu = menu.addMenu(self.tr("&Help"))
        help_menu.addAction(self.about_action)

    # --- state ---

    def busy(self) -> bool:
        return self.w.generating or not self.w.session_ready

    def refresh(self) -> None:
        """Enable what can run now; Regenerate and Continue follow the last reply."""
        busy = self.busy()
        # a remote server has no regenerate or continue (the worker would refuse them): not offered
        rewrite = not (self.w.engine_info is not None and self.w.engine_info.capabilities.remote)
        self.w.chat.refresh_actions(busy, rewrite)
        last = self._last_reply() if rewrite else None
        self.regenerate_action.setEnabled(not busy and last is not None and last.message_id is not None)
        self.continue_action.setEnabled(not busy and last is not None and last.message_id is not None
                                        and last.finish in FINISH_MARKS and last.has_reply())
        has_chat = self.w.conversation_id is not None
        self.export_markdown_action.setEnabled(has_chat)
        self.export_json_action.setEnabled(has_chat)
        self.clear_prefix_action.setEnabled(self.w.engine_info is not None and not self.w.generating)
        self.undo_bar.button.setEnabled(not (self.pending_messages and busy))    # not into a turn in flight

    def _last_reply(self) -> MessageWidget | None:
        chat = self.w.chat.chat_messages()
        return chat[-1] if chat and chat[-1].role == "assistant" else None

    def show_entry(self, widget: MessageWidget, entry) -> None:
        """A restored message: its id, its finish mark, its reply versions."""
        widget.message_id = entry.id
        widget.set_finish(entry.finish)
        if entry.role == "assistant":
            self.w.chat.set_author(widget, entry.model)
        versions = self.w.history.versions(entry.id)
        widget.set_versions(self.w.history.chosen_version(entry.id), len(versions))

    def turn_failed(self, turn, reply: MessageWidget | None) -> None:
        """A regenerate or Continue that raised: the reply shows what the database kept."""
        if isinstance(turn, ReplyRecord) and reply is not None:
            entry = next((e for e in self.w.history.entries(turn.conversation_id) if e.id == turn.message_id), None)
            if entry is not None:
                reply.set_text(entry.content)
                reply.set_reasoning(entry.reasoning)
                self.show_entry(reply, entry)
        self.refresh()

    def turn_ended(self, turn, reply: MessageWidget | None, event: TurnFinished) -> None:
        """After any turn: give the new widgets their database ids, the mark and the versions."""
        if isinstance(turn, TurnRecord) and reply is not None:
            chat = self.w.chat.chat_messages()
            reply.message_id = turn.reply_id
            before = chat[:chat.index(reply)] if reply in chat else []
            users = [m for m in before if m.role == "user"]
            if users and users[-1].message_id is None:
                users[-1].message_id = turn.user_id
        elif isinstance(turn, TurnRecord) and turn.user_id is None:
            pass                        # refused: nothing was saved
        if reply is not None:
            reply.set_finish(event.finish_reason)
            if isinstance(turn, ReplyRecord) and reply.message_id is not None:
                count = len(self.w.history.versions(reply.message_id))
                reply.set_versions(self.w.history.chosen_version(reply.message_id), count)
        self.refresh()

    # --- message actions ---

    def run(self, name: str, message: MessageWidget) -> None:
        handlers = {"copy": self.copy, "delete": self.delete_message, "edit": self.edit_and_resend,
                    "regenerate": self.regenerate, "continue": self.continue_reply,
                    "previous": lambda m: self.step_version(m, -1), "next": lambda m: self.step_version(m, +1)}
        handlers[name](message)

    def copy(self, message: MessageWidget) -> None:
        """The message's text; a reply's answer alone, without its reasoning."""
        QGuiApplication.clipboard().setText(message.text())
        self.w.statusBar().showMessage(self.tr("Copied the message to the clipboard"), 2000)

    def _saved_messages(self, upto_id: int | None = None, without_id: int | None = None) -> list[dict]:
        """The conversation as saved: all of it, only what comes before message `upto_id`, or all but one."""
        if self.w.conversation_id is None:
            return []
        out = []
        for entry in self.w.history.entries(self.w.conversation_id):
            if upto_id is not None and entry.id >= upto_id:
                break
            if entry.id != without_id:
                out.append({"role": entry.role, "content": entry.content})
        return out

    def _write(self, write, *args):
        """A history write; what it returned (True for None), or None once the banner said why it failed."""
        try:
            result = write(*args)
            return True if result is None else result
        except HistoryError as exc:
            self.w.banner.show_message(self.tr("Cannot save this chat"), str(exc))
            return None

    def edit_and_resend(self, message: MessageWidget) -> None:
        """Replace a user message with its edited text and send it: the messages after it go (view and
        database), and the session rewinds to where the message began (the cache forks there)."""
        text = message.edited_text()
        if not text or self.busy():
            return
        earlier = self._saved_messages(upto_id=message.message_id) if message.message_id is not None \
            else self._saved_messages()
        if message.message_id is not None and not self._write(self.w.history.delete_from, self.w.conversation_id,
                                                               message.message_id):
            return
        chat = self.w.chat.messages()
        for later in chat[chat.index(message):]:
            self.w.chat.remove_message(later)
        self.w.send(text, rewind_to=earlier)

    def _start_reply(self, message: MessageWidget, kind: str) -> bool:
        w = self.w
        if self.busy() or message.message_id is None or w.conversation_id is None:
            return False
        try:
            w.history.check_writable()
            record = ReplyRecord(w.history, w.conversation_id, message.message_id, kind, message.text(),
                                 model=w.engine_info.model_name if w.engine_info is not None else None,
                                 before_reasoning=message.reasoning())
        except HistoryError as exc:
            w.banner.show_message(self.tr("Cannot save this chat"), str(exc))
            return False
        w.banner.hide_message()
        w.turn = record
        w.turn_conversation_id = w.conversation_id
        w.generating = True
        if kind == "regenerate":
            w.chat.restart_reply(message)
        else:
            message.set_finish("")
            w.chat.resume_reply(message)
        w._update_controls()
        self.refresh()
        return True

    def regenerate(self, message: MessageWidget) -> None:
        """A new reply in place of this one (the last): the engine forks the cache where it began, so the
        history is not read again; the old reply stays a version the arrows switch back to."""
        shown = self._saved_messages()          # the session is brought in step with what is shown first
        if message is self._last_reply() and self._start_reply(message, "regenerate"):
            self.w.host.regenerate(self.w.settings.sampling, shown)

    def continue_reply(self, message: MessageWidget) -> None:
        shown = self._saved_messages()
        if message is self._last_reply() and self._start_reply(message, "continue"):
            self.w.host.continue_reply(self.w.settings.sampling, shown)

    def regenerate_last(self) -> None:
        if (last := self._last_reply()) is not None:
            self.regenerate(last)

    def continue_last(self) -> None:
        last = self._last_reply()
        if last is not None and last.finish in FINISH_MARKS:
            self.continue_reply(last)

    def step_version(self, message: MessageWidget, step: int) -> None:
        """Show the previous or next reply of a regenerated message; the choice is saved and the session
        switches to it (keeping its cache when the engine still holds it)."""
        if self.busy() or message.message_id is None:
            return
        history = self.w.history
        count = len(history.versions(message.message_id))
        position = history.chosen_version(message.message_id) + step
        if not 0 <= position < count:
            return
        try:
            version = history.choose_version(message.message_id, position)
        except HistoryError as exc:
            self.w.banner.show_message(self.tr("Cannot save this chat"), str(exc))
            return
        message.set_text(version.content)
        message.set_reasoning(version.reasoning)
        message.set_finish(version.finish)
        self.w.chat.set_author(message, version.model)
        message.set_versions(position, count)
        self.w.host.sync_history(self._saved_messages())
        self.refresh()

    # --- conversations: export, delete with undo ---

    def export_dialog(self, conversation_id: int | None, fmt: str) -> str | None:
        """Ask where to save, then export; the path written, or None."""
        conversation_id = self.w.conversation_id if conversation_id is None else conversation_id
        conversation = self.w.history.get(conversation_id) if conversation_id is not None else None
        if conversation is None:
            self.w.statusBar().showMessage(self.tr("Open a saved chat to export it"), 4000)
            return None
        kind = "Markdown (*.md)" if fmt == "markdown" else "JSON (*.json)"
        start = os.path.join(self._export_folder(), suggested_name(conversation.title, fmt))
        path, _ = QFileDialog.getSaveFileName(self.w, self.tr("Export “{title}”").format(title=conversation.title),
                                              start, kind)
        if not path:
            return None
        if not path.endswith(FORMATS[fmt]):
            path += FORMATS[fmt]
        model = self.w.engine_info.model_name if self.w.engine_info else ""
        try:
            written = export_conversation(self.w.history, conversation_id, path, fmt, model)
        except OSError as exc:
            self.w.banner.show_message(self.tr("Could not export the chat"),
                                       self.tr("{error} ({path}): choose a folder you can write to.").format(
                                           error=exc.strerror or exc, path=path))
            return None
        self.w.store.set_export_dir(str(written.resolve().parent))
        self.w.statusBar().showMessage(self.tr("Exported the chat to {path}").format(path=written), 6000)
        return str(written)

    def _export_folder(self) -> str:
        """Where the save dialog starts: the last export's folder, else Documents, else home (never the folder
        kvchat happened to be started from)."""
        last = self.w.store.export_dir()
        if last and os.path.isdir(last):
            return last
        documents = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
        return documents if documents and os.path.isdir(documents) else os.path.expanduser("~")

    # --- engine-wide ---

    def clear_prefix_cache(self) -> None:
        if self.w.engine_info is not None and not self.w.generating:
            self.w.host.clear_prefix_cache()

    def _on_prefix_cleared(self, event: PrefixCleared) -> None:
        if event.stats is not None:
            self.w._on_stats(event.stats)
        text = (self.tr("Cleared the prefix cache: {freed} of KV memory went back to the pool. Open chats keep "
                        "their cache.").format(freed=format_mib(event.freed_bytes)) if event.freed_bytes else
                self.tr("The prefix cache was already empty: nothing to free. Open chats keep their cache."))
        self.w.dashboard.live.show_notice(text)
        self.w.statusBar().showMessage(text, 8000)

    def _on_stats(self, snapshot: StatsSnapshot) -> None:
        """Say in the status line when the engine released a conversation's cache for room."""
        if snapshot.notice and snapshot.notice != self._last_notice:
            self.w.statusBar().showMessage(engine_text(snapshot.notice), 10_000)
        self._last_notice = snapshot.notice
        released = snapshot.pool.released if snapshot.pool is not None else None
        if released is not None and self._released is not None and released > self._released:
            n = released - self._released
            if snapshot.pool.saved_budget_bytes:      # kept warm: the chats' caches went to their files
                text = (self.tr("Moved the cache of 1 idle chat to disk to make room in the KV budget; reopening it "
                                "reads it back.") if n == 1 else
                        self.tr("Moved the caches of {n} idle chats to disk to make room in the KV budget; reopening "
                                "one reads it back.").format(n=n))
                self.w.dashboard.data.mark("offload", self.tr("{n} to disk").format(n=n))
            else:
                text = (self.tr("Released the cache of 1 idle chat to make room in the KV budget; reopening it reads "
                                "its history again.") if n == 1 else
                        self.tr("Released the cache of {n} idle chats to make room in the KV budget; reopening one "
                                "reads its history again.").format(n=n))
                self.w.dashboard.data.mark("offload", self.tr("{n} released").format(n=n))
            self.w.statusBar().showMessage(text, 10_000)
        if released is not None:
            self._released = released

    def show_about(self) -> AboutDialog:
        info = self.w.engine_info
        dialog = AboutDialog(info.model_name if info else None, weights_text(info.weights_label) if info else "",
                             self.w.settings.model, self.w)
        dialog.finished.connect(dialog.deleteLater)
        dialog.open()
        self.about_dialog = dialog
        return dialog
