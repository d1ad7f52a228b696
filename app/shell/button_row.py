"""A row of buttons that wraps: in a narrow window its buttons go onto more lines instead of shrinking to a glyph.

Qt's flow layout example, in two groups: `left` from the left edge, `right` at the right end of the same line (a
line of its own when they do not fit beside each other). Its minimum width is its widest button, so the window's
minimum size (and a 640x480 screen) never squeezes a button's text.
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, QPoint, QRect, QSize, Qt
from PySide6.QtWidgets import QDockWidget, QLayout, QMainWindow, QWidget, QWidgetItem


class ButtonRow(QLayout):
    def __init__(self, left: list[QWidget], right: list[QWidget], parent: QWidget | None = None):
        super().__init__(parent)
        self.setContentsMargins(0, 0, 0, 0)
        self.setSpacing(6)
        self._left = [QWidgetItem(w) for w in left]
        self._right = [QWidgetItem(w) for w in right]
        for w in (*left, *right):
            self.addChildWidget(w)

    # --- QLayout ---

    def addItem(self, item) -> None:
        self._right.append(item)

    def count(self) -> int:
        return len(self._left) + len(self._right)

    def itemAt(self, index: int):
        items = self._left + self._right
        return items[index] if 0 <= index < len(items) else None

    def takeAt(self, index: int):
        items = self._left + self._right
        if not 0 <= index < len(items):
            return None
        item = items[index]
        (self._left if item in self._left else self._right).remove(item)
        return item

    def expandingDirections(self) -> Qt.Orientation:
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:
        return True

    def heightForWidth(self, width: int) -> int:
        return self._place(QRect(0, 0, width, 0), apply=False)

    def setGeometry(self, rect: QRect) -> None:
        super().setGeometry(rect)
        self._place(rect, apply=True)

    def sizeHint(self) -> QSize:
        """All on one line, with a double gap between the two groups."""
        shown = self._shown(self._left + self._right)
        width = sum(i.sizeHint().width() for i in shown) + self.spacing() * len(shown)
        return QSize(width, max((i.sizeHint().height() for i in shown), default=0))

    def minimumSize(self) -> QSize:
        """The widest button: every other one can go onto a line of its own."""
        shown = self._shown(self._left + self._right)
        return QSize(max((i.sizeHint().width() for i in shown), default=0),
                     max((i.sizeHint().height() for i in shown), default=0))

    # --- placing ---

    @staticmethod
    def _shown(items: list) -> list:
        return [i for i in items if not i.isEmpty()]

    def _place(self, rect: QRect, apply: bool) -> int:
        """Lays the buttons out in `rect` (when `apply`); returns the height they take."""
        gap, right_edge = self.spacing(), rect.x() + rect.width()
        x, y, line = rect.x(), rect.y(), 0
        left, right = self._shown(self._left), self._shown(self._right)
        for item in left:
            x, y, line = self._put(item, x, y, line, rect.x(), right_edge, apply)
        right_width = sum(i.sizeHint().width() for i in right) + gap * max(0, len(right) - 1)
        if right and x > rect.x() and x + gap + right_width > right_edge:
            x, y, line = rect.x(), y + line + gap, 0        # the right group starts a line of its own
        x = max(x, right_edge - right_width)
        for item in right:
            x, y, line = self._put(item, x, y, line, rect.x(), right_edge, apply)
        return y + line - rect.y()

    def _put(self, item, x: int, y: int, line: int, left_edge: int, right_edge: int, apply: bool):
        size = item.sizeHint()
        if x > left_edge and x + size.width() > right_edge:
            x, y, line = left_edge, y + line + self.spacing(), 0
        if apply:
            item.setGeometry(QRect(QPoint(x, y), size))
        return x + size.width() + self.spacing(), y, max(line, size.height())


class ColumnWidth(QObject):
    """The chat column's minimum width: its buttons on one line while the window has room for that beside the chat
    list and the dashboard at their narrowest; less in a smaller window (the buttons wrap), so that the dashboard
    gives way first and a 640x480 window still shows every button whole."""

    SLACK = 16                          # the splitter's handle and the dock's separator

    def __init__(self, window: QMainWindow, column: QWidget, row: ButtonRow, beside: QWidget, dock: QDockWidget):
        super().__init__(window)
        self.window, self.column, self.row, self.beside, self.dock = window, column, row, beside, dock
        window.installEventFilter(self)
        dock.topLevelChanged.connect(self.fit)
        dock.visibilityChanged.connect(self.fit)
        dock.dockLocationChanged.connect(self.fit)

    def eventFilter(self, watched, event) -> bool:
        if event.type() == QEvent.Type.Resize:
            self.fit()
        return False

    def fit(self, *_args) -> None:
        # beside the chat: shown (or to be shown with the window), docked, and on the left or the right
        docked = not self.dock.isHidden() and not self.dock.isFloating() and self.window.dockWidgetArea(self.dock) in (
            Qt.DockWidgetArea.LeftDockWidgetArea, Qt.DockWidgetArea.RightDockWidgetArea)
        room = self.window.width() - _least_width(self.beside) - self.SLACK - (_least_width(self.dock) if docked else 0)
        margins = self.column.layout().contentsMargins()
        one_line = self.row.sizeHint().width() + margins.left() + margins.right()
        floor = self.column.layout().minimumSize().width()
        width = max(floor, min(room, one_line))
        if self.column.minimumWidth() != width:
            self.column.setMinimumWidth(width)


def _least_width(widget: QWidget) -> int:
    """The width a layout gives a widget at the least: its minimum width where one is set, else its hint's."""
    return widget.minimumWidth() or widget.minimumSizeHint().width()
