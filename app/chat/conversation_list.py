"""The saved-conversation list beside the chat: newest first, with rename, export and delete; a search
filters it by title and message text.

Each row is the title on one line, elided to the list's width (once, by us, so Qt's wrapping
cannot elide it a second time), and when / cache mode under it, over up to three lines when it is
long. Only a left click opens a chat: a right click shows the menu and leaves the open conversation
marked.
"""
from __future__ import annotations

import re
import time

from PySide6.QtCore import QCoreApplication, Qt, Signal
from PySide6.QtWidgets import QInputDialog, QListWidget, QListWidgetItem, QMenu, QMessageBox, QStyle, QWidget

from kvchat.app.store.history import HistoryError, HistoryStore
from kvchat.app.i18n import cache_label

ID_ROLE = Qt.ItemDataRole.UserRole
TITLE_ROLE = Qt.ItemDataRole.UserRole + 1   # (title, detail) as stored, before eliding
DETAIL_LINES = 3
_BREAK = re.compile(r".+?(?:[·,，/]\s*|\s+|$)")     # a piece of the detail line up to where it may break


def _when(timestamp: float) -> str:
    age = time.time() - timestamp
    if age < 60:
        return QCoreApplication.translate("ConversationList", "just now")
    if age < 3600:
        return QCoreApplication.translate("ConversationList", "{n} min ago").format(n=int(age // 60))
    if age < 86400:
        return time.strftime("%H:%M", time.localtime(timestamp))
    # the date's strftime format is translated too ("%d %b" reads "30 Nov"; Chinese puts the month first)
    return time.strftime(QCoreApplication.translate("ConversationList", "%d %b"), time.localtime(timestamp))


def _wrapped(metrics, text: str, width: int) -> list[str]:
    """`text` on DETAIL_LINES lines at most, broken after its separators (a long cache mode would otherwise be
    cut to "K int8 / V i…" in a narrow list); only what is left past the last line is elided."""
    pieces = _BREAK.findall(text)
    lines = [""]
    for piece in pieces:
        if lines[-1] and metrics.horizontalAdvance(lines[-1] + piece.rstrip()) > width and len(lines) < DETAIL_LINES:
            lines.append("")
        lines[-1] += piece
    return [metrics.elidedText(line.rstrip(), Qt.TextElideMode.ElideRight, width) for line in lines]


class ConversationList(QListWidget):
    chosen = Signal(int)                # a conversation id the user picked
    deleted = Signal(int)
    delete_requested = Signal(int)      # the window confirms, deletes and offers Undo
    export_requested = Signal(int, str)     # conversation id, "markdown" or "json"

    def __init__(self, history: HistoryStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("conversationList")
        self.history = history
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setWordWrap(False)
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.open_id: int | None = None     # the conversation the window shows
        self.query = ""                     # the search box's text: only matching chats are listed
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._menu)
        self.itemClicked.connect(self._clicked)
        self.refresh()

    def set_query(self, query: str) -> None:
        """List only the chats whose title or messages contain every word of `query`."""
        self.query = query.strip()
        self.refresh(self.open_id)

    def refresh(self, current_id: int | None = None) -> None:
        self.open_id = current_id
        self.blockSignals(True)
        self.clear()
        found = self.history.search(self.query) if self.query else self.history.conversations()
        for conversation in found:
            cache = cache_label(conversation.cache) if conversation.cache else "?"
            item = QListWidgetItem()
            item.setData(TITLE_ROLE, (conversation.title, f"{_when(conversation.updated_at)} · {cache}"))
            self._set_text(item)
            item.setData(ID_ROLE, conversation.id)
            item.setToolTip(self.tr("{title}\nCache: {cache}\nStarted {started}").format(
                title=conversation.title, cache=cache,
                started=time.strftime('%Y-%m-%d %H:%M', time.localtime(conversation.created_at))))
            self.addItem(item)
            if conversation.id == current_id:
                item.setSelected(True)
                self.setCurrentItem(item)
        if current_id is None:
            self.clearSelection()
        self.blockSignals(False)

    def _text_width(self) -> int:
        """Where a row's text goes: the item's padding in style.qss (8 px a side) and the margin the item view
        keeps inside it (else Qt elides a line we measured as fitting a second time)."""
        margin = self.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None, self) + 1
        return max(40, self.viewport().width() - 2 * self.spacing() - 16 - 2 * margin)

    def _set_text(self, item: QListWidgetItem) -> None:
        title, detail = item.data(TITLE_ROLE)
        metrics, width = self.fontMetrics(), self._text_width()
        lines = [metrics.elidedText(" ".join(title.split()), Qt.TextElideMode.ElideRight, width)]
        item.setText("\n".join(lines + _wrapped(metrics, " ".join(detail.split()), width)))

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        for i in range(self.count()):
            self._set_text(self.item(i))

    def mousePressEvent(self, event) -> None:
        if event.button() == Qt.MouseButton.RightButton:
            event.accept()              # the context menu follows; selection stays on the open chat
            return
        super().mousePressEvent(event)

    def mouseReleaseEvent(self, event) -> None:
        if event.button() == Qt.MouseButton.RightButton:
            event.accept()
            return
        super().mouseReleaseEvent(event)

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
        rename = menu.addAction(self.tr("Rename…"))
        markdown = menu.addAction(self.tr("Export as Markdown…"))
        as_json = menu.addAction(self.tr("Export as JSON…"))
        menu.addSeparator()
        delete = menu.addAction(self.tr("Delete…"))
        action = menu.exec(self.mapToGlobal(pos))
        if action is rename:
            current = self.history.get(conversation_id)
            title, ok = QInputDialog.getText(self, self.tr("Rename chat"), self.tr("Title"),
                                             text=current.title if current else "")
            if ok and title.strip():
                try:
                    self.history.rename(conversation_id, title.strip())
                except HistoryError as exc:     # a read-only history: the title stays, the reason is shown
                    QMessageBox.warning(self, QCoreApplication.translate("MainWindow", "Cannot save this chat"),
                                        str(exc))
                self.refresh(self.open_id)
        elif action in (markdown, as_json):
            self.export_requested.emit(conversation_id, "markdown" if action is markdown else "json")
        elif action is delete:
            self.delete_requested.emit(conversation_id)
