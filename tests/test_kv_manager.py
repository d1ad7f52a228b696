"""The KV manager without torch: exact block ids, reference counts, prefix index, budget, fork, truncate."""
import pytest

from kvchat.engine.config import CacheConfig
from kvchat.engine.kv.layout import FullAttention, SinkWindow, kv_layout
from kvchat.engine.kv.manager import BlockPool, KVCacheManager, NoFreeBlocks
from types import SimpleNamespace

MODEL = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16)      # all a layout reads of a model
FP = kv_layout(MODEL, CacheConfig(k_format="fp16", v_format="fp16", block_size=4), "fp32", "cpu")
NOWIN = FullAttention(4)


def _manager(blocks: int) -> KVCacheManager:
    return KVCacheManager(blocks * FP.block_bytes)


def _step(m, seq, ids):
    res = m.reserve(seq, len(ids))
    m.commit(res, ids)
    return res


def test_block_bytes_of_a_layout():
    """2 layers x (K + V) x 4 tokens x 2 heads x 16 dims x 2 bytes."""
    assert FP.block_bytes == 2 * 2 * 4 * 2 * 16 * 2
    assert FP.bytes_per_token == FP.block_bytes / 4 and FP.fixed_bytes == 0


def test_pool_hands_out_lowest_id_and_shrinks_high_water():
    pool = BlockPool()
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    pool.free(2)
    pool.free(0)
    assert pool.allocate() == 0 and pool.allocate() == 2 and pool.allocate() == 4
    pool.free(4)
    pool.free(3)
    assert pool.high_water == 3


def test_reserve_commit_and_slot_tables():
    m = _manager(8)
    seq = m.new_sequence(FP, NOWIN)
    res = _step(m, seq, [1, 2, 3, 4, 5, 6])
    assert seq.block_table == [0, 1] and res.first_slot == 0 and seq.num_tokens == 6
    res = _step(m, seq, [7])
    assert res.new_blocks == [] and res.first_slot == 6
    res = _step(m, seq, [8, 9])
    assert res.new_blocks == [2] and seq.block_table == [0, 1, 2]
    m.check()


def test_rollback_leaves_everything_as_before():
    m = _manager(8)
    seq = m.new_sequence(FP, NOWIN)
    _step(m, seq, [1, 2, 3, 4, 5])
    before = (list(seq.block_table), seq.num_tokens, list(m.pool.ref_cnt), m.held_bytes)
    res = m.reserve(seq, 9)
    assert len(seq.block_table) == 4
    m.rollback(res)
    assert (list(seq.block_table), seq.num_tokens, list(m.pool.ref_cnt), m.held_bytes) == before
    m.check()


def test_prefix_blocks_are_shared_then_evictable_then_reused():
    m = _manager(8)
    a = m.new_sequence(FP, NOWIN)
    prompt = list(range(10, 20))                     # 10 tokens: 2 full blocks and a partial one
    _step(m, a, prompt)
    b = m.new_sequence(FP, NOWIN)
    assert m.match_prefix(b, prompt + [99]) == 8     # both full blocks, by reference
    assert b.block_table == a.block_table[:2] and m.pool.ref_cnt[:2] == [2, 2]
    m.free(a)
    m.free(b)
    assert m.pool.num_evictable == 2 and m.view().evictable_blocks == 2
    c = m.new_sequence(FP, NOWIN)
    assert m.match_prefix(c, prompt[:9]) == 8
    assert m.prefix_queries == 8 + 8 and m.prefix_hits == 16
    m.check()


