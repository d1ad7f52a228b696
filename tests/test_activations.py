"""The opt-in int8 activations (EngineConfig(activations="int8"), kernels/cpu_act8.h): every SIMD variant gives the
same bits, a row the same alone as among others, the one-call decode step the same as the layer-by-layer path,
close to the exact product; and the setting is checked, switched live and kept off the torch-free path."""
import pytest
import torch

from kvchat.engine import Engine
from kvchat.engine.config import CacheConfig, ConfigError, EngineConfig
from kvchat.kernels import cpu_lib, cpu_quant
from test_cpu_quant import _q4, _q8
from test_decode_layers import _decode, ggufs  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="C kernels unavailable")


def _cases(k):
    """Every scale kind the q4 loop reads (float32 with zeros; float16 with Q4_0's implicit -8, with float16 zeros
    as Q4_1's, with none; the fifth bits of Q5_0 / Q5_1; the K-quants' packed bytes with and without the fifth
    bits) and int8 codes with and without zeros."""
    codes, scale, zero = q4 = _q4(40, k, seed=1)
    gen = torch.Generator().manual_seed(5)
    high = torch.randint(0, 256, (40, k // 8), dtype=torch.uint8, generator=gen)
    q4_0 = cpu_quant.Scales(scale.half(), offset8=True)
    q5_0 = cpu_quant.Scales(scale.half(), offset8=True, centre=16)
    sup = lambda: (torch.rand(40, k // 256, generator=gen) * 0.01).half()     # noqa: E731 (k % 256 == 0 only)
    kp = cpu_quant.Scales(torch.randint(0, 256, (40, k // 256 * 12), dtype=torch.uint8, generator=gen),
                          scale_sup=sup(), zero_sup=sup(), per=8, kpacked=True) if k % 256 == 0 else None
    ref4 = lambda x, c: cpu_quant.q4_gemv_ref(x, *c)       # noqa: E731
    cases = [("q4", q4, lambda x, c, act: cpu_quant.q4_gemv(x, *c, act=act), ref4),
             ("q4_0", q4, lambda x, c, act: cpu_quant.q4_gemv(x, codes, q4_0, act=act), None),
             ("q5_0", q4, lambda x, c, act: cpu_quant.q4_gemv(x, codes, q5_0, high=high, act=act), None),
             ("q4_1", q4, lambda x, c, act: cpu_quant.q4_gemv(x, codes, scale.half(), zero.half(), act=act), None),
             ("q5_1", q4, lambda x, c, act: cpu_quant.q4_gemv(x, codes, scale.half(), zero.half(), high=high,
                                                              act=act), None),
             ("f16", q4, lambda x, c, act: cpu_quant.q4_gemv(x, codes, scale.half(), act=act), None)]
    if k % 256 == 0:
        cases += [("q4_k", q4, lambda x, c, act: cpu_quant.q4_gemv(x, codes, kp, act=act), None),
                  ("q5_k", q4, lambda x, c, act: cpu_quant.q4_gemv(x, codes, kp, high=high, act=act), None)]
    for group, with_zero in ((32, False), (32, True)):
        cases.append((f"q8/{with_zero}", _q8(40, k, group, with_zero, seed=2),
                      lambda x, c, act, g=group: cpu_quant.q8_gemv(x, c[0], c[1], c[2], g, act=act),
                      lambda x, c: cpu_quant.q8_gemv_ref(x, c[0], c[1], c[2], 32)))
    return cases


@pytest.mark.parametrize("variant", cpu_lib.runnable_variants())
@pytest.mark.parametrize("k", [576, 544, 608, 768])     # groups: a multiple of 4, one over, two over; K-quants
def test_int8_rows_are_the_same_in_every_simd_variant_and_alone(variant, k):
    lib = cpu_lib._build(variant=variant)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(3))
    old = cpu_quant._lib
    for label, codes, fn, ref_fn in _cases(k):
        ref = ref_fn(x, codes) if ref_fn else fn(x, codes, 16)      # else the int16 kernel (exact to ~1e-5)
        for m in (1, 2, 3, 5, 8):
            try:
                cpu_quant._lib = lib
                got = fn(x[:m], codes, 8)
                alone = torch.cat([fn(x[i:i + 1], codes, 8) for i in range(m)])
            finally:
                cpu_quant._lib = old
            assert torch.equal(got, alone), (variant, label, m)
            if variant != "baseline":       # the baseline sums in plain loops, in another order
                assert torch.equal(got, fn(x[:m], codes, 8)), (variant, label, m)
            # int8 rounding of the activations: about 0.5% of the largest output
            assert (got - ref[:m]).abs().max() <= 2e-2 * ref.abs().max(), (variant, label, m)
            assert not torch.equal(got, fn(x[:m], codes, 16))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K_M"])
def test_the_one_call_step_with_int8_activations_equals_the_layer_path(ggufs, kind):  # noqa: F811
    engine = Engine.load(EngineConfig(model=ggufs[kind], activations="int8"))
    assert engine.activations == "int8" and engine.model.kernel_layers() is not None
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    cache = CacheConfig(k_format="fp32", v_format="fp32")
    a = _decode(engine, cache, prompts, 12, fused=True)
    b = _decode(engine, cache, prompts, 12, fused=False)
    assert torch.equal(a, b), (kind, (a - b).abs().max().item())
    engine.set_activations("int16")
    exact = _decode(engine, cache, prompts, 12, fused=True)
    assert not torch.equal(a, exact)            # the switch reached the kernel's table


def test_the_setting_is_checked_and_kept_off_the_torch_free_path():
    with pytest.raises(ConfigError, match="activations='int4': choose int16, int8"):
        EngineConfig(activations="int4")
    from kvchat.cli.options import engine_config
    from kvchat.cli.terminal import build_parser
    from kvchat.engine.runtime import quick
    args = build_parser().parse_args(["chat", "--activations", "int8", "--prompt", "hi"])
    assert engine_config(args).activations == "int8" and not quick.covers(args)
    engine = Engine.load(EngineConfig(cache=CacheConfig(budget_mb=64)))
    with pytest.raises(ConfigError, match="activations='fp8'"):
        engine.set_activations("fp8")
    assert engine.activations == "int16"
