"""The saved-conversation list beside the chat: newest first, with rename and delete."""
from __future__ import annotations

import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QInputDialog, QListWidget, QListWidgetItem, QMenu, QWidget

from .history import HistoryStore

ID_ROLE = Qt.ItemDataRole.UserRole


def _when(timestamp: float) -> str:
    age = time.time() - timestamp
    if age < 60:
        return "just now"
    if age < 3600:
        return f"{int(age // 60)} min ago"
    if age < 86400:
        return time.strftime("%H:%M", time.localtime(timestamp))
    return time.strftime("%d %b", time.localtime(timestamp))


class ConversationList(QListWidget):
    chosen = Signal(int)                # a conversation id the user picked
    deleted = Signal(int)

    def __init__(self, history: HistoryStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("conversationList")
        self.history = history
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setWordWrap(True)
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._menu)
        self.itemClicked.connect(self._clicked)
        self.refresh()

    def refresh(self, current_id: int | None = None) -> None:
        self.blockSignals(True)
        self.clear()
        for conversation in self.history.conversations():
            cache = conversation.cache.label() if conversation.cache else "?"
            item = QListWidgetItem(f"{conversation.title}\n{_when(conversation.updated_at)} · {cache}")
            item.setData(ID_ROLE, conversation.id)
            item.setToolTip(f"{conversation.title}\nCache: {cache}\nStarted "
                            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(conversation.created_at))}")
            self.addItem(item)
            if conversation.id == current_id:
                item.setSelected(True)
                self.setCurrentItem(item)
        if current_id is None:
            self.clearSelection()
        self.blockSignals(False)

    def ids(self) -> list[int]:
        return [self.item(i).data(ID_ROLE) for i in range(self.count())]

    def _clicked(self, item: QListWidgetItem) -> None:
        self.chosen.emit(int(item.data(ID_ROLE)))

    def _menu(self, pos) -> None:
        item = self.itemAt(pos)
        if item is None:
            return
        conversation_id = int(item.data(ID_ROLE))
        menu = QMenu(self)
        rename = menu.addAction("Rename…")
        delete = menu.addAction("Delete")
        action = menu.exec(self.mapToGlobal(pos))
        if action is rename:
            current = self.history.get(conversation_id)
            title, ok = QInputDialog.getText(self, "Rename chat", "Title", text=current.title if current else "")
            if ok and title.strip():
                self.history.rename(conversation_id, title.strip())
                self.refresh(conversation_id)
        elif action is delete:
            self.history.delete(conversation_id)
            self.deleted.emit(conversation_id)
            self.refresh()
