"""Triton kernels against their torch references, and the references against plain float math.

Without CUDA (or with TRITON_INTERPRET=1 already set) the Triton kernels run on the CPU under the
interpreter; with CUDA and no TRITON_INTERPRET they run compiled on the GPU. The choice must be
made before triton is imported, so it happens at the top of this module.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.formats import PageFormat, page_format  # noqa: E402

try:
    from kernels import triton_attention, triton_store
    _TRITON_ERROR = None
except Exception as exc:  # triton missing, or unusable in this process
    triton_attention = triton_store = None
    _TRITON_ERROR = f"triton kernels cannot run here: {exc!r}"

needs_triton = pytest.mark.skipif(_TRITON_ERROR is not None, reason=_TRITON_ERROR or "")

# Kernel and reference read the same pages, so they differ only by fp32 summation order and the
# ulps of sin/cos; the bound is per format as dequantized magnitudes (and q's dtype) differ.
# The GPU's sin/cos and reduction order add a little more.
ATOL = {"fp32": 1e-5, "fp16": 1e-5, "bf16": 1e-5, "int8": 2e-5, "fp8": 2e-5, "int4": 3e-5}
GPU_SLACK = 1.0 if INTERPRET else 5.0


def _fmt(name: str, role: str) -> PageFormat:
    return page_format(name, role)


def _empty_pages(fmt: PageFormat, num_blocks: int, bs: int, H: int, D: int):
    shapes = fmt.shapes(bs, H, D)
    make = {k: torch.zeros((num_blocks, *shape), dtype=dtype, device=DEVICE) for k, (shape, dtype) in shapes.items()}
    return make["data"], make.get("scale"), make.get("zero")


def _paged(keys, values, bs: int, k_fmt: PageFormat, v_fmt: PageFormat, windows=None, seed=0):
    """keys/values: per sequence [T_b, H, D] -> pages (ref-stored, shuffled block ids) and block tables.

    Blocks that a window has fully evicted point at a garbage block the kernel must never read.
    """
    gen = torch.Generator().manual_seed(seed)
    H, D = keys[0].shape[1:]
    nblk = [max(1, -(-k.shape[0] // bs)) for k in keys]
    total = sum(nblk) + 1                                         # + 1 garbage block
    ids = torch.randperm(total, generator=gen)
    garbage = int(ids[-1])
    tables = torch.full((len(keys), max(nblk)), garbage, dtype=torch.int32)
    srcs_k, srcs_v, used = [], [], 0
    for b, (k, v) in enumerate(zip(keys, values)):
        pad = nblk[b] * bs - k.shape[0]
        srcs_k.append(torch.cat((k, torch.zeros(pad, H, D))).view(nblk[b], bs, H, D))
        srcs_v.append(torch.cat((v, torch.zeros(pad, H, D))).view(nblk[b], bs, H, D))
        tables[b, :nblk[b]] = ids[used:used + nblk[b]].to(torch.int32)
        used += nblk[b]
        ws, ns = windows[b] if windows else (0, 0)
        for j in range(nblk[b]):
            if j * bs >= ns and (j + 1) * bs <= ws:
                tables[b, j] = garbage
    block_ids = torch.cat((ids[:used], ids[-1:])).to(torch.int32).to(DEVICE)
    junk = 50 * torch.randn(1, bs, H, D, generator=gen)
    pages = []
    for fmt, srcs in ((k_fmt, srcs_k), (v_fmt, srcs_v)):
        data, scale, zero = _empty_pages(fmt, total, bs, H, D)
        reference.store_blocks(torch.cat((*srcs, junk)).to(DEVICE), block_ids, data, scale, zero, fmt)
        pages += [data, scale, zero]
    return pages, tables.to(DEVICE)


def _inv_freq(D: int) -> torch.Tensor:
    return (1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)).to(DEVICE)


def _attention_case(k_name, v_name, D, group, bs, lens, windows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Hkv = 2
    keys = [torch.randn(t, Hkv, D, generator=gen) for t in lens]
    values = [torch.randn(t, Hkv, D, generator=gen) for t in lens]
    k_fmt, v_fmt = _fmt(k_name, "k"), _fmt(v_name, "v")
    pages, tables = _paged(keys, values, bs, k_fmt, v_fmt, windows, seed)
    q_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(k_name, torch.float32)
    q = torch.randn(len(lens), Hkv * group, D, generator=gen).to(q_dtype).to(DEVICE)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return (q, *pages, tables, as_i32(lens), as_i32([w[0] for w in windows]), as_i32([w[1] for w in windows]),
            _inv_freq(D), 1 / math.sqrt(D), k_fmt, v_fmt)


def _tol(*names: str) -> float:
    return max(ATOL[n] for n in names) * GPU_SLACK


# ---------------------------------------------------------------- quantize-and-store

STORE_FORMATS = [("fp32", "k"), ("fp16", "k"), ("bf16", "k"), ("int8", "k"), ("int8", "v"),
                 ("fp8", "k"), ("fp8", "v"), ("int4", "k"), ("int4", "v")]


@needs_triton
@pytest.mark.parametrize("bs,D", [(1, 64), (16, 128), (64, 64)])
@pytest.mark.parametrize("name,role", STORE_FORMATS)
def test_store_matches_reference_bit_exact(name, role, bs, D):
    """Triton store writes the same data, scale and zero pages as the reference, bit for bit."""
    fmt = _fmt(name, role)
    gen = torch.Generator().manual_seed(bs + D)
    src = (3 * torch.randn(3, bs, 2, D, generator=gen)).to(DEVICE)
    block_ids = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    want = _empty_pages(fmt, 6, bs, 2, D)
    got = _empty_pages(fmt, 6, bs, 2, D)
    reference.store_blocks(src, block_ids, *want, fmt)
    triton_store.store_blocks(src, block_ids, *got, fmt)
    for w, g in zip(want, got):
        if w is not None:   # compare raw bytes: rounding is explicit (half to even), so no step of slack
            assert torch.equal(w.view(torch.uint8), g.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_store_rounds_half_to_even(name):
    """Codes exactly halfway between two levels round to even, like torch.round."""
    fmt = PageFormat(name, "token", symmetric=name != "int4")
    if name == "int8":   # max |x| = 127 makes the scale exactly 1
        row = [-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 127.0] + [0.0] * 55
    else:                # min 0 and max 15 make the zero point 0 and the scale 1
        row = [i + 0.5 for i in range(14)] + [0.0, 15.0]
        row = row * 4
    src = torch.tensor(row, device=DEVICE).view(1, 1, 1, 64)
    data, scale, zero = _empty_pages(fmt, 1, 1, 1, 64)
    triton_store.store_blocks(src, torch.zeros(1, dtype=torch.int32, device=DEVICE), data, scale, zero, fmt)
    if name == "int4":
        data = torch.stack((data & 0xF, data >> 4), -1)
    assert float(scale.flatten()[0]) == 1.0
    assert torch.equal(data.flatten().float().cpu(), torch.tensor(row).round())


# ---------------------------------------------------------------- decode attention

ATTN_FORMATS = [("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("int8", "int8"), ("fp8", "fp8"),
                ("int4", "int4"), ("int8", "int4"), ("int4", "fp16"), ("fp8", "bf16")]
# head_dim, GQA group, block size; three sequences: a single token, a partly filled last block,
# and a window with 4 sinks whose middle blocks were evicted.
GEOMETRIES = [(64, 1, 16), (128, 3, 1), (64, 8, 64)]
LENS, WINDOWS = [1, 37, 150], [(0, 0), (0, 0), (100, 4)]


@needs_triton
@pytest.mark.parametrize("D,group,bs", GEOMETRIES, ids=[f"d{d}-g{g}-bs{b}" for d, g, b in GEOMETRIES])
@pytest.mark.parametrize("k_name,v_name", ATTN_FORMATS, ids=[f"{k}-{v}" for k, v in ATTN_FORMATS])
def test_attention_matches_reference(k_name, v_name, D, group, bs):
    """Triton decode attention equals the reference for a K/V format pair, GQA group and block size."""
    args = _attention_case(k_name, v_name, D, group, bs, LENS, WINDOWS)
    want_out, want_lse = reference.paged_decode_attention(*args)
    out, lse = triton_attention.paged_decode_attention(*args)
    tol = _tol(k_name, v_name)
    assert out.shape == want_out.shape and out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, atol=tol, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=0)


@needs_triton
@pytest.mark.parametrize("name", ["fp16", "int8", "fp8", "int4"])
def test_attention_same_for_block_size_1_and_16(name):
    """The same tokens paged with block size 1 and 16 give the same output (token-local value scales)."""
    # Keys in full precision: per-channel key scales span a block, so they change with block size.
    results = [triton_attention.paged_decode_attention(*_attention_case("fp16", name, 64, 3, bs, LENS, WINDOWS))
               for bs in (1, 16)]
    torch.testing.assert_close(results[0][0], results[1][0], atol=_tol("fp16", name), rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=_tol("fp16", name), rtol=0)


@needs_triton
def test_attention_split_k_matches_one_split():
    """Flash-decoding splits, some of them empty for short sequences, merge to the one-split result."""
    args = _attention_case("int8", "int4", 64, 3, 16, [3, 300, 260], [(0, 0), (0, 0), (120, 4)])
    out1, lse1 = triton_attention.decode(*args, num_splits=1, tile=32)
    out5, lse5 = triton_attention.decode(*args, num_splits=5, tile=32)
    torch.testing.assert_close(out5, out1, atol=_tol("int8", "int4"), rtol=0)
    torch.testing.assert_close(lse5, lse1, atol=_tol("int8", "int4"), rtol=0)


@needs_triton
def test_attention_empty_sequence():
    """A sequence holding no tokens gives out 0 and lse -inf, as the reference does."""
    args = list(_attention_case("fp16", "int8", 64, 1, 16, [0, 5], [(0, 0), (0, 0)]))
    out, lse = triton_attention.decode(*args, num_splits=2)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    torch.testing.assert_close(out, reference.paged_decode_attention(*args)[0], atol=_tol("fp16", "int8"), rtol=0)


# ---------------------------------------------------------------- dispatch

def test_import_kernels_needs_no_triton():
    """`import kernels` neither imports triton nor needs it; without triton the CPU path still runs."""
    code = ("import sys; import kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'; "
            "sys.modules['triton'] = None; kernels.triton_available.cache_clear(); "
            "assert not kernels.triton_available(); "
            "import torch; f = kernels.page_format('int8', 'v'); s = f.shapes(4, 1, 8); "
            "d, sc = (torch.zeros(2, *s[k][0], dtype=s[k][1]) for k in ('data', 'scale')); "
            "kernels.store_blocks(torch.ones(1, 4, 1, 8), torch.tensor([1]), d, sc, None, f); "
            "assert d[1].eq(127).all()")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_dispatch_on_cpu_is_the_reference():
    """On CPU tensors the public entry points give exactly the reference's results."""
    args = _attention_case("int4", "fp8", 64, 3, 16, [9, 20], [(0, 0), (12, 2)])
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    got, want = kernels.paged_decode_attention(*args), reference.paged_decode_attention(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------- references against plain math

@pytest.mark.parametrize("name,role", [("int8", "k"), ("int8", "v"), ("fp8", "k"), ("fp8", "v"), ("int4", "k"), ("int4", "v")])
def test_quantize_error_within_one_step(name, role):
    """Reference quantize/dequantize errs at most half a step (int) or 2^-4 relative (fp8), plus fp16 scale rounding."""
    fmt = _fmt(name, role)
    x = 4 * torch.randn(3, 16, 2, 64, generator=torch.Generator().manual_seed(1))
    data, scale, zero = reference.quantize(x, fmt)
    err = (reference.dequantize(data, scale, zero, fmt) - x).abs()
    step = reference.dequantize(torch.full_like(data, 0x11 if name == "int4" else 1), scale,
                                None if zero is None else torch.zeros_like(zero), fmt)
    amax = x.abs().amax()
    if name == "fp8":   # 3 mantissa bits: half an ulp is 2^-4 of |x|; below 2^-6 the subnormal step 2^-9
        centred = x if zero is None else x - zero.float().unsqueeze(1)   # fp8 keys are centred per channel
        bound = centred.abs() * 2 ** -4 + step * 2 ** -10 + amax * 2 ** -10
    else:               # half a step, plus what clamping loses when the fp16 scale rounded down
        bound = step / 2 + amax * 2 ** -10
    assert (err <= bound + 1e-6).all()


def test_merge_attention_equals_softmax_over_union():
    """Merging two partial attentions by lse equals one softmax over all keys; an empty part is neutral."""
    gen = torch.Generator().manual_seed(2)
    s, v = torch.randn(5, 12, generator=gen), torch.randn(12, 8, generator=gen)

    def attend(cols):
        lse = torch.logsumexp(s[:, cols], -1)
        return torch.softmax(s[:, cols], -1) @ v[cols], lse

    out, lse = reference.merge_attention(*attend(slice(0, 7)), *attend(slice(7, 12)))
    want_out, want_lse = attend(slice(0, 12))
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    empty = (torch.zeros(5, 8), torch.full((5,), -math.inf))
    out, lse = reference.merge_attention(*empty, want_out, want_lse)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


def test_reference_attention_equals_plain_math():
    """Reference decode attention equals a per-key loop with RoPE at StreamingLLM in-cache positions."""
    D, bs, T, ws, ns = 8, 4, 10, 6, 2
    gen = torch.Generator().manual_seed(3)
    k, v, q = torch.randn(T, 1, D, generator=gen), torch.randn(T, 1, D, generator=gen), torch.randn(1, 1, D, generator=gen)
    fmt = PageFormat("fp32")
    data_k = torch.cat((k, torch.zeros(2, 1, D))).view(3, bs, 1, D)
    data_v = torch.cat((v, torch.zeros(2, 1, D))).view(3, bs, 1, D)
    inv = 1.0 / 100 ** (torch.arange(0, D, 2).float() / D)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out, lse = reference.paged_decode_attention(q, data_k, None, None, data_v, None, None, i32(0, 1, 2)[None],
                                                i32(T), i32(ws), i32(ns), inv, 0.5, fmt, fmt)
    held = [(0, 0), (1, 1), (6, 2), (7, 3), (8, 4), (9, 5)]          # (slot, position)
    scores, vals = [], []
    for slot, pos in held:
        key = k[slot, 0].double()
        rotated = key.clone()
        for i in range(D // 2):   # rotate-half: channel pairs (i, i + D/2) turn by pos * inv_freq[i]
            c, s_ = math.cos(pos * float(inv[i])), math.sin(pos * float(inv[i]))
            rotated[i] = key[i] * c - key[i + D // 2] * s_
            rotated[i + D // 2] = key[i + D // 2] * c + key[i] * s_
        scores.append(0.5 * float(q[0, 0].double() @ rotated))
        vals.append(v[slot, 0].double())
    m = max(scores)
    w = [math.exp(x - m) for x in scores]
    want = sum(wi * vi for wi, vi in zip(w, vals)) / sum(w)
    torch.testing.assert_close(out[0, 0].double(), want, atol=1e-5, rtol=0)
    assert abs(float(lse[0, 0]) - (m + math.log(sum(w)))) < 1e-5