def test_prefix_match_is_confirmed_by_ids_and_chained():
    """Same second block after a different first block is no hit."""
    m = _manager(8)
    a = m.new_sequence(FP, NOWIN)
    _step(m, a, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = m.new_sequence(FP, NOWIN)
    assert m.match_prefix(b, [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    c = m.new_sequence(FP, NOWIN)
    assert m.match_prefix(c, [1, 2, 3, 4, 0, 6, 7, 8, 9]) == 4


def test_evictable_blocks_go_when_the_pool_needs_them():
    m = _manager(3)
    a = m.new_sequence(FP, NOWIN)
    _step(m, a, [1, 2, 3, 4, 5, 6, 7, 8])
    m.free(a)
    b = m.new_sequence(FP, NOWIN)
    _step(m, b, list(range(30, 42)))                 # 3 blocks: both cached ones are evicted
    assert m.pool.num_evictable == 0 and len(b.block_table) == 3
    m.check()


def test_least_recently_used_idle_sequence_is_released_first():
    m = _manager(4)
    a, b, c = (m.new_sequence(FP, NOWIN) for _ in range(3))
    _step(m, a, list(range(100, 108)))
    _step(m, b, list(range(200, 208)))
    _step(m, c, list(range(300, 304)))               # 5 blocks would be too many: a (oldest) goes
    assert a.released and not a.block_table and not b.released
    assert m.released_log == [a.seq_id]
    with pytest.raises(NoFreeBlocks):
        m.reserve(c, 100)
    m.check()


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    m = _manager(8)
    a = m.new_sequence(FP, NOWIN)
    _step(m, a, [1, 2, 3, 4, 5, 6])
    child, n = m.fork(a, 6)
    assert n == 6 and child.block_table == [0, 1] and m.pool.ref_cnt[:2] == [2, 2]
    res = m.reserve(child, 1)
    assert res.copied == (1, 1, 2) and child.block_table == [0, 2]
    m.commit(res, [7])
    assert m.pool.ref_cnt[:3] == [2, 1, 1]
    m.check()


def test_truncate_takes_tokens_back():
    m = _manager(8)
    a = m.new_sequence(FP, NOWIN)
    _step(m, a, list(range(1, 11)))
    dropped = m.truncate(a, 5)
    assert dropped == [2] and a.num_tokens == 5 and a.block_table == [0, 1]
    _step(m, a, [50, 51, 52, 53])
    assert a.block_table == [0, 1, 2]
    m.check()


def test_window_evicts_whole_blocks_after_the_sinks():
    m = _manager(16)
    g = SinkWindow(4, 8, 2)                       # 2 sinks in one sink block, a window of 8
    a = m.new_sequence(FP, g)
    for t in range(30):
        _step(m, a, [t])
    assert a.evicted > 0 and a.block_table[0] == 0
    assert a.tokens_held == 2 + 8
    assert len(a.block_table) <= g.peak_blocks(1)
    m.check()


def test_budget_counts_bytes_across_layouts():
    int8 = kv_layout(MODEL, CacheConfig(k_format="int8", v_format="int8", block_size=4), "fp32", "cpu")
    m = KVCacheManager(6 * FP.block_bytes)
    a, b = m.new_sequence(FP, NOWIN), m.new_sequence(int8, NOWIN)
    _step(m, a, list(range(8)))
    _step(m, b, list(range(8)))
    assert m.held_bytes == 2 * FP.block_bytes + 2 * int8.block_bytes + b.side_bytes
    m.check()


def test_a_block_dropped_inside_a_window_stays_null_as_the_window_moves_past_it():
    """drop() and the window's rule on one positioned table: the dropped entry stays null (never freed twice), the
    window still lets the older blocks go and keeps at least one block past the sinks, and every entry's index stays
    its position."""
    m = _manager(16)
    a = m.new_sequence(FP, SinkWindow(4, 12, 2))
    for t in range(20):
        _step(m, a, [t])
    assert a.evicted == 1 and a.table[1] is None           # the window let block 1 go (tokens 4..7)
    held = m.held_bytes
    assert m.drop(a, 3) == FP.block_bytes and a.table[3] is None and m.held_bytes == held - FP.block_bytes
    m.check()
    for t in range(20, 40):
        _step(m, a, [t])
        m.check()
        assert len(a.table) == -(-a.num_tokens // 4)
    assert a.table[0] is not None and all(b is None for b in a.table[1:7])
    assert a.held_positions()[0] == 0 and a.tokens_held <= 2 + 12
