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
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_quant.c")
KV_SOURCE = Path(__file__).with_name("cpu_kv_quant.c")     # quantized-KV decode attention: built in the background
PROBE_SOURCE = Path(__file__).with_name("cpu_probe.c")      # which variant the CPU runs (CPUID), built for the baseline
HEADER = Path(__file__).with_name("cpu_common.h")
HEADERS = (HEADER, Path(__file__).with_name("cpu_avx512.h"), Path(__file__).with_name("cpu_act8.h"),
           Path(__file__).with_name("cpu_moe.h"),
           Path(__file__).with_name("cpu_q6k.h"), Path(__file__).with_name("cpu_q6k_act8.h"),
           Path(__file__).with_name("cpu_mxfp4.h"),
           Path(__file__).with_name("cpu_gdn.h"),
           Path(__file__).with_name("cpu_prompt_attn.h"),
           Path(__file__).with_name("cpu_gemm8.h"))       # what the libraries include: part of the key
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
_variant: str | None = None         # the variant library() loaded (or would load)
_variant_why = ""
_skipped: list[str] = []            # variants above it that did not build or load, with why

# Prebuilt variants, best first, with the CPU features each needs (bits of cpu_probe.c's kvchat_cpu_features).
# A variant is compiled for exactly its instructions (never -march=native), so a cached or shipped build runs on
# any CPU that offers them. The AVX-512 variant asks for VNNI and BF16 too: the compiler may emit them on its own.
FEATURE_BITS = {"avx2": 0, "fma": 1, "f16c": 2, "avx512f": 3, "avx512bw": 4, "avx512vl": 5, "avx512vnni": 6,
                "avx512bf16": 7, "avx": 8, "amx_bf16": 9}
_AVX2 = ["-march=x86-64", "-mavx", "-mavx2", "-mfma", "-mf16c"]
X86_VARIANTS = {
    "avx512": (_AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16"],
               ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512bf16")),
    "avx2": (_AVX2, ("avx", "avx2", "fma", "f16c")),
    "baseline": (["-march=x86-64", "-mtune=generic"], ()),
}
OTHER_VARIANTS = {"generic": ([], ())}      # aarch64 and the rest: the compiler's default for the architecture
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]   # no contraction: dequant bit-exact with torch
OPENMP = "-fopenmp"                 # tried first; without it (Apple clang, no libomp) the kernels run on one thread


def variants() -> dict[str, tuple[list[str], tuple[str, ...]]]:
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return X86_VARIANTS if x86 else OTHER_VARIANTS


_features: int | None = None


def cpu_features() -> set[str]:
    """The CPU's features that pick a variant, from CPUID (cpu_probe.c); empty where the probe cannot be built."""
    global _features
    if _features is None:
        _features = 0
        try:
            probe = _build(PROBE_SOURCE, variant=list(variants())[-1])
            _features = int(probe.kvchat_cpu_features())
        except (OSError, RuntimeError) as exc:
            log.warning("cannot ask the CPU which kernels it runs (%s): using the baseline build", exc)
    return {name for name, bit in FEATURE_BITS.items() if _features >> bit & 1}


def choose_variant() -> tuple[str, str]:
    """(variant, why): KVCHAT_CPU_VARIANT when set, else the best one whose features the CPU has."""
    table = variants()
    forced = os.environ.get("KVCHAT_CPU_VARIANT")
    if forced:
        if forced not in table:
            raise RuntimeError(f"KVCHAT_CPU_VARIANT={forced!r}: this machine's variants are {', '.join(table)}")
        missing = [f for f in table[forced][1] if f not in cpu_features()]
        if missing:         # loading it would end the process on its first instruction the CPU lacks
            raise RuntimeError(f"KVCHAT_CPU_VARIANT={forced!r}: this CPU lacks {', '.join(missing)}; it runs "
                               f"{', '.join(runnable_variants())}")
        return forced, "chosen by KVCHAT_CPU_VARIANT"
    best = runnable_variants()[0]           # the last variant needs nothing: there is always one
    return best, "the CPU lacks AVX2, FMA or F16C" if best == "baseline" else "the best this CPU runs"


