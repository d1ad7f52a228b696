"""The C kernels this test session built, handed to the kvchat processes a test starts with a cache folder of its own.

conftest.py builds (or finds) the kernels once, in the session's KVCHAT_CACHE_DIR. A child process given another
KVCHAT_CACHE_DIR compiles them again whenever kernels/_built lags the sources (about 10 s of a 2-core machine each),
which is not what those tests are about. seeded() copies the session's libraries, each with the hash recorded when
it was built, into the child's cache folder: the child checks and loads them there as any later start of kvchat
does (cpu_lib._build: the folder's and file's owner and mode, the recorded sha256). Nothing else is copied (the
prefill choice measured on this machine is measured again)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

HASH_SUFFIX = ".sha256"         # kernels/cpu_lib.py's HASH_SUFFIX
# the session's cache folder, as conftest.py set it before importing this module (a test may point
# KVCHAT_CACHE_DIR elsewhere for a while: tests/test_tokenizer_start.py's module fixture does)
SESSION_CACHE = os.environ.get("KVCHAT_CACHE_DIR")


def seeded(cache: str | os.PathLike, libraries: tuple[str, ...] = ("cpu_quant", "cpu_kv_quant", "cpu_probe")) -> Path:
    """`cache` (created if need be) with the session's builds of `libraries` (kernels/<name>.c) in its kernels
    folder; returns it."""
    cache = Path(cache)
    target = cache / "kernels"
    target.mkdir(parents=True, exist_ok=True)
    target.chmod(0o700)                 # as cpu_lib makes its folders: one nobody else can write to
    source = Path(SESSION_CACHE) / "kernels" if SESSION_CACHE else None
    if source is None or source.resolve() == target.resolve() or not source.is_dir():
        return cache
    for lib in sorted(source.glob("*.so")):
        if lib.name.rsplit("-", 2)[0] not in libraries:
            continue
        digest = lib.with_name(lib.name + HASH_SUFFIX)
        if digest.is_file():            # a finished build (its hash is moved into place after the library)
            shutil.copy2(lib, target / lib.name)
            shutil.copy2(digest, target / digest.name)
    return cache
