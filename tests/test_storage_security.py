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
    from kernels import cpu_lib
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
        from kernels import cpu_lib
        from engine.gguf_file import split_blocks
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
    from kernels.cpu_lib import check_library
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
