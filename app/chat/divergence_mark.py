"""Marks a replay leaves in the chat: the first token of a reply that another cache mode would have chosen otherwise,
highlighted where it stands in the reply's text, with a tooltip that says what the mode would have said.

Only what is shown changes: the message's text (MessageWidget.text(), the history, the session) stays as it was, and
a reply drawn anew (a Continue, a regenerate) drops its mark. Where the token cannot be found in the rendered text
(inside a code block, or text the markdown rewrote), a line under the reply says the same.
"""
from __future__ import annotations

import html

from PySide6.QtCore import QObject
from PySide6.QtGui import QCursor
from PySide6.QtWidgets import QLabel, QToolTip

LINK = "kvchat-divergence:"
MARK_STYLE = "background-color:#fde68a; color:#7c2d12; text-decoration:underline;"
CONTEXT_CHARS = 16                      # characters before the token that must match too (a token is often common)


def _marked(token: str, number: int) -> str:
    return f'<a href="{LINK}{number}"><span style="{MARK_STYLE}">{html.escape(token)}</span></a>'


def find_in(body: str, before: str, token: str) -> int | None:
    """Where `token` (after `before`) starts in a label's markdown `body`: the reply's text as rendered, whose line
    breaks may carry the two spaces of a hard break. None: not found once."""
    for context in (before, before.replace("\n", "  \n"), before[-6:], ""):
        at = body.find(context + token)
        if at >= 0 and (context or body.count(token) == 1):
            return at + len(context)
    return None


class DivergenceMarks(QObject):
    """The marks of the last replay shown; `clear` takes them all back."""

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._marked: list[tuple[QLabel, str, str]] = []     # (label, its text before, its text marked)
        self._notes: list[QLabel] = []
        self._tips: dict[int, str] = {}
        self._hooked: set[int] = set()

    def clear(self) -> None:
        for label, before, marked in self._marked:
            try:
                if label.text() == marked:
                    label.setText(before)
            except RuntimeError:        # the chat was cleared: the label is gone
                pass
        for note in self._notes:
            try:
                note.hide()
                note.deleteLater()
            except RuntimeError:
                pass
        self._marked, self._notes, self._tips = [], [], {}

    def place(self, message, offset: int | None, length: int, tip: str) -> bool:
        """Mark characters [offset, offset + length) of the message's text; True when marked in place, False when a
        line under the reply says it instead."""
        number = len(self._tips)
        self._tips[number] = tip
        text = message.text()
        if offset is not None and 0 <= offset < len(text) and length > 0:
            token = text[offset:offset + length]
            before = text[max(0, offset - CONTEXT_CHARS):offset]
            for label in message.findChildren(QLabel, "messageText"):
                body = label.text()
                at = find_in(body, before, token)
                if at is None:
                    continue
                marked = body[:at] + _marked(token, number) + body[at + len(token):]
                label.setText(marked)
                self._marked.append((label, body, marked))
                self._hook(label)
                return True
        note = QLabel(tip, message, objectName="divergenceNote", wordWrap=True)
        note.setStyleSheet("color: #9a3412; font-style: italic;")
        layout = message.layout()
        layout.insertWidget(max(0, layout.count() - 1), note)      # above the footer
        self._notes.append(note)
        return False

    def _hook(self, label: QLabel) -> None:
        if id(label) not in self._hooked:
            self._hooked.add(id(label))
            label.linkHovered.connect(lambda url, label=label: self._hovered(label, url))

    def _hovered(self, label: QLabel, url: str) -> None:
        if url.startswith(LINK) and url[len(LINK):].isdigit():
            tip = self._tips.get(int(url[len(LINK):]))
            if tip:
                QToolTip.showText(QCursor.pos(), tip, label)

    def tip_for(self, number: int) -> str | None:
        return self._tips.get(number)

    def marked_labels(self) -> list[QLabel]:
        return [label for label, _before, _marked in self._marked]
