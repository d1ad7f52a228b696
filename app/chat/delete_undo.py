"""Deleting with Undo: a chat (hidden until the offer ends) or a question with its reply (the rows kept
in memory, put back under their own ids). One offer at a time, in the status bar for UNDO_S seconds.

A part of ChatActions (it uses the controller's window, history writes and refresh); kept apart so
each file holds one idea.
"""
from __future__ import annotations

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QMessageBox, QPushButton

from kvchat.app.chat.message_view import MessageWidget

UNDO_S = 10


class UndoBar(QFrame):
    """"Deleted “title”.  [Undo]" in the status bar for UNDO_S seconds."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("undoBar")
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 0, 2, 0)
        self.label = QLabel(objectName="undoText")
        self.button = QPushButton(self.tr("Undo"), objectName="undoButton")
        row.addWidget(self.label)
        row.addWidget(self.button)
        self.timer = QTimer(self, singleShot=True, interval=UNDO_S * 1000)
        self.setVisible(False)


class DeleteWithUndo:
    """Delete messages and chats, and take it back: mixed into ChatActions."""

    def _build_undo(self) -> None:
        self.pending_delete: int | None = None     # a hidden chat the Undo bar can bring back
        self.pending_messages: list = []            # or messages it can put back (history.TakenMessage)
        self.undo_bar = UndoBar()
        self.undo_bar.button.clicked.connect(self.undo_delete)
        self.undo_bar.timer.timeout.connect(self._purge_pending)
        self.w.statusBar().addPermanentWidget(self.undo_bar)

    def delete_message(self, message: MessageWidget) -> None:
        """Delete a question together with its reply (Delete on either one): a reply alone would leave a
        question that reopening drops. The session follows (the last exchange rewinds the cache; an earlier
        one rebuilds from the prefix cache) and Undo puts both back for UNDO_S seconds."""
        if self.busy():
            return
        exchange = self._exchange(message)
        ids = [m.message_id for m in exchange if m.message_id is not None]
        taken = self._write(self.w.history.take_messages, ids) if ids else []
        if taken is None:
            return
        for widget in exchange:
            self.w.chat.remove_message(widget)
        self.w.host.sync_history(self._saved_messages())
        self.w.conversations.refresh(self.w.conversation_id)
        self.refresh()
        if taken:
            self._offer_undo(None, taken, self.tr("Deleted a question and its reply.") if len(exchange) > 1
                             else self.tr("Deleted a message."))

    def _exchange(self, message: MessageWidget) -> list[MessageWidget]:
        """The question and the reply it got, from either of the two."""
        chat = self.w.chat.chat_messages()
        i = chat.index(message)
        if message.role == "assistant":
            return chat[i - 1:i + 1] if i > 0 and chat[i - 1].role == "user" else [message]
        return chat[i:i + 2] if i + 1 < len(chat) and chat[i + 1].role == "assistant" else [message]

    def ask_delete_conversation(self, conversation_id: int) -> QMessageBox | None:
        conversation = self.w.history.get(conversation_id)
        if conversation is None:
            return None
        count = len(self.w.history.messages(conversation_id))
        question = self.tr("Delete “{title}” and its 1 message?") if count == 1 else \
            self.tr("Delete “{title}” and its {count} messages?")
        box = QMessageBox(QMessageBox.Icon.Question, self.tr("Delete chat?"),
                          question.format(title=conversation.title, count=count) + "\n\n"
                          + self.tr("You can undo this for {seconds} seconds.").format(seconds=UNDO_S),
                          QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, self.w)
        box.setObjectName("confirmDeleteDialog")
        box.button(QMessageBox.StandardButton.Yes).setText(self.tr("Delete"))
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        box.accepted.connect(lambda: self.delete_conversation(conversation_id))
        box.finished.connect(box.deleteLater)
        box.open()
        self.delete_box = box
        return box

    def delete_conversation(self, conversation_id: int) -> None:
        """Hide it now; it is deleted for good when the Undo in the status bar times out."""
        conversation = self.w.history.get(conversation_id)
        if conversation is None:
            return
        self._purge_pending()
        if not self._write(self.w.history.hide, conversation_id):
            return
        open_id = None if self.w.conversation_id == conversation_id else self.w.conversation_id
        self.w.conversations.refresh(open_id)
        self.w._conversation_deleted(conversation_id)
        self._offer_undo(conversation_id, [], self.tr("Deleted “{title}”.").format(title=conversation.title))

    def _offer_undo(self, conversation_id: int | None, messages: list, text: str) -> None:
        """One thing at a time can be undone: a hidden chat or deleted messages; a new delete ends the last offer."""
        self._purge_pending()
        self.pending_delete, self.pending_messages = conversation_id, messages
        self.undo_bar.label.setText(text)
        self.undo_bar.setVisible(True)
        self.undo_bar.timer.start()
        self.refresh()

    def undo_delete(self) -> None:
        conversation_id, self.pending_delete = self.pending_delete, None
        messages, self.pending_messages = self.pending_messages, []
        self.undo_bar.timer.stop()
        self.undo_bar.setVisible(False)
        if messages:
            self._put_back(messages)
            return
        if conversation_id is None or not self._write(self.w.history.restore, conversation_id):
            return
        if not self.w.generating:
            self.w.show_conversation(conversation_id)
        else:
            self.w.conversations.refresh(self.w.conversation_id)
        self.w.statusBar().showMessage(self.tr("Restored the chat"), 3000)

    def _put_back(self, messages: list) -> None:
        """Deleted messages return where they were; the open chat is shown again and its session follows."""
        conversation_id = messages[0].row[1]
        if self.w.history.get(conversation_id) is None:
            self.w.statusBar().showMessage(self.tr("The chat those messages were in is deleted"), 4000)
            return
        if not self._write(self.w.history.put_back, messages):
            return
        if conversation_id == self.w.conversation_id:
            self.w.show_conversation(conversation_id, open_session=False)
            self.w.host.sync_history(self._saved_messages())
        self.w.conversations.refresh(self.w.conversation_id)
        self.refresh()
        self.w.statusBar().showMessage(self.tr("Restored the deleted messages"), 3000)

    def _purge_pending(self) -> None:
        conversation_id, self.pending_delete = self.pending_delete, None
        self.pending_messages = []          # already gone from the file: only the offer ends
        self.undo_bar.timer.stop()
        self.undo_bar.setVisible(False)
        if conversation_id is not None:
            if self._write(self.w.history.purge, conversation_id) is not None:
                self.w.host.forget_cache(conversation_id)       # its saved KV goes with it
