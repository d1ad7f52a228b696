"""The C kernels' prebuilt variants (baseline, AVX2, AVX-512; generic elsewhere): chosen by CPUID, keyed by what
they were built for, each one this CPU can run held to the same checks, and buildable without OpenMP, without
_Float16 and for aarch64."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvchat.kernels import cpu_lib

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(cpu_lib.library() is None, reason=f"C kernels unavailable: {cpu_lib.library_error()}")


def _halves(lib, bits: np.ndarray) -> np.ndarray:
    out = np.empty(bits.shape, np.float32)
    lib.kvchat_f16_to_f32(bits.ctypes.data, out.ctypes.data, bits.size)
    return out


def _to_half(lib, x: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape, np.uint16)
    lib.kvchat_f32_to_f16(x.ctypes.data, out.ctypes.data, x.size)
    return out


@pytest.fixture(scope="module", params=cpu_lib.runnable_variants())
def variant_lib(request):
    return request.param, cpu_lib._build(variant=request.param)


def test_the_choice_is_the_best_variant_the_cpu_runs():
    status = cpu_lib.status()
    runnable = cpu_lib.runnable_variants()
    assert runnable[-1] == list(cpu_lib.variants())[-1]             # the baseline runs everywhere
    if not os.environ.get("KVCHAT_CPU_VARIANT"):
        assert status["variant"] == runnable[0], status
    if status["variant"] in ("avx2", "avx512"):
        assert {"avx2", "fma", "f16c"} <= set(status["cpu_features"])
        assert "avx2+fma+f16c" in status["build"]


def test_a_build_is_named_for_its_variant_not_for_this_machine():
    names = {v: cpu_lib.library_name(cpu_lib.SOURCE, v) for v in cpu_lib.variants()}
    assert len(set(names.values())) == len(names) and all(f"-{v}-" in n for v, n in names.items())
    assert "-march=native" not in " ".join(" ".join(cpu_lib.variant_flags(v)) for v in cpu_lib.variants())


def test_an_unknown_forced_variant_is_refused_in_one_line():
    env = dict(os.environ, KVCHAT_CPU_VARIANT="sse9")
    code = "from kvchat.kernels import cpu_lib; print(cpu_lib.library() is None, cpu_lib.library_error())"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("True KVCHAT_CPU_VARIANT='sse9': this machine's variants are"), out.stdout
    beyond = [v for v in cpu_lib.variants() if v not in cpu_lib.runnable_variants()]
    if beyond:          # a variant this CPU cannot execute is refused, never loaded (SIGILL)
        out = subprocess.run([sys.executable, "-c", code], env=dict(env, KVCHAT_CPU_VARIANT=beyond[0]), cwd=ROOT,
                             capture_output=True, text=True, check=True)
        assert out.stdout.startswith(f"True KVCHAT_CPU_VARIANT='{beyond[0]}': this CPU lacks "), out.stdout


def test_every_half_converts_as_numpy_does(variant_lib):
    """All 65,536 halves to float, and floats (every half, the midpoints between neighbours, subnormals, overflow,
    infinities, NaN) back to half with round-to-nearest-even, in each variant (F16C or integer arithmetic)."""
    name, lib = variant_lib
    bits = np.arange(65536, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = _halves(lib, bits)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)), name
    finite = want[np.isfinite(want)]
    with np.errstate(over="ignore"):
        up = np.nextafter(finite.astype(np.float16), np.float16(np.inf)).astype(np.float32)
    rng = np.random.default_rng(0)
    x = np.concatenate([finite, (finite + up) / 2, np.nextafter((finite + up) / 2, np.float32(np.inf)),
                        rng.standard_normal(20000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 20000),
                        np.array([65504, 65519.99, 65520, 1e9, -1e9, np.inf, -np.inf, 2 ** -25, 2 ** -26, 0.0, -0.0],
                                 np.float32)]).astype(np.float32)
    x = x[np.isfinite(x) | np.isinf(x)]
    with np.errstate(over="ignore"):
        assert np.array_equal(_to_half(lib, x), x.astype(np.float16).view(np.uint16)), name
    assert np.isnan(_to_half(lib, np.array([np.nan], np.float32)).view(np.float16)).all()


def test_each_variant_gives_the_kernels_the_same_numbers(variant_lib):
    """A packed matvec (with RMSNorm) and a dequantization in each variant: dequantization equals the reference
    bit for bit everywhere; the SIMD variants' matvec equals the chosen variant's (one order of operations, no
    contraction); the baseline's scalar sums run in another order, so it is held to the torch reference."""
    import torch
    from kvchat.kernels import cpu_quant
    from test_cpu_quant import _q4
    name, lib = variant_lib
    codes, scale, zero = _q4(96, 256)
    x, norm = torch.randn(3, 256), torch.rand(256) + 0.5
    chosen = cpu_quant.q4_gemv(x, codes, scale, zero, norm=norm, eps=1e-5)
    old = cpu_quant._lib
    try:
        cpu_quant._lib = lib
        got = cpu_quant.q4_gemv(x, codes, scale, zero, norm=norm, eps=1e-5)
        deq = cpu_quant.q4_dequant(codes, scale, zero)
    finally:
        cpu_quant._lib = old
    assert torch.equal(deq, cpu_quant.q4_dequant_ref(codes, scale, zero)), name
    if name != "baseline" or cpu_lib.current_variant() == "baseline":
        assert torch.equal(got, chosen), name
    want = cpu_quant.q4_gemv_ref(x, codes, scale, zero, norm=norm, eps=1e-5)
    assert (got - want).abs().max() <= 2e-4 * want.abs().max(), name


