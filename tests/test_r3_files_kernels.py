"""Kernel builds (issue 37, item 17): nothing is compiled into a folder another user owns or others can write (a
shared KVCHAT_CACHE_DIR), where the library could be swapped before it loads; the app runs on torch's kernels and
says why. A build happens in a fresh private folder and moves into place whole."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534


def test_a_world_writable_cache_folder_of_another_user_gets_no_build_and_torch_runs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("another user's folder needs root to make")
    shared = tmp_path / "shared" / "kernels"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    os.chown(shared, NOBODY, NOBODY)
    empty_install = tmp_path / "built"
    empty_install.mkdir(mode=0o700)
    child = """
        import sys
        from pathlib import Path
        import torch
        from kvchat.kernels import cpu_lib, cpu_quant
        cpu_lib.BUILT = Path(sys.argv[1])          # no build shipped: the cache folder is the only place
        print(cpu_lib.library() is None, cpu_quant.available())
        print(cpu_quant.unavailable_reason())
    """
    env = {**os.environ, "KVCHAT_CACHE_DIR": str(shared.parent)}
    for name in ("KVCHAT_NO_CPU_KERNELS", "KVCHAT_CPU_VARIANT"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(child), str(empty_install)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    refused, why = run.stdout.splitlines()
    assert refused == "True False"
    assert f"the kernels' folder {shared} belongs to another user" in why and "KVCHAT_CACHE_DIR" in why
    assert list(shared.iterdir()) == []                       # nothing compiled there, nothing left to load later
    assert os.stat(shared).st_uid == NOBODY and stat.S_IMODE(os.stat(shared).st_mode) == 0o777   # not taken over


def test_a_build_happens_in_a_fresh_private_folder_and_moves_into_place(tmp_path, monkeypatch):
    """The compiler (a wrapper given as CC, as a user may) writes into a new 0700 folder of this user, not into the
    cache folder itself; afterwards the cache folder holds the library and its hash only."""
    from kvchat.kernels import cpu_lib
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "cc"
    real = cpu_lib._compiler()
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        prev=
        for a in "$@"; do
            if [ "$prev" = "-o" ]; then d=$(dirname "$a"); echo "$d $(stat -c '%a %u' "$d")" >> "{log}"; fi
            prev=$a
        done
        exec "{real}" "$@"
    """))
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    folder = tmp_path / "kernels"
    variant = list(cpu_lib.variants())[-1]
    lib = cpu_lib._build(cpu_lib.PROBE_SOURCE, into=folder, variant=variant)
    assert int(lib.kvchat_cpu_features()) >= 0
    where, mode, uid = log.read_text().splitlines()[0].split()
    assert Path(where).parent == folder and Path(where) != folder
    assert (mode, int(uid)) == ("700", os.getuid())
    name = cpu_lib.library_name(cpu_lib.PROBE_SOURCE, variant)
    assert sorted(p.name for p in folder.iterdir()) == [name, name + cpu_lib.HASH_SUFFIX]
    assert cpu_lib.check_library(folder / name) is None