def auto_prefill() -> tuple[str, str]:
    """(precision, why) that EngineConfig(prefill="auto") gives prompt rows on this CPU: on AVX2, AVX-512 or AMX,
    what this machine measured (prefill_record: the engine times the paths once, on its first load, and keeps the
    answer, so every later start makes the same choice), bf16 before that where the CPU has AMX (oneDNN's bf16 GEMM
    there ran 5-6x the fp32 one), else fp32. Torch-free: quick.covers asks it too."""
    have = cpu_features()
    if prefill_measured_here():
        got = prefill_record()
        if got is not None:
            return got
        if "amx_bf16" in have:
            return "bf16", "the CPU's AMX multiplies bf16 (not measured yet: the engine measures it on its first load)"
        return "fp32", "no AMX: not measured yet (the engine measures it on its first load)"
    return "fp32", "no AMX, AVX-512 or AVX2 on this CPU"


def prefill_measured_here() -> bool:
    """Whether prefill="auto" is decided by measurement on this CPU: bf16 multiplies (AVX-512 BF16's vdpbf16ps or
    AMX) or the int8 prompt rows (cpu_gemm8.h: AVX-512 VNNI or AVX2) to weigh against the exact fp32 GEMM."""
    return bool(cpu_features() & {"avx512bf16", "avx512vnni", "avx2", "amx_bf16"})


PREFILL_RECORD = 5          # what a record was measured among: 1 fp32 and bf16, 2 with int8, 3 keyed by the kernels'
                            # build too, 4 with the avx2 build's int8 rows, 5 AMX CPUs too (older ones: measured
                            # again)


def _prefill_path() -> Path:
    return _cache_dir() / "prefill-choice.json"


