"""The prompt GEMM's precision (EngineConfig.prefill): bf16 slabs dequantized in one pass as torch rounds them,
rows whose bits do not depend on the rows beside them, the choice said and switchable live, and what it costs
against the exact fp32 path on the real default model."""
import pytest
import torch

from kvchat.engine.config import CacheConfig, ConfigError, EngineConfig
from kvchat.kernels import cpu_lib, cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="C kernels unavailable")


@pytest.fixture(scope="module", params=cpu_lib.runnable_variants())
def variant(request):
    return cpu_lib._build(variant=request.param)


def test_bf16_dequantization_rounds_as_torch_does(variant):
    from test_cpu_quant import _q4, _q8
    old = cpu_quant._lib
    try:
        cpu_quant._lib = variant
        codes, scale, zero = _q4(48, 576, seed=4)
        want = cpu_quant.q4_dequant(codes, scale, zero).bfloat16()
        assert torch.equal(cpu_quant.q4_dequant(codes, scale, zero, dtype=torch.bfloat16).view(torch.int16),
                           want.view(torch.int16))
        for group, with_zero in ((32, False), (16, True)):
            codes, scale, zero = _q8(48, 576, group, with_zero, seed=5)
            want = cpu_quant.q8_dequant(codes, scale, zero, group).bfloat16()
            got = cpu_quant.q8_dequant(codes, scale, zero, group, dtype=torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), group
    finally:
        cpu_quant._lib = old


def test_a_bf16_prompt_row_is_the_same_in_any_call():
    """Calls of BF16_TILE rows: a row gives the same bits alone, among 64, 65 or 130 rows, at any place."""
    from kvchat.engine.model.linears import BF16_TILE, Q4Linear
    from test_cpu_quant import _q4
    lin = Q4Linear(*_q4(1536, 576, seed=6))
    lin.prefill_dtype = torch.bfloat16
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(7))
    whole = lin._gemm(x)
    for rows in (slice(0, 1), slice(3, 8), slice(0, BF16_TILE), slice(1, BF16_TILE + 2), slice(60, 130)):
        assert torch.equal(lin._gemm(x[rows]), whole[rows]), rows
    exact = x @ lin.dequantize().t()
    assert (whole - exact).abs().max() <= 2e-2 * exact.abs().max()      # bf16 inputs and outputs


@pytest.fixture(scope="module")
def engine():
    from kvchat.engine import Engine
    return Engine.load(EngineConfig(cache=CacheConfig(budget_mb=64)))


def test_the_choice_is_said_and_switches_live(engine):
    assert (engine.prefill, engine.prefill_why) == cpu_lib.auto_prefill()
    ids = engine.tokenizer.encode("The key and value of every token stay in the cache, so that attention can look "
                                  "back over the conversation without reading it again. " * 3)
    try:
        engine.set_prefill("fp32")
        assert engine.prefill == "fp32"
        exact = engine.new_session(prefix_cache=False).append(ids)
        engine.set_prefill("bf16")
        assert (engine.prefill, engine.prefill_why) == ("bf16", "asked for")
        fast = engine.new_session(prefix_cache=False).append(ids)
        with pytest.raises(ConfigError, match="prefill='fp16': choose auto, fp32, bf16, int8"):
            engine.set_prefill("fp16")
        assert engine.prefill == "bf16"             # a refused value changes nothing
    finally:
        engine.set_prefill("auto")
    assert not torch.equal(exact, fast)             # the switch reached the GEMM
    # the output head keeps fp32: bf16 outputs (steps of 0.125 near 25) made the top two logits tie on a Zen 4
    assert not torch.equal(fast, fast.bfloat16().float())
    agree = (exact.argmax(-1) == fast.argmax(-1)).double().mean()
    assert agree >= 0.9, agree                      # 97.7% over 512 tokens of prose (bench quality --weight-fidelity)


def test_a_bad_prefill_setting_is_refused_in_one_line(tiny_llama):
    with pytest.raises(ConfigError, match="prefill='int4': choose auto, fp32, bf16, int8"):
        EngineConfig(prefill="int4")
    from kvchat.engine import Engine
    dense = Engine.load(EngineConfig(model=tiny_llama, prefill="bf16"))
    assert dense.prefill == "fp32" and "dense" in dense.prefill_why     # float weights keep their own dtype


def test_the_command_line_takes_it():
    from kvchat.cli.terminal import build_parser
    from kvchat.cli.options import engine_config
    args = build_parser().parse_args(["chat", "--prefill", "bf16", "--prompt", "hi"])
    assert engine_config(args).prefill == "bf16"
    from kvchat.engine.runtime import quick
    assert not quick.covers(args)                   # the torch-free one-shot path reads prompts as fp32 does
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefill", "fast"])
