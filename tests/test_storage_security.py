"""Storage and security: the settings file is private and its API key goes to a real keyring where there is one;
the About dialog shows a hostile model name as text; kernel libraries are checked before they load; a read-only
history opens for reading with a banner instead of being taken for damage."""
from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from kvchat.app.store.settings_store import AppSettings, RemoteSettings, SettingsStore

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

    from kvchat.app.dialogs.about import AboutDialog
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


# ---- kernel libraries: checked before they load ----------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int unrelated(void) { return 1; }
"""


def shared_library(tmp_path, name: str, code: str, defines=()) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(code)
    out = tmp_path / f"{name}.so"
    subprocess.run(["cc", "-shared", "-fPIC", *defines, str(src), "-o", str(out)], check=True)
    return out


def test_a_planted_library_is_never_loaded_and_the_kernels_still_work(tmp_path):
    """A .so under the expected name in the install folder (no recorded hash: its constructor would write a marker)
    and a valid .so without the kernels' functions in the cache (its hash forged to match) are both refused with
    one line each; the kernels are built again and work."""
    from kvchat.kernels import cpu_lib
    name = cpu_lib.library_name(cpu_lib.SOURCE)
    marker = tmp_path / "constructor-ran"
    built, cache = tmp_path / "built", tmp_path / "cache" / "kernels"
    built.mkdir(mode=0o700)
    cache.mkdir(mode=0o755, parents=True)
    planted = shared_library(tmp_path, "planted", PLANTED, [f'-DMARKER="{marker}"']).replace(built / name)
    empty = shared_library(tmp_path, "empty", "int unrelated(void) { return 1; }\n").replace(cache / name)
    (cache / f"{name}.sha256").write_text(hashlib.sha256(empty.read_bytes()).hexdigest())
    child = """
        import sys
        import numpy as np
        from pathlib import Path
        from kvchat.kernels import cpu_lib
        from kvchat.engine.gguf.blocks import split_blocks
        cpu_lib.BUILT = Path(sys.argv[1])
        data = np.random.default_rng(0).integers(0, 256, (3, 4 * 18), dtype=np.uint8)
        heads, body = split_blocks(data, 18, 2)
        blocks = data.reshape(3, 4, 18)
        print(cpu_lib.library() is not None, np.array_equal(heads, blocks[..., :2]),
              np.array_equal(body, blocks[..., 2:].reshape(3, -1)))
    """
    env = {**os.environ, "KVCHAT_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KVCHAT_NO_CPU_KERNELS", None)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(child), str(built)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True", "True"]
    assert not marker.exists() and not planted.exists()
    warnings = run.stderr.strip().splitlines()
    assert len(warnings) == 2 and all(line.startswith("not using the kernel library") for line in warnings)
    assert "no hash was recorded" in warnings[0] and "lacks the kernels' functions" in warnings[1]
    rebuilt = cache / name
    assert cpu_lib.check_library(rebuilt) is None and mode(cache) == 0o700


def test_library_check_refuses_what_others_could_have_written(tmp_path):
    """The check passes only a file with its recorded hash, of this user, writable by nobody else, in such a folder."""
    from kvchat.kernels.cpu_lib import check_library
    folder = tmp_path / "libs"
    folder.mkdir(mode=0o700)
    lib = folder / "k.so"
    lib.write_bytes(b"\x7fELF pretend")
    lib.chmod(0o700)
    digest = folder / "k.so.sha256"
    digest.write_text(hashlib.sha256(lib.read_bytes()).hexdigest() + "\n")
    assert check_library(lib) is None
    lib.chmod(0o720)
    assert "written by other users" in check_library(lib)
    lib.chmod(0o700)
    folder.chmod(0o777)
    assert "its folder" in check_library(lib)
    folder.chmod(0o700)
    lib.write_bytes(b"\x7fELF changed")
    assert "differ from the hash" in check_library(lib)
    digest.unlink()
    assert "no hash was recorded" in check_library(lib)
    link = folder / "link.so"
    link.symlink_to(lib)
    assert "link" in check_library(link)
    if os.geteuid() == 0:
        digest.write_text(hashlib.sha256(lib.read_bytes()).hexdigest())
        os.chown(lib, 65534, 65534)
        assert "another user" in check_library(lib)


# ---- history on a read-only folder or file system ------------------------------------------------

def saved_history(folder: Path) -> bytes:
    """A history with one chat, closed cleanly (no -wal or -shm left), in WAL mode; its bytes."""
    from kvchat.app.store.history import HistoryStore
    from kvchat.engine.config import CacheConfig
    store = HistoryStore(folder / "history.sqlite3")
    store.add_message(store.create("kept chat", CacheConfig()), "user", "kept message")
    store.close()
    assert sorted(p.name for p in folder.iterdir()) == ["history.sqlite3"]
    return (folder / "history.sqlite3").read_bytes()


@pytest.fixture
def read_only_mount(tmp_path):
    """(src, ro, mount): mount() makes ro a read-only bind mount of src. Needs root; skipped where not permitted."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()

    def mount():
        if os.geteuid() != 0:
            pytest.skip("a read-only mount needs root")
        steps = (["mount", "--bind", str(src), str(ro)], ["mount", "-o", "remount,ro,bind", str(ro)])
        for step in steps:
            if subprocess.run(step, capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(ro)], capture_output=True)
                pytest.skip("mounting is not permitted here")

    yield src, ro, mount
    subprocess.run(["umount", "-l", str(ro)], capture_output=True)