def cpu_name() -> str:
    """The CPU's model as the kernel names it (/proc/cpuinfo), else what platform knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.split(":")[0].strip() in ("model name", "Hardware", "Model"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _machine_key() -> str:
    """What a prefill measurement holds for: the record's version, this CPU's model and features, and the kernels'
    build (the avx512 build's int8 rows run twice the avx2 build's on Zen 4: a forced variant, or a compiler that
    could not build AVX-512, is measured again)."""
    return f"{PREFILL_RECORD}|{cpu_name()}|{','.join(sorted(cpu_features()))}|{current_variant()}"


def prefill_record() -> tuple[str, str] | None:
    """(precision, why) this machine measured for prompts (save_prefill_record), or None: none, another machine's,
    or a damaged file."""
    import json
    try:
        got = json.loads(_prefill_path().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(got, dict) or got.get("key") != _machine_key() or got.get("choice") not in ("fp32", "bf16", "int8") \
            or not isinstance(got.get("why"), str):
        return None
    return got["choice"], got["why"]


def save_prefill_record(choice: str, why: str) -> None:
    """Keep a prefill measurement for this machine (atomically; a folder that cannot be written keeps nothing)."""
    import json
    path = _prefill_path()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": _machine_key(), "choice": choice, "why": why}, f)
        os.replace(tmp, path)


def runnable_variants() -> list[str]:
    """The variants this CPU can execute, best first (the tests run the kernels' checks against each)."""
    have = cpu_features()
    return [name for name, (_, needs) in variants().items() if set(needs) <= have]


def library() -> ctypes.CDLL | None:
    """The main library (cpu_quant.c) of the chosen variant, built or loaded once; a variant that does not build
    (an old compiler without AVX-512) gives way to the next. None where none can be, or KVCHAT_NO_CPU_KERNELS is
    set (library_error() says why)."""
    global _main, _main_error, _variant, _variant_why
    if _main is None and _main_error is None:
        if os.environ.get("KVCHAT_NO_CPU_KERNELS"):
            _main_error = "disabled by KVCHAT_NO_CPU_KERNELS"
            return None
        try:
            _variant, _variant_why = choose_variant()
        except RuntimeError as exc:
            _main_error = str(exc)
            return None
        names = list(variants())
        # a forced variant is that one only; else each one below the choice, until one builds
        for name in [_variant] if os.environ.get("KVCHAT_CPU_VARIANT") else names[names.index(_variant):]:
            try:
                _main, _variant, _main_error = _build(variant=name), name, None
                return _main
            except (OSError, RuntimeError) as exc:
                _skipped.append(f"{name}: {exc}")
                _main_error = str(exc)          # kept only when no variant loads (the return above clears it)
    return _main


def library_error() -> str | None:
    return _main_error


def status() -> dict:
    """What `kvchat doctor` and the status line say about the kernels."""
    lib = library()
    info = lib.kvchat_build_info().decode() if lib is not None else None
    return {"loaded": lib is not None, "variant": _variant if lib is not None else None, "why": _variant_why,
            "error": _main_error if lib is None else None, "skipped": list(_skipped), "build": info,
            "openmp": info is not None and "openmp=1" in info, "cpu_features": sorted(cpu_features()),
            "machine": platform.machine(), "variants": list(variants())}


BUILT = Path(__file__).with_name("_built")    # libraries compiled at install (`python -m kernels.cpu_quant`)
HASH_SUFFIX = ".sha256"         # beside each library: the sha256 of the file as it was built


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (cc / gcc)")
    return cc


def variant_flags(variant: str) -> list[str]:
    return COMMON_FLAGS + variants()[variant][0]


def library_name(source: Path = SOURCE, variant: str | None = None) -> str:
    """The file name of a build of `source` for `variant` (default: the chosen one): keyed by the source and the
    variant's flags, so it runs on any CPU with the variant's features, whichever compiler built it."""
    variant = variant or current_variant()
    src = source.read_bytes() + (b"".join(h.read_bytes() for h in HEADERS) if source != PROBE_SOURCE else b"")
    key = hashlib.sha256(src + " ".join(variant_flags(variant)).encode()).hexdigest()[:16]
    return f"{source.stem}-{variant}-{key}.so"


def current_variant() -> str:
    """The variant library() uses: the one it loaded, else the one it would choose."""
    if _variant is not None:
        return _variant
    try:
        return choose_variant()[0]
    except RuntimeError:
        return list(variants())[-1]


def _build(source: Path = SOURCE, into: Path | None = None, variant: str | None = None) -> ctypes.CDLL:
    """The library for `source` and `variant`: a checked build from the install folder or the cache, else compiled
    now (into `into`, or the cache). A file that fails its check is never loaded: it is removed and built again."""
    variant = variant or current_variant()
    name, target = library_name(source, variant), into or _cache_dir()
    with contextlib.suppress(OSError):      # a read-only home can still load the build from install
        _private_folder(target)
    for folder in [target] if into is not None else [BUILT, target]:
        lib = _load_checked(folder / name, source)
        if lib is not None:
            return lib
    target = _private_folder(target)
    problem = _ownership(target, f"the kernels' folder {target}", stat.S_ISDIR)
    if problem:         # what is built there could be swapped before it loads, or after, for the next start
        raise RuntimeError(f"{problem}: the kernels are not built there (set KVCHAT_CACHE_DIR to a folder of your "
                           f"own)")
    return _compile(source, target / name, variant_flags(variant))


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


def _compile(source: Path, out: Path, flags: list[str]) -> ctypes.CDLL:
    """Build in a fresh private folder beside `out` (0700, nobody else can put a file there between the compiler and
    dlopen), record its hash, load it, then rename it into place (os.replace: atomic, same file system). With OpenMP
    where the compiler has it, else without (one thread: said in the library's build info)."""
    work = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.stem}-"))
    tmp = work / out.name
    try:
        cc = _compiler()
        res = subprocess.run([cc, *flags, OPENMP, str(source), "-o", str(tmp)], capture_output=True, text=True)
        if res.returncode:
            log.info("compiling %s with OpenMP failed; trying without: %s", source.name, res.stderr.strip()[-300:])
            res = subprocess.run([cc, *flags, "-Wno-unknown-pragmas", str(source), "-o", str(tmp)],
                                 capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"compiling {source.name} failed: {res.stderr.strip()[:400]}")
        os.chmod(tmp, 0o700)
        digest = _hash_file(tmp)
        digest.write_text(_sha256(tmp) + "\n")
        # loaded under its unique temporary path: dlopen hands back an already loaded library by path, which
        # would be the refused one when this replaces a file that loaded but lacked the kernels' functions
        try:
            lib = _bind(ctypes.CDLL(str(tmp)), source)
        except AttributeError as exc:
            raise RuntimeError(f"the library built from {source.name} lacks a kernel: {exc}") from exc
        os.replace(tmp, out)
        os.replace(digest, _hash_file(out))
        return lib
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
    if source == PROBE_SOURCE:
        lib.kvchat_cpu_features.argtypes = []
        lib.kvchat_cpu_features.restype = ctypes.c_uint64
        return lib
    lib.kvchat_f16_to_f32.argtypes = [P, P, ctypes.c_int64]
    lib.kvchat_f32_to_f16.argtypes = [P, P, ctypes.c_int64]
    lib.kvchat_f16_to_f32.restype = lib.kvchat_f32_to_f16.restype = None
    lib.kvchat_build_info.argtypes = []
    lib.kvchat_build_info.restype = ctypes.c_char_p
    if source == KV_SOURCE:
        lib.attn_decode_quant.argtypes = [P, P, P, I, I, I, I, P, I, P, I, P, P, P, P, P, F, P, I, P, P, P, I, P]
        lib.attn_decode_quant.restype = None
        lib.attend_quant_layer.argtypes = [P, I, P, P]
        lib.attend_quant_layer.restype = I
        lib.attn_prompt_quant.argtypes = [P, P]
        lib.attn_prompt_quant.restype = I
        return lib
    lib.q4_gemv.argtypes = [P, I, I, P, P, P, I, P, P, I, P, F, P, I, P, P, I, P]     # the last: q5's fifth bits
    lib.q8_gemv.argtypes = [P, I, I, P, P, P, I, I, P, P, I, P, F, P, I, P, P, I]
    # prompt rows with int8 activations (cpu_gemm8.h): x, T, K, codes, bits, high, scale, zero, N, y, kind, ssup,
    # zsup, per -> 0, 1 (not in this build) or 2 (out of memory)
    lib.gemm8_rows.argtypes = [P, I, I, P, I, P, P, P, I, P, I, P, P, I]
    lib.gemm8_rows.restype = I
    lib.gemm8_q6k_rows.argtypes = [P, I, I, P, P, P, P, I, P]     # x, T, K, ql, qh, sc, d, N, y
    lib.gemm8_q6k_rows.restype = I
    lib.q4_dequant.argtypes = [P, P, P, I, I, P, I, P, P, I, P]
    lib.q8_dequant.argtypes = [P, P, P, I, I, I, P, I, P, P, I]
    lib.q4_dequant_bf16.argtypes = lib.q4_dequant.argtypes
    lib.q8_dequant_bf16.argtypes = lib.q8_dequant.argtypes
    # Q6_K (cpu_q6k.h): x, M, K, ql, qh, sc, d, N, y, scratch, mode, norm, eps, resid; ql, qh, sc, d, N, K, out
    lib.q6k_gemv.argtypes = [P, I, I, P, P, P, P, I, P, P, I, P, F, P]
    lib.q6k_dequant.argtypes = lib.q6k_dequant_bf16.argtypes = [P, P, P, P, I, I, P]
    # MXFP4 (cpu_mxfp4.h): x, M, K, codes, e8m0, N, y, scratch, mode, norm, eps, resid; codes, e8m0, N, K, out
    lib.mxfp4_gemv.argtypes = [P, I, I, P, P, I, P, P, I, P, F, P]
    lib.mxfp4_dequant.argtypes = lib.mxfp4_dequant_bf16.argtypes = [P, P, I, I, P]
    lib.attn_decode_rot.argtypes = [P, P, I, I, I, I, P, P, I, P, I, F, P, P]
    lib.attn_decode_batch.argtypes = [I, P, P, P, I, I, I, P, P, I, P, P, F, F, P, P, P, P, I, P]
    lib.decode_attend.argtypes = [I, P, P, P, I, I, I, I, I, I, P, P, P, P, P, P, P, I, P, P, P, F, F, P, P, P, P, I, P]
    for f in (lib.q4_gemv, lib.q8_gemv, lib.q4_dequant, lib.q8_dequant, lib.q4_dequant_bf16, lib.q8_dequant_bf16,
              lib.q6k_gemv, lib.q6k_dequant, lib.q6k_dequant_bf16,
              lib.mxfp4_gemv, lib.mxfp4_dequant, lib.mxfp4_dequant_bf16,
              lib.attn_decode_rot, lib.attn_decode_batch, lib.decode_attend):
        f.restype = None
    lib.decode_layers.argtypes = [I, P, I, P, I, F, I, I, I, P, P, P, P, P, P, P, P, P, P, P, F, P, P, P, I, P]
    lib.decode_layers_grouped.argtypes = [I, P, I, P, I, F, I, I, I, I, P, P, P, F, P, I, P, P]
    lib.decode_layers_grouped.restype = I
    lib.qk_norm_rows.argtypes = [P, I, I, I, I, I, P, P, F]
    lib.norm_add_rows.argtypes = [P, P, I, I, P, F]
    lib.norm_add_rows.restype = None
    lib.gelu_gate_rows.argtypes = [P, I, I, P]
    lib.gelu_gate_rows.restype = None
    lib.beside_rows.argtypes = [P, P, P, I, I, P, P, P, F, P]
    lib.beside_rows.restype = None
    lib.softcap_rows.argtypes = [P, ctypes.c_int64, F]
    lib.softcap_rows.restype = None
    lib.sigmoid_mul_rows.argtypes = [P, P, ctypes.c_int64]
    lib.sigmoid_mul_rows.restype = None
    lib.all_finite.argtypes = [P, ctypes.c_int64, I]
    lib.all_finite.restype = I
    lib.argmax_f32.argtypes = [P, ctypes.c_int64]
    lib.argmax_f32.restype = ctypes.c_int64
    lib.checksum64.argtypes = [P, ctypes.c_int64, P]
    lib.checksum64.restype = None
    lib.attn_prompt.argtypes = [P]
    lib.attn_prompt.restype = I
    lib.choose_blocks.argtypes = [P, P, P, I, I, I, P, P, I, P, P, I, I, P, P]
    lib.choose_blocks.restype = None
    lib.moe_layer_rows.argtypes = [I, I, P, P, F, P, P, P]
    lib.moe_layer_rows.restype = I
    lib.moe_grouped_rows.argtypes = [I, I, P, P, P, P, P, P]
    lib.moe_grouped_rows.restype = I
    lib.shared_expert_rows.argtypes = [I, I, P, P, F, P, P]
    lib.shared_expert_rows.restype = I
    lib.gdn_rule.argtypes = [I, I, I, I, I, P, P, P, P, P, P, P]
    lib.gdn_rule.restype = I
    lib.gdn_mix.argtypes = [P, I, P, I, F, P, P, P, P, P]
    lib.gdn_mix.restype = I
    lib.qk_norm_rows.restype = None
    lib.split_blocks.argtypes = [P, ctypes.c_int64, I, I, P, P]
    lib.split_blocks.restype = None
    lib.decode_layers.restype = I
    return lib


