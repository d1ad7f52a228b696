"""The block pool: block ids, reference counts, the free heap and the evictable prefix blocks.

Plain Python, no torch. It hands out block ids (lowest free id first, so page storage stays as large
as the blocks in use), counts references, and keeps freed blocks that hold a full, hashed prefix
block as *evictable*: reusable by a later conversation with the same prefix until the pool needs
them (least recently freed first). Names follow vLLM's v1 block pool where they apply.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict


class BlockPool:
    """Block ids, reference counts, the free heap and the evictable prefix blocks."""

    def __init__(self, clock=None):
        self.ref_cnt: list[int] = []
        self._free: list[int] = []                         # heap of unreferenced, unhashed ids below high_water
        # unreferenced, hashed: least recently freed first, each with the tick it was freed at (pools that share a
        # clock, one per KV group, can so find the least recently freed block over all of them)
        self._evictable: OrderedDict[int, int] = OrderedDict()
        self._clock = clock if clock is not None else itertools.count()
        self.block_hash: dict[int, tuple] = {}             # id -> its prefix key
        self._by_key: dict[tuple, int] = {}                # prefix key -> id

    @property
    def high_water(self) -> int:
        """One past the highest id in use or evictable: the page storage's length."""
        return len(self.ref_cnt)

    @property
    def num_in_use(self) -> int:
        return len(self.ref_cnt) - len(self._free) - len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def evictable_ids(self) -> list[int]:
        return list(self._evictable)

    def oldest_freed(self) -> int | None:
        """The tick the least recently freed evictable block was freed at (None when there is none)."""
        return next(iter(self._evictable.values()), None)

    def allocate(self) -> int:
        if self._free:
            block_id = heapq.heappop(self._free)
        else:
            block_id = len(self.ref_cnt)
            self.ref_cnt.append(0)
        self.ref_cnt[block_id] = 1
        return block_id

    def evict_oldest(self) -> int | None:
        """Forget the least recently freed prefix block; returns its id (now free) or None."""
        if not self._evictable:
            return None
        block_id, _ = self._evictable.popitem(last=False)
        self._forget(block_id)
        heapq.heappush(self._free, block_id)
        self._trim()
        return block_id

    def touch(self, block_id: int) -> None:
        """Take a reference, reviving an evictable block."""
        if self.ref_cnt[block_id] == 0:
            del self._evictable[block_id]
        self.ref_cnt[block_id] += 1

    def free(self, block_id: int) -> bool:
        """Drop one reference; True when nothing references the block any more."""
        assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id]:
            return False
        if block_id in self.block_hash:
            self._evictable[block_id] = next(self._clock)
        else:
            heapq.heappush(self._free, block_id)
            self._trim()
        return True

    def cache(self, block_id: int, key: tuple) -> None:
        if key not in self._by_key and block_id not in self.block_hash:
            self._by_key[key] = block_id
            self.block_hash[block_id] = key

    def uncache(self, block_id: int) -> None:
        """Take a referenced block out of the prefix index (its contents are about to change)."""
        self._forget(block_id)

    def lookup(self, key: tuple) -> int | None:
        return self._by_key.get(key)

    def clear_cache(self) -> list[int]:
        """Forget every prefix key; evictable blocks become free. Returns the ids freed."""
        freed = list(self._evictable)
        self._evictable.clear()
        self._by_key.clear()
        self.block_hash.clear()
        for block_id in freed:
            heapq.heappush(self._free, block_id)
        self._trim()
        return freed

    def _forget(self, block_id: int) -> None:
        key = self.block_hash.pop(block_id, None)
        if key is not None and self._by_key.get(key) == block_id:
            del self._by_key[key]

    def _trim(self) -> None:
        # free ids at the top are forgotten, so high_water (and the page storage) shrinks with use
        top = len(self.ref_cnt)
        while self.ref_cnt and self.ref_cnt[-1] == 0 and (len(self.ref_cnt) - 1) not in self._evictable:
            self.ref_cnt.pop()
        if len(self.ref_cnt) < top:
            limit = len(self.ref_cnt)
            self._free = [b for b in self._free if b < limit]
            heapq.heapify(self._free)
