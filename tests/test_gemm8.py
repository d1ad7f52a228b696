"""Prompt rows with int8 activations (prefill="int8", kernels/cpu_gemm8.h): every packed kind it reads gives
llama.cpp's Q8_0 rounding of x times the dequantized weights, a row's bits never depend on the rows beside it or
how many there are, and an engine reading prompts this way answers as the exact path does."""
import pytest
import torch

from kvchat.kernels import cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.gemm8_available(), reason="int8 prompt rows need the AVX2 or AVX-512 build")


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """x rounded as llama.cpp's Q8_0 rounds it: per group of 32, scale max|x| / 127, to nearest."""
    g = x.view(x.shape[0], -1, 32)
    s = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(s > 0, s, torch.ones_like(s))) * s).view_as(x)


def _cases(n: int, k: int):
    from test_cpu_quant import _q4, _q8
    codes, scale, zero = _q4(n, k, seed=1)
    half = scale.half()
    high = torch.randint(0, 256, (n, k // 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    yield "q4", (codes, scale, zero), dict(bits=4), cpu_quant.q4_dequant(codes, scale, zero)
    yield "q4/f16", (codes, half, zero.half()), dict(bits=4), cpu_quant.q4_dequant(codes, half, zero.half())
    q4_0 = cpu_quant.Scales(half, offset8=True)
    yield "q4_0", (codes, q4_0), dict(bits=4), cpu_quant.q4_dequant(codes, q4_0)
    q5_0 = cpu_quant.Scales(half, offset8=True, centre=16)
    yield "q5_0", (codes, q5_0), dict(bits=4, high=high), cpu_quant.q4_dequant(codes, q5_0, high=high)
    for with_zero in (False, True):
        c8, s8, z8 = _q8(n, k, 32, with_zero, seed=2)
        yield f"q8/{with_zero}", (c8, s8, z8), dict(bits=8), cpu_quant.q8_dequant(c8, s8, z8, 32)


@pytest.mark.parametrize("n,k", [(41, 96), (16, 64), (200, 576)])
def test_every_kind_is_q8_0_activations_times_the_weights(n, k):
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(3)) * 3
    x[5] = 0                                            # a row of zeros: scale 0, no NaN
    for label, args, kw, w in _cases(n, k):
        got = cpu_quant.gemm8(x, *args, **kw)
        ref = _q8_0(x).double() @ w.double().t()
        assert got.shape == (37, n) and torch.isfinite(got).all(), label
        assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), label
        assert torch.equal(got[5], torch.zeros(n)), label


def test_no_rows_give_no_rows():
    from test_cpu_quant import _q4
    codes, scale, zero = _q4(41, 96, seed=1)
    assert cpu_quant.gemm8(torch.empty(0, 96), codes, scale, zero).shape == (0, 41)


def test_a_rows_bits_do_not_depend_on_the_call():
    """Alone, first or last of 1 to 19 rows (tiles of 8 and every remainder): the same bits."""
    x = torch.randn(19, 96, generator=torch.Generator().manual_seed(5))
    for label, args, kw, _ in _cases(41, 96):
        whole = cpu_quant.gemm8(x, *args, **kw)
        for lo, hi in ((0, 1), (3, 4), (0, 8), (2, 11), (1, 19), (18, 19), (5, 12)):
            assert torch.equal(cpu_quant.gemm8(x[lo:hi].contiguous(), *args, **kw), whole[lo:hi]), (label, lo, hi)


def test_an_engine_reading_prompts_in_int8_agrees_with_the_exact_path():
    """The default model (Q4_1 and Q8_0 tensors): next-token choices over a prose prompt agree with fp32's on at
    least 90% of positions (bf16's bar, test_prefill_precision)."""
    from kvchat.engine import Engine, EngineConfig
    from kvchat.engine.config import CacheConfig
    engine = Engine.load(EngineConfig(cache=CacheConfig(budget_mb=64), prefill="int8"))
    assert (engine.prefill, engine.prefill_why) == ("int8", "asked for")
    ids = engine.tokenizer.encode("The key and value of every token stay in the cache, so that attention can look "
                                  "back over the conversation without reading it again. " * 3)
    fast = engine.new_session(prefix_cache=False).append(ids)
    engine.set_prefill("fp32")
    exact = engine.new_session(prefix_cache=False).append(ids)
    assert not torch.equal(exact, fast)
    agree = (exact.argmax(-1) == fast.argmax(-1)).double().mean()
    assert agree >= 0.9, agree
