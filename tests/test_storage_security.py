"""Storage and security: the settings file is private and its API key goes to a real keyring where there is one;
the About dialog shows a hostile model name as text; kernel libraries are checked before they load; a read-only
history opens for reading with a banner instead of being taken for damage."""
from __future__ import annotations

import os
import stat
import sys
import types

import pytest

from app.settings_store import AppSettings, RemoteSettings, SettingsStore

HOSTILE_NAME = '<a href="file:///etc/passwd">x</a><img src=x>'


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---- settings: 0600 file, keyring ----------------------------------------------------------------

def with_server(key: str) -> AppSettings:
    return AppSettings(remote=RemoteSettings("http://127.0.0.1:8000/v1", key, "m"))


def test_settings_file_with_an_api_key_is_private(tmp_path, monkeypatch):
    """A new settings file is 0600 in a new 0700 folder, an old 0644 one becomes 0600, and the key reads back."""
    monkeypatch.setitem(sys.modules, "keyring", None)      # no keyring here: the key goes to the file
    path = tmp_path / "conf" / "settings.ini"
    SettingsStore(path).save(with_server("sk-secret"))
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert "sk-secret" in path.read_text()
    old = tmp_path / "old.ini"
    old.write_text("[engine]\nkind=local\n")
    old.chmod(0o644)
    store = SettingsStore(old)
    store.save(with_server("sk-other"))
    assert mode(old) == 0o600
    assert SettingsStore(old).load().remote.api_key == "sk-other"


class _Ring:
    """A keyring backend as the keyring package exposes it (the package is not installed here)."""

    def __init__(self, priority: float):
        self.priority, self.saved = priority, {}

    def get_keyring(self):
        return self

    def set_password(self, service, user, key):
        self.saved[(service, user)] = key

    def get_password(self, service, user):
        return self.saved.get((service, user))


def test_api_key_goes_to_a_real_keyring_and_not_into_the_file(tmp_path, monkeypatch):
    """With a usable keyring the file holds no key and the key still loads; a fail backend keeps it in the file."""
    ring = _Ring(priority=5)
    monkeypatch.setitem(sys.modules, "keyring", types.SimpleNamespace(
        get_keyring=ring.get_keyring, set_password=ring.set_password, get_password=ring.get_password))
    path = tmp_path / "settings.ini"
    SettingsStore(path).save(with_server("sk-secret"))
    assert "sk-secret" not in path.read_text() and list(ring.saved.values()) == ["sk-secret"]
    assert SettingsStore(path).load().remote.api_key == "sk-secret"
    assert SettingsStore(path).last_server().api_key == "sk-secret"
    ring.priority = 0                                       # keyring's fail backend: the file it is
    SettingsStore(path).save(with_server("sk-new"))
    assert "sk-new" in path.read_text() and SettingsStore(path).load().remote.api_key == "sk-new"


# ---- About: dynamic strings are escaped ----------------------------------------------------------

def test_about_shows_a_hostile_model_name_as_text(qtbot):
    """A model named like a link and an image shows those characters; the only link is the README's, no image."""
    from PySide6.QtGui import QTextDocument

    from app.about import AboutDialog
    dialog = AboutDialog(HOSTILE_NAME, "Q4_1 <b>", "some/model")
    qtbot.addWidget(dialog)
    doc = QTextDocument()
    doc.setHtml(dialog.text.text())
    assert f"{HOSTILE_NAME} (Q4_1 <b>)" in doc.toPlainText()
    links, images = [], 0
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fmt = it.fragment().charFormat()
            links += [fmt.anchorHref()] if fmt.isAnchor() else []
            images += fmt.isImageFormat()
            it += 1
        block = block.next()
    assert images == 0 and len(links) == 1 and links[0].endswith("README.md") and "passwd" not in links[0]