def _with_lib(lib, fn):
    from kvchat.kernels import cpu_quant
    old = cpu_quant._lib
    try:
        cpu_quant._lib = lib
        return fn()
    finally:
        cpu_quant._lib = old


@pytest.mark.parametrize("k", [576, 544])          # an even and an odd number of groups of 32
def test_the_simd_variants_give_the_same_bits_for_every_row_count_and_format(variant_lib, k):
    """AVX-512 runs two groups per register (cpu_avx512.h) and AVX2 one: the same integer sums and the same float
    operations in the same order, so every SIMD variant gives the chosen one's bits, for 1 to 8 rows, q4 with
    zeros, float16 scales with and without zeros, q5, q8 in groups of 32 and 16, with and without zeros; and a row's
    result is the same alone as in a call of several rows (what batch invariance in serving rests on)."""
    import torch
    from kvchat.kernels import cpu_quant
    from test_cpu_quant import _q4, _q8
    name, lib = variant_lib
    if name == "baseline":
        pytest.skip("the baseline sums in another order: held to the torch reference above")
    q4 = _q4(41, k, seed=1)         # an odd number of weight rows: decode takes them two at a time
    codes, scale, zero = q4
    half = scale.half()
    high = torch.randint(0, 256, (41, k // 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    cases = [("q4", lambda x: cpu_quant.q4_gemv(x, *q4)),      # and the files' own scales: float16 with zeros (Q4_1),
             ("q4/f16", lambda x: cpu_quant.q4_gemv(x, codes, half, zero.half())),   # the implicit -8 (Q4_0), and
             ("q4_0", lambda x: cpu_quant.q4_gemv(x, codes, cpu_quant.Scales(half, offset8=True))),    # Q5_0
             ("q5_0", lambda x: cpu_quant.q4_gemv(x, codes, cpu_quant.Scales(half, offset8=True, centre=16),
                                                  high=high)),
             ("q5_1", lambda x: cpu_quant.q4_gemv(x, codes, half, zero.half(), high=high)),   # and float16 scales
             ("q4/f16/none", lambda x: cpu_quant.q4_gemv(x, codes, half))]                   # without zeros
    for group, with_zero, f16 in ((32, False, False), (32, True, False), (16, False, False), (32, False, True)):
        codes8, scale8, zero8 = _q8(41, k, group, with_zero, seed=2)
        cases.append((f"q8/{group}/{with_zero}/{f16}",
                      lambda x, c=codes8, s=scale8.half() if f16 else scale8, z=zero8, g=group:
                      cpu_quant.q8_gemv(x, c, s, z, g)))
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(3))
    for label, fn in cases:
        for m in range(1, 9):
            got = _with_lib(lib, lambda: fn(x[:m]))
            assert torch.equal(got, fn(x[:m])), (name, label, m)
            alone = torch.cat([_with_lib(lib, lambda i=i: fn(x[i:i + 1])) for i in range(m)])
            assert torch.equal(got, alone), (name, label, m)


