"""The C kernels over packed weights (kernels/cpu_quant.c) against their torch references."""
import hashlib
import math
from pathlib import Path

import pytest
import torch

from kvchat.kernels import cpu_quant as cq

pytestmark = pytest.mark.skipif(not cq.available(), reason=f"C kernels unavailable: {cq.unavailable_reason()}")


def _q4(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    zero = -8 * scale + torch.randn(n, k // 32, generator=g) * 0.01
    return codes, scale, zero


def _q8(n, k, group, with_zero, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.002
    zero = torch.randn(n, k // group, generator=g) * 0.01 if with_zero else None
    return codes, scale, zero


def _close(out, ref, rel=2e-4):
    # activations are quantized to int16 per group of 32 inside the kernel: errors ~1e-5 of the output scale
    return (out - ref).abs().max().item() <= rel * ref.abs().max().item() + 1e-6


@pytest.mark.parametrize("n,k", [(64, 64), (96, 576), (576, 1536), (50, 256)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_q4_gemv_matches_reference(n, k, m):
    """q4 matvec equals dequantize-then-matmul for 1-8 rows, odd row counts and several K."""
    codes, scale, zero = _q4(n, k)
    x = torch.randn(m, k)
    assert _close(cq.q4_gemv(x, codes, scale, zero), cq.q4_gemv_ref(x, codes, scale, zero))


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("with_zero", [False, True])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_q8_gemv_matches_reference(group, with_zero, m):
    """q8 matvec with groups of 16 (Q6_K) or 32 (Q8_0, Q5_K), with and without zero points."""
    codes, scale, zero = _q8(80, 512, group, with_zero)
    x = torch.randn(m, 512)
    assert _close(cq.q8_gemv(x, codes, scale, zero, group), cq.q8_gemv_ref(x, codes, scale, zero, group))


@pytest.mark.parametrize("kind", ["q4", "q8-32", "q8-16", "q8-32z", "q8-16z"])
@pytest.mark.parametrize("k", [64, 96, 576])
def test_gemv_rows_do_not_depend_on_the_batch(kind, k):
    """Each row of an M-row call equals, bit for bit, the same row computed alone (M = 1): a stream
    batched with others (kvchat serve) decodes exactly as it would alone. Odd group counts included."""
    norm, resid = torch.rand(k) + 0.5, torch.randn(8, 80)
    x = torch.randn(8, k) * 3
    if kind == "q4":
        codes, scale, zero = _q4(80, k)
        f = lambda xs, r=None, **kw: cq.q4_gemv(xs, codes, scale, zero, residual=r, **kw)
    else:
        group, with_zero = int(kind[3:5]), kind.endswith("z")
        codes, scale, zero = _q8(80, k, group, with_zero)
        f = lambda xs, r=None, **kw: cq.q8_gemv(xs, codes, scale, zero, group, residual=r, **kw)
    for m in range(2, 9):
        batched = f(x[:m], resid[:m].contiguous(), norm=norm, eps=1e-5)
        plain = f(x[:m])
        for i in range(m):
            assert torch.equal(batched[i], f(x[i:i + 1], resid[i:i + 1].contiguous(), norm=norm, eps=1e-5)[0]), (m, i)
            assert torch.equal(plain[i], f(x[i:i + 1])[0]), (m, i)


def test_fused_norm_swiglu_residual():
    """RMSNorm before, SwiGLU before and a residual after are fused exactly as the reference composes them."""
    codes, scale, zero = _q4(128, 256)
    x, norm, resid = torch.randn(2, 256) * 3, torch.rand(256) + 0.5, torch.randn(2, 128)
    assert _close(cq.q4_gemv(x, codes, scale, zero, norm=norm, eps=1e-5, residual=resid),
                  cq.q4_gemv_ref(x, codes, scale, zero, norm=norm, eps=1e-5, residual=resid))
    gu = torch.randn(1, 512)
    assert _close(cq.q4_gemv(gu, codes, scale, zero, swiglu=True), cq.q4_gemv_ref(gu, codes, scale, zero, swiglu=True))
    c8, s8, _ = _q8(128, 256, 32, False)
    assert _close(cq.q8_gemv(x[:1], c8, s8, None, 32, norm=norm, eps=1e-5, residual=resid[:1]),
                  cq.q8_gemv_ref(x[:1], c8, s8, None, 32, norm=norm, eps=1e-5, residual=resid[:1]))


def test_dequant_exact():
    """Dequantization in C is bit-exact with the torch reference (prefill reads these slabs)."""
    codes, scale, zero = _q4(40, 128)
    assert torch.equal(cq.q4_dequant(codes, scale, zero), cq.q4_dequant_ref(codes, scale, zero))
    c8, s8, z8 = _q8(40, 128, 16, True)
    assert torch.equal(cq.q8_dequant(c8, s8, z8, 16), cq.q8_dequant_ref(c8, s8, z8, 16))
    c32, s32, z32 = _q8(40, 128, 32, True)
    assert torch.equal(cq.q8_dequant(c32, s32, z32, 32), cq.q8_dequant_ref(c32, s32, z32, 32))


def test_dequant_into_a_reused_slab():
    """Prefill dequantizes into one buffer per thread: a slab written over holds exactly the new rows."""
    codes, scale, zero = _q4(40, 128)
    buf = cq.slab(40 * 128)
    with torch.inference_mode():      # the buffer may have been made inside inference mode by an earlier prefill
        buf.fill_(float("nan"))
    out = cq.q4_dequant(codes, scale, zero, out=buf.view(40, 128))
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, cq.q4_dequant_ref(codes, scale, zero))
    c8, s8, z8 = _q8(20, 128, 32, False)
    out = cq.q8_dequant(c8, s8, z8, 32, out=cq.slab(20 * 128).view(20, 128))
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, cq.q8_dequant_ref(c8, s8, z8, 32))
    with pytest.raises(AssertionError):
        cq.q4_dequant(codes, scale, zero, out=torch.empty(40, 127))


def test_zero_point_offset_cancels():
    """A Q4_0 grid (zero = -8 * scale) on an input with a large common offset stays accurate (no cancellation)."""
    codes = torch.full((16, 32), 0x88, dtype=torch.uint8)     # every code 8: every weight exactly 0
    scale = torch.full((16, 2), 0.5)
    x = torch.randn(1, 64) + 100.0
    # the code and zero terms are each about 25,600 here: what is left is fp32 rounding, not a mismatch of inputs
    assert cq.q4_gemv(x, codes, scale, -8 * scale).abs().max().item() <= 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,n,sinks", [(9, 3, 64, 1, 0), (9, 3, 64, 37, 4), (8, 8, 32, 20, 0),
                                              (32, 8, 128, 50, 2), (4, 1, 16, 5, 5), (9, 3, 64, 300, 4),
                                              (8, 2, 512, 40, 2)])
def test_attn_decode_matches_reference(hq, hkv, d, n, sinks, dtype):
    """Decode attention over rotated fp32/bf16 pages (rows in any order, sinks read with their own query, past
    256 slots split into spans whose softmaxes are merged) equals the torch reference."""
    g = torch.Generator().manual_seed(n)
    k_pages = torch.randn(400, hkv, d, generator=g).to(dtype)
    v_pages = torch.randn(400, hkv, d, generator=g).to(dtype)
    rows = torch.randperm(400, generator=g)[:n]
    q, q_sink = torch.randn(hq, d, generator=g) * 3, torch.randn(hq, d, generator=g)
    args = (q, q_sink, sinks, k_pages, v_pages, rows, d ** -0.5)
    assert torch.allclose(cq.attn_decode(*args), cq.attn_decode_ref(*args), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_attention_equals_each_sequence_alone(dtype):
    """Several sequences in one call (ragged lengths on both sides of the span thresholds, some with sinks)
    give each sequence the same bits as a call for it alone."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d = 6, 2, 32
    k_pages = torch.randn(900, hkv, d, generator=g).to(dtype)
    v_pages = torch.randn(900, hkv, d, generator=g).to(dtype)
    lengths, sinks = [30, 300, 1, 70, 255], [0, 4, 0, 2, 0]
    rows = [torch.randperm(900, generator=g)[:n] for n in lengths]
    q, q_sink = torch.randn(5, hq, d, generator=g) * 3, torch.randn(5, hq, d, generator=g)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    out = cq.attn_decode_batch(q, q_sink, torch.tensor(sinks, dtype=torch.int32), k_pages, v_pages, torch.cat(rows),
                               offsets, d ** -0.5)
    for b in range(5):
        alone = cq.attn_decode(q[b], q_sink[b], sinks[b], k_pages, v_pages, rows[b], d ** -0.5)
        assert torch.equal(out[b], alone), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_soft_caps_its_scores(dtype):
    """Gemma 2's soft-cap inside the C decode attention: scores cap * tanh(s / cap) before the softmax, one span or
    several, against a float64 reference; a cap past every score's reach leaves the bits of none."""
    g = torch.Generator().manual_seed(8)
    hq, hkv, d, cap = 4, 2, 64, 5.0
    k_pages = torch.randn(700, hkv, d, generator=g).to(dtype)
    v_pages = torch.randn(700, hkv, d, generator=g).to(dtype)
    lengths = [1, 70, 300]
    rows = [torch.randperm(700, generator=g)[:n] for n in lengths]
    q = torch.randn(3, hq, d, generator=g) * 4                  # scores of +-10 and more: the cap bends them
    offsets = torch.tensor([0] + lengths).cumsum(0)
    args = (q, q, torch.zeros(3, dtype=torch.int32), k_pages, v_pages, torch.cat(rows), offsets, d ** -0.5)
    out = cq.attn_decode_batch(*args, softcap=cap)
    for b in range(3):
        k = k_pages[rows[b]].double().repeat_interleave(hq // hkv, 1)         # [n, hq, d]
        v = v_pages[rows[b]].double().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * d ** -0.5
        want = torch.einsum("hn,nhd->hd", torch.softmax(cap * torch.tanh(s / cap), -1), v)
        assert torch.allclose(out[b].double(), want, atol=1e-5, rtol=1e-4), b
        plain = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
        assert not torch.allclose(out[b].double(), plain, atol=1e-3) or lengths[b] == 1
    assert torch.equal(cq.attn_decode_batch(*args, softcap=None), cq.attn_decode_batch(*args))


def test_half_scales_read_like_float_scales():
    """float16 scales and zeros (kept where the file's values are exactly float16) give the float32 results."""
    codes, scale, zero = _q4(96, 256)
    scale, zero = scale.half(), zero.half()
    x = torch.randn(1, 256)
    full = cq.q4_gemv(x, codes, scale.float(), zero.float())
    assert torch.equal(cq.q4_gemv(x, codes, scale, zero), full)
    assert torch.equal(cq.q4_dequant(codes, scale, zero), cq.q4_dequant_ref(codes, scale, zero))
    c8, s8, z8 = _q8(96, 256, 32, True)
    assert torch.equal(cq.q8_gemv(x, c8, s8.half(), z8.half(), 32), cq.q8_gemv(x, c8, s8.half().float(), z8.half().float(), 32))


@pytest.mark.parametrize("m", [1, 3, 8])
def test_q4_0_scales_without_stored_zeros_give_the_same_bits(m):
    """Q4_0's zero is -8 * scale: kept implicit (kind 4) it is neither stored nor read, and every kernel gives
    the bits of the explicit form; a zero that is not exactly -8 * scale stays stored."""
    codes, scale, _ = _q4(96, 512)
    scale = scale.half()
    explicit = cq.Scales(scale, scale * -8)
    implicit = explicit.implicit_zero()
    assert implicit.offset8 and implicit.zero is None and implicit.kind == 4
    assert implicit.nbytes == explicit.nbytes // 2
    x = torch.randn(m, 512)
    assert torch.equal(cq.q4_gemv(x, codes, implicit), cq.q4_gemv(x, codes, explicit))
    assert torch.equal(cq.q4_gemv(x, codes[10:40], implicit.rows(10, 40)), cq.q4_gemv(x, codes[10:40], explicit.rows(10, 40)))
    assert torch.equal(cq.q4_dequant(codes, implicit), cq.q4_dequant(codes, explicit))
    assert torch.equal(cq.q4_dequant_ref(codes, implicit), cq.q4_dequant_ref(codes, explicit))
    nudged = scale * -8
    nudged[5, 3] = nudged[5, 3] * 1.001
    assert not cq.Scales(scale, nudged).implicit_zero().offset8


def test_a_damaged_library_from_install_is_replaced_by_a_cached_build(tmp_path, monkeypatch):
    """kernels/_built holds the libraries compiled at install; a damaged one (an interrupted copy) is removed
    and the kernels are compiled into the cache dir instead, and load."""
    cq.cpu_lib.library()
    name = cq.cpu_lib.library_name()
    whole = next(f.read_bytes() for f in (cq.cpu_lib.BUILT / name, cq.cpu_lib._cache_dir() / name) if f.exists())
    built = tmp_path / "built"
    monkeypatch.setattr(cq.cpu_lib, "BUILT", built)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    # as an install leaves it (this session's build and its recorded hash, copied: a file this process has not
    # mapped), then cut short
    built.mkdir(mode=0o700)
    so = built / name
    so.write_bytes(whole[:len(whole) // 3])
    so.chmod(0o700)
    (built / (so.name + cq.cpu_lib.HASH_SUFFIX)).write_text(hashlib.sha256(whole).hexdigest())
    lib = cq._build()
    assert not so.exists() and hasattr(lib, "decode_layers")
    assert list((tmp_path / "cache" / "kernels").glob("cpu_quant-*.so"))


def test_split_blocks_equals_numpy(monkeypatch):
    """GGUF blocks split by the C kernel (scales apart from codes) equal numpy's strided copies, into given buffers
    too, for Q4_0's 18-byte and Q8_0's 34-byte blocks."""
    import numpy as np
    from kvchat.engine.gguf.blocks import split_blocks
    from kvchat.kernels import cpu_lib
    rng = np.random.default_rng(0)
    for size, head in ((18, 2), (34, 2), (20, 4)):
        data = rng.integers(0, 256, (37, 12 * size), dtype=np.uint8)
        fast = split_blocks(data, size, head)
        heads, body = np.empty((37, 12, head), np.uint8), np.empty((37, 12 * (size - head)), np.uint8)
        split_blocks(data, size, head, heads, body)
        with monkeypatch.context() as mp:
            mp.setattr(cpu_lib, "library", lambda: None)
            slow = split_blocks(data, size, head)
        blocks = data.reshape(37, 12, size)
        assert np.array_equal(slow[0], blocks[..., :head]) and np.array_equal(slow[1], blocks[..., head:].reshape(37, -1))
        for h, b in (fast, (heads, body)):
            assert np.array_equal(h, slow[0]) and np.array_equal(b, slow[1])


def test_more_rows_than_a_matvec_takes_are_refused_not_overrun():
    """The matvecs keep MAX_ROWS rows' sums on the stack: a call with more is refused before the kernel runs (the
    model's fused() splits them), and MAX_ROWS rows still run."""
    codes, scale, zero = _q4(16, 64)
    x = torch.randn(cq.MAX_ROWS + 1, 64)
    with pytest.raises(AssertionError, match="at most"):
        cq.q4_gemv(x, codes, scale, zero)
    assert cq.q4_gemv(x[:cq.MAX_ROWS].contiguous(), codes, scale, zero).shape == (cq.MAX_ROWS, 16)


def test_argmax_is_torchs_pick():
    """The C greedy pick: torch.argmax's index over random logits, ties (the first of equals), -inf everywhere, signed
    zeros, every length around the vector width; None (torch picks) with a NaN, another dtype or a strided view."""
    g = torch.Generator().manual_seed(3)
    for n in list(range(1, 20)) + [255, 256, 257, 151936]:
        x = torch.randn(n, generator=g)
        assert cq.argmax(x) == int(x.argmax()), n
        x[n // 3] = x[n - 1] = x.max() + 1                      # two equal maxima: the first
        assert cq.argmax(x) == n // 3 == int(x.argmax()), n
    assert cq.argmax(torch.full((37,), -math.inf)) == 0 == int(torch.full((37,), -math.inf).argmax())
    z = torch.tensor([-1.0, -0.0, 0.0, -2.0] * 5)
    assert cq.argmax(z) == int(z.argmax()) == 1
    x = torch.randn(100, generator=g)
    x[70] = math.nan
    assert cq.argmax(x) is None
    assert cq.argmax(x.double()) is None and cq.argmax(torch.randn(40, generator=g)[::2]) is None


@pytest.mark.parametrize("n", [1, 7, 8, 9, 8191, 8193, 262144])
def test_softcap_is_the_capped_tanh_and_keeps_nans(n):
    """Gemma's final logit cap in C (softcap_rows, in place): cap * tanh(x / cap) within 1e-6 of the cap against
    float64, +-inf to +-cap, a NaN left a NaN (the fault checks read it), at lengths around the vector width and the
    threads' chunks."""
    if not cq.available():
        pytest.skip("the C kernels are not built here")
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 60
    x[0] = float("nan")
    if n > 2:
        x[1], x[2] = float("inf"), -float("inf")
    y = x.clone()
    assert cq.softcap_(y, 30.0)
    ref = torch.tanh(x.double() / 30.0) * 30.0
    assert torch.isnan(y[0]) and (torch.isnan(y) == torch.isnan(x)).all()
    assert float((y.double() - ref).nan_to_num().abs().max()) <= 30.0 * 1e-6
    assert not cq.softcap_(x.double(), 30.0)


def test_sigmoid_gate_is_the_float64_product():
    """Qwen3.5's output gate in C (sigmoid_mul_rows, in place): o * sigmoid(g) within 2 ulp-ish of float64 over gates
    that saturate both ways, a NaN kept; shapes or dtypes it cannot take are left to torch (False, nothing done)."""
    if not cq.available():
        pytest.skip("the C kernels are not built here")
    gen = torch.Generator().manual_seed(3)
    o, g = torch.randn(5, 512, generator=gen), torch.randn(5, 512, generator=gen) * 40
    g[0, 0], o[0, 1] = -200.0, float("nan")
    got = o.clone()
    assert cq.sigmoid_mul_(got, g)
    want = o.double() * torch.sigmoid(g.double())
    assert torch.isnan(got[0, 1]) and got[0, 0] == 0.0
    torch.testing.assert_close(got.double().nan_to_num(), want.nan_to_num(), rtol=3e-7, atol=1e-30)
    assert not cq.sigmoid_mul_(o.double(), g.double()) and not cq.sigmoid_mul_(o, g[:, :10])
    assert not cq.sigmoid_mul_(o.t(), g.t())
