"""The conversation as a column of messages: markdown prose, code blocks with a Copy button.

A streaming reply is buffered and redrawn at most every FLUSH_MS, so a fast decoder cannot
flood the GUI thread with markdown layouts.

Links in replies are model output: never followed by Qt itself. An http(s) link opens in the
browser after the user confirms it; any other scheme (file:, data:, custom handlers) never opens.
"""
from __future__ import annotations

import re

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QMessageBox, QPushButton, QScrollArea, QSizePolicy,
                               QVBoxLayout, QWidget)

FLUSH_MS = 50
OPENABLE_SCHEMES = ("http", "https")
INTERRUPTED_MARK = "Interrupted: kvchat closed before this reply finished"


def confirm_link(url: str, parent: QWidget | None) -> QMessageBox | None:
    """Ask before opening an http(s) link from a reply; other schemes are refused outright (None)."""
    target = QUrl(url)
    if target.scheme().lower() not in OPENABLE_SCHEMES or not target.isValid() or not target.host():
        return None
    box = QMessageBox(QMessageBox.Icon.Question, "Open link?",
                      f"The reply links to:\n\n{target.toDisplayString()}\n\nOpen it in your browser?",
                      QMessageBox.StandardButton.Open | QMessageBox.StandardButton.Cancel, parent)
    box.setObjectName("confirmLinkDialog")
    box.setDefaultButton(QMessageBox.StandardButton.Cancel)
    box.accepted.connect(lambda: QDesktopServices.openUrl(target))
    box.finished.connect(box.deleteLater)
    box.open()
    return box
_FENCE = re.compile(r"^(```|~~~)[ \t]*([\w+#.-]*)[^\n]*$", re.MULTILINE)


def split_segments(text: str) -> list[tuple[str, str, str]]:
    """Split markdown into ("text", "", prose) and ("code", language, code) pieces.

    An unterminated fence (a reply still streaming) makes the rest of the text a code block.
    """
    segments: list[tuple[str, str, str]] = []
    pos = 0
    while True:
        opening = _FENCE.search(text, pos)
        if opening is None:
            break
        fence, language = opening.group(1), opening.group(2)
        closing = re.compile(rf"^{re.escape(fence)}[ \t]*$", re.MULTILINE).search(text, opening.end())
        prose = text[pos:opening.start()]
        if prose.strip():
            segments.append(("text", "", prose.strip("\n")))
        code_start = opening.end() + 1
        code_end = closing.start() if closing else len(text)
        segments.append(("code", language, text[code_start:code_end].rstrip("\n")))
        if closing is None:
            return segments
        pos = closing.end()
    rest = text[pos:]
    if rest.strip() or not segments:
        segments.append(("text", "", rest.strip("\n")))
    return segments


class CodeBlock(QFrame):
    copied = Signal(str)

    def __init__(self, language: str, code: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("codeBlock")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        header = QWidget(objectName="codeHeader")
        row = QHBoxLayout(header)
        row.setContentsMargins(8, 2, 4, 2)
        self.language_label = QLabel(language or "code", objectName="codeLanguage")
        self.copy_button = QPushButton("Copy", objectName="copyButton")
        self.copy_button.setToolTip("Copy this code block to the clipboard")
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.clicked.connect(self.copy)
        row.addWidget(self.language_label)
        row.addStretch(1)
        row.addWidget(self.copy_button)
        self.body = QLabel(objectName="codeBody")
        self.body.setTextFormat(Qt.TextFormat.PlainText)
        self.body.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.body.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.body.setWordWrap(True)
        self.body.setContentsMargins(10, 6, 10, 8)
        layout.addWidget(header)
        layout.addWidget(self.body)
        self.set_code(language, code)

    def set_code(self, language: str, code: str) -> None:
        self.language_label.setText(language or "code")
        self.body.setText(code)

    def code(self) -> str:
        return self.body.text()

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.code())
        self.copy_button.setText("Copied")
        QTimer.singleShot(1200, self.copy_button, lambda: self.copy_button.setText("Copy"))
        self.copied.emit(self.code())