def test_window_starts_on_a_read_only_file_system_and_shows_why(qtbot, tmp_path, monkeypatch, read_only_mount):
    """On a read-only mount the history is not taken for damage: nothing is moved, the chats are listed, a banner
    says why nothing is saved, and Send is refused with the text kept."""
    from PySide6.QtCore import Qt

    from fakes import FakeLoader, isolate_app, open_window
    src, ro, mount = read_only_mount
    data = saved_history(src)
    mount()
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(ro))
    window = open_window(qtbot, FakeLoader())
    assert window.history.recovered is None and window.history.read_only
    assert "Chat history is read-only" in window.banner.text()
    assert "file system is mounted read-only" in window.banner.text()
    assert "new messages are not saved" in window.banner.text()
    assert [c.title for c in window.history.conversations()] == ["kept chat"]
    qtbot.waitUntil(lambda: window.session_ready, timeout=10_000)
    window.input.setPlainText("please keep me")
    qtbot.keyClick(window.input, Qt.Key.Key_Return)
    assert "Cannot save this chat" in window.banner.text() and "mounted read-only" in window.banner.text()
    assert not window.generating and window.input.toPlainText() == "please keep me"
    [kept] = window.history.conversations()
    window.show_conversation(kept.id)
    qtbot.waitUntil(lambda: window.session_ready, timeout=10_000)
    window.banner.hide_message()
    with qtbot.waitSignal(window.host.mode_switched, timeout=5000):    # the chat's new mode cannot be saved
        window.host.set_cache(window.session_cache.with_(k_format="int8", v_format="int8"))
    assert "Cannot save this chat" in window.banner.text()
    warnings = rename_from_the_menu(window, monkeypatch, "a new title")
    assert len(warnings) == 1 and "read-only" in warnings[0]
    assert [c.title for c in window.history.conversations()] == ["kept chat"]
    assert sorted(p.name for p in src.iterdir()) == ["history.sqlite3"]
    assert (src / "history.sqlite3").read_bytes() == data


def rename_from_the_menu(window, monkeypatch, title: str) -> list[str]:
    """Rename the first chat through its context menu (the menu and the title dialog answered); warnings shown."""
    from PySide6.QtWidgets import QInputDialog, QMenu, QMessageBox

    from kvchat.app.chat import conversation_list

    class FirstChoice(QMenu):
        def exec(self, *args):
            return self.actions()[0]

    monkeypatch.setattr(conversation_list, "QMenu", FirstChoice)
    monkeypatch.setattr(QInputDialog, "getText", lambda *args, **kwargs: (title, True))
    shown = []
    monkeypatch.setattr(QMessageBox, "warning", lambda parent, heading, text: shown.append(text))
    listing = window.conversations
    listing._menu(listing.visualItemRect(listing.item(0)).center())
    return shown


def test_damaged_or_missing_history_on_a_read_only_file_system_still_starts(tmp_path, read_only_mount):
    """A damaged file that cannot be moved aside stays as it is, and a history that cannot be created is said so:
    both start on an empty history that refuses writes with the reason."""
    from kvchat.app.store.history import HistoryError, HistoryStore
    src, ro, mount = read_only_mount
    garbage = os.urandom(8192)
    (src / "history.sqlite3").write_bytes(garbage)
    mount()
    damaged = HistoryStore(ro / "history.sqlite3")
    assert "damaged" in damaged.read_only_reason and "could not be moved aside" in damaged.read_only_reason
    assert damaged.conversations() == [] and (src / "history.sqlite3").read_bytes() == garbage
    with pytest.raises(HistoryError, match="read-only: it is damaged"):
        damaged.check_writable()
    missing = HistoryStore(ro / "new" / "history.sqlite3")
    assert "could not be created" in missing.read_only_reason and missing.conversations() == []
    with pytest.raises(HistoryError, match="new messages are not saved"):
        missing.create("x", damaged_cache())


def damaged_cache():
    from kvchat.engine.config import CacheConfig
    return CacheConfig()


def test_read_only_folder_opens_read_only_for_a_user_who_cannot_write_it(tmp_path):
    """A folder the user cannot write (SQLite cannot create the -shm there): the history opens read-only, nothing is
    moved aside, and a write says which folder to make writable. Run as 'nobody' where the tests run as root."""
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvchat-ro-folder-{os.getpid()}"
    folder.mkdir(mode=0o755)
    try:
        data = saved_history(folder)
        if os.geteuid() == 0:       # the file is the user's own: only the folder stops writing
            os.chown(folder / "history.sqlite3", 65534, 65534)
        folder.chmod(0o555)
        code = """
            import os, sys
            from kvchat.app.store.history import HistoryError, HistoryStore
            if os.geteuid() == 0:
                os.setgid(65534); os.setuid(65534)
            store = HistoryStore(sys.argv[2])
            print(store.recovered, [c.title for c in store.conversations()], store.messages(1))
            try:
                store.add_message(1, "user", "x")
                print("WROTE")
            except HistoryError as exc:
                print("ERROR", exc)
        """
        run = subprocess.run([sys.executable, "-c", textwrap.dedent(code), "", str(folder / "history.sqlite3")],
                             capture_output=True, text=True, timeout=120, cwd="/")
        assert run.returncode == 0, run.stderr
        first, second = run.stdout.splitlines()
        assert first == "None ['kept chat'] [{'role': 'user', 'content': 'kept message'}]"
        assert second.startswith("ERROR") and "read-only" in second and f"cannot write its folder {folder}" in second
        assert sorted(p.name for p in folder.iterdir()) == ["history.sqlite3"]
        assert (folder / "history.sqlite3").read_bytes() == data
    finally:
        folder.chmod(0o755)
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
