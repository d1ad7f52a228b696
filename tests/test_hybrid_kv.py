"""Hybrid KV (issue 23 item 4): a Gemma-3-shaped tiny model (6 layers: 5 sliding with window 16, 1 global) and a
Gemma 2 one (sliding and global alternating, soft-capped) through the engine, a KV group per kind of layer.

Against transformers' own Gemma3ForCausalLM / Gemma2ForCausalLM on the same folder: the logits of a prompt 8x the
window (read in chunks and decodes) and 32 greedy tokens. The bytes the engine holds equal kv/layout's hybrid
arithmetic, not the full count; and quantized formats, fork, truncate, rollback, a live switch, prefix hits, a
batched step and the user's window on top all work on the groups."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig
from kvchat.engine.config import ConfigError
from kvchat.engine.kv.layout import conversation_bytes, kv_layout, layer_windows, window_peak_bytes
from kvchat.engine.model.source import locate, transformers_reference
from tiny_models import read_chunks, tiny_family_dir

WINDOW = 16
TOKENS = 8 * WINDOW
FP32 = CacheConfig(k_format="fp32", v_format="fp32")
IDS = torch.randint(3, 320, (TOKENS + 40,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def family(request, tmp_path_factory):
    folder = tiny_family_dir(tmp_path_factory.mktemp(request.param), request.param)
    engine = Engine.load(EngineConfig(model=folder))
    reference = transformers_reference(locate(folder), torch.float32).eval()
    return request.param, engine, reference


@pytest.fixture(scope="module")
def gemma3(family):
    if family[0] != "gemma3":
        pytest.skip("the Gemma 3 shape only")
    return family[1]


def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()


def read(engine, seq, ids, sizes=(40, 1, 1, 30, 1, 1)):
    """tiny_models.read_chunks: prompt chunks and one-token steps."""
    return read_chunks(engine, seq, ids, sizes)


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-3) -> bool:
    return float((got - want).abs().max()) <= tol * float(want.abs().max())


def test_logits_and_greedy_tokens_equal_transformers(family):
    name, engine, reference = family
    s = engine.new_session(cache=FP32)
    assert len(s.seq.members) == 2
    assert close(read(engine, s.seq, IDS[:TOKENS]), reference_logits(reference, IDS[:TOKENS]))
    engine.runner.cache.check()
    # 32 greedy tokens after a prompt longer than the window, each a one-token decode
    s2 = engine.new_session(cache=FP32)
    logits = s2.append(IDS[:40], all_logits=False)
    ours = []
    for _ in range(32):
        ours.append(int(logits[-1].argmax()))
        logits = s2.append(ours[-1:], all_logits=False)
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([IDS[:40]]), max_new_tokens=32, do_sample=False)[0, 40:].tolist()
    assert ours == theirs


def test_bytes_held_follow_the_hybrid_arithmetic(gemma3):
    engine = gemma3
    for cache in (FP32, CacheConfig(), CacheConfig(k_format="int8", v_format="int8")):
        s = engine.new_session(cache=cache)
        read(engine, s.seq, IDS[:TOKENS])
        config = engine.runner.config
        held = sum(k + v for k, v in engine.runner.layer_bytes(s.seq))
        want = conversation_bytes(config, cache, TOKENS, engine.runner.dtype_name, "cpu")
        assert held == want == engine.runner.conversation_bytes(s.seq)
        full = kv_layout(config, cache, engine.runner.dtype_name, "cpu").sequence_bytes(TOKENS)
        # 1/6 of a full cache grows, 5/6 hold their window (plus the block being filled)
        assert held < 0.4 * full
        per_layer = engine.runner.layer_bytes(s.seq)
        assert per_layer[0] == per_layer[4] and sum(per_layer[5]) > 4 * sum(per_layer[0])
        assert s.stats().kv_bytes == held
        s.close()
    engine.runner.cache.check()


QUANTIZED = [CacheConfig(k_format="int8", v_format="int8"), CacheConfig(k_format="int4", v_format="int4"),
             CacheConfig(k_format="int4", v_format="int4", full_precision_layers=(0, 1, 2))]    # some layers only


@pytest.mark.parametrize("cache", QUANTIZED, ids=["int8", "int4", "int4-some-layers"])
def test_quantized_formats_run_on_the_groups(family, cache):
    name, engine, reference = family
    s = engine.new_session(cache=cache)
    got = read(engine, s.seq, IDS[:TOKENS])
    want = reference_logits(reference, IDS[:TOKENS])
    assert torch.isfinite(got).all() and close(got, want, 0.25)
    held = sum(k + v for k, v in engine.runner.layer_bytes(s.seq))
    assert held == conversation_bytes(engine.runner.config, cache, TOKENS, engine.runner.dtype_name, "cpu")
    engine.runner.cache.check()
    s.close()


def test_fork_truncate_and_rollback(gemma3):
    engine = gemma3
    runner = engine.runner
    a = engine.new_session(cache=FP32)
    read(engine, a.seq, IDS[:12], sizes=())          # within the window: nothing left yet, a fork shares all
    child, shared = runner.fork(a.seq, 12)
    assert shared == 12 and len(child.members) == 2
    got = runner.step([(child, IDS[12:20])], all_logits=True)[0]
    want = runner.step([(a.seq, IDS[12:20])], all_logits=True)[0]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    runner.close(child)
    # past the window the sliding group let blocks go: a fork shares nothing and reads again
    read(engine, a.seq, IDS[20:TOKENS], sizes=())
    child, shared = runner.fork(a.seq, TOKENS)
    assert shared == 0 and child.num_tokens == 0
    runner.close(child)
    # truncate within what the window still holds, then the same logits as before
    before = runner.step([(a.seq, IDS[TOKENS:TOKENS + 3])], all_logits=True)[0]
    runner.truncate(a.seq, 3)
    again = runner.step([(a.seq, IDS[TOKENS:TOKENS + 3])], all_logits=True)[0]
    torch.testing.assert_close(again, before, atol=0, rtol=0)
    with pytest.raises(ConfigError):
        runner.truncate(a.seq, 2 * WINDOW)            # the sliding layers no longer hold what that needs
    # an exception inside the step at a sliding layer leaves every group as it was
    model = runner.model
    forward = model.forward
    state = [(len(m.block_table), m.num_tokens, m.evicted) for m in a.seq.members]

    def failing(x, attention, *args, **kw):
        def attend(layer, q, k, v):
            out = attention(layer, q, k, v)
            if layer == 5:
                raise RuntimeError("boom")
            return out
        return forward(x, attend, *args, **kw)

    model.forward = failing
    try:
        with pytest.raises(RuntimeError):
            runner.step([(a.seq, IDS[TOKENS + 3:TOKENS + 40])], all_logits=True)
    finally:
        model.forward = forward
    assert [(len(m.block_table), m.num_tokens, m.evicted) for m in a.seq.members] == state
    runner.cache.check()
    a.close()


def test_prefix_hits_take_the_shortest_group(gemma3):
    engine = gemma3
    runner = engine.runner
    a = engine.new_session(cache=FP32)
    want = read(engine, a.seq, IDS[:64], sizes=())
    b = engine.new_session(cache=FP32)
    hit = runner.match_prefix(b.seq, IDS[:64])
    # every group kept its blocks from the start (the sliding group's that left its window stay cached)
    assert hit == 48 and all(m.num_tokens == hit for m in b.seq.members)
    got = runner.step([(b.seq, IDS[hit:64])], all_logits=True)[0]
    assert close(got, want[hit:], 1e-5)
    runner.cache.check()
    a.close()
    b.close()


def test_a_batched_step_equals_solo_steps(gemma3):
    """A decode of one conversation and a prompt chunk of another in one step, as the serve scheduler batches."""
    engine = gemma3
    runner = engine.runner
    solo, pair = [], []
    for out in (solo, pair):
        a, b = engine.new_session(cache=FP32), engine.new_session(cache=FP32)
        runner.step([(a.seq, IDS[:40])], hash_ids=False)
        if out is solo:
            out.append(runner.step([(a.seq, IDS[40:41])], hash_ids=False)[0])
            out.append(runner.step([(b.seq, IDS[50:90])], hash_ids=False)[0])
        else:
            out.extend(runner.step([(a.seq, IDS[40:41]), (b.seq, IDS[50:90])], hash_ids=False,
                                   decode=[True, False]))
        a.close()
        b.close()
    # dense float weights: the linears see other row counts in a batch, so equal to float32 rounding (the
    # packed weights' bit-for-bit batch invariance is tests/test_batch_invariance.py's)
    for x, y in zip(solo, pair):
        assert close(x, y, 1e-5)


def test_live_switch_and_the_users_window_on_top(gemma3):
    engine = gemma3
    runner = engine.runner
    config = runner.config
    s = engine.new_session(cache=FP32)
    read(engine, s.seq, IDS[:TOKENS], sizes=())
    int8 = CacheConfig(k_format="int8", v_format="int8")
    s.set_cache(int8)
    assert len(s.seq.members) == 2
    held = sum(k + v for k, v in runner.layer_bytes(s.seq))
    assert held == conversation_bytes(config, int8, TOKENS, runner.dtype_name, "cpu")
    assert torch.isfinite(runner.step([(s.seq, IDS[TOKENS:TOKENS + 1])])[0]).all()
    runner.cache.check()
    # a user window larger than the layers' own: the sliding layers keep 16, the global one the user's 32 + sinks
    windowed = CacheConfig(k_format="fp32", v_format="fp32", window=32, sinks=4)
    assert layer_windows(config, windowed) == (16,) * 5 + (32,)
    w = engine.new_session(cache=windowed)
    read(engine, w.seq, IDS[:TOKENS], sizes=())
    held = sum(k + v for k, v in runner.layer_bytes(w.seq))
    assert held == conversation_bytes(config, windowed, TOKENS, runner.dtype_name, "cpu")
    assert w.seq.tokens_held == 32 + 4
    # the int8 conversation switched into the window: the global group slides, the sliding ones stay as they were
    s.set_cache(windowed)
    held = sum(k + v for k, v in runner.layer_bytes(s.seq))
    assert held == conversation_bytes(config, windowed, TOKENS + 1, runner.dtype_name, "cpu")
    assert torch.isfinite(runner.step([(s.seq, IDS[TOKENS + 1:TOKENS + 2])])[0]).all()
    s.close()
    w.close()
    runner.cache.check()


def test_room_is_made_by_releasing_whole_conversations(gemma3):
    """A 1 MiB budget: one conversation of 1,000 tokens and the prompt chunk of the next do not fit together, so
    the idle one is released, every group of it; its forecast counted only the global layer's growth past the
    windows."""
    engine = gemma3
    runner = engine.runner
    n = 1000
    ids = torch.randint(3, 320, (2 * n,), generator=torch.Generator().manual_seed(2)).tolist()
    small = FP32.with_(budget_mb=1.0)
    one = conversation_bytes(runner.config, small, n, runner.dtype_name, "cpu")
    try:
        a = engine.new_session(cache=small)
        a.append(ids[:n])
        assert runner.conversation_bytes(a.seq) == one
        sliding = a.seq.groups[1]
        lacks = window_peak_bytes(sliding.layout, sliding.geometry) - runner.cache._blocks.sequence_bytes(sliding)
        global_block = a.seq.layout.block_bytes          # the first group: the global layer, 16 tokens a block
        in_last = -n % 16                                # the free rows of its last global block
        assert a.tokens_left() == (runner.budget_bytes - one - lacks) // global_block * 16 + in_last
        b = engine.new_session(cache=small)
        b.append(ids[n:])                                # another prompt: no prefix to share
        assert all(m.released and not m.block_table for m in a.seq.members)
        assert runner.conversation_bytes(b.seq) == one and runner.held_bytes <= runner.budget_bytes
        runner.cache.check()
        a.close()
        b.close()
    finally:
        engine.new_session(cache=FP32).close()          # the module's budget again


def test_sliding_pages_stay_at_their_window(tmp_path):
    """Each KV group has its own block ids, so the sliding layers' page storage (the process's real KV memory) grows
    to their window, not to the global layer's blocks: at 8x the window it is near the bytes held and far below a
    full-attention cache. Blocks are not indexed here (hash_ids=False), so none is kept for reuse past its window."""
    engine = Engine.load(EngineConfig(model=tiny_family_dir(tmp_path, "gemma3")))
    runner = engine.runner
    for cache in (FP32, CacheConfig(k_format="int8", v_format="int8")):
        seq = runner.new_sequence(cache)
        for pos in range(0, TOKENS, 8):
            runner.step([(seq, IDS[pos:pos + 8])], hash_ids=False)
        held = runner.held_bytes
        assert held == runner.conversation_bytes(seq)
        full = kv_layout(runner.config, cache, runner.dtype_name, "cpu").sequence_bytes(TOKENS)
        # the rest is the pages' growth by doubling (at least 4 blocks a layout)
        assert runner.storage_bytes() <= 2.5 * held and runner.storage_bytes() < 0.6 * full, \
            (runner.storage_bytes(), held, full)
        runner.cache.check()
        runner.close(seq)


def test_each_group_has_its_own_block_ids():
    """The manager alone: two groups' sequences both count their ids from 0, one budget holds both, and room is
    made from the least recently freed prefix block over the groups' pools."""
    from kvchat.engine.kv.layout import FullAttention, KVLayout
    from kvchat.engine.kv.manager import KVCacheManager
    full = kv_layout(SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16),
                     CacheConfig(k_format="fp16", v_format="fp16", block_size=4), "fp32", "cpu")
    glob, slide = (KVLayout(1, 2, 16, 4, full.full_dtype, (full.formats[i],), (i,)) for i in (0, 1))
    nowin = FullAttention(4)
    m = KVCacheManager(6 * glob.block_bytes)
    a, b = m.new_sequence(glob, nowin), m.new_sequence(slide, nowin)
    for seq in (a, b):
        m.commit(m.reserve(seq, 8), list(range(8)))
    assert a.block_table == b.block_table == [0, 1]
    assert m.high_water(glob) == m.high_water(slide) == 2 and m.held_bytes == 4 * glob.block_bytes
    m.free(b)                                           # freed first: its blocks are the oldest prefix blocks
    m.free(a)
    c = m.new_sequence(glob, nowin)
    m.commit(m.reserve(c, 16), list(range(100, 116)))   # 4 blocks in a budget of 6: two evictable blocks go
    assert m.pools[(1,)].num_evictable == 0 and m.pools[(0,)].num_evictable == 2
    m.check()