class MessageWidget(QFrame):
    """One message. `set_text` keeps existing segment widgets when the structure is unchanged."""

    def __init__(self, role: str, author: str, text: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.role = role
        self.setObjectName("userMessage" if role == "user" else "assistantMessage" if role == "assistant"
                           else "noticeMessage")
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(12, 8, 12, 10)
        self._layout.setSpacing(6)
        self.author_label = QLabel(author, objectName="messageAuthor")
        self._layout.addWidget(self.author_label)
        self._segments: list[tuple[str, str, str]] = []
        self._widgets: list[QWidget] = []
        self._text = ""
        self.set_text(text)

    def text(self) -> str:
        return self._text

    def code_blocks(self) -> list[CodeBlock]:
        return [w for w in self._widgets if isinstance(w, CodeBlock)]

    def set_text(self, text: str) -> None:
        self._text = text
        segments = split_segments(text) if self.role != "notice" else [("text", "", text)]
        same_shape = [s[0] for s in segments] == [s[0] for s in self._segments]
        if not same_shape:
            for widget in self._widgets:
                self._layout.removeWidget(widget)
                widget.deleteLater()
            self._widgets = [self._make_widget(kind) for kind, _, _ in segments]
            for widget in self._widgets:
                self._layout.addWidget(widget)
        for widget, (kind, language, body) in zip(self._widgets, segments):
            if kind == "code":
                widget.set_code(language, body)
            elif widget.text() != body:
                widget.setText(body)
        self._segments = segments

    def _make_widget(self, kind: str) -> QWidget:
        if kind == "code":
            return CodeBlock("", "", self)
        label = QLabel(self, objectName="messageText")
        label.setTextFormat(Qt.TextFormat.PlainText if self.role == "user" else Qt.TextFormat.MarkdownText)
        label.setWordWrap(True)
        label.setOpenExternalLinks(False)
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        label.linkActivated.connect(lambda url: confirm_link(url, self))
        return label

    def mark_interrupted(self) -> None:
        self.interrupted_label = QLabel(INTERRUPTED_MARK, self, objectName="interruptedMark")
        self.interrupted_label.setStyleSheet("color: #9a6700; font-style: italic;")
        self.interrupted_label.setToolTip("The app stopped (a crash or power loss) while this reply streamed; "
                                          "what had arrived was saved.")
        self._layout.addWidget(self.interrupted_label)

    def is_interrupted(self) -> bool:
        return getattr(self, "interrupted_label", None) is not None


class ChatView(QScrollArea):
    """The message column. Follows the newest text while the user is at the bottom."""

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
        self.setWidget(self._column)
        self.assistant_name = "Assistant"
        self._messages: list[MessageWidget] = []
        self._reply: MessageWidget | None = None
        self._reply_text = ""
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
            message.deleteLater()
        self._messages.clear()
        self._follow = True

    def set_assistant_name(self, name: str) -> None:
        """Name the model's replies, those already shown (restored before the model loaded) included."""
        self.assistant_name = name
        for message in self.messages():
            if getattr(message, "role", None) == "assistant":
                message.author_label.setText(name)

    def add_message(self, role: str, text: str) -> MessageWidget:
        author = {"user": "You", "assistant": self.assistant_name}.get(role, "kvchat")
        message = MessageWidget(role, author, text, self._column)
        self._layout.addWidget(message)
        self._messages.append(message)
        self._follow = True
        return message

    def remove_message(self, message: MessageWidget) -> None:
        if message in self._messages:
            self._messages.remove(message)
            self._layout.removeWidget(message)
            message.deleteLater()

    def mark_interrupted(self, message: MessageWidget) -> None:
        message.mark_interrupted()

    def add_notice(self, text: str) -> MessageWidget:
        return self.add_message("notice", text)

    # --- a streaming reply ---

    def begin_reply(self) -> None:
        self.end_reply()
        self._reply = self.add_message("assistant", "")
        self._reply_text = ""
        self._flush_timer.start()

    def append_reply(self, delta: str) -> None:
        if self._reply is None:
            self.begin_reply()
        self._reply_text += delta
        self._dirty = True

    def end_reply(self, final_text: str | None = None) -> MessageWidget | None:
        reply = self._reply
        if reply is None:
            return None
        if final_text is not None:
            self._reply_text = final_text
        self._dirty = True
        self._flush()
        self._flush_timer.stop()
        self._reply = None
        return reply

    def reply_text(self) -> str:
        return self._reply_text

    def _flush(self) -> None:
        if self._reply is not None and self._dirty:
            self._dirty = False
            self._reply.set_text(self._reply_text or "…")

    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 24

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        if self._follow:
            self.verticalScrollBar().setValue(maximum)
