"""The message box: Enter sends, Shift+Enter starts a new line, grows with its text up to a limit."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit, QWidget

MIN_LINES, MAX_LINES = 2, 8


class ChatInput(QPlainTextEdit):
    submitted = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatInput")
        self.setPlaceholderText(self.tr("Message the model…  (Enter sends, Shift+Enter for a new line)"))
        self.setTabChangesFocus(True)
        self.document().contentsChanged.connect(self._fit_height)
        self._fit_height()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            modifiers = event.modifiers()
            if modifiers & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
                return
            if not modifiers & (Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.AltModifier):
                self.submit()
                return
        super().keyPressEvent(event)

    def submit(self) -> None:
        text = self.toPlainText().strip()
        if text and self.isEnabled():
            self.submitted.emit(text)

    def _fit_height(self) -> None:
        line = self.fontMetrics().lineSpacing()
        lines = min(MAX_LINES, max(MIN_LINES, int(self.document().size().height())))
        margins = self.contentsMargins()
        self.setFixedHeight(lines * line + 2 * int(self.document().documentMargin()) + margins.top()
                            + margins.bottom() + 4)
