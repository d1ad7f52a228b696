"""Block ids, reference counts and the free queue. Plain Python: no torch here.

The lowest free id is always handed out first, so a cache's page tensors, which are sized to
the highest id in use, stay exactly as large as the blocks it holds.
"""
from __future__ import annotations

import heapq


class BlockPoolExhausted(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = []
        self._free: list[int] = []          # min-heap of freed ids below len(ref_cnt)

    @property
    def num_used_blocks(self) -> int:
        return len(self.ref_cnt) - len(self._free)

    def get_num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 1.0

    @property
    def high_water(self) -> int:
        """One past the highest id in use: the page tensors' length."""
        return len(self.ref_cnt)

    def allocate(self) -> int:
        if not self.can_allocate(1):
            raise BlockPoolExhausted(f"all {self.num_blocks} blocks are in use")
        if self._free:
            block_id = heapq.heappop(self._free)
        else:
            block_id = len(self.ref_cnt)
            self.ref_cnt.append(0)
        self.ref_cnt[block_id] = 1
        return block_id

    def allocate_many(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise BlockPoolExhausted(f"need {n} blocks, {self.get_num_free_blocks()} free")
        return [self.allocate() for _ in range(n)]

    def incref(self, block_id: int) -> None:
        assert self.ref_cnt[block_id] > 0, f"block {block_id} is free"
        self.ref_cnt[block_id] += 1

    def free(self, block_id: int) -> bool:
        """Drop one reference; returns True when the block went back to the free queue."""
        assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id]:
            return False
        heapq.heappush(self._free, block_id)
        self._trim()
        return True

    def _trim(self) -> None:
        # forget free ids at the top so high_water (and the page tensors) shrink with use
        while self.ref_cnt and self.ref_cnt[-1] == 0:
            self.ref_cnt.pop()
        if self._free and self._free[0] >= 0:
            limit = len(self.ref_cnt)
            if any(b >= limit for b in self._free):
                self._free = [b for b in self._free if b < limit]
                heapq.heapify(self._free)

    def resize(self, num_blocks: int) -> None:
        if num_blocks < self.num_used_blocks:
            raise BlockPoolExhausted(f"{self.num_used_blocks} blocks are in use; cannot shrink to {num_blocks}")
        self.num_blocks = num_blocks

    def reset(self) -> None:
        self.ref_cnt.clear()
        self._free.clear()
