"""The window at its smallest, 640x480, keeps every button's text whole (issue 37, item 10): the buttons under the
message box (and the banner's) wrap onto more lines instead of shrinking to a glyph, the dashboard gives way first;
the window goes no smaller; at 1024 px the buttons still sit on one line. The app's style sheet is loaded, as the app
does."""
from __future__ import annotations

from dataclasses import replace

import pytest
from PySide6.QtWidgets import QApplication, QPushButton

from kvchat.app.shell.main import load_style
from kvchat.engine.config import CacheConfig
from fakes import FakeLoader, isolate_app, open_window

pytestmark = pytest.mark.gui
BUTTONS = ("settings_button", "models_button", "reset_button", "stop_button", "send_button")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    app = QApplication.instance()
    style = app.styleSheet()
    load_style(app)
    yield
    app.setStyleSheet(style)


def sized(qtbot, window, width: int, height: int) -> None:
    window.resize(width, height)
    qtbot.waitUntil(lambda: window.width() == max(width, 640), timeout=2000)
    qtbot.wait(100)                     # the chat column's minimum follows the window (app/shell/button_row.py)


def readable(window) -> list[str]:
    """Every visible push button as wide as its text needs, none cut off by what holds it, none over another."""
    problems, shown = [], [b for b in window.findChildren(QPushButton) if b.isVisible()]
    for b in shown:
        if b.width() < b.sizeHint().width() or b.visibleRegion().boundingRect() != b.rect():    # none cut off
            problems.append(f"{b.text()!r} {b.geometry()} shows {b.visibleRegion().boundingRect()}, wants "
                            f"{b.sizeHint()}")
    for a in shown:
        for b in shown:
            if a is not b and a.parentWidget() is b.parentWidget() and a.geometry().intersects(b.geometry()):
                problems.append(f"{a.text()!r} overlaps {b.text()!r}")
    return problems


def test_at_640x480_every_button_keeps_its_text(qtbot):
    window = open_window(qtbot, FakeLoader(), autoload=False)
    window.apply_settings(replace(window.settings, cache=CacheConfig(k_format="int8", v_format="int8")))
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    window.banner.show_message("Cannot load the model", "A message long enough to wrap in a narrow window, with "
                               "what to do next.", settings_button=True)
    sized(qtbot, window, 640, 480)
    assert (window.width(), window.height()) == (640, 480)
    assert window.dashboard.live.quality_row.button.isVisible()     # the dashboard's Measure is one of those checked
    assert readable(window) == []
    assert window.send_button.geometry().top() > window.settings_button.geometry().top()     # they wrapped
    assert window.input.geometry().bottom() < window.settings_button.geometry().top()
    sized(qtbot, window, 500, 400)
    assert (window.width(), window.height()) == (640, 480)      # no smaller than that
    window.banner.hide_message()
    sized(qtbot, window, 1024, 700)
    assert readable(window) == []
    tops = {getattr(window, name).geometry().top() for name in BUTTONS}
    assert len(tops) == 1                               # one line where there is room for it
    assert window.dock.width() >= 380                   # and the dashboard keeps its room beside it
