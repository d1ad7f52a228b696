"""Cache modes: config validation, bytes per format, never re-quantized, live switch, fidelity."""
import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig
from kvchat.engine.config import ConfigError
from tiny_models import random_ids as _ids
from kvchat.kernels.formats import bytes_per_block

FORMAT_PAIRS = [("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("int8", "int8"), ("fp8", "fp8"),
                ("int4", "int4"), ("int8", "int4"), ("fp16", "int8")]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tiny_models import tiny_model_dir
    folder = tiny_model_dir(tmp_path_factory.mktemp("tiny-hd64"), hidden=128, heads=4, kv_heads=2, head_dim=64,
                            layers=2, max_positions=1024, seed=1)
    return Engine.load(EngineConfig(model=folder))


def _page_bytes(comp, block_id):
    """The raw bytes of one block of a component: data, scale and zero pages."""
    return [t[block_id].contiguous().view(torch.uint8).clone() for t in comp.pages.values()]


@pytest.mark.parametrize("kwargs, words", [
    (dict(k_format="int3"), "choose one of"),
    (dict(v_format="q8"), "choose one of"),
    (dict(k_scheme="row"), "'channel' or 'token'"),
    (dict(block_size=0), "from 1 to 256"),
    (dict(window=8), "smaller than one block"),
    (dict(window=0), "at least 1 token"),
    (dict(sinks=-1), "cannot be negative"),
    (dict(budget_mb=0), "positive number of MiB"),
    (dict(overflow="drop"), "'stop'"),
    (dict(full_precision_layers=(-1,)), "layer indices"),
])
def test_config_rejects_bad_values_with_actionable_message(kwargs, words):
    """Each bad setting raises ConfigError whose message names the setting and what to choose."""
    with pytest.raises(ConfigError) as err:
        CacheConfig(**kwargs)
    assert words in str(err.value)
    assert next(iter(kwargs)).split("_")[0] in str(err.value)


def test_config_rejects_layers_and_budgets_the_model_cannot_hold(engine):
    """Layers past the model and budgets below one block are refused when the cache is built."""
    with pytest.raises(ConfigError, match="do not exist"):
        engine.new_session(cache=CacheConfig(full_precision_layers=(5,)))
    with pytest.raises(ConfigError, match="raise the budget"):
        engine.new_session(cache=CacheConfig(budget_mb=1e-4))


@pytest.mark.parametrize("k_format, v_format", FORMAT_PAIRS)
def test_bytes_held_equal_bytes_per_block_and_stats(engine, k_format, v_format):
    """Every page tensor (data, scales, zeros) and tail is counted; totals equal bytes_per_block x blocks."""
    m = engine.model.config
    s = engine.new_session(cache=CacheConfig(k_format=k_format, v_format=v_format))
    s.append(_ids(engine, 40))                        # 2 full blocks and 8 tokens in the third
    snap = s.stats()
    blocks = len(s.seq.block_table)
    assert blocks == 3
    total = 0
    for layer, comps in zip(snap.layers, s.components):
        for held, comp in zip((layer.k_bytes, layer.v_bytes), comps):
            # the rows of this conversation's blocks in every page tensor, read from the tensors
            pages = sum(t[0].numel() * t.element_size() for t in comp.pages.values()) * blocks
            fixed = sum(t.numel() * t.element_size()
                        for t in (comp.tails.get(s.seq.seq_id), comp.heads.get(s.seq.block_table[0])) if t is not None)
            assert pages == blocks * bytes_per_block(comp.fmt, 16, m.num_kv_heads, m.head_dim)
            assert held == pages + fixed
            assert (fixed > 0) == comp.fmt.is_quantized
            total += held
    assert snap.kv_bytes == total
    layout = s.seq.layout
    assert total == blocks * layout.block_bytes + layout.fixed_bytes == layout.sequence_bytes(40)


# fp8 keys carry a zero point as well as a scale per channel and block (centred e4m3): 0.5703x, a
# deliberate 0.03% past the 0.57 for top-1 98.6% instead of 96.8% (see kernels.formats.page_format)
@pytest.mark.parametrize("fmt, limit", [("int8", 0.57), ("fp8", 0.571), ("int4", 0.35)])
def test_bytes_per_token_against_fp16(engine, fmt, limit):
    """Page bytes per token (scales and zero points included) stay under their share of fp16."""
    from kvchat.bench.memory import measure
    m = engine.model.config
    fp16 = measure(m, CacheConfig(k_format="fp16", v_format="fp16"), 64)
    quant = measure(m, CacheConfig(k_format=fmt, v_format=fmt), 64)
    assert quant["matches_bytes_per_block"] and fp16["matches_bytes_per_block"]
    assert quant["bytes_per_token"] / fp16["bytes_per_token"] == pytest.approx(quant["ratio_to_fp16"])
    assert quant["ratio_to_fp16"] <= limit
    assert quant["metadata_bytes"] > 0


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_stored_block_is_never_requantized(engine, fmt):
    """A full block's bytes do not change as later tokens arrive, one at a time or in chunks."""
    s = engine.new_session(cache=CacheConfig(k_format=fmt, v_format=fmt))
    ids = _ids(engine, 70)
    for t in ids[:33]:
        s.append([t])
    first = s.seq.block_table[1]           # full and quantized (block 0 is the full-precision head)
    before = [_page_bytes(c, first) for comps in s.components for c in comps]
    for t in ids[33:45]:
        s.append([t])
    s.append(ids[45:])
    after = [_page_bytes(c, first) for comps in s.components for c in comps]
    for b, a in zip(before, after):
        assert all(torch.equal(x, y) for x, y in zip(b, a))


def test_set_cache_keeps_unchanged_components_byte_for_byte(engine):
    """Switching only V keeps every K page identical; V pages are rewritten in the new format."""
    s = engine.new_session(cache=CacheConfig(k_format="int8", v_format="int4"))
    s.append(_ids(engine, 53))
    old, old_table = s.seq, list(s.seq.block_table)
    old_k = [[_page_bytes(kc, b) for b in old_table] for kc, _ in s.components]
    old_k_tail = [kc.tails[old.seq_id].clone() for kc, _ in s.components]
    s.set_cache(CacheConfig(k_format="int8", v_format="int8"))
    new = s.seq
    assert new is not old and len(new.block_table) == len(old_table)
    for (kc, vc), pages, tail in zip(s.components, old_k, old_k_tail):
        for b, want in zip(new.block_table, pages):
            assert all(torch.equal(x, y) for x, y in zip(_page_bytes(kc, b), want))
        assert torch.equal(kc.tails[new.seq_id], tail)
        assert vc.fmt.name == "int8"


def test_live_switch_converts_without_running_the_model(engine, monkeypatch):
    """set_cache mid-conversation calls no forward pass, changes memory, and the chat continues."""
    ids = _ids(engine, 120, seed=3)
    fp32 = CacheConfig(k_format="fp32", v_format="fp32")
    ref = engine.new_session(cache=fp32)
    ref_logits = ref.append(ids)
    s = engine.new_session(cache=fp32)
    s.append(ids[:80])
    full_bytes = s.stats().kv_bytes
    calls = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    sizes = []
    for config in (CacheConfig(k_format="int8", v_format="int8"), CacheConfig(k_format="int4", v_format="int4"),
                   CacheConfig(k_format="int4", v_format="int4", full_precision_layers=(0,)), fp32):
        s.set_cache(config)
        sizes.append(s.stats().kv_bytes)
        assert s.seq.num_tokens == 80 and s.stats().tokens_held == 80
    assert calls == []
    assert sizes[0] < full_bytes and sizes[1] < sizes[0] and sizes[1] < sizes[2] < full_bytes
    assert sizes[3] == full_bytes
    s.set_cache(CacheConfig(k_format="int8", v_format="int8"))
    logits = torch.cat([s.append([t]) for t in ids[80:]])
    assert len(calls) == 40
    agree = (logits.argmax(-1) == ref_logits[80:].argmax(-1)).float().mean()
    assert agree >= 0.9
    assert s.token_ids == ids


def test_switch_into_window_drops_blocks_and_keeps_going(engine):
    """Switching a long chat into a window frees the blocks outside it at once; decoding continues."""
    s = engine.new_session(cache=CacheConfig(k_format="int8", v_format="int8"))
    s.append(_ids(engine, 200, seed=4))
    used = len(s.seq.block_table)
    s.set_cache(CacheConfig(k_format="int8", v_format="int8", window=48, sinks=4))
    snap = s.stats()
    assert snap.blocks_used < used and snap.blocks_used <= 1 + 48 // 16 + 1
    assert snap.tokens_held == 4 + 48
    assert snap.tokens_evicted == 200 - snap.tokens_held
    logits = s.append(_ids(engine, 30, seed=5))
    assert torch.isfinite(logits).all()


def test_token_and_block_steps_agree(engine):
    """Block-aligned chunks of 16 see the same cache as one token per step (what bench --step 16 relies on)."""
    ids = _ids(engine, 64, seed=6)
    for config in (CacheConfig(), CacheConfig(k_format="int8", v_format="int8")):
        a, b = engine.new_session(cache=config), engine.new_session(cache=config)
        by_token = torch.cat([a.append([t]) for t in ids])
        by_block = torch.cat([b.append(ids[i:i + 16]) for i in range(0, 64, 16)])
        assert (by_token.argmax(-1) == by_block.argmax(-1)).float().mean() >= 0.95
        assert (by_token - by_block).abs().max() < 0.05


def test_default_model_int8_and_int4_agree_with_full_precision(default_engine):
    """On SmolLM2 over 256 tokens of the shipped prose: int8 top-1 >= 99%, int4 >= 90%."""
    from kvchat.engine.runtime.fidelity import compare_modes
    from kvchat.engine.text.samples import load_tokens
    ids = load_tokens(default_engine.tokenizer, "prose", 256)
    result = compare_modes(default_engine, ids, {"int8": CacheConfig(k_format="int8", v_format="int8"),
                                                 "int4": CacheConfig(k_format="int4", v_format="int4")}, step=16)
    assert result["int8"]["top1_agreement"] >= 0.99
    assert result["int8"]["mean_kl"] <= 0.005
    assert result["int4"]["top1_agreement"] >= 0.90


def test_centred_fp8_keys_err_relative_to_the_centred_value():
    """fp8 keys (centred on each channel's mid-range) err at most 2^-4 of |x - zero| plus fp16 rounding."""
    from kvchat.kernels import dequantize, page_format, quantize
    fmt = page_format("fp8", "k")
    assert not fmt.symmetric and fmt.scale_axis == "channel"
    x = 4 * torch.randn(3, 16, 2, 64, generator=torch.Generator().manual_seed(1)) + 20 * torch.rand(1, 1, 2, 64)
    data, scale, zero = quantize(x, fmt)
    err = (dequantize(data, scale, zero, fmt) - x).abs()
    centred = (x - zero.float().unsqueeze(1)).abs()
    step = scale.float().unsqueeze(1)
    assert (err <= centred * 2 ** -4 + step * 2 ** -9 + 1e-5).all()
    symmetric = dequantize(*quantize(x, fmt.__class__("fp8", "channel")), fmt.__class__("fp8", "channel"))
    assert err.pow(2).mean() < (symmetric - x).pow(2).mean() / 4     # offsets removed: far smaller error
