"""Building and loading the C kernel libraries (cpu_quant.c, cpu_kv_quant.c), without torch.

kernels.cpu_quant wraps these libraries for torch tensors; engine.quick drives them from numpy arrays,
so that a one-shot answer in the terminal needs no torch at all.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_quant.c")
KV_SOURCE = Path(__file__).with_name("cpu_kv_quant.c")     # quantized-KV decode attention: built in the background
HEADER = Path(__file__).with_name("cpu_common.h")
MAX_ROWS = 8          # rows of x per gemv call (MAXM in the C source)
# decode_layers' attention callback: (ctx, layer, qkv [B, n_qkv] float*, out [B, Hq * D] float*) -> 0, or nonzero
# to stop
ATTEND_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


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


def _build(retry: bool = True, source: Path = SOURCE, into: Path | None = None) -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (cc / gcc)")
    src = source.read_bytes() + HEADER.read_bytes()
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]   # dequant bit-exact with torch
    machine = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0] \
        if Path("/proc/cpuinfo").exists() else ""
    key = hashlib.sha256(src + " ".join(flags + [cc, machine]).encode()).hexdigest()[:16]
    name = f"{source.stem}-{key}.so"
    out = (into or BUILT) / name
    if into is None and not out.is_file():     # not built at install (or for another machine): build once, cached
        out = _cache_dir() / name
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}.so")
        res = subprocess.run([cc, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"compiling {source.name} failed: {res.stderr.strip()[:400]}")
        tmp.replace(out)
    try:
        lib = ctypes.CDLL(str(out))
    except OSError:             # a damaged cached build (an interrupted copy, a full disk): build it once again
        if not retry:
            raise
        out.unlink(missing_ok=True)
        return _build(retry=False, source=source, into=into)     # into=None: the cache dir, now BUILT lacks it
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
                ("norm_mlp", ctypes.c_void_p)]
