"""The dashboard dock's title bar: its name, the page switcher, and the float and close buttons."""
from __future__ import annotations

from PySide6.QtWidgets import QDockWidget, QHBoxLayout, QLabel, QStyle, QTabBar, QToolButton, QWidget


COMPACT_TABS = "QTabBar::tab { padding: 3px 5px; }"


class DockTitle(QWidget):
    def __init__(self, dock: QDockWidget, switcher: QTabBar):
        super().__init__(dock)
        self.setObjectName("dashboardTitle")
        row = QHBoxLayout(self)
        row.setContentsMargins(6, 2, 2, 0)
        row.setSpacing(6)
        self.label = QLabel(dock.windowTitle(), objectName="dashboardTitleText")
        row.addWidget(self.label)
        self.switcher = switcher
        row.addWidget(switcher, 0)
        row.addStretch(1)
        for icon, tip, slot in ((QStyle.StandardPixmap.SP_TitleBarNormalButton, self.tr("Float or dock the panel"),
                                 lambda: dock.setFloating(not dock.isFloating())),
                                (QStyle.StandardPixmap.SP_TitleBarCloseButton,
                                 self.tr("Hide the panel (View menu brings it back)"), dock.close)):
            button = QToolButton(autoRaise=True)
            button.setIcon(self.style().standardIcon(icon))
            button.setToolTip(tip)
            button.clicked.connect(slot)
            row.addWidget(button)

    def fit(self) -> None:
        """The dock's name gives way to a fifth page's tab (a mixture of experts' Experts page), which the View menu
        names too; by the number of tabs shown, never by the width it is given, so the dock's minimum width, and
        a restored window's layout, do not depend on what it was last resized to."""
        tabs = self.switcher
        shown = sum(tabs.isTabVisible(i) for i in range(tabs.count()))
        self.label.setVisible(shown <= 5)
        # six tabs (Attention, and a mixture of experts' Experts page) fit a 1024-pixel window with less padding
        tabs.setStyleSheet(COMPACT_TABS if shown > 5 else "")
