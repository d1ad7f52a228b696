"""An inline message above the chat: what went wrong and what to do, without a modal dialog."""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget


class Banner(QFrame):
    settings_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("banner")
        row = QHBoxLayout(self)
        row.setContentsMargins(12, 8, 8, 8)
        texts = QVBoxLayout()
        self.title = QLabel(objectName="bannerTitle")
        self.message = QLabel(objectName="bannerMessage")
        self.message.setWordWrap(True)
        texts.addWidget(self.title)
        texts.addWidget(self.message)
        row.addLayout(texts, 1)
        self.settings_button = QPushButton(self.tr("Open Settings…"))
        self.settings_button.clicked.connect(self.settings_requested)
        close = QPushButton(self.tr("Dismiss"), objectName="bannerClose")
        close.clicked.connect(self.hide_message)
        row.addWidget(self.settings_button)
        row.addWidget(close)
        self.setVisible(False)

    def show_message(self, title: str, message: str, settings_button: bool = False) -> None:
        self.title.setText(title)
        self.message.setText(message)
        self.settings_button.setVisible(settings_button)
        self.setVisible(True)

    def hide_message(self) -> None:
        self.setVisible(False)

    def text(self) -> str:
        return f"{self.title.text()}: {self.message.text()}" if self.isVisible() else ""
