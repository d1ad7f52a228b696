"""BlockPool: exact block ids, ref counts and free-queue order (no torch)."""
import pytest

from engine.block_pool import BlockPool, BlockPoolExhausted


def test_allocates_lowest_free_id_first():
    """Freed ids are reused lowest first, so page tensors stay compact."""
    pool = BlockPool(8)
    assert pool.allocate_many(4) == [0, 1, 2, 3]
    pool.free(2)
    pool.free(0)
    assert pool.get_num_free_blocks() == 6
    assert pool.allocate() == 0
    assert pool.allocate() == 2
    assert pool.allocate() == 4


def test_high_water_shrinks_when_top_blocks_free():
    """Freeing the highest ids lowers the high-water mark the page tensors follow."""
    pool = BlockPool(8)
    pool.allocate_many(5)
    pool.free(3)
    assert pool.high_water == 5
    pool.free(4)
    assert pool.high_water == 3
    assert pool.allocate() == 3


def test_ref_counts_keep_shared_blocks():
    """A block with two owners returns to the pool only after both free it."""
    pool = BlockPool(2)
    b = pool.allocate()
    pool.incref(b)
    assert pool.free(b) is False
    assert pool.num_used_blocks == 1
    assert pool.free(b) is True
    assert pool.num_used_blocks == 0


def test_exhaustion_and_usage():
    """Allocation past the budget raises; usage is the used share."""
    pool = BlockPool(3)
    pool.allocate_many(3)
    assert pool.usage == 1.0
    with pytest.raises(BlockPoolExhausted):
        pool.allocate()
    with pytest.raises(BlockPoolExhausted):
        pool.resize(2)
