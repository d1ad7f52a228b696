"""Building and loading the C kernel libraries (cpu_quant.c, cpu_kv_quant.c), without torch.

kernels.cpu_quant wraps these libraries for torch tensors; engine.runtime.quick drives them from numpy arrays,
so that a one-shot answer in the terminal needs no torch at all.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_quant.c")
KV_SOURCE = Path(__file__).with_name("cpu_kv_quant.c")     # quantized-KV decode attention: built in the background
HEADER = Path(__file__).with_name("cpu_common.h")
MAX_ROWS = 8          # rows of x per gemv call (MAXM in the C source)
# decode_layers' attention callback: (ctx, layer, qkv [B, n_qkv] float*, out [B, Hq * D] float*) -> 0, or nonzero
# to stop
ATTEND_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    override = os.environ.get("KVCHAT_CACHE_DIR")
    if override:
        return Path(override) / "kernels"
    import platformdirs
    return Path(platformdirs.user_cache_dir("kvchat")) / "kernels"


_main = None
_main_error: str | None = None


def library() -> ctypes.CDLL | None:
    """The main library (cpu_quant.c), built or loaded once; None where it cannot be, or KVCHAT_NO_CPU_KERNELS
    is set (library_error() says why)."""
    global _main, _main_error
    if _main is None and _main_error is None:
        if os.environ.get("KVCHAT_NO_CPU_KERNELS"):
            _main_error = "disabled by KVCHAT_NO_CPU_KERNELS"
        else:
            try:
                _main = _build()
            except (OSError, RuntimeError) as exc:
                _main_error = str(exc)
    return _main


def library_error() -> str | None:
    return _main_error


BUILT = Path(__file__).with_name("_built")    # libraries compiled at install (`python -m kernels.cpu_quant`)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]   # dequant bit-exact with torch
HASH_SUFFIX = ".sha256"         # beside each library: the sha256 of the file as it was built


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (cc / gcc)")
    return cc


def library_name(source: Path = SOURCE) -> str:
    """The file name a build of `source` has on this machine: keyed by the source, compiler, flags and CPU flags."""
    src = source.read_bytes() + HEADER.read_bytes()
    machine = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0] \
        if Path("/proc/cpuinfo").exists() else ""
    key = hashlib.sha256(src + " ".join(FLAGS + [_compiler(), machine]).encode()).hexdigest()[:16]
    return f"{source.stem}-{key}.so"


def _build(source: Path = SOURCE, into: Path | None = None) -> ctypes.CDLL:
    """The library for `source`: a checked build from the install folder or the cache, else compiled now (into
    `into`, or the cache). A file that fails its check is never loaded: it is removed and built again."""
    name, target = library_name(source), into or _cache_dir()
    with contextlib.suppress(OSError):      # a read-only home can still load the build from install
        _private_folder(target)
    for folder in [target] if into is not None else [BUILT, target]:
        lib = _load_checked(folder / name, source)
        if lib is not None:
            return lib
    return _compile(source, _private_folder(target) / name)


def _load_checked(path: Path, source: Path) -> ctypes.CDLL | None:
    """The library at `path` if it passes check_library and has the kernels' functions; None if absent or not."""
    try:
        os.lstat(path)
    except OSError:         # absent, or in a folder this user cannot look into
        return None
    problem = check_library(path)
    if problem is None:
        try:
            return _bind(ctypes.CDLL(str(path)), source)
        except OSError as exc:          # an interrupted copy, a full disk
            problem = f"it does not load ({exc})"
        except AttributeError as exc:   # another library under this name
            problem = f"it lacks the kernels' functions ({exc})"
    log.warning("not using the kernel library %s: %s; building it again", path, problem)
    if check_folder(path.parent) is None:       # a folder of ours: the bad file goes (never one of somebody else's)
        for old in (path, _hash_file(path)):
            with contextlib.suppress(OSError):
                old.unlink()
    return None


def check_library(path: Path) -> str | None:
    """Why the library at `path` must not be loaded, or None: a regular file of ours (or root's) that nobody else
    can write, in such a folder, whose bytes hash to what was recorded when kvchat built it. Loading runs the
    file's constructors, so a file someone else could have put there is refused before dlopen."""
    problem = check_folder(path.parent) or _ownership(path, "it", stat.S_ISREG)
    if problem:
        return problem
    try:
        recorded = _hash_file(path).read_text().strip()
    except OSError:
        return "no hash was recorded for it (kvchat did not build it)"
    return None if _sha256(path) == recorded else "its bytes differ from the hash recorded when it was built"


