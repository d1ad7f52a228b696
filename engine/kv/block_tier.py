"""The second tier of a retrieval conversation (CacheConfig.retrieval_blocks): its blocks past the KV budget.

When a step of a conversation that reads chosen blocks needs room the budget no longer has (no idle conversation left
to release), the cache moves its oldest blocks (never the sinks' or the two newest) here instead of failing: their
bytes go to a private file (records of every layer's K and V, each layer's with a CRC-32), their key summaries stay in
memory (they are what the choice reads), and the table entry becomes null, so a prompt reads the blocks in memory
and each generated token ranks every block, on disk or not. A chosen block on disk is read back, one layer at a time,
into a small cache of fetched blocks: `slots` block ids of the pool held for it (in the budget), the least recently
used slot of a layer taken first; a token reads at most FETCH_MOST blocks from disk per layer (its best-scored
ones; the rest of its choice is in memory). A file that cannot be read (gone, damaged) ends fetching: the conversation goes
on with the blocks in memory, and `failed` says why (the session shows it once).

Full-precision pages only (fp32, fp16, bf16): a quantized conversation past its budget stops as before.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

FETCH_MOST = 16         # most blocks a token reads back from disk per layer (the rest of its choice is in memory)
FETCH_SPARE = 4         # fetch-cache slots beyond those, so a layer's recent fetches may stay for the next token


class TierError(OSError):
    """A block could not be read back from the tier (the file is gone or damaged)."""


class BlockTier:
    def __init__(self, layout, comps, blocks: int, device):
        self.layout, self.comps, self.device = layout, comps, device
        self.most = min(blocks, FETCH_MOST)         # blocks from disk a token may read per layer
        self.num_slots = self.most + FETCH_SPARE
        self.staging = None                  # the pinned Sequence whose blocks are the fetch cache (KVCache makes it)
        self.records: dict[int, tuple[int, list[int]]] = {}   # table position -> (file offset, CRC per layer)
        self.summaries: list[torch.Tensor] = []  # per layer [blocks on disk, Hkv, 2D] bf16, rows by summary_row
        self.summary_row: dict[int, int] = {}     # position -> its row in summaries
        self.cached: list[OrderedDict] = [OrderedDict() for _ in comps]     # per layer: position -> slot
        self.fetches = self.hits = 0
        self.failed = ""
        self.notified = False
        self._folder = Path(tempfile.mkdtemp(prefix="kvchat-tier-"))        # 0700, removed at close
        weakref.finalize(self, shutil.rmtree, self._folder, True)
        self.path = self._folder / "blocks.bin"
        self._file = open(self.path, "w+b")
        weakref.finalize(self, self._file.close)
        # a block's bytes per layer from the page shape: the pool may hold no pages at all when the first spill comes
        self._layer_bytes = [sum(math.prod(c.pages["data"].shape[1:]) * c.pages["data"].element_size() for c in pair)
                             for pair in comps]

    @property
    def positions(self) -> list[int]:
        return sorted(self.records)

    @property
    def nbytes(self) -> int:
        return len(self.records) * sum(self._layer_bytes)

    def put(self, positions: list[int], blocks: list[int], summaries: list[torch.Tensor]) -> None:
        """Write blocks `blocks` (every layer's K and V) as table positions `positions`, with their summaries
        [layers] of [n, Hkv, 2D], in one write; OSError (a full disk) leaves the tier as it was."""
        parts, records = [], {}
        offset = self._file.seek(0, os.SEEK_END)
        for position, block in zip(positions, blocks):
            crcs = []
            for pair in self.comps:
                raw = b"".join(c.pages["data"][block].contiguous().view(torch.uint8).numpy().tobytes() for c in pair)
                parts.append(raw)
                crcs.append(zlib.crc32(raw))
            records[position] = (offset, crcs)
            offset += sum(self._layer_bytes)
        self._file.write(b"".join(parts))
        self._file.flush()
        self.records.update(records)
        if not self.summaries:
            self.summaries = [torch.empty((0, *s.shape[1:]), dtype=torch.bfloat16) for s in summaries]
        row = self.summaries[0].shape[0]
        self.summaries = [torch.cat((t, s.to(torch.bfloat16))) for t, s in zip(self.summaries, summaries)]
        self.summary_row.update((p, row + i) for i, p in enumerate(positions))

    def summary_rows(self, positions: list[int]) -> torch.Tensor:
        return torch.tensor([self.summary_row[p] for p in positions], dtype=torch.long)

    def fetch(self, position: int, layer: int) -> int:
        """The block id whose pages of `layer` hold position's K and V now: a slot of the fetch cache, read from the
        file unless it is there already. TierError when the file cannot give it back."""
        cache = self.cached[layer]
        slot = cache.get(position)
        ids = self.staging.block_table
        if slot is not None:
            cache.move_to_end(position)
            self.hits += 1
            return ids[slot]
        offset, crcs = self.records[position]
        size = self._layer_bytes[layer]
        at = offset + sum(self._layer_bytes[:layer])
        try:
            raw = os.pread(self._file.fileno(), size, at)
        except (OSError, ValueError) as exc:
            raise TierError(f"the blocks on disk could not be read ({exc})") from None
        if len(raw) != size or zlib.crc32(raw) != crcs[layer]:
            raise TierError("the blocks on disk are damaged")
        slot = len(cache) if len(cache) < self.num_slots else cache.popitem(last=False)[1]
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        start = 0
        for c in self.comps[layer]:
            page = c.pages["data"][ids[slot]]
            n = page.numel() * page.element_size()
            page.view(torch.uint8).view(-1).copy_(data[start:start + n])
            start += n
        cache[position] = slot
        self.fetches += 1
        return ids[slot]

    def forget_cached(self) -> None:
        """The fetch cache's blocks no longer hold what it says (its pages moved): read again on the next choice."""
        for cache in self.cached:
            cache.clear()

    def close(self) -> None:
        self.records.clear()
        self.summary_row.clear()
        self.summaries = []
        try:
            self._file.close()
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)
