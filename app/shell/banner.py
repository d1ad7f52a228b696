"""An inline message above the chat: what went wrong and what to do, without a modal dialog."""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QLabel, QPushButton, QVBoxLayout, QWidget

from kvchat.app.shell.button_row import ButtonRow


class Banner(QFrame):
    settings_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("banner")
        texts = QVBoxLayout(self)
        texts.setContentsMargins(12, 8, 8, 8)
        self.title = QLabel(objectName="bannerTitle")
        self.title.setWordWrap(True)
        self.message = QLabel(objectName="bannerMessage")
        self.message.setWordWrap(True)
        texts.addWidget(self.title)
        texts.addWidget(self.message)
        self.settings_button = QPushButton(self.tr("Open Settings…"))
        self.settings_button.clicked.connect(self.settings_requested)
        close = QPushButton(self.tr("Dismiss"), objectName="bannerClose")
        close.clicked.connect(self.hide_message)
        texts.addLayout(ButtonRow([], [self.settings_button, close]))   # under the text: a narrow window keeps it
        self.topic = ""                 # what the message is about, where something else may make it stale
        self.setVisible(False)

    def show_message(self, title: str, message: str, settings_button: bool = False, topic: str = "") -> None:
        self.title.setText(title)
        self.message.setText(message)
        self.settings_button.setVisible(settings_button)
        self.topic = topic
        self.setVisible(True)

    def hide_message(self) -> None:
        self.setVisible(False)

    def hide_topic(self, topic: str) -> None:
        """Hide the message shown about `topic` (one that spoke of a model no longer loaded); any other stays."""
        if self.isVisible() and self.topic == topic:
            self.hide_message()

    def text(self) -> str:
        return f"{self.title.text()}: {self.message.text()}" if self.isVisible() else ""
