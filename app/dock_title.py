"""The dashboard dock's title bar: its name, the page switcher, and the float and close buttons."""
from __future__ import annotations

from PySide6.QtWidgets import QDockWidget, QHBoxLayout, QLabel, QStyle, QTabBar, QToolButton, QWidget


class DockTitle(QWidget):
    def __init__(self, dock: QDockWidget, switcher: QTabBar):
        super().__init__(dock)
        self.setObjectName("dashboardTitle")
        row = QHBoxLayout(self)
        row.setContentsMargins(6, 2, 2, 0)
        row.setSpacing(6)
        self.label = QLabel(dock.windowTitle(), objectName="dashboardTitleText")
        row.addWidget(self.label)
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
        """A narrow dock with every page's tab (a mixture of experts adds one): the tabs keep their room and the
        name, which the View menu says too, gives way; measured by size hints, so hiding it changes nothing."""
        row = self.layout()
        margins = row.contentsMargins()
        widgets = [row.itemAt(i).widget() for i in range(row.count())]
        needed = sum(w.sizeHint().width() + row.spacing() for w in widgets if w is not None) \
            + margins.left() + margins.right()
        self.label.setVisible(self.width() >= needed)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.fit()
