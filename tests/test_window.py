"""Sliding window with attention sinks: eviction, constant memory, StreamingLLM positions."""
import math

import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig
from kvchat.engine.kv.pages import slot_positions
from tiny_models import random_ids as _ids

FP32 = dict(k_format="fp32", v_format="fp32")     # exact comparisons need the 32-bit cache


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tiny_models import tiny_model_dir
    folder = tiny_model_dir(tmp_path_factory.mktemp("tiny-window"), hidden=128, heads=4, kv_heads=2, head_dim=64,
                            layers=2, max_positions=128, seed=2)
    return Engine.load(EngineConfig(model=folder))


def _expected_blocks(n, window, sinks, bs):
    """Blocks a window holds after n tokens: every block but the non-sink ones wholly before the window."""
    sink_blocks = math.ceil(sinks / bs)
    start = max(sinks, n - window)
    gone = max(0, start // bs - sink_blocks)
    return max(0, math.ceil(n / bs) - gone)


@pytest.mark.parametrize("fmt", ["auto", "int4"])
def test_blocks_return_to_pool_as_they_leave_the_window(engine, fmt):
    """After every token the pool holds exactly the blocks still in the window or the sinks."""
    window, sinks, bs = 48, 4, 16
    s = engine.new_session(cache=CacheConfig(k_format=fmt, v_format=fmt, window=window, sinks=sinks))
    for n, t in enumerate(_ids(engine, 150), start=1):
        s.append([t])
        snap = s.stats()
        assert snap.blocks_used == len(s.seq.block_table) == _expected_blocks(n, window, sinks, bs)
        assert snap.tokens_held == min(n, sinks + window) if n > sinks else snap.tokens_held == n
        assert snap.tokens_held + snap.tokens_evicted == n


@pytest.mark.parametrize("fmt", ["auto", "int8", "int4"])
def test_memory_is_constant_once_the_window_is_full(engine, fmt):
    """KV bytes stop growing once the window is full, and never pass their first full-window value."""
    s = engine.new_session(cache=CacheConfig(k_format=fmt, v_format=fmt, window=64, sinks=4))
    ids = _ids(engine, 400, seed=1)
    s.append(ids[:96])
    plateau = s.stats().kv_bytes
    sizes = []
    for i in range(96, 400, 16):
        s.append(ids[i:i + 16])
        sizes.append(s.stats().kv_bytes)
    assert set(sizes) == {plateau}


def test_positions_are_bounded_and_stream_runs_past_max_positions(engine):
    """A 300-token stream through a 48-token window on a 128-position model: positions stay below 68."""
    s = engine.new_session(cache=CacheConfig(window=48, sinks=4))
    assert engine.model.config.max_position_embeddings == 128
    highest = 0
    for i, t in enumerate(_ids(engine, 300, seed=2)):
        logits = s.append([t])
        assert torch.isfinite(logits).all()
        ws, ns = s.seq.window()
        slots, pos = slot_positions(s.seq.seq_len, ws, ns)
        highest = max(highest, int(pos.max()) + 1)
    assert s.seq.num_tokens == 300
    assert highest <= 4 + 48 + 16
    assert s.stats().tokens_evicted > 200


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    # with one layer the stored K/V depend on the token alone, so a window step can be recomputed exactly
    from tiny_models import tiny_model_dir
    folder = tiny_model_dir(tmp_path_factory.mktemp("tiny-1layer"), hidden=128, heads=4, kv_heads=2, head_dim=64,
                            layers=1, max_positions=128, seed=3)
    return Engine.load(EngineConfig(model=folder))


@pytest.mark.parametrize("sinks", [4, 0])
def test_window_step_equals_fresh_session_over_the_kept_tokens(one_layer, sinks):
    """Each decode step in a window attends to sinks + the last window tokens at positions 0.. (StreamingLLM)."""
    engine, window = one_layer, 32
    ids = _ids(engine, 110, seed=3)
    s = engine.new_session(cache=CacheConfig(window=window, sinks=sinks, **FP32))
    s.append(ids[:40])
    for n in range(40, 110):
        got = s.append([ids[n]])[-1]
        start = max(sinks, n - window)
        kept = ids[:min(sinks, n)] + ids[start:n] + [ids[n]]
        want = engine.new_session(cache=CacheConfig(**FP32)).append(kept)[-1]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_window_larger_than_the_text_is_the_full_cache(engine):
    """A window that never fills gives the full-precision cache's logits exactly."""
    ids = _ids(engine, 70, seed=4)
    a = torch.cat([engine.new_session(cache=CacheConfig(window=100, **FP32)).append(ids)])
    b = engine.new_session(cache=CacheConfig(**FP32)).append(ids)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sink_blocks_stay_and_window_int4_combines(engine):
    """The sink block keeps its id, pages and full-precision head through the stream; int4 + window combine."""
    s = engine.new_session(cache=CacheConfig(k_format="int4", v_format="int4", window=32, sinks=4))
    ids = _ids(engine, 300, seed=5)
    s.append(ids[:16])
    s.append(ids[16:17])
    sink = s.seq.block_table[0]
    before = [t[sink].clone() for comps in s.components for c in comps for t in c.pages.values()]
    heads = [c.heads[sink].clone() for comps in s.components for c in comps]
    for i in range(17, 300, 16):
        s.append(ids[i:i + 16])
    assert s.seq.block_table[0] == sink
    after = [t[sink] for comps in s.components for c in comps for t in c.pages.values()]
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(before, after))
    assert all(torch.equal(c.heads[sink], h) for c, h in zip((c for comps in s.components for c in comps), heads))
    assert s.stats().blocks_used <= 1 + 32 // 16 + 1


@pytest.mark.parametrize("config", [CacheConfig(k_format="fp32", v_format="fp32", window=40, sinks=4),
                                    CacheConfig(k_format="bf16", v_format="bf16", window=40, sinks=4),
                                    CacheConfig(k_format="fp32", v_format="fp32")], ids=["fp32-window", "bf16-window", "fp32"])
def test_c_decode_attention_matches_the_torch_path(engine, config, monkeypatch):
    """Decode through the C kernel (rotated keys read in place, sinks seen with their own query) gives the logits
    of the torch gather path."""
    from kvchat.kernels import cpu_quant
    ids = _ids(engine, 90, seed=6)
    a = engine.new_session(cache=config)
    want = torch.cat([a.append(ids[:20])] + [a.append([t]) for t in ids[20:]])
    monkeypatch.setattr(cpu_quant, "can_attend", lambda q, pages: False)
    b = engine.new_session(cache=config)
    got = torch.cat([b.append(ids[:20])] + [b.append([t]) for t in ids[20:]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_window_without_sinks_drops_the_first_block_and_its_full_precision_copy(engine):
    """With sinks=0 the first block leaves like any other, and its full-precision head goes with it."""
    s = engine.new_session(cache=CacheConfig(k_format="int8", v_format="int8", window=32, sinks=0))
    ids = _ids(engine, 120, seed=7)
    s.append(ids[:17])
    first = s.seq.block_table[0]
    assert all(first in c.heads for comps in s.components for c in comps)
    s.append(ids[17:120])
    assert s.seq.evicted > 0 and first not in s.seq.block_table
    assert s.stats().kv_bytes == s.seq.layout.sequence_bytes(120, 32, 0)    # no head counted any more
    # the block stays only as a reusable prefix block; clearing the prefix cache drops its copy too
    assert first in engine.runner.cache._blocks.pool.evictable_ids()
    engine.clear_prefix_cache()
    assert all(first not in c.heads for comps in s.components for c in comps)
    assert s.stats().tokens_held == 32
