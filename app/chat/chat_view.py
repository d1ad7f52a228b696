"""The conversation as a column of messages (each a MessageWidget, message_view.py) that follows the newest text.

A streaming reply is buffered and redrawn at most every FLUSH_MS, so a fast decoder cannot
flood the GUI thread with markdown layouts.
"""
from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QLabel, QScrollArea, QVBoxLayout, QWidget

from kvchat.app.chat.message_view import MessageWidget

FLUSH_MS = 50
SYSTEM_PROMPT_CHARS = 240               # the rest of a long system prompt is in the line's tooltip


class ChatView(QScrollArea):
    """The message column. Follows the newest text while the user is at the bottom.

    `action_requested(name, message)` asks the window to run an action from under a message: "copy",
    "delete", "edit", "regenerate", "continue", "previous", "next"."""

    action_requested = Signal(str, object)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self._column = QWidget(objectName="chatColumn")
        self._layout = QVBoxLayout(self._column)
        self._layout.setContentsMargins(16, 16, 16, 16)
        self._layout.setSpacing(12)
        self._layout.addStretch(1)
        # the instructions the model reads before the chat: shown, muted, above the first message
        self.system_prompt_line = QLabel(self._column, objectName="systemPromptLine", wordWrap=True)
        self.system_prompt_line.setTextFormat(Qt.TextFormat.PlainText)
        self.system_prompt_line.setStyleSheet("color: #64748b; font-size: 9pt;")
        self.system_prompt_line.setVisible(False)
        self._layout.addWidget(self.system_prompt_line)
        self.setWidget(self._column)
        self.assistant_name = self.tr("Assistant")
        self._messages: list[MessageWidget] = []
        self._reply: MessageWidget | None = None
        self._reply_text = ""
        self._reply_reasoning = ""
        self._dirty = False
        self._follow = True
        self._flush_timer = QTimer(self, interval=FLUSH_MS)
        self._flush_timer.timeout.connect(self._flush)
        self.verticalScrollBar().rangeChanged.connect(self._on_range_changed)
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)

    def messages(self) -> list[MessageWidget]:
        return list(self._messages)

    def clear(self) -> None:
        self.end_reply()
        for message in self._messages:
            self._layout.removeWidget(message)
            message.hide()
            message.deleteLater()
        self._messages.clear()
        self._follow = True

    def set_assistant_name(self, name: str) -> None:
        """Name the replies the loaded model writes from now on; those shown keep the name of their own author."""
        self.assistant_name = name

    def set_author(self, message: MessageWidget, model: str | None) -> None:
        """A reply's label: the model that wrote it, or a neutral "Assistant" when that was not stored (a reply
        saved by an earlier version): naming the model loaded now would credit it with another model's words."""
        message.author_label.setText(model or self.tr("Assistant"))

    def add_message(self, role: str, text: str, author: str | None = None) -> MessageWidget:
        """`author`: who wrote it; a reply without one is labelled "Assistant"."""
        author = author or {"user": self.tr("You"), "assistant": self.tr("Assistant")}.get(role, "kvchat")
        message = MessageWidget(role, author, text, self._column)
        if role in ("user", "assistant"):
            message._request = lambda name, m=message: self.action_requested.emit(name, m)
        self._layout.addWidget(message)
        self._messages.append(message)
        self._follow = True
        return message

    def remove_message(self, message: MessageWidget) -> None:
        if message in self._messages:
            self._messages.remove(message)
            self._layout.removeWidget(message)
            message.hide()
            message.deleteLater()

    def mark_interrupted(self, message: MessageWidget) -> None:
        message.mark_interrupted()

    def chat_messages(self) -> list[MessageWidget]:
        """The user's messages and the replies, without notices."""
        return [m for m in self._messages if m.role in ("user", "assistant")]

    def scroll_to_message(self, index: int) -> MessageWidget | None:
        """Bring the index-th of the user's messages and replies (the session's messages' order) into view; it stays
        there (the view stops following the newest text until scrolled back down)."""
        chat = self.chat_messages()
        if not 0 <= index < len(chat):
            return None
        self._follow = False
        self.ensureWidgetVisible(chat[index], 0, 24)
        return chat[index]

    def refresh_actions(self, busy: bool, can_rewrite: bool = True) -> None:
        """Which actions each message offers now: Regenerate/Continue only on the last reply; none while busy."""
        chat = self.chat_messages()
        for message in chat:
            message.set_actions(last=message is chat[-1] and message is not self._reply, busy=busy,
                                can_rewrite=can_rewrite)

    def resume_reply(self, message: MessageWidget) -> None:
        """Stream into an existing reply: a Continue appends to it, a regenerate replaces its text."""
        self.end_reply()
        self._reply = message
        self._reply_text = message.text()
        self._reply_reasoning = message.reasoning()
        self._dirty = False
        self._flush_timer.start()

    def restart_reply(self, message: MessageWidget) -> None:
        """A regenerate: the loaded model writes the reply anew, so it is named."""
        self.resume_reply(message)
        message.author_label.setText(self.assistant_name)
        self._reply_text = self._reply_reasoning = ""
        message.set_finish("")
        message.set_reasoning("")
        message.set_text("…")

    def add_notice(self, text: str) -> MessageWidget:
        return self.add_message("notice", text)

    def remove_notices(self) -> None:
        """Notices and error bubbles that no longer apply (the next reply came through)."""
        for message in [m for m in self._messages if m.role == "notice"]:
            self.remove_message(message)

    def set_system_prompt(self, prompt: str) -> None:
        """"System prompt: …" above the chat, its first lines only (the tooltip has it all); hidden when empty."""
        prompt = (prompt or "").strip()
        short = prompt if len(prompt) <= SYSTEM_PROMPT_CHARS else prompt[:SYSTEM_PROMPT_CHARS].rstrip() + "…"
        self.system_prompt_line.setText(self.tr("System prompt: {prompt}").format(prompt=short))
        self.system_prompt_line.setToolTip(prompt)
        self.system_prompt_line.setVisible(bool(prompt))

    # --- a streaming reply ---

    def begin_reply(self) -> None:
        self.end_reply()
        self._reply = self.add_message("assistant", "", self.assistant_name)
        self._reply_text = self._reply_reasoning = ""
        self._flush_timer.start()

    def append_reply(self, delta: str) -> None:
        if self._reply is None:
            self.begin_reply()
        self._reply_text += delta
        self._dirty = True

    def append_reasoning(self, delta: str) -> None:
        """More of the streaming reply's reasoning (shown above its text, collapsed)."""
        if self._reply is None:
            self.begin_reply()
        self._reply_reasoning += delta
        self._dirty = True

    def end_reply(self, final_text: str | None = None, reasoning: str | None = None) -> MessageWidget | None:
        reply = self._reply
        if reply is None:
            return None
        if final_text is not None:
            self._reply_text = final_text
        if reasoning is not None:
            self._reply_reasoning = reasoning
        self._reply, self._dirty = None, False
        self._flush_timer.stop()
        reply.set_reasoning(self._reply_reasoning)
        reply.set_text(self._reply_text or "…")
        return reply

    def reply_text(self) -> str:
        return self._reply_text

    def reply_reasoning(self) -> str:
        return self._reply_reasoning

    def show_reply_status(self, text: str) -> None:
        """What happens before the first token (a long chat read again), in the empty reply until it comes."""
        if self._reply is not None and not self._reply_text and not self._reply_reasoning:
            self._reply.set_text(text or "…")

    def _flush(self) -> None:
        if self._reply is not None and self._dirty:
            self._dirty = False
            self._reply.set_reasoning(self._reply_reasoning, live=True)
            self._reply.set_text(self._reply_text or "…")

    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 24

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        if self._follow:
            self.verticalScrollBar().setValue(maximum)
