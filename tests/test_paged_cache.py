"""Paged KV cache in full precision: block-size invariance, exact bytes, growth, reset."""
import math

import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig
from tiny_models import random_ids as _ids


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(EngineConfig(model=tiny_llama))


def test_outputs_identical_for_block_sizes(engine):
    """Prefill + token-by-token decode give bit-identical logits with block sizes 1, 16 and 64."""
    ids = _ids(engine, 150)
    results = []
    for bs in (1, 16, 64):
        s = engine.new_session(cache=CacheConfig(block_size=bs))
        first = s.append(ids[:100])
        rest = torch.cat([s.append([t]) for t in ids[100:]])
        results.append(torch.cat((first, rest)))
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], results[2])


@pytest.mark.parametrize("bs", [1, 16, 64])
def test_reported_bytes_equal_tensors_and_formula(engine, bs):
    """Per-layer K/V bytes equal the tensors held and 2 x layers x kv_heads x head_dim x bytes x blocks."""
    c = engine.model.config
    s = engine.new_session(cache=CacheConfig(block_size=bs))
    for n in (1, 37, 64, 130):
        s.append(_ids(engine, n, seed=n))
        tokens = s.seq.num_tokens
        blocks = math.ceil(tokens / bs)
        per_comp = c.num_kv_heads * c.head_dim * 2 * blocks * bs       # 16-bit "auto" cache on the CPU
        snap = s.stats()
        assert len(s.seq.block_table) == blocks
        for layer, (kc, vc) in zip(snap.layers, s.components):
            held_k = sum(t[0].numel() * t.element_size() for t in kc.pages.values()) * blocks
            held_v = sum(t[0].numel() * t.element_size() for t in vc.pages.values()) * blocks
            assert kc.pages["data"].shape[0] >= max(s.seq.block_table) + 1
            assert layer.k_bytes == held_k == per_comp
            assert layer.v_bytes == held_v == per_comp
        assert snap.kv_bytes == 2 * c.num_layers * per_comp


def test_memory_grows_with_conversation_and_reset_returns_it(engine):
    """KV bytes start at 0, grow block by block (not preallocated), and reset returns every block."""
    for seq in list(engine.runner.cache.sequences()):   # earlier tests' conversations
        engine.runner.close(seq)
    engine.clear_prefix_cache()                                   # and the blocks they left for reuse
    s = engine.new_session(cache=CacheConfig(block_size=16, budget_mb=64))
    assert s.stats().kv_bytes == 0
    sizes = []
    for _ in range(5):
        s.append(_ids(engine, 20))
        sizes.append(s.stats().kv_bytes)
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    assert sizes[-1] < 64 * 2**20 / 100          # nowhere near the budget
    freed = s.reset()
    snap = s.stats()
    assert snap.kv_bytes == 0 and snap.blocks_used == 0 and snap.tokens_held == 0
    # its full blocks stay as reclaimable prefix blocks until the pool needs them or the user clears them: the pool
    # still holds them, so reset returned the rest, and clearing them returns them
    assert snap.pool.evictable_bytes > 0 and snap.pool.held_bytes == snap.pool.evictable_bytes
    assert freed == sizes[-1] - snap.pool.evictable_bytes
    assert engine.clear_prefix_cache() == snap.pool.evictable_bytes
    assert engine.runner.storage_bytes() == 0            # the page storage itself went back


def test_memory_never_passes_budget(engine):
    """Filling a small budget stops at it: bytes held never exceed budget_mb."""
    budget_mb = 0.05
    s = engine.new_session(cache=CacheConfig(block_size=16, budget_mb=budget_mb))
    from kvchat.engine import BudgetFull
    with pytest.raises(BudgetFull):
        for _ in range(200):
            s.append(_ids(engine, 7))
            assert s.stats().kv_bytes <= budget_mb * 2**20
    assert s.stats().kv_bytes <= budget_mb * 2**20


def test_int4_groups_shrink_for_small_heads(tmp_path):
    """int4 on a model with head_dim 16 quantizes in groups of 16 instead of failing."""
    from tiny_models import tiny_model_dir
    engine = Engine.load(EngineConfig(model=tiny_model_dir(tmp_path, hidden=64, heads=4, kv_heads=2)))
    s = engine.new_session()
    s.append(_ids(engine, 40))
    s.set_cache(CacheConfig(k_format="int4", v_format="int4", k_scheme="token"))
    s.append(_ids(engine, 20, seed=2))
    assert {l.v_format for l in s.stats().layers} == {"int4 (groups of 16, asym)"}