class GDN(ctypes.Structure):
    """A Gated DeltaNet layer's mixer as gdn_mix reads it (kernels/cpu_gdn.h: gdn_t)."""
    _fields_ = [("Hk", ctypes.c_int), ("Dk", ctypes.c_int), ("H", ctypes.c_int), ("Dv", ctypes.c_int),
                ("K", ctypes.c_int), ("conv", ctypes.c_void_p), ("A", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p),
                ("norm", ctypes.c_void_p)]


class QLin(ctypes.Structure):
    """One packed linear (or one part of a concatenation) as decode_layers reads it."""
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("ssup", ctypes.c_void_p), ("zsup", ctypes.c_void_p), ("bits", ctypes.c_int), ("kind", ctypes.c_int),
                ("per", ctypes.c_int), ("group", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int),
                ("act", ctypes.c_int),      # activation bits: 8 for int8, 0 (or 16) for int16
                ("high", ctypes.c_void_p),  # bits 4: q5's fifth bits, or None
                ("bias", ctypes.c_void_p)]  # float32 [N] added before any residual, or None


class QLayer(ctypes.Structure):
    _fields_ = [("lin", (QLin * 3) * 4), ("nparts", ctypes.c_int * 4), ("norm_attn", ctypes.c_void_p),
                ("norm_mlp", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("moe", ctypes.c_void_p), ("shared", ctypes.c_void_p), ("post_attn", ctypes.c_void_p),
                ("post_mlp", ctypes.c_void_p),
                ("act", ctypes.c_int), ("mix_in", ctypes.c_int), ("mix_out", ctypes.c_int),
                ("gdn", ctypes.c_void_p), ("state", ctypes.c_int), ("mix_order", ctypes.c_void_p),
                ("ple", QLin * 2), ("ple_norm", ctypes.c_void_p), ("scalar", ctypes.c_void_p), ("gate", ctypes.c_int),
                ("beside", ctypes.c_void_p * 3), ("hd", ctypes.c_int), ("kvh", ctypes.c_int), ("vk", ctypes.c_int),
                ("vnorm", ctypes.c_int), ("keep", ctypes.c_int), ("from_", ctypes.c_int)]


class SharedExpert(ctypes.Structure):
    """A shared expert beside a routed MLP as shared_expert_rows reads it (shared_t in cpu_moe.h)."""
    _fields_ = [("gu", QLin * 3), ("ngu", ctypes.c_int), ("down", QLin), ("gate", ctypes.c_void_p)]


class StepInputs(ctypes.Structure):
    """What a decode step brings its layers, as decode_layers_grouped reads it (step_inputs_t in cpu_gdn.h): the
    Gated DeltaNet states, Gemma 4's per-layer inputs."""
    _fields_ = [("n", ctypes.c_int)] + [(name, ctypes.POINTER(ctypes.c_void_p))
                                        for name in ("tail_in", "S_in", "tail_out", "S_out")] + [
        ("ple", ctypes.c_void_p), ("ple_layers", ctypes.c_int)]


class PromptArgs(ctypes.Structure):
    """attn_prompt's arguments (pa_args_t in cpu_prompt_attn.h)."""
    _fields_ = [(n, ctypes.c_int) for n in ("T", "P", "Hq", "Hkv", "D", "bf16", "n_sink")] + [
        (n, ctypes.c_void_p) for n in ("q", "sink_k", "sink_logits", "kp", "vp", "rows", "outside")] + [
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("out", ctypes.c_void_p),
        ("load", ctypes.c_void_p), ("ctx", ctypes.c_void_p), ("load_floats", ctypes.c_int)]


class PromptQuantPages(ctypes.Structure):
    """attn_prompt_quant's pages (pq_ctx_t in cpu_kv_quant.c)."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("kc", "vc", "knew", "vnew", "cos_h", "sin_h", "slots", "table", "pos")] + [
        ("bs", ctypes.c_int), ("n_full", ctypes.c_int)]


class MoE(ctypes.Structure):
    """A routed MLP as moe_layer_rows and decode_layers read it (moe_t in cpu_moe.h)."""
    _fields_ = [("E", ctypes.c_int), ("k", ctypes.c_int), ("act", ctypes.c_int), ("normalize", ctypes.c_int),
                ("alpha", ctypes.c_float), ("limit", ctypes.c_float), ("router", QLin),
                ("router_bias", ctypes.c_void_p), ("gate", ctypes.c_void_p), ("up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("gb", ctypes.c_void_p), ("ub", ctypes.c_void_p), ("db", ctypes.c_void_p),
                ("hits", ctypes.c_void_p), ("router_norm", ctypes.c_void_p), ("expert_scale", ctypes.c_void_p)]
