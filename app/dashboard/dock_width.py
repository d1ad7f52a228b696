"""The dashboard dock keeps the width the user gave it.

A smaller window squeezes the dock; when the window grows again Qt gives all the new room to the chat,
so the dock would stay narrow for good. Here the dock's width is remembered as the layout first gives
it (the saved layout restored) and when the user drags the separator between chat and dock, and
given back after the window grows, as far as the chat's minimum width allows. A dock squeezed by the
layout (a smaller window, a wider chat) does not change the width it comes back to.
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt, QTimer
from PySide6.QtWidgets import QDockWidget, QMainWindow

SIDE_AREAS = (Qt.DockWidgetArea.LeftDockWidgetArea, Qt.DockWidgetArea.RightDockWidgetArea)


class DockWidth(QObject):
    def __init__(self, window: QMainWindow, dock: QDockWidget):
        super().__init__(window)
        self.window, self.dock = window, dock
        self.wanted: int | None = None      # the width to come back to; None until the first layout
        self._window_width = -1             # the window's width once its last resize settled
        self._dragging = False              # a mouse button is down on the window itself: on a separator
        self._restoring = False
        window.installEventFilter(self)
        dock.installEventFilter(self)

    def eventFilter(self, watched, event) -> bool:
        kind = event.type()
        if watched is self.window and kind in (QEvent.Type.MouseButtonPress, QEvent.Type.MouseButtonRelease):
            self._dragging = kind == QEvent.Type.MouseButtonPress
        elif kind == QEvent.Type.Resize:
            if watched is self.window:
                # settled after the layout pass, whichever order Qt delivers the two resizes in
                QTimer.singleShot(0, self._settle)
            elif self._dragging and not self._restoring and self.window.width() == self._window_width:
                self.wanted = self.dock.width()
        return False

    def _settle(self) -> None:
        grew = self.window.width() > self._window_width >= 0
        self._window_width = self.window.width()
        if self.wanted is None:
            self.wanted = self.dock.width()
        elif grew:
            self._restore()

    def _restore(self) -> None:
        dock = self.dock
        if dock.isFloating() or not dock.isVisible() or self.window.dockWidgetArea(dock) not in SIDE_AREAS:
            return
        central = self.window.centralWidget()
        room = self.window.width() - (central.minimumSizeHint().width() if central is not None else 0) - 8
        target = min(self.wanted, room)
        if dock.width() >= target:
            return
        self._restoring = True          # the dock's resize that follows is ours, not the user's choice
        self.window.resizeDocks([dock], [target], Qt.Orientation.Horizontal)
        QTimer.singleShot(0, self._restored)

    def _restored(self) -> None:
        self._restoring = False
