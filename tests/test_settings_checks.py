"""Settings validated by the engine's own check, saved only once accepted, and fixed where they failed;
links in replies opened only as http(s), after a confirmation."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QApplication, QDialogButtonBox, QMessageBox

from kvchat.app.chat.chat_view import ChatView
from kvchat.app.chat.message_view import confirm_link
from kvchat.app.store.history import HistoryStore
from kvchat.app.store.settings_store import SettingsStore
from kvchat.engine.config import CacheConfig, SamplingParams
from fakes import FakeLoader, isolate_app, open_window

pytestmark = pytest.mark.gui
BAD = CacheConfig(budget_mb=0.01)        # a valid config that holds no block of the fake model


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def ready_window(qtbot, **changes):
    window = open_window(qtbot, FakeLoader(), autoload=False)
    fields = {n: getattr(window.settings, n) for n in ("model", "cache", "sampling", "system_prompt")}
    window.apply_settings(type(window.settings)(**{**fields, **changes}))
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    return window


def ok_button(dialog):
    return dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)


def test_dialog_refuses_what_the_engine_would_refuse(qtbot):
    """With a model loaded, a budget below one block, a window past the context and a missing layer disable OK."""
    window = ready_window(qtbot)
    dialog = window.open_settings()
    assert ok_button(dialog).isEnabled()
    dialog.block_size.setValue(256)                # 0.25 MiB a block on the fake model (16-bit cache on the CPU)
    dialog.budget.setValue(0.2)
    assert not ok_button(dialog).isEnabled() and "does not hold even one block" in dialog.error_label.text()
    dialog.budget.setValue(64.0)
    dialog.window.setValue(4000)                   # the fake model's context is 2,048
    assert not ok_button(dialog).isEnabled() and "context of 2,048" in dialog.error_label.text()
    dialog.window.setValue(1024)
    dialog.full_layers.setText("0, 7")
    assert not ok_button(dialog).isEnabled() and "7" in dialog.error_label.text()
    dialog.full_layers.setText("0")
    assert ok_button(dialog).isEnabled()
    dialog.reject()


def test_refused_settings_are_not_saved(qtbot):
    """A cache the engine refuses leaves the saved settings and the session's mode as they were."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=3))
    before = SettingsStore().load()
    fields = {n: getattr(window.settings, n) for n in ("model", "sampling", "system_prompt")}
    with qtbot.waitSignal(window.host.error, timeout=5000):
        window.apply_settings(type(window.settings)(cache=BAD, **fields))
    assert SettingsStore().load().cache == before.cache != BAD
    assert window.settings.cache == before.cache
    good = CacheConfig(k_format="int8", v_format="int8")
    with qtbot.waitSignal(window.host.mode_switched, timeout=5000):
        window.apply_settings(type(window.settings)(cache=good, **fields))
    assert SettingsStore().load().cache == good


def test_open_settings_fix_applies_to_the_new_chat_that_failed(qtbot, tmp_path):
    """Saved settings the engine refuses make New chat fail; fixing them from the banner opens the new chat,
    and the previous conversation keeps its own cache."""
    good = CacheConfig(k_format="int8", v_format="int8")
    history = HistoryStore()
    old_id = history.create("old chat", good)
    history.add_message(old_id, "user", "hi")
    history.add_message(old_id, "assistant", "hello")
    history.close()
    store = SettingsStore()
    saved = store.load()
    store.save(type(saved)(saved.model, BAD, SamplingParams(max_new_tokens=3), ""))
    store.set_last_conversation(old_id)
    loader = FakeLoader()
    window = open_window(qtbot, loader)
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    assert window.conversation_id == old_id and window.session_cache == good
    with qtbot.waitSignal(window.host.error, timeout=5000):
        window.new_chat()
    assert window.banner.isVisible() and window.banner.settings_button.isVisible()
    assert not window.send_button.isEnabled()
    window.banner.settings_button.click()
    dialog = window.settings_dialog
    assert dialog.budget.value() == pytest.approx(0.0, abs=0.05)
    dialog.budget.setValue(32.0)
    assert ok_button(dialog).isEnabled()
    with qtbot.waitSignal(window.host.session_opened, timeout=5000) as opened:
        ok_button(dialog).click()
    assert opened.args[0].conversation_id is None and opened.args[0].cache.budget_mb == 32.0
    assert window.conversation_id is None and window.send_button.isEnabled()
    assert window.history.get(old_id).cache == good
    assert SettingsStore().load().cache.budget_mb == 32.0
    assert all(s.cache_config == good for s in loader.engines[0].sessions[:1])


# ---- links ---------------------------------------------------------------------------------------

@pytest.fixture
def opened_urls(monkeypatch):
    urls = []
    monkeypatch.setattr(QDesktopServices, "openUrl", staticmethod(lambda url: urls.append(url.toString()) or True))
    return urls


def link_dialogs():
    return [w for w in QApplication.topLevelWidgets() if isinstance(w, QMessageBox) and w.isVisible()
            and w.objectName() == "confirmLinkDialog"]


def test_reply_links_are_not_followed_by_qt(qtbot):
    """A reply's markdown link is rendered without Qt opening it on click."""
    view = ChatView()
    qtbot.addWidget(view)
    message = view.add_message("assistant", "see [the docs](https://example.org) or [this](file:///etc/passwd)")
    label = message._widgets[0]
    assert "href" in label.text() or "](" in label.text()
    assert label.openExternalLinks() is False


@pytest.mark.parametrize("url", ["file:///etc/passwd", "FILE:///home/me/.ssh/id_rsa", "javascript:alert(1)",
                                 "data:text/html,hi", "smb://host/share", "ms-settings:", "/etc/passwd", "http://"])
def test_links_other_than_http_never_open(qtbot, opened_urls, url):
    """file://, data:, custom schemes and host-less links are refused without a dialog."""
    assert confirm_link(url, None) is None
    assert link_dialogs() == [] and opened_urls == []


def test_http_link_opens_only_after_confirmation(qtbot, opened_urls):
    """Clicking an https link in a reply asks first; Cancel opens nothing, Open opens it in the browser."""
    view = ChatView()
    qtbot.addWidget(view)
    view.show()
    message = view.add_message("assistant", "read [the docs](https://example.org/page)")
    label = message._widgets[0]
    label.linkActivated.emit("https://example.org/page")
    [box] = link_dialogs()
    assert "https://example.org/page" in box.text()
    box.button(QMessageBox.StandardButton.Cancel).click()
    assert opened_urls == []
    label.linkActivated.emit("https://example.org/page")
    qtbot.waitUntil(lambda: len(link_dialogs()) == 1)
    link_dialogs()[0].button(QMessageBox.StandardButton.Open).click()
    assert opened_urls == ["https://example.org/page"]
