"""GGUF Q6_K kept at its own 6.5625 bits a weight (kernels/cpu_q6k.h, linears.Q6Linear): exactly gguf's values, the
matvec against its float reference in every CPU variant and prep, and a Q6_K file held at its file's size, giving
the int8 path's logits."""
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvchat.bench.gguf_writer import ModelShape, write_random_gguf
from kvchat.engine import Engine, EngineConfig
from kvchat.engine.config import CacheConfig
from kvchat.engine.gguf.blocks import packed_matrix, q6k_parts, unpermute_rows
from kvchat.engine.model.gguf_view import GGUFModel
from kvchat.engine.model.experts import RoutedMLP, expert_views
from kvchat.engine.model.linears import ConcatLinear, Q6Linear, Q8Linear
from kvchat.engine.model.spec import Experts
from kvchat.engine.runtime import quick
from kvchat import kernels
from kvchat.kernels import cpu_lib
from kvchat.kernels import cpu_quant as cq

pytestmark = pytest.mark.skipif(not cq.available(), reason=f"C kernels unavailable: {cq.unavailable_reason()}")

FP32 = CacheConfig(k_format="fp32", v_format="fp32")


def _blocks(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K rows [n, k / 256 * 210]: every code and scale byte random, d any finite float16 (subnormals,
    zero and negatives included)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    sign = (rng.integers(0, 2, (n, k // 256)) << 15).astype(np.uint16)
    d = rng.integers(0, 0x7C00, (n, k // 256), dtype=np.uint16) | sign
    d[:, ::3] = np.float16(1e-3).view(np.uint16)          # a share of realistic scales
    b[..., 208:210] = d.view(np.uint8).reshape(n, k // 256, 2)
    return b.reshape(n, -1)


def _parts(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, cq.Scales]:
    ql, qh, sc, d = (torch.from_numpy(a) for a in q6k_parts(data))
    return ql, qh, cq.Scales(sc, scale_sup=d, per=16)


def _gguf(data: np.ndarray) -> np.ndarray:
    return np.asarray(dequantize(data, GGMLQuantizationType.Q6_K), np.float32).reshape(data.shape[0], -1)


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


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


def _realistic(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Q6_K rows whose d is a weight scale (so products stay in float range): for matvecs."""
    b = _blocks(n, k, seed).reshape(n, k // 256, 210)
    d = np.random.default_rng(seed + 1).uniform(2e-5, 5e-4, (n, k // 256)).astype(np.float16)
    b[..., 208:210] = d.view(np.uint8).reshape(n, k // 256, 2)
    return b.reshape(n, -1)


def test_dequantized_rows_are_gguf_values_bit_for_bit(variant):
    """The C dequantization (float32, and bf16 as torch rounds the float32 values) and the torch reference give
    gguf-py's values for random blocks, bit for bit (the sign of zeros included), in each variant."""
    name, lib = variant
    data = _blocks(48, 1024, seed=1)
    want = _gguf(data)
    ql, qh, s = _parts(data)
    assert np.array_equal(_bits(cq.q6k_dequant_ref(ql, qh, s)), _bits(want))
    got = _with(lib, lambda: cq.q6k_dequant(ql, qh, s))
    assert np.array_equal(_bits(got), _bits(want)), name
    b16 = _with(lib, lambda: cq.q6k_dequant(ql, qh, s, dtype=torch.bfloat16))
    assert torch.equal(b16.view(torch.int16), torch.from_numpy(want).bfloat16().view(torch.int16)), name


def test_the_packed_form_is_the_files_bytes():
    """Nothing is re-rounded or widened: the four arrays hold the blocks' 210 bytes per 256 values, as they are."""
    data = _blocks(5, 512, seed=2)
    parts = q6k_parts(data)
    assert sum(a.nbytes for a in parts) == data.nbytes
    joined = np.concatenate([a.view(np.uint8).reshape(5, 2, -1) for a in parts], -1).reshape(5, -1)
    assert np.array_equal(joined, data)


def _x(m, k, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2


def _close(out, ref, rel):
    return (out - ref).abs().max().item() <= rel * ref.abs().max().item()


def _rounded(x: torch.Tensor, top: int) -> torch.Tensor:
    """x as the kernels round activations per group of 32 (top 32767: int16, quantize_x; 127: int8, quantize_x8):
    round(x * top / max|x|) * max|x| / top."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))   # (top / t: 1/t * top)
    return (torch.round(g * inv) * (amax / top)).view_as(x)


@pytest.mark.parametrize("prep", ["none", "rmsnorm", "swiglu", "residual"])
def test_gemv_tracks_the_float_reference(variant, prep):
    """1 to 8 rows, each prep the decode step fuses, in each variant: within the int16 activations' rounding of the
    float reference, and (no prep) the float product of those rounded activations to float summation order."""
    name, lib = variant
    k, n = 768, 72
    ql, qh, s = _parts(_realistic(n, k, seed=3))
    w = cq.q6k_dequant_ref(ql, qh, s)
    norm = torch.rand(k, generator=torch.Generator().manual_seed(4)) + 0.5
    for m in range(1, 9):
        x = _x(m, 2 * k if prep == "swiglu" else k, seed=m)
        kw = {"none": {}, "rmsnorm": {"norm": norm, "eps": 1e-5}, "swiglu": {"swiglu": True},
              "residual": {"residual": _x(m, n, seed=50 + m)}}[prep]
        got = _with(lib, lambda: cq.q6k_gemv(x, ql, qh, s, **kw))
        assert _close(got, cq.q6k_gemv_ref(x, ql, qh, s, **kw), 1e-4), (name, prep, m)
        if prep == "none":
            assert _close(got, _rounded(x, 32767) @ w.t(), 2e-6), (name, m)


def test_int8_activations_are_exact_for_their_rounding(variant):
    """act=8: the matvec equals the float product of the int8-rounded activations (so only that rounding differs
    from the float reference), 1 to 8 rows, in each variant; with RMSNorm it tracks the float reference."""
    name, lib = variant
    k, n = 512, 40
    ql, qh, s = _parts(_realistic(n, k, seed=5))
    w = cq.q6k_dequant_ref(ql, qh, s)
    for m in range(1, 9):
        x = _x(m, k, seed=10 + m)
        got = _with(lib, lambda: cq.q6k_gemv(x, ql, qh, s, act=8))
        assert _close(got, _rounded(x, 127) @ w.t(), 2e-6), (name, m)
    norm = torch.rand(k) + 0.5
    x = _x(3, k, seed=30)
    got = _with(lib, lambda: cq.q6k_gemv(x, ql, qh, s, norm=norm, eps=1e-5, act=8))
    assert _close(got, cq.q6k_gemv_ref(x, ql, qh, s, norm=norm, eps=1e-5), 2e-2), name


@pytest.mark.parametrize("act", [16, 8])
def test_simd_variants_give_the_same_bits_and_rows_do_not_depend_on_the_batch(variant, act):
    """AVX-512's two groups a register are AVX2's chains: both give the chosen variant's bits for 1 to 8 rows, and
    each row of a call equals the same row alone (a stream batched with others decodes as it would alone)."""
    name, lib = variant
    if name == "baseline":
        pytest.skip("the baseline sums in plain loops, in another order: held to the reference above")
    k, n = 1280, 48
    ql, qh, s = _parts(_realistic(n, k, seed=6))
    x = _x(8, k, seed=7)
    fn = lambda rows: cq.q6k_gemv(rows, ql, qh, s, act=act)              # noqa: E731
    for m in range(1, 9):
        got = _with(lib, lambda: fn(x[:m]))
        assert torch.equal(got, fn(x[:m])), (name, act, m)
        alone = torch.cat([_with(lib, lambda i=i: fn(x[i:i + 1])) for i in range(m)])
        assert torch.equal(got, alone), (name, act, m)


def test_a_q6linear_runs_its_kinds_paths_and_cuts_into_expert_views():
    """Q6Linear: decode rows (the kernel), prompt rows (dequantized slabs, fp32 and bf16) and an embedding lookup
    give the reference's numbers; expert_view is rows lo..hi over the same memory."""
    k, n = 512, 96
    data = _realistic(n, k, seed=8)
    ql, qh, s = _parts(data)
    lin = Q6Linear(ql, qh, s)
    w = torch.from_numpy(_gguf(data))
    assert lin.kind == "q6" and torch.equal(lin.dequantize(), w) and lin.nbytes == data.nbytes
    x = _x(20, k, seed=9)
    assert _close(lin(x[:3]), x[:3] @ w.t(), 1e-4) and _close(lin(x), x @ w.t(), 1e-5)
    assert torch.equal(lin.rows(torch.tensor([5, 0, 95])), w[[5, 0, 95]])
    lin.prefill_dtype = torch.bfloat16
    assert _close(lin(x), x @ w.t(), 2e-2)
    views = expert_views(lin, 4)
    assert [v.out_features for v in views] == [24] * 4
    assert views[2].codes.data_ptr() == ql[48:].data_ptr() and views[2].high.data_ptr() == qh[48:].data_ptr()
    assert views[2].scales.scale.data_ptr() == s.scale[48:].data_ptr()
    assert torch.equal(views[2].dequantize(), w[48:72])


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """x rounded as llama.cpp's Q8_0 rounds it: per group of 32, scale max|x| / 127, to nearest."""
    g = x.view(x.shape[0], -1, 32)
    sc = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(sc > 0, sc, torch.ones_like(sc))) * sc).view_as(x)


def test_int8_prompt_rows_are_q8_0_activations_times_gguf_values(variant):
    """Prompt rows with int8 activations over Q6_K (cpu_gemm8.h: each sub-block's scale applied in int32): the
    float64 product of x rounded as llama.cpp's Q8_0 and gguf's own values, in every build that has them (AVX-512
    and AVX2 with the same bits); a row's bits never depend on the rows beside it; Q6Linear takes them under int8."""
    name, lib = variant
    k, n = 768, 41                                  # three super-blocks, a part block of weight rows
    data = _realistic(n, k, seed=11)
    ql, qh, s = _parts(data)
    w = torch.from_numpy(_gguf(data)).double()
    x = _x(19, k, seed=12) * 3
    x[4] = 0
    if not _with(lib, cq.gemm8_available):
        pytest.skip(f"the {name} build has no int8 prompt rows")
    got = _with(lib, lambda: cq.gemm8_q6k(x, ql, qh, s))
    ref = _q8_0(x).double() @ w.t()
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max() and torch.equal(got[4], torch.zeros(n))
    assert torch.equal(got, cq.gemm8_q6k(x, ql, qh, s)) or not cq.gemm8_available()      # the chosen build's bits
    for lo, hi in ((0, 1), (3, 4), (2, 11), (18, 19), (5, 12)):
        assert torch.equal(_with(lib, lambda: cq.gemm8_q6k(x[lo:hi].contiguous(), ql, qh, s)), got[lo:hi]), (lo, hi)
    lin = Q6Linear(ql, qh, s)
    lin.prefill_dtype = torch.int8
    assert torch.equal(_with(lib, lambda: lin(x)), got)


def test_the_gpu_paths_slabs_give_the_kernels_numbers():
    """Q6Linear._gpu (dequantized slabs through torch: no Triton kernel reads Q6_K's bits) gives the CPU path's
    numbers, norm before, bias and residual after (on CPU tensors here); moved() to the GPU path widens it to the
    int8 grid the Triton kernels read, the same values."""
    k, n = 256, 40
    ql, qh, s = _parts(_realistic(n, k, seed=13))
    lin = Q6Linear(ql, qh, s, bias=torch.randn(n))
    x, norm, res = _x(5, k, seed=14), torch.rand(k) + 0.5, _x(5, n, seed=15)
    want = lin.fused(x, norm=norm, eps=1e-5, residual=res, split=0)          # prompt rows: the fp32 GEMM
    assert _close(lin._gpu(x, norm, 1e-5, False, res), want, 1e-6)
    wide = lin.widened()             # what moved() gives the GPU path: the Triton kernels' int8 grid, same values
    assert isinstance(wide, Q8Linear) and torch.equal(wide.dequantize(), lin.dequantize())


def test_routed_experts_in_q6k_run_in_the_kernel_as_in_the_grouped_path():
    """A routed MLP whose router and experts are Q6Linear views: moe_layer_rows (decode rows in C) gives the
    grouped path's numbers to float rounding."""
    h, f, e = 256, 256, 4
    gate, up, down = (Q6Linear(*_parts(_realistic(e * a, b, seed=11 + i)))
                      for i, (a, b) in enumerate(((f, h), (f, h), (h, f))))
    router = Q6Linear(*_parts(_realistic(e, h, seed=20)))
    mlp = RoutedMLP(Experts(count=e, used=2, ffn=f), router, None, expert_views(gate, e), expert_views(up, e),
                    expert_views(down, e))
    table = mlp.kernel_table()
    assert table is not None
    x = _x(3, h, seed=12) * 5
    norm = torch.rand(h) + 0.5
    fast = mlp.fused(x, norm, 1e-5, x, split=3)
    mlp._table = None
    try:
        slow = mlp.fused(x, norm, 1e-5, x, split=3)
    finally:
        mlp._table = table
    assert _close(fast, slow, 1e-5)


@pytest.fixture(scope="module")
def q6_file(tmp_path_factory):
    return write_random_gguf(tmp_path_factory.mktemp("q6k") / "tiny-Q6_K.gguf", "tiny", "Q6_K", seed=5)


def test_a_file_tensor_packs_to_gguf_values(q6_file):
    """A real file's Q6_K tensors (bench/gguf_writer.py's Q6_K mix, q/k rows unpermuted as the loader does) pack
    into Q6_K parts that dequantize to gguf's values bit for bit."""
    gf = GGUFModel(q6_file)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.embed_tokens.weight"):
        heads = gf.permuted_heads(name, 4, 2)
        m = packed_matrix(gf, name, heads)
        assert m.bits == 6 and m.kind == "Q6_K", name
        lin = Q6Linear(torch.from_numpy(m.codes), torch.from_numpy(m.grid["high"]),
                       cq.Scales(torch.from_numpy(m.grid["scale"]), scale_sup=torch.from_numpy(m.grid["scale_sup"]),
                                 per=16))
        want = gf.dequantize(name)
        assert np.array_equal(_bits(lin.dequantize()), _bits(unpermute_rows(want, heads) if heads else want)), name


def _widened(lin):
    """The int8 path this file took before (Q6Linear.widened): int8 codes beside the same scales."""
    if isinstance(lin, ConcatLinear):
        return ConcatLinear([_widened(p) for p in lin.parts], lin.bias)
    return lin.widened() if isinstance(lin, Q6Linear) else lin


def test_a_q6k_model_holds_its_files_bytes_and_gives_the_int8_paths_logits(q6_file):
    """Every linear of a Q6_K file is a Q6Linear, the weights hold at most 1.02x the file's tensor bytes, the
    one-call decode step covers it, and prompt and decode logits equal the int8 path's to float rounding."""
    engine = Engine.load(EngineConfig(model=str(q6_file), prefill="fp32"))
    model = engine.model
    assert model.linear_kinds() == {"q6": 9}
    assert model.weight_bytes() <= 1.02 * GGUFModel(q6_file).tensor_bytes
    assert model.kernel_layers() is not None
    wide = Engine.load(EngineConfig(model=str(q6_file), prefill="fp32"))
    m8 = wide.model
    for L in m8.layers:
        for part in ("qkv", "o", "gate_up", "down"):
            setattr(L, part, _widened(getattr(L, part)))
    m8.table = m8.lm_head = _widened(m8.lm_head)
    m8._kernel_layers, m8._kernel_checked = None, False
    assert set(m8.linear_kinds()) == {"q8"} and m8.weight_bytes() > 1.1 * model.weight_bytes()
    ids = torch.randint(3, 49152, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = engine.new_session(cache=FP32), wide.new_session(cache=FP32)
    la, lb = a.append(ids)[-1], b.append(ids)[-1]
    for _ in range(6):
        assert _close(la, lb, 1e-4)
        nxt = int(lb.argmax())
        la, lb = a.append([nxt])[-1], b.append([nxt])[-1]


@pytest.mark.skipif(not kernels.triton_available(), reason="triton is not importable here")
def test_the_gpu_path_loads_q6k_as_the_triton_kernels_int8_grid(q6_file, monkeypatch):
    """On the GPU path (here triton's interpreter on CPU tensors) every Q6_K linear is the widened int8 grid the
    Triton kernels read, holding gguf's values."""
    cuda = torch.cuda.is_available()
    if not cuda:
        monkeypatch.setenv("KVCHAT_GPU_PATH", "interpret")
        assert kernels.gpu_path("cpu"), "TRITON_INTERPRET=1 must be set before triton is imported (conftest)"
    model = Engine.load(EngineConfig(model=str(q6_file), device="cuda" if cuda else "cpu")).model
    assert model.weights == "gguf" and model.linear_kinds() == {"q8": 9}
    gf = GGUFModel(q6_file)
    want = gf.dequantize("model.layers.1.mlp.down_proj.weight")
    assert np.array_equal(_bits(model.layers[1].down.dequantize().cpu()), _bits(want))


def test_the_one_shot_path_reads_q6k_at_its_bits(q6_file):
    """engine/runtime/quick.py packs the same parts (no torch) and its logits track the engine's."""
    m = quick.QuickModel(Path(q6_file))
    assert all(p.bits == 6 for p in m.keep if isinstance(p, quick.Packed)) and m.head.bits == 6
    engine = Engine.load(EngineConfig(model=str(q6_file), prefill="fp32"))
    ids = torch.randint(3, m.config.vocab_size, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    want = engine.new_session().append(ids, all_logits=False)[-1].numpy()
    got = quick.QuickSequence(m, len(ids) + 1).forward(ids)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()


def test_a_mixture_of_q6k_experts_decodes_in_one_call(tmp_path):
    """A Qwen3-MoE-shaped Q6_K file: its 3-D expert tensors become Q6Linear views, the one-call step covers the
    layers, and its decode logits equal the layer-by-layer path's bit for bit."""
    shape = ModelShape("moe-q6k", 2, 256, 4, 2, 512, 64, 2048, 1e6, False, arch="qwen3moe", vocab=None,
                       rms_norm_eps=1e-6, experts=4, experts_used=2, expert_ffn=256)
    path = write_random_gguf(tmp_path / "moe-Q6_K.gguf", shape, "Q6_K", seed=3)
    engine = Engine.load(EngineConfig(model=str(path)))
    model = engine.model
    mlp = next(L.mlp for L in model.layers if L.mlp is not None)
    assert all(isinstance(x, Q6Linear) for x in mlp.gate + mlp.up + mlp.down)
    assert model.weight_bytes() <= 1.02 * GGUFModel(path).tensor_bytes
    assert model.kernel_layers() is not None
    ids = torch.randint(3, 1000, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = engine.new_session(cache=FP32), engine.new_session(cache=FP32)
    a.append(ids)
    b.append(ids)
    got = a.append([7])
    model._kernel_layers, model._kernel_checked = None, True
    try:
        want = b.append([7])
    finally:
        model._kernel_checked = False
    assert torch.equal(got, want)
