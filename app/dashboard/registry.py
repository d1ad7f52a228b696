"""The dashboard's pages, each registered by its own module, so the dock makes its tabs from this list and a new
page is one module and one `register` call: the dock does not change.

A page's title and tooltip are marked with QT_TRANSLATE_NOOP in the "Dashboard" context; the dock translates them
where it shows them. Tabs come in `order`, not in import order, so which module happens to be imported first cannot
reorder the switcher.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from PySide6.QtWidgets import QWidget


def always_shown(_widget: QWidget, _remote: bool) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Page:
    name: str                           # English whatever the interface language: show_page and tests use it
    title: str                          # the tab's text, marked for the "Dashboard" context
    tip: str                            # the tab's tooltip, marked the same way
    factory: Callable[..., QWidget]     # (DashboardData) -> the page's widget, made once by the dock
    order: int                          # the tab's place, left to right
    local_only: str = ""                # what the page needs a cache on this computer for ("" if it shows a remote one)
    shown: Callable[[QWidget, bool], bool] = always_shown   # (its widget, remote) -> whether its tab is offered

    def __post_init__(self):
        if not self.name or not self.title:
            raise ValueError(f"a dashboard page needs a name and a title: {self!r}")


_PAGES: dict[str, Page] = {}


def register(page: Page) -> Page:
    """Add a page; registering the same name twice is a mistake (two modules claiming one tab), not an update."""
    if page.name in _PAGES and _PAGES[page.name] != page:
        raise ValueError(f"dashboard page {page.name!r} is registered twice")
    if any(other.order == page.order and other.name != page.name for other in _PAGES.values()):
        raise ValueError(f"dashboard page {page.name!r} takes order {page.order}, which another page holds")
    _PAGES[page.name] = page
    return page


def pages() -> list[Page]:
    """Every registered page in tab order."""
    return sorted(_PAGES.values(), key=lambda page: page.order)