def test_k_quant_scales_give_the_same_bits_in_every_variant_and_row_count(variant_lib):
    """Q4_K / Q5_K's packed scale bytes (kind 5), which a decode row widens with its scale products inside the
    two-row loop (k_terms8) and several rows widen apart: the same bits either way and in every SIMD variant."""
    import torch
    from kvchat.kernels import cpu_quant
    from test_cpu_quant import _q4
    name, lib = variant_lib
    if name == "baseline":
        pytest.skip("the baseline sums in another order: held to the torch reference above")
    k, gen = 768, torch.Generator().manual_seed(6)
    codes = _q4(41, k, seed=7)[0]
    high = torch.randint(0, 256, (41, k // 8), dtype=torch.uint8, generator=gen)
    sup = lambda: (torch.rand(41, k // 256, generator=gen) * 0.01).half()     # noqa: E731
    kp = cpu_quant.Scales(torch.randint(0, 256, (41, k // 256 * 12), dtype=torch.uint8, generator=gen),
                          scale_sup=sup(), zero_sup=sup(), per=8, kpacked=True)
    x = torch.randn(8, k, generator=gen)
    for label, fn in (("q4_k", lambda x: cpu_quant.q4_gemv(x, codes, kp)),
                      ("q5_k", lambda x: cpu_quant.q4_gemv(x, codes, kp, high=high))):
        for m in (1, 2, 5):
            got = _with_lib(lib, lambda: fn(x[:m]))
            assert torch.equal(got, fn(x[:m])), (name, label, m)
            alone = torch.cat([_with_lib(lib, lambda i=i: fn(x[i:i + 1])) for i in range(m)])
            assert torch.equal(got, alone), (name, label, m)


def test_int8_prompt_rows_give_the_same_bits_in_every_simd_variant(variant_lib):
    """Prompt rows with int8 activations (cpu_gemm8.h): sixteen weight rows a VNNI step on AVX-512, eight a maddubs
    step on AVX2, the same integer sums and float steps, so 4- and 5-bit codes (Q4_0, Q4_1, Q5_0, Q4_K / Q5_K's packed
    scales) give the same bits in both; Q8_0's signed codes take another order of their zero terms on AVX2, held to
    the chosen build within float rounding. An odd weight-row count leaves a part block either way."""
    import torch
    from kvchat.kernels import cpu_quant
    from test_cpu_quant import _q4, _q8
    name, lib = variant_lib
    if name == "baseline":
        pytest.skip("the baseline build has no int8 prompt rows")
    if not cpu_quant.gemm8_available():
        pytest.skip("the chosen build has no int8 prompt rows")
    k, gen = 768, torch.Generator().manual_seed(8)
    codes, scale, zero = _q4(41, k, seed=1)
    half = scale.half()
    high = torch.randint(0, 256, (41, k // 8), dtype=torch.uint8, generator=gen)
    sup = lambda: (torch.rand(41, k // 256, generator=gen) * 0.01).half()     # noqa: E731
    kp = cpu_quant.Scales(torch.randint(0, 256, (41, k // 256 * 12), dtype=torch.uint8, generator=gen),
                          scale_sup=sup(), zero_sup=sup(), per=8, kpacked=True)
    exact = {"q4_1": lambda x: cpu_quant.gemm8(x, codes, half, zero.half()),
             "q4_0": lambda x: cpu_quant.gemm8(x, codes, cpu_quant.Scales(half, offset8=True)),
             "q5_0": lambda x: cpu_quant.gemm8(x, codes, cpu_quant.Scales(half, offset8=True, centre=16), high=high),
             "q4_k": lambda x: cpu_quant.gemm8(x, codes, kp),
             "q5_k": lambda x: cpu_quant.gemm8(x, codes, kp, high=high)}
    c8, s8, _ = _q8(41, k, 32, False, seed=2)
    x = torch.randn(13, k, generator=gen) * 2
    for label, fn in exact.items():
        assert torch.equal(_with_lib(lib, lambda: fn(x)), fn(x)), (name, label)
    got, want = (f(lambda: cpu_quant.gemm8(x, c8, s8.half(), bits=8)) for f in (lambda g: _with_lib(lib, g),
                                                                                  lambda g: g()))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name


def test_decode_attention_gives_the_same_bits_in_every_simd_variant(variant_lib):
    """The decode attention's value pass holds its sums in registers, 16 lanes on AVX-512 and 8 on AVX2, four vectors
    of dimensions at a time and the rest in a plain loop: the same multiply and add per element in either, so the
    variants agree bit for bit (head dims a multiple of the chunk and not, GQA groups past the four a pass holds,
    bf16 and fp32 pages, rows out of order, sinks)."""
    import torch
    from kvchat.kernels import cpu_quant
    name, lib = variant_lib
    if name == "baseline":
        pytest.skip("the baseline's dot products sum in another order")
    g = torch.Generator().manual_seed(5)
    for d, hq, hkv, dtype in ((64, 9, 3, torch.bfloat16), (80, 6, 1, torch.float32), (128, 16, 2, torch.bfloat16)):
        kp, vp = (torch.randn(310, hkv, d, generator=g).to(dtype) for _ in range(2))
        rows = torch.randperm(310, generator=g)[:300]
        q, qs = torch.randn(hq, d, generator=g), torch.randn(hq, d, generator=g)
        want = cpu_quant.attn_decode(q, qs, 2, kp, vp, rows, d ** -0.5)
        got = _with_lib(lib, lambda: cpu_quant.attn_decode(q, qs, 2, kp, vp, rows, d ** -0.5))
        assert torch.equal(got, want), (name, d, hq, hkv, dtype)


def test_gemma4_gelu_and_side_by_side_norms_give_the_same_bits_in_every_variant(variant_lib):
    """Gemma 4's GELU gate (eight lanes at a time and a scalar tail: the chosen variant's bits in every SIMD variant)
    and its MLP and experts joined (beside_rows: three RMSNorms and the residual, the same bits in every variant), both
    within rounding of the float64 formulas."""
    import torch
    from kvchat.kernels import cpu_quant
    name, lib = variant_lib
    g = torch.Generator().manual_seed(8)
    gu = torch.randn(3, 2 * 45, generator=g) * 3           # 45: five lanes of eight and a tail
    x, dense, routed = (torch.randn(3, 72, generator=g) for _ in range(3))
    norms = tuple(torch.rand(72, generator=g) + 0.5 for _ in range(3))

    def run():
        return cpu_quant.gelu_gate(gu), cpu_quant.beside_add(x, dense.clone(), routed, norms, norms[1], 1e-6)
    want, got = run(), _with_lib(lib, run)
    assert torch.equal(got[1], want[1]), name               # plain loops in every variant
    gd, ud = gu.double().chunk(2, dim=-1)
    ref = torch.nn.functional.gelu(gd, approximate="tanh") * ud
    assert torch.allclose(got[0].double(), ref, atol=1e-5), name
    if name != "baseline":                                   # its exp is libm's, not the eight-lane one
        assert torch.equal(got[0], want[0]), name

    def rms(t, w):
        t = t.double()
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    ref = x.double() + rms(rms(dense, norms[0]) + rms(routed, norms[2]), norms[1])
    assert torch.allclose(want[1].double(), ref, atol=1e-5), name


@pytest.mark.slow
def test_the_kernel_checks_pass_on_the_baseline_variant():
    """What a CPU without AVX2 (and an ARM build's scalar loops) runs: the kernels' own test files, again, with
    the baseline forced."""
    if cpu_lib.current_variant() == "baseline":
        pytest.skip("the baseline is the variant the suite runs")
    env = dict(os.environ, KVCHAT_CPU_VARIANT="baseline")
    # (not the damaged-library test: it builds a library again, whichever variant, and says nothing of the kernels)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                          "-k", "not damaged_library", "tests/test_cpu_quant.py", "tests/test_quant_decode_kernel.py"],
                         env=env, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:]


def test_without_openmp_the_kernels_still_build_and_say_so(tmp_path, monkeypatch):
    """A compiler without OpenMP (Apple clang, or no libomp): the build falls back to one thread and says so."""
    monkeypatch.setattr(cpu_lib, "OPENMP", "-fno-such-openmp-flag")
    lib = cpu_lib._build(into=tmp_path, variant=list(cpu_lib.variants())[-1])
    assert b"openmp=0" in lib.kvchat_build_info()
    assert hasattr(lib, "decode_layers")


@pytest.mark.parametrize("compiler", ["clang", "gcc-11"])
def test_other_compilers_build_every_variant(compiler, tmp_path):
    """clang (here without libomp: the OpenMP fallback) and gcc 11 (no _Float16 on x86) build both libraries."""
    if not shutil.which(compiler):
        pytest.skip(f"{compiler} is not installed (apt-get install {compiler})")
    for variant in cpu_lib.variants():
        for source in (cpu_lib.SOURCE, cpu_lib.KV_SOURCE):
            out = tmp_path / f"{source.stem}-{variant}.so"
            # -O0 -c: what a compiler refuses shows without optimizing (the optimized builds are the suite's own)
            res = subprocess.run([compiler, *cpu_lib.variant_flags(variant), "-O0", "-c", "-Wno-unknown-pragmas",
                                  str(source), "-o", str(out)], capture_output=True, text=True)
            assert res.returncode == 0, (variant, source.name, res.stderr[-2000:])


def test_the_aarch64_build_compiles():
    """The ARM build (the scalar loops; NEON where the compiler vectorizes them) compiles with a cross compiler."""
    cc = shutil.which("aarch64-linux-gnu-gcc")
    if not cc:
        pytest.skip("no aarch64 cross compiler (apt-get install gcc-aarch64-linux-gnu)")
    for source in (cpu_lib.SOURCE, cpu_lib.KV_SOURCE, cpu_lib.PROBE_SOURCE):
        res = subprocess.run([cc, *cpu_lib.COMMON_FLAGS, "-O0", "-c", "-fopenmp", "-Werror=implicit-function-declaration",
                              str(source), "-o", os.devnull], capture_output=True, text=True)
        assert res.returncode == 0, (source.name, res.stderr[-2000:])


def test_the_baseline_build_is_said_not_silent():
    """Forced (or on a CPU without AVX2), the baseline build decodes about 2.5x slower: the status line and `kvchat doctor`
    say so; doctor names the variant, why, the build and the CPU's features."""
    env = dict(os.environ, KVCHAT_CPU_VARIANT="baseline")
    code = "from kvchat.engine.runtime.engine import kernel_status; print(kernel_status('cpu'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "C kernels: the baseline x86-64 build (without AVX2, FMA and F16C), several times slower"
    doctor = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "doctor"], env=env, cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    assert "kernels    baseline build: chosen by KVCHAT_CPU_VARIANT" in doctor and "isa=base" in doctor
    chosen = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "doctor", "--json"], cwd=ROOT, capture_output=True,
                            text=True, check=True, env={k: v for k, v in os.environ.items()
                                                        if k != "KVCHAT_CPU_VARIANT"}).stdout
    import json
    report = json.loads(chosen)
    assert report["kernels"]["variant"] == cpu_lib.runnable_variants()[0]
    assert report["kernels"]["cpu_features"] == sorted(cpu_lib.cpu_features()) and report["device"] == "cpu"
    off = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "doctor"], cwd=ROOT, capture_output=True, text=True,
                         check=True, env=dict(os.environ, KVCHAT_NO_CPU_KERNELS="1")).stdout
    assert "kernels    none: disabled by KVCHAT_NO_CPU_KERNELS; running torch's kernels" in off
    assert "note       C kernels not loaded" in off


def _harness_inputs(tmp_path):
    """The harness's input file (tests/kernel_harness.c reads it in this order) and the torch arguments."""
    import torch
    from test_cpu_quant import _q4, _q8
    M, K, N, G, Hq, Hkv, D, L = 3, 256, 40, 32, 4, 2, 64, 37
    gen = torch.Generator().manual_seed(3)
    x, norm = torch.randn(M, K, generator=gen), torch.rand(K, generator=gen) + 0.5
    c4, s4, z4 = _q4(N, K, seed=1)
    c8, s8, z8 = _q8(N, K, G, True, seed=2)
    q = torch.randn(Hq, D, generator=gen)
    kp, vp = torch.randn(L, Hkv, D, generator=gen), torch.randn(L, Hkv, D, generator=gen)
    parts = [np.array([M, K, N, G, Hq, Hkv, D, L], np.int32), x, norm, c4, s4, z4, c8, s8, z8, q, kp, vp,
             torch.arange(L, dtype=torch.int64)]
    path = tmp_path / "in.bin"
    path.write_bytes(b"".join((p if isinstance(p, np.ndarray) else p.contiguous().numpy()).tobytes() for p in parts))
    return path, dict(x=x, norm=norm, q4=(c4, s4, z4), q8=(c8, s8, z8), G=G, q=q, kp=kp, vp=vp, L=L)


@pytest.mark.arm
def test_the_aarch64_build_equals_the_references_under_qemu(tmp_path):
    """Opt-in (-m arm; Debian's gcc-aarch64-linux-gnu and qemu-user): the ARM build of the kernels, run under
    qemu-user, gives the torch references' numbers: dequantization bit for bit, every half, the matvecs and the
    decode attention within float32 rounding."""
    import torch
    from kvchat.kernels import cpu_quant as cq
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if not (cc and qemu):
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    exe = tmp_path / "harness"
    subprocess.run([cc, "-O3", "-ffp-contract=off", "-fopenmp", str(cpu_lib.SOURCE), str(ROOT / "tests" / "kernel_harness.c"),
                    "-o", str(exe), "-lm"], check=True, capture_output=True)
    path, a = _harness_inputs(tmp_path)
    res = subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", str(exe), str(path), str(tmp_path / "out.bin")],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert res.returncode == 0, res.stderr
    assert "neon" in res.stderr                        # the build saw the NEON unit (__ARM_NEON)
    got = torch.from_numpy(np.fromfile(tmp_path / "out.bin", np.float32))
    x, (c4, s4, z4), (c8, s8, z8) = a["x"], a["q4"], a["q8"]
    want = [cq.q4_gemv_ref(x, c4, s4, z4, norm=a["norm"], eps=1e-5), cq.q4_dequant_ref(c4, s4, z4),
            cq.q8_gemv_ref(x, c8, s8, z8, a["G"]), cq.q8_dequant_ref(c8, s8, z8, a["G"]),
            cq.attn_decode_ref(a["q"], a["q"], 0, a["kp"], a["vp"], torch.arange(a["L"]), 0.125)]
    exact = [False, True, False, True, False]
    at = 0
    for w, is_exact in zip(want, exact):
        part, at = got[at:at + w.numel()].view(w.shape), at + w.numel()
        if is_exact:
            assert torch.equal(part, w)
        else:
            assert (part - w).abs().max() <= 2e-4 * w.abs().max()
    halves = got[at:]
    ref = torch.from_numpy(np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32))
    nan = ref.isnan()
    assert torch.equal(halves.isnan(), nan) and torch.equal(halves[~nan], ref[~nan])
