"""GGUF Q5_0, Q5_1 and Q5_K kept at their own 5.5 bits a weight (linears.Q5Linear: the q4 kernels with a plane of
fifth bits): exactly gguf's values, the matvecs against their float reference in every CPU variant, the same bits
whatever the batch, and a 5-bit file held at its file's size through the engine, the one-call step and the one-shot
path."""
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvchat.bench.gguf_writer import write_random_gguf
from kvchat.engine import Engine, EngineConfig
from kvchat.engine.config import CacheConfig
from kvchat.engine.gguf.blocks import q5_blocks
from kvchat.engine.model.experts import expert_views
from kvchat.engine.model.gguf_view import GGUFModel
from kvchat.engine.model.linears import Q5Linear, Q8Linear
from kvchat.engine.runtime import quick
from kvchat.kernels import cpu_lib
from kvchat.kernels import cpu_quant as cq

pytestmark = pytest.mark.skipif(not cq.available(), reason=f"C kernels unavailable: {cq.unavailable_reason()}")

SIZES = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q5_K": (256, 176)}
KINDS = list(SIZES)


def _blocks(kind: str, n: int, k: int, seed: int = 0, realistic: bool = False) -> np.ndarray:
    """Random rows of `kind` blocks: every code, fifth-bit and sub-scale byte random; the float16 scales any finite
    value (subnormals, zero, negatives), or with realistic=True weight-sized ones (for matvecs)."""
    rng = np.random.default_rng(seed)
    per, size = SIZES[kind]
    b = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    halves = 2 if kind != "Q5_0" else 1                   # d (and m / dmin)
    for i in range(halves):
        if realistic:
            h = rng.uniform(2e-5, 5e-3 if kind != "Q5_K" else 5e-4, (n, k // per)).astype(np.float16)
            h = h.view(np.uint16)
        else:
            sign = (rng.integers(0, 2, (n, k // per)) << 15).astype(np.uint16)
            h = rng.integers(0, 0x7C00, (n, k // per), dtype=np.uint16) | sign
            h[:, ::3] = np.float16(1e-3).view(np.uint16)
        b[..., 2 * i:2 * i + 2] = h.view(np.uint8).reshape(n, k // per, 2)
    return b.reshape(n, -1)


def _lin(kind: str, data: np.ndarray) -> Q5Linear:
    codes, grid = q5_blocks(kind, data)
    grid = {key: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for key, a in grid.items()}
    high = grid.pop("high")
    return Q5Linear(torch.from_numpy(codes), high, cq.Scales(**grid))


def _gguf(kind: str, data: np.ndarray) -> np.ndarray:
    return np.asarray(dequantize(data, GGMLQuantizationType[kind]), np.float32).reshape(data.shape[0], -1)


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _same(kind: str, got, want) -> bool:
    """Bit for bit; Q5_0 as values (q * d - 16 d gives +0 where gguf's d * (q - 16) gives -0 for a negative d)."""
    if kind == "Q5_0":
        return np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    return np.array_equal(_bits(got), _bits(want))


@pytest.fixture(scope="module", params=cpu_lib.runnable_variants())
def variant(request):
    """Each variant this CPU runs (AVX-512, AVX2, the baseline's plain loops) as cpu_quant's library."""
    return request.param, cpu_lib._build(variant=request.param)


def _with(lib, fn):
    old = cq._lib
    try:
        cq._lib = lib
        return fn()
    finally:
        cq._lib = old


def _x(m, k, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2


def _close(out, ref, rel):
    return (out - ref).abs().max().item() <= rel * ref.abs().max().item()


def _rounded(x: torch.Tensor, top: int) -> torch.Tensor:
    """x as the kernels round activations per group of 32 (32767: int16; 127: int8)."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / top)).view_as(x)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_rows_are_gguf_values_bit_for_bit(variant, kind):
    """The C dequantization (float32, and bf16 as torch rounds the float32 values), the torch reference and the
    widened int8 form give gguf-py's values for random blocks, bit for bit, in each variant."""
    name, lib = variant
    data = _blocks(kind, 24, 512, seed=1)
    want = _gguf(kind, data)
    lin = _lin(kind, data)
    h = lin.high
    assert _same(kind, cq.q4_dequant_ref(lin.codes, lin.scales, high=h), want), kind
    got = _with(lib, lambda: cq.q4_dequant(lin.codes, lin.scales, high=h))
    assert _same(kind, got, want), (name, kind)
    b16 = _with(lib, lambda: cq.q4_dequant(lin.codes, lin.scales, high=h, dtype=torch.bfloat16))
    assert _same(kind, b16.float(), torch.from_numpy(want).bfloat16().float()), (name, kind)
    wide = lin.widened()
    assert isinstance(wide, Q8Linear) and _same(kind, wide.dequantize(), want), kind


@pytest.mark.parametrize("kind", KINDS)
def test_the_packed_form_holds_the_files_bits(kind):
    """Every kind keeps its blocks' bytes (nibbles, qh words, float16 scales; Q5_0's zero implicit; Q5_K's 12 scale
    bytes and d, dmin as packed): exactly the file's size."""
    data = _blocks(kind, 6, 1024, seed=2, realistic=True)
    lin = _lin(kind, data)
    assert lin.nbytes == data.nbytes and lin.scales.offset8 == (kind == "Q5_0")
    assert lin.scales.kpacked == (kind == "Q5_K")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prep", ["none", "rmsnorm", "swiglu"])
def test_gemv_tracks_the_float_reference(variant, kind, prep):
    """1 to 8 rows, each prep the decode step fuses, in each variant: within the int16 activations' rounding of the
    float reference; with no prep, the float product of those rounded activations to summation order."""
    name, lib = variant
    k, n = 768, 40
    lin = _lin(kind, _blocks(kind, n, k, seed=3, realistic=True))
    w = lin.dequantize()
    norm = torch.rand(k, generator=torch.Generator().manual_seed(4)) + 0.5
    for m in (1, 2, 3, 5, 8):
        x = _x(m, 2 * k if prep == "swiglu" else k, seed=m)
        kw = {"none": {}, "rmsnorm": {"norm": norm, "eps": 1e-5}, "swiglu": {"swiglu": True}}[prep]
        got = _with(lib, lambda: cq.q4_gemv(x, lin.codes, lin.scales, high=lin.high, **kw))
        ref = cq.q4_gemv_ref(x, lin.codes, lin.scales, None, high=lin.high, **kw)
        assert _close(got, ref, 1e-4), (name, kind, prep, m)
        if prep == "none":
            assert _close(got, _rounded(x, 32767) @ w.t(), 2e-6), (name, kind, m)


@pytest.mark.parametrize("kind", KINDS)
def test_int8_activations_are_exact_for_their_rounding(variant, kind):
    """act=8: the matvec equals the float product of the int8-rounded activations, 1 to 8 rows, in each variant."""
    name, lib = variant
    k, n = 512, 24
    lin = _lin(kind, _blocks(kind, n, k, seed=5, realistic=True))
    w = lin.dequantize()
    for m in (1, 3, 4, 8):
        x = _x(m, k, seed=10 + m)
        got = _with(lib, lambda: cq.q4_gemv(x, lin.codes, lin.scales, high=lin.high, act=8))
        assert _close(got, _rounded(x, 127) @ w.t(), 2e-6), (name, kind, m)


@pytest.mark.parametrize("act", [16, 8])
def test_simd_variants_give_the_same_bits_and_rows_do_not_depend_on_the_batch(variant, act):
    """AVX-512 and AVX2 give the same bits for 1 to 8 rows, and each row of a call equals the same row alone."""
    name, lib = variant
    if name == "baseline":
        pytest.skip("the baseline sums in plain loops, in another order: held to the reference above")
    for kind in KINDS:
        lin = _lin(kind, _blocks(kind, 32, 1280, seed=6, realistic=True))
        x = _x(8, 1280, seed=7)
        fn = lambda rows: cq.q4_gemv(rows, lin.codes, lin.scales, high=lin.high, act=act)   # noqa: E731
        for m in range(1, 9):
            got = _with(lib, lambda: fn(x[:m]))
            assert torch.equal(got, fn(x[:m])), (name, kind, act, m)
            alone = torch.cat([_with(lib, lambda i=i: fn(x[i:i + 1])) for i in range(m)])
            assert torch.equal(got, alone), (name, kind, act, m)


def test_a_q5linear_runs_its_kinds_paths_and_cuts_into_expert_views():
    """Q5Linear: decode rows (the kernel), prompt rows (dequantized slabs, fp32 and bf16), an embedding lookup and
    the GPU path's torch slabs give the reference's numbers; expert_view is rows lo..hi over the same memory."""
    k, n = 512, 96
    data = _blocks("Q5_K", n, k, seed=8, realistic=True)
    lin = _lin("Q5_K", data)
    w = torch.from_numpy(_gguf("Q5_K", data))
    assert lin.kind == "q5" and torch.equal(lin.dequantize(), w)
    x = _x(20, k, seed=9)
    assert _close(lin(x[:3]), x[:3] @ w.t(), 1e-4) and _close(lin(x), x @ w.t(), 1e-5)
    assert torch.equal(lin.rows(torch.tensor([5, 0, 95])), w[[5, 0, 95]])
    norm, res = torch.rand(k) + 0.5, _x(5, n, seed=15)
    assert _close(lin._gpu(x[:5], norm, 1e-5, False, res), lin.fused(x[:5], norm=norm, eps=1e-5, residual=res,
                                                                       split=0), 1e-6)
    lin.prefill_dtype = torch.bfloat16
    assert _close(lin(x), x @ w.t(), 2e-2)
    views = expert_views(lin, 4)
    assert views[2].codes.data_ptr() == lin.codes[48:].data_ptr() and views[2].high.data_ptr() == lin.high[48:].data_ptr()
    assert torch.equal(views[2].dequantize(), w[48:72])


FP32 = CacheConfig(k_format="fp32", v_format="fp32")


@pytest.fixture(scope="module")
def q5_file(tmp_path_factory):
    return write_random_gguf(tmp_path_factory.mktemp("q5") / "tiny-Q5_0.gguf", "tiny", "Q5_0", seed=4)


def test_a_q5_model_holds_its_files_bytes_decodes_in_one_call_and_in_the_one_shot_path(q5_file):
    """Every layer linear of a Q5_0 file is a Q5Linear holding gguf's values, the weights within 1.02x the file's
    tensor bytes (the widened int8 form held 1.5x); the one-call decode step gives the layer path's logits bit for
    bit; the one-shot path (numpy, no torch) tracks the engine."""
    engine = Engine.load(EngineConfig(model=str(q5_file), prefill="fp32"))
    model = engine.model
    gf = GGUFModel(q5_file)
    assert model.linear_kinds()["q5"] == 8
    assert model.weight_bytes() <= 1.02 * gf.tensor_bytes
    want = gf.dequantize("model.layers.1.mlp.down_proj.weight")
    assert _same("Q5_0", model.layers[1].down.dequantize(), want)
    assert model.kernel_layers() is not None
    ids = torch.randint(3, 49152, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = engine.new_session(cache=FP32), engine.new_session(cache=FP32)
    first = a.append(ids)[-1]
    b.append(ids)
    got = a.append([7])
    model._kernel_layers, model._kernel_checked = None, True
    try:
        assert torch.equal(got, b.append([7]))
    finally:
        model._kernel_checked = False
    m = quick.QuickModel(Path(q5_file))
    assert any(p.bits == 5 for p in m.keep if isinstance(p, quick.Packed))
    one_shot = quick.QuickSequence(m, len(ids) + 1).forward(ids)
    assert np.abs(one_shot - first.numpy()).max() <= 2e-3 * np.abs(first.numpy()).max()