def check_folder(folder: Path) -> str | None:
    return _ownership(folder, f"its folder {folder}", stat.S_ISDIR)


def _ownership(path: Path, what: str, kind) -> str | None:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{what} cannot be read ({exc.strerror})"
    if not kind(st.st_mode):
        return f"{what} is a link or another kind of file"
    if st.st_uid not in (os.getuid(), 0):
        return f"{what} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"{what} can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _compile(source: Path, out: Path) -> ctypes.CDLL:
    """Build into a temporary name in the private folder, record its hash, load it, then rename it into place."""
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}-", suffix=".so")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        res = subprocess.run([_compiler(), *FLAGS, str(source), "-o", str(tmp)], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"compiling {source.name} failed: {res.stderr.strip()[:400]}")
        os.chmod(tmp, 0o700)
        digest = tmp.with_name(tmp.name + HASH_SUFFIX)
        digest.write_text(_sha256(tmp) + "\n")
        # loaded under its unique temporary name: dlopen hands back an already loaded library by path, which
        # would be the refused one when this replaces a file that loaded but lacked the kernels' functions
        try:
            lib = _bind(ctypes.CDLL(str(tmp)), source)
        except AttributeError as exc:
            raise RuntimeError(f"the library built from {source.name} lacks a kernel: {exc}") from exc
        tmp.replace(out)
        digest.replace(_hash_file(out))
        return lib
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + HASH_SUFFIX)):
            with contextlib.suppress(OSError):
                leftover.unlink()


def _private_folder(folder: Path) -> Path:
    """The folder, created 0700; one of ours that others could read or write is made 0700."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder


def _hash_file(path: Path) -> Path:
    return path.with_name(path.name + HASH_SUFFIX)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _bind(lib: ctypes.CDLL, source: Path) -> ctypes.CDLL:
    """Argument and result types of each kernel; AttributeError when the library lacks one."""
    P, I = ctypes.c_void_p, ctypes.c_int
    F = ctypes.c_float
    if source == KV_SOURCE:
        lib.attn_decode_quant.argtypes = [P, P, P, I, I, I, I, P, I, P, I, P, P, P, P, P, F, I, P, P]
        lib.attn_decode_quant.restype = None
        lib.attend_quant_layer.argtypes = [P, I, P, P]
        lib.attend_quant_layer.restype = I
        return lib
    lib.q4_gemv.argtypes = [P, I, I, P, P, P, I, P, P, I, P, F, P, I, P, P, I]
    lib.q8_gemv.argtypes = [P, I, I, P, P, P, I, I, P, P, I, P, F, P, I, P, P, I]
    lib.q4_dequant.argtypes = [P, P, P, I, I, P, I, P, P, I]
    lib.q8_dequant.argtypes = [P, P, P, I, I, I, P, I, P, P, I]
    lib.attn_decode_rot.argtypes = [P, P, I, I, I, I, P, P, I, P, I, F, P, P]
    lib.attn_decode_batch.argtypes = [I, P, P, P, I, I, I, P, P, I, P, P, F, P, P]
    lib.decode_attend.argtypes = [I, P, P, P, I, I, I, I, I, I, P, P, P, P, P, P, P, I, P, P, P, F, P, P]
    for f in (lib.q4_gemv, lib.q8_gemv, lib.q4_dequant, lib.q8_dequant, lib.attn_decode_rot, lib.attn_decode_batch,
              lib.decode_attend):
        f.restype = None
    lib.decode_layers.argtypes = [I, P, I, P, I, F, I, I, I, P, P, P, P, P, P, P, P, P, P, P, F, P, P]
    lib.qk_norm_rows.argtypes = [P, I, I, I, I, I, P, P, F]
    lib.qk_norm_rows.restype = None
    lib.split_blocks.argtypes = [P, ctypes.c_int64, I, I, P, P]
    lib.split_blocks.restype = None
    lib.decode_layers.restype = I
    return lib


class QLin(ctypes.Structure):
    """One packed linear (or one part of a concatenation) as decode_layers reads it."""
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("ssup", ctypes.c_void_p), ("zsup", ctypes.c_void_p), ("bits", ctypes.c_int), ("kind", ctypes.c_int),
                ("per", ctypes.c_int), ("group", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int)]


class QLayer(ctypes.Structure):
    _fields_ = [("lin", (QLin * 3) * 4), ("nparts", ctypes.c_int * 4), ("norm_attn", ctypes.c_void_p),
                ("norm_mlp", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p)]
