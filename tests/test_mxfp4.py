"""GGUF MXFP4 (GGML type 39, gpt-oss's expert weights): the torch reference against gguf-py's own dequantization,
the C kernels (kernels/cpu_mxfp4.h) in every variant this CPU runs against the reference, MXFP4Linear's prompt and
decode rows, the Triton kernels (under triton's interpreter without a GPU) and the loader's packed form of a file."""
import numpy as np
import pytest
import torch

from kvchat.engine.gguf.blocks import mxfp4_blocks, packed_matrix
from kvchat.engine.model.linears import MXFP4Linear
from kvchat.kernels import cpu_lib, cpu_quant as cq

needs_kernels = pytest.mark.skipif(not cq.available(), reason=f"C kernels unavailable: {cq.unavailable_reason()}")


def _blocks(rows: int, nb: int, seed: int = 0, exponents=range(256)) -> np.ndarray:
    """Raw MXFP4 rows [rows, nb * 17]: random code bytes, each exponent of `exponents` in turn (shuffled)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, nb, 17), dtype=np.uint8)
    e = np.resize(np.array(list(exponents), np.uint8), rows * nb)
    b[..., 0] = rng.permutation(e).reshape(rows, nb)
    return b.reshape(rows, nb * 17)


def _mx(n: int, k: int, seed: int = 0, exponents=range(126, 130)) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [n, k/2], e8m0 [n, k/32] with scales 2^-2 to 2^1: groups of like size, so that a wrong product in any
    group shows against the sum of all (the dequantization tests cover every exponent)."""
    codes, e8m0 = mxfp4_blocks(_blocks(n, k // 32, seed, exponents))
    return torch.from_numpy(codes), torch.from_numpy(e8m0)


def _gguf_dequantize(data: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    with np.errstate(over="ignore"):           # values 8 and 12 with e >= 253: infinities, as the kernels give
        return np.asarray(dequantize(data, GGMLQuantizationType.MXFP4), np.float32).reshape(data.shape[0], -1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_the_reference_is_gguf_bit_for_bit():
    """mxfp4_blocks + mxfp4_dequant_ref give gguf-py's numbers bit for bit over all 256 exponents (e < 2: subnormal
    scales; e >= 253: gguf's infinities) and every code in both nibbles."""
    data = _blocks(8, 64)
    codes, e8m0 = mxfp4_blocks(data)
    assert codes.shape == (8, 1024) and e8m0.shape == (8, 64) and codes.dtype == e8m0.dtype == np.uint8
    assert len(np.unique(e8m0)) == 256 and len(np.unique(codes & 15)) == len(np.unique(codes >> 4)) == 16
    want = torch.from_numpy(_gguf_dequantize(data))
    got = cq.mxfp4_dequant_ref(torch.from_numpy(codes), torch.from_numpy(e8m0))
    assert _same_bits(got, want)
    assert (got[:, :16] != 0).any() and torch.isinf(got).any() and ((got != 0) & (got.abs() < 2 ** -126)).any()


def test_the_value_table_and_exponents_are_gguf_s():
    from gguf.quants import MXFP4
    assert cq.MXFP4_VALUES == tuple(MXFP4.kvalues)
    e = np.arange(256, dtype=np.uint8)
    assert np.array_equal(cq.e8m0_ref(torch.from_numpy(e)).numpy().view(np.uint32),
                          MXFP4.e8m0_to_fp32_half(e).view(np.uint32))


_built: dict = {}


@pytest.fixture(params=cpu_lib.runnable_variants() if cq.available() else [])
def variant(request):
    """(name, library) of each variant this CPU runs (each built once); cq's calls go to it during the test."""
    if request.param not in _built:
        _built[request.param] = cpu_lib._build(variant=request.param)
    old = cq._lib
    cq._lib = _built[request.param]
    yield request.param, cq._lib
    cq._lib = old


def _chosen(fn):
    """fn() with the variant the engine loaded, whatever variant a test holds."""
    held = cq._lib
    cq._lib = cpu_lib.library()
    try:
        return fn()
    finally:
        cq._lib = held


@needs_kernels
def test_c_dequantization_is_the_reference_bit_for_bit(variant):
    """float32 slabs equal the reference bit for bit, every exponent and code; bf16 slabs equal its .bfloat16()
    (round to nearest even); into a reused slab as prefill writes them."""
    name, _ = variant
    codes, e8m0 = (torch.from_numpy(a) for a in mxfp4_blocks(_blocks(24, 48, seed=1)))
    ref = cq.mxfp4_dequant_ref(codes, e8m0)
    assert _same_bits(cq.mxfp4_dequant(codes, e8m0), ref), name
    bf = cq.mxfp4_dequant(codes, e8m0, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf.view(torch.int16), ref.bfloat16().view(torch.int16)), name
    with torch.inference_mode():            # as the engine's prefill uses the slab (made in it)
        buf = cq.slab(24 * 1536)
        buf.fill_(float("nan"))
        out = cq.mxfp4_dequant(codes[:20], e8m0[:20], out=buf[:20 * 1536].view(20, 1536))
        assert out.data_ptr() == buf.data_ptr() and _same_bits(out, ref[:20]), name


def _quantized_ref(x: torch.Tensor, codes: torch.Tensor, e8m0: torch.Tensor, act: int) -> tuple:
    """What the kernel computes, in float64: x rounded per group of 32 to int16 (act 16) or int8 (act 8) as the C
    code rounds it, the exact integer products, each group's sum times 2^(e - 128) * xs. -> (y [M, N], the sum of
    the terms' magnitudes [M, N]): only the kernel's float32 sums may differ from it."""
    top = 32767.0 if act == 16 else 127.0
    m, k = x.shape
    g = x.view(m, k // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(top) / amax, torch.zeros(()))
    q = torch.round(g * inv)                                                     # lrintf: half to even
    xs = (amax / torch.tensor(top))[..., 0]                                      # [M, G]
    n = codes.shape[0]
    values = torch.tensor(cq.MXFP4_VALUES, dtype=torch.float64)
    b = codes.view(n, -1, 16).long()
    w = values[torch.cat((b & 15, b >> 4), -1)]                                  # [N, G, 32]
    dots = torch.einsum("mgj,ngj->mng", q.double(), w)                           # exact integers
    f = cq.e8m0_ref(e8m0)[None] * xs[:, None, :]                                 # float32, as the kernel forms it
    terms = f.double() * dots
    return terms.sum(-1), terms.abs().sum(-1)


@needs_kernels
@pytest.mark.parametrize("k", [576, 544])            # an even and an odd number of groups of 32
@pytest.mark.parametrize("act", [16, 8])
def test_c_gemv_matches_the_reference_for_1_to_8_rows(variant, k, act):
    """For M = 1..8 rows: the matvec equals the exact product of the quantized activations up to float32 summation
    (the integer products exact); a row's bits are the same alone as among others; the SIMD variants give the
    engine's variant's bits (the baseline sums in plain loops, in another order); and close to the float product."""
    name, _ = variant
    codes, e8m0 = _mx(40, k, seed=2)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(3)) * 2
    rel = 2e-4 if act == 16 else 2e-2                # int16 / int8 rounding of the activations
    for m in range(1, 9):
        got = cq.mxfp4_gemv(x[:m], codes, e8m0, act=act)
        want, size = _quantized_ref(x[:m], codes, e8m0, act)
        assert ((got.double() - want).abs() <= 4e-6 * size + 1e-30).all(), (name, act, m)
        alone = torch.cat([cq.mxfp4_gemv(x[i:i + 1], codes, e8m0, act=act) for i in range(m)])
        assert torch.equal(got, alone), (name, act, m)
        if name != "baseline" or cpu_lib.current_variant() == "baseline":
            assert torch.equal(got, _chosen(lambda: cq.mxfp4_gemv(x[:m], codes, e8m0, act=act))), (name, act, m)
        ref = cq.mxfp4_gemv_ref(x[:m], codes, e8m0)
        assert (got - ref).abs().max() <= rel * ref.abs().max(), (name, act, m)


@needs_kernels
@pytest.mark.parametrize("act", [16, 8])
def test_c_gemv_reads_every_exponent(variant, act):
    """E8M0 exponents through a decode row's scales (formed eight at a time): the subnormal 2^-128 and 2^-127, and
    runs of four across the range, each row's groups of like size, against activations scaled so that no sum
    leaves float32: the exact product up to float32 summation."""
    name, _ = variant
    for lo in (0, 2, 60, 124, 252):
        exponents, scale = range(lo, lo + 4 if lo else 2), 2.0 ** max(-100, min(100, 128 - lo))
        codes, e8m0 = _mx(24, 1024, seed=4, exponents=exponents)
        x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(5)) * scale
        got = cq.mxfp4_gemv(x, codes, e8m0, act=act)
        want, size = _quantized_ref(x, codes, e8m0, act)
        assert torch.isfinite(got).all() and ((got.double() - want).abs() <= 4e-6 * size + 1e-30).all(), (name, act)


@needs_kernels
@pytest.mark.parametrize("act", [16, 8])
def test_c_gemv_fuses_norm_swiglu_and_residual(variant, act):
    """RMSNorm before, SwiGLU before and a residual after, in the kernel, as the reference composes them; the
    residual is added to exactly the plain product."""
    name, _ = variant
    gen = torch.Generator().manual_seed(4)
    codes, e8m0 = _mx(48, 256, seed=5)
    norm, resid = torch.rand(256, generator=gen) + 0.5, torch.randn(8, 48, generator=gen)
    rel = 2e-4 if act == 16 else 2e-2
    for m in (1, 3, 8):
        x, gu = torch.randn(m, 256, generator=gen) * 3, torch.randn(m, 512, generator=gen)
        r = resid[:m].contiguous()
        for kw, inp in ((dict(norm=norm, eps=1e-5), x), (dict(swiglu=True), gu), (dict(residual=r), x),
                        (dict(norm=norm, eps=1e-5, residual=r), x)):
            got = cq.mxfp4_gemv(inp, codes, e8m0, act=act, **kw)
            ref = cq.mxfp4_gemv_ref(inp, codes, e8m0, **kw)
            assert (got - ref).abs().max() <= rel * ref.abs().max(), (name, act, m, sorted(kw))
        plain = cq.mxfp4_gemv(x, codes, e8m0, act=act)
        assert torch.equal(cq.mxfp4_gemv(x, codes, e8m0, residual=r, act=act), plain + r), (name, act, m)


def test_the_linear_s_prompt_rows_go_through_the_gemm_over_dequantized_slabs():
    """Prompt rows (more than MAX_ROWS) through dequantized slabs and the BLAS GEMM equal the dense product of the
    reference weights (float32 rounding only); bias, RMSNorm and residual around it; bf16 prefill close to it."""
    gen = torch.Generator().manual_seed(6)
    codes, e8m0 = _mx(72, 192, seed=7)
    bias, norm = torch.randn(72, generator=gen), torch.rand(192, generator=gen) + 0.5
    w = cq.mxfp4_dequant_ref(codes, e8m0)
    x, resid = torch.randn(20, 192, generator=gen), torch.randn(20, 72, generator=gen)
    lin = MXFP4Linear(codes, e8m0, bias)
    want = torch.nn.functional.linear(cq.prep_ref(x, norm, 1e-5), w, bias) + resid
    got = lin.fused(x, norm=norm, eps=1e-5, residual=resid)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    lin.bias = None
    want = x @ w.t()
    assert (lin(x) - want).abs().max() <= 1e-5 * want.abs().max()
    lin.prefill_dtype = torch.bfloat16
    assert (lin(x) - want).abs().max() <= 2e-2 * want.abs().max()


@needs_kernels
def test_the_linear_s_decode_rows_are_the_kernel_s_and_its_parts_are_the_file_s():
    """Decode rows run mxfp4_gemv (int16, or int8 with act_bits 8) with the prep fused, each row the same bits
    however many prompt rows follow it; dequantize(), rows() (an embedding lookup), an expert's view (no copy),
    nbytes (17 bytes per 32 weights) and moved() read the same bytes."""
    gen = torch.Generator().manual_seed(8)
    codes, e8m0 = _mx(64, 256, seed=9)
    lin = MXFP4Linear(codes, e8m0)
    x, norm, resid = torch.randn(11, 256, generator=gen), torch.rand(256, generator=gen) + 0.5, torch.randn(11, 64)
    (part,) = lin.kernel_parts()                    # lin_apply's bits-4 linear of KIND_MXFP4: the exponents as scale
    assert lin.kind == "mxfp4" and (part.bits, part.kind, part.N, part.K) == (4, MXFP4Linear.KERNEL_KIND, 64, 256)
    assert part.codes == codes.data_ptr() and part.scale == e8m0.data_ptr()
    assert torch.equal(lin.fused(x[:3], norm=norm, eps=1e-5, residual=resid[:3]),
                       cq.mxfp4_gemv(x[:3], codes, e8m0, norm=norm, eps=1e-5, residual=resid[:3]))
    mixed = lin.fused(x, norm=norm, eps=1e-5, residual=resid, split=3)
    assert torch.equal(mixed[:3], lin.fused(x[:3], norm=norm, eps=1e-5, residual=resid[:3]))
    assert torch.equal(mixed[3:], lin.fused(x[3:], norm=norm, eps=1e-5, residual=resid[3:], split=0))
    lin.act_bits = 8
    assert torch.equal(lin(x[:2]), cq.mxfp4_gemv(x[:2], codes, e8m0, act=8))
    dense = cq.mxfp4_dequant_ref(codes, e8m0)
    assert _same_bits(lin.dequantize(), dense)
    ids = torch.tensor([5, 0, 63, 5])
    assert _same_bits(lin.rows(ids), dense[ids])
    part = lin.expert_view(16, 32)
    assert part.codes.data_ptr() == codes[16:].data_ptr() and part.e8m0.data_ptr() == e8m0[16:].data_ptr()
    assert _same_bits(part.dequantize(), dense[16:32]) and part.out_features == 16 and part.in_features == 256
    assert lin.nbytes == 64 * 256 * 17 // 32 and lin.moved("cpu") is lin


def test_a_gguf_mxfp4_tensor_is_packed_as_the_file_stores_it(tmp_path):
    """A GGUF written by gguf-py's GGUFWriter with a 3-D MXFP4 expert tensor (gguf.quants.quantize): packed_matrix
    keeps its codes and exponents (kind "MXFP4", rows of the experts stacked), whose dequantization is gguf's."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from kvchat.engine.gguf.file import GGUFFile
    w = (np.random.default_rng(10).standard_normal((2, 24, 64)) * 0.05).astype(np.float32)    # [experts, out, in]
    data = quantize(w, GGMLQuantizationType.MXFP4)
    path = tmp_path / "mxfp4.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", data, raw_dtype=GGMLQuantizationType.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gf = GGUFFile(path)
    m = packed_matrix(gf, "blk.0.ffn_gate_exps.weight", None)
    assert m.kind == "MXFP4" and m.bits == 4 and set(m.grid) == {"e8m0"}
    assert m.codes.shape == (48, 32) and m.grid["e8m0"].shape == (48, 2)
    assert m.codes.flags.c_contiguous and m.grid["e8m0"].flags.c_contiguous
    want = torch.from_numpy(_gguf_dequantize(data.reshape(48, -1)))
    lin = MXFP4Linear(torch.from_numpy(m.codes), torch.from_numpy(m.grid["e8m0"]))
    assert _same_bits(lin.dequantize(), want) and _same_bits(lin.expert_view(24, 48).dequantize(), want[24:])


class TestTriton:
    """mxfp4_matmul, the Triton kernels' MXFP4 path, against mxfp4_matmul_ref (under triton's interpreter on the
    CPU: conftest)."""

    @pytest.fixture(autouse=True)
    def _triton(self):
        pytest.importorskip("triton")

    @staticmethod
    def _device():
        return "cuda" if torch.cuda.is_available() else "cpu"

    @pytest.mark.parametrize("rows", [1, 3, 8, 9, 70])         # the GEMV kernel up to DECODE_ROWS, then the tiled one
    def test_every_row_count_matches_the_reference(self, rows):
        from kvchat.kernels.triton_matmul import DECODE_ROWS, mxfp4_matmul, mxfp4_matmul_ref
        assert DECODE_ROWS == 8
        gen = torch.Generator().manual_seed(rows)
        codes, e8m0 = _mx(37, 96, seed=rows)
        x, bias = torch.randn(rows, 96, generator=gen), torch.randn(37, generator=gen)
        d = self._device()
        got = mxfp4_matmul(x.to(d), codes.to(d), e8m0.to(d), bias.to(d)).cpu()
        want = mxfp4_matmul_ref(x, codes, e8m0, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, 37)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()      # TF32 on a GPU's tensor cores: 1e-3
        assert mxfp4_matmul(x[:0].to(d), codes.to(d), e8m0.to(d)).shape == (0, 37)

    def test_the_weights_are_dequantized_as_gguf_does(self):
        """Multiplying by the identity reads back every weight bit for bit: subnormal scales (e < 2) included, all
        but the three whose values 8 and 12 overflow (0 times an infinity is NaN)."""
        if torch.cuda.is_available():
            pytest.skip("on a GPU the tiled kernel multiplies in TF32")
        from kvchat.kernels.triton_matmul import mxfp4_matmul
        codes, e8m0 = (torch.from_numpy(a) for a in mxfp4_blocks(_blocks(127, 2, seed=11, exponents=range(253))))
        assert len(e8m0.unique()) == 253
        want = cq.mxfp4_dequant_ref(codes, e8m0)
        eye = torch.eye(64)
        assert _same_bits(mxfp4_matmul(eye, codes, e8m0), want.t().contiguous())       # the tiled kernel
        assert _same_bits(mxfp4_matmul(eye[:8], codes, e8m0), want.t()[:8].contiguous())   # the GEMV one

    def test_the_linear_s_gpu_path_is_the_kernel_s(self):
        from kvchat.kernels.triton_matmul import mxfp4_matmul_ref
        gen = torch.Generator().manual_seed(12)
        codes, e8m0 = _mx(40, 128, seed=13)
        x, norm, resid = torch.randn(5, 128, generator=gen), torch.rand(128, generator=gen) + 0.5, torch.randn(5, 40)
        d = self._device()
        lin = MXFP4Linear(codes, e8m0).moved(d)
        got = lin._gpu(x.to(d), norm.to(d), 1e-5, False, resid.to(d)).cpu()
        want = mxfp4_matmul_ref(cq.prep_ref(x, norm, 1e-5), codes, e8m0) + resid
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
