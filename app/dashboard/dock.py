"""The KV memory dock: a tab per registered page (registry.py), the page shown, the pages a remote server cannot
fill, and the redraw clock that brings one stale panel up to date per tick.

Painting is the dashboard's whole cost and the GUI thread shares the CPU (and the GIL) with the decoder, so each tick
draws at most one panel, and a page not shown is not drawn.
"""
from __future__ import annotations

import html

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QFrame, QLabel, QScrollArea, QStackedWidget, QTabBar, QVBoxLayout, QWidget

# each page module registers its page on import (registry.py): the dock needs them imported, not named
from kvchat.app.dashboard import (attention_view, experts_view, lengths_view, live_page, plan_panel,  # noqa: F401
                                  pool_view)
from kvchat.app.dashboard.dashboard_data import DashboardData
from kvchat.app.dashboard.live_page import LivePage
from kvchat.app.dashboard.registry import pages
from kvchat.app.dashboard.server_panel import unavailable_remote

REDRAW_MS = 125                         # each panel at most 8 Hz


def _scroll(name: str) -> QScrollArea:
    scroll = QScrollArea(objectName=name)
    scroll.setWidgetResizable(True)
    scroll.setFrameShape(QFrame.Shape.NoFrame)
    scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    return scroll


class Dashboard(QWidget):
    PANELS = LivePage.PANELS + ("experts",)

    def __init__(self, data: DashboardData | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("dashboard")
        self.data = data or DashboardData()
        self._drawn: dict[str, int] = {}
        self._next_panel = 0
        self.remote_url = ""                # set while the engine is a remote server
        self.title = None                   # the dock's title bar, once title_bar made it

        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        # the page switcher sits in the dock's title bar when the window puts it there (title_bar): no row of its own
        self.switcher = QTabBar(objectName="dashboardSwitcher")
        self.switcher.setDrawBase(False)
        self.switcher.setExpanding(False)
        self.switcher.setDocumentMode(True)
        self.pages = QStackedWidget(objectName="dashboardPages")
        self.switcher.currentChanged.connect(self._show_index)
        outer.addWidget(self.switcher)
        outer.addWidget(self.pages, 1)
        self._pages = pages()
        self._page_keys = [page.name for page in self._pages]   # English names: show_page and tests use them
        self._widgets: dict[str, QWidget] = {}
        for page in self._pages:
            widget = page.factory(self.data)
            self._widgets[page.name] = widget
            if not isinstance(widget, QScrollArea):     # a page that does not scroll itself gets a scroll area
                scroll = _scroll(f"{widget.objectName()}Scroll")
                scroll.setWidget(widget)
                widget = scroll
            self.pages.addWidget(widget)
            self.switcher.setTabToolTip(self.switcher.addTab(self.tr(page.title)), self.tr(page.tip))
        self.live: LivePage = self._widgets["Live"]
        self.pool_view, self.plan = self._widgets["Pool"], self._widgets["Plan"]
        self.lengths, self.experts = self._widgets["Lengths"], self._widgets["Experts"]
        self.attention = self._widgets["Attention"]
        self.live.markers_stale.connect(lambda: self._drawn.pop("markers", None))
        self._offer_pages()
        self.unavailable = QLabel("", objectName="remoteUnavailable")   # local-only pages with a remote server
        self.unavailable.setWordWrap(True)
        self.unavailable.setContentsMargins(10, 10, 10, 10)
        self.unavailable.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        unavailable_scroll = _scroll("remoteUnavailableScroll")
        unavailable_scroll.setWidget(self.unavailable)
        self.pages.addWidget(unavailable_scroll)
        self.timer = QTimer(self, interval=REDRAW_MS // len(self.PANELS))
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    # --- pages ---

    def set_remote(self, url: str, model: str = "") -> None:
        """A remote server (url) or this computer (""): local-only views say they are unavailable, not zeros."""
        self.remote_url = url
        self.live.set_remote(url, model)
        self._drawn.clear()
        self._show_index(self.switcher.currentIndex())

    def set_model(self, config) -> None:
        """The loaded model's description (None: unknown, as for a remote server): a mixture of experts gets the
        Experts page, a dense model does not."""
        self.experts.set_model(config)
        self._offer_pages()
        self.switcher.updateGeometry()      # its width hint changed: the title bar lays it out again
        if self.title is not None:      # one more tab: the dock's name may give way
            self.title.fit()
        self._drawn.pop("experts", None)

    def _offer_pages(self) -> None:
        """Each tab visible as its page's `shown` says; the page shown falls back to Live when its tab goes."""
        for index, page in enumerate(self._pages):
            shown = page.shown(self._widgets[page.name], bool(self.remote_url))
            if not shown and self.switcher.currentIndex() == index:
                self.switcher.setCurrentIndex(0)
            self.switcher.setTabVisible(index, shown)

    def _show_index(self, index: int) -> None:
        page = self._pages[index] if 0 <= index < len(self._pages) else None
        if page is not None and page.name == "Experts":     # drawn only while shown
            self.experts.show_stats(self.data.latest)
        if self.remote_url and page is not None and page.local_only:
            self.unavailable.setText(self.tr("<b>{page}</b>: {unavailable}.<br>{what} needs the KV cache on this "
                                             "computer; the model runs on {url}. What that server reports (KV usage, "
                                             "requests, prefix-cache hits) is on the Live page.").format(
                page=self.switcher.tabText(index), unavailable=unavailable_remote(),
                what=self.tr(page.local_only), url=html.escape(self.remote_url)))
            self.pages.setCurrentIndex(self.pages.count() - 1)
        else:
            self.pages.setCurrentIndex(index)

    def page_names(self) -> list[str]:
        """The pages shown, by their English names ("Live", "Pool", "Plan", "Lengths", "Experts" for a mixture of
        experts), whatever the interface language."""
        return [name for i, name in enumerate(self._page_keys) if self.switcher.isTabVisible(i)]

    def show_page(self, name: str) -> None:
        self.switcher.setCurrentIndex(self._page_keys.index(name))

    def current_page(self) -> QWidget:
        """The widget the visible page scrolls: the Live body, or the Pool, Plan, Lengths or Experts view."""
        return self.pages.currentWidget().widget()

    def title_bar(self, dock) -> QWidget:
        """A title bar for the dock that holds the page switcher, so the pages keep the dock's whole height."""
        from kvchat.app.dashboard.dock_title import DockTitle
        self.title = DockTitle(dock, self.switcher)
        self.title.fit()                # the tabs' padding and the name as the pages shown now need, from the start
        return self.title

    # --- the redraw clock ---

    def redraw(self) -> None:
        """Bring every panel up to date now."""
        for panel in self.PANELS:
            self._draw_panel(panel)

    def _tick(self) -> None:
        """Timer tick: redraw the next stale panel only. Each panel then paints in an event of its
        own, which keeps every GUI event short while the decoder competes for the CPU."""
        for _ in range(len(self.PANELS)):
            panel = self.PANELS[self._next_panel]
            self._next_panel = (self._next_panel + 1) % len(self.PANELS)
            if self._drawn.get(panel) != self.data.version:
                self._draw_panel(panel)
                return

    def _draw_panel(self, panel: str) -> None:
        if self._drawn.get(panel) == self.data.version:
            return
        self._drawn[panel] = self.data.version
        if panel != "experts":
            self.live.draw(panel)
        elif self.data.latest is not None and self.current_page() is self.experts:   # else drawn when shown
            self.experts.show_stats(self.data.latest)
