"""Which blocks of a KV group stay: one small policy class per kind of layer, written once.

Full attention keeps every block; the user's window with sinks (StreamingLLM) and a layer's own sliding window let
whole blocks go once every token in them is older than the window. The manager applies them to positioned block
tables (kv/manager.Sequence.table); the forecast (kv/layout.py, plan/estimate.py) reads the same arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvchat.engine.config import CacheConfig

PREFILL_CHUNK = 512                     # most prompt tokens one step reads (less within a window)


@dataclass(frozen=True, slots=True)
class WindowGeometry:
    """Which of a KV group's blocks stay, as blocks of a positioned table (kv/manager.Sequence.table): the rule of one
    kind of layer, as vLLM keeps a manager per kind of KV spec. Three kinds, each a small class below:

    - FullAttention: every block stays.
    - SinkWindow: the user's sliding window with attention sinks (StreamingLLM, arXiv 2309.17453). The first
      `sink_blocks` blocks hold the sinks and stay; the blocks after them leave, whole, once every token in them is
      older than the window, so `evicted` blocks after the sinks are null and held slot j >= the sink end is token
      j + evicted * block_size.
    - ModelWindow: a layer's own sliding window (Gemma, gpt-oss): no sinks, absolute positions, so every block holds
      what full attention's model computes and may be indexed for prefix reuse after blocks left.

    Build one with `WindowGeometry.of(cache)` or `layer_geometry`; `window` is None for full attention only."""

    block_size: int
    window: int | None = None
    sinks: int = 0
    model_window = False
    by_importance = False       # the cache chooses which blocks leave (KeepImportant), not the window's order

    def __post_init__(self):
        if type(self) is WindowGeometry:
            raise TypeError("a window geometry is one of its kinds: FullAttention, SinkWindow or ModelWindow")

    @classmethod
    def of(cls, cache: CacheConfig) -> "WindowGeometry":
        """The user's cache mode: its window and sinks, or full attention."""
        if cache.window is None:
            if cache.retrieval_blocks is not None:
                return ReadChosen(cache.block_size, None, cache.sinks, cache.retrieval_blocks)
            return FullAttention(cache.block_size)
        if cache.eviction == "importance":
            return KeepImportant(cache.block_size, cache.window, cache.sinks)
        return SinkWindow(cache.block_size, cache.window, cache.sinks)

    @property
    def sink_blocks(self) -> int:
        return 0

    @property
    def full_attention_tokens(self) -> float:
        """Tokens a sequence computes as full attention does, which are the only ones prefix reuse may share."""
        return float("inf")

    def start(self, num_tokens: int, evicted: int) -> tuple[int, int]:
        """(window_start slot, num_sinks) of a stream of num_tokens tokens with `evicted` blocks gone."""
        return 0, 0

    def num_to_evict(self, num_tokens: int, evicted: int, table_len: int) -> int:
        """How many held blocks after the sink blocks have left the window and can go back to the pool."""
        return 0

    def held(self, num_tokens: int, evicted: int) -> int:
        """Tokens whose K/V the window attends to."""
        seq_len = num_tokens - evicted * self.block_size
        ws, ns = self.start(num_tokens, evicted)
        return min(ns, seq_len) + max(0, seq_len - max(ws, ns))

    def steady_blocks(self, num_tokens: int) -> tuple[int, int]:
        """(blocks held, blocks evicted) once num_tokens tokens went through the window."""
        table = self.blocks_for(num_tokens)
        gone = self.num_to_evict(num_tokens, 0, table)
        return table - gone, gone

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def prefill_chunk(self) -> int:
        """Prompt tokens one step reads: whole blocks, and no more than a window."""
        return PREFILL_CHUNK

    def sliding_window_for(self, budget_blocks: int) -> int:
        """The longest window (whole blocks) that fits in budget_blocks beside these sink blocks while a prompt
        chunk is in flight: the window and the chunk share what is left, less a block of each for their partial
        ends. 0 when not even one block fits."""
        sink_blocks = -(-self.sinks // self.block_size)
        return max(0, (budget_blocks - sink_blocks - 2) // 2 * self.block_size)

    def peak_blocks(self, chunk: int) -> int:
        """Most blocks a windowed conversation holds while a chunk of `chunk` new tokens is in flight."""
        raise ValueError("full attention has no peak: it grows with the conversation")


@dataclass(frozen=True, slots=True)
class FullAttention(WindowGeometry):
    """Every block stays."""


@dataclass(frozen=True, slots=True)
class ReadChosen(FullAttention):
    """Every block stays; each generated token reads the sink blocks, the newest blocks and `blocks` chosen ones per
    layer (query-aware retrieval, Quest: engine/runtime/retrieval.py). Its layout keeps a key summary per block."""

    blocks: int = 0

    @property
    def read_sink_blocks(self) -> int:
        return -(-self.sinks // self.block_size)


@dataclass(frozen=True, slots=True)
class SinkWindow(WindowGeometry):
    """The user's window and sinks (see WindowGeometry)."""

    @property
    def sink_blocks(self) -> int:
        return -(-self.sinks // self.block_size)

    @property
    def full_attention_tokens(self) -> float:
        # a window changes the K/V of later tokens (they attend to the sinks and the window only), so only blocks
        # within the first window + sinks tokens are full attention's
        return self.window + self.sinks

    def start(self, num_tokens: int, evicted: int) -> tuple[int, int]:
        bs = self.block_size
        seq_len = num_tokens - evicted * bs
        start_abs = max(self.sinks, num_tokens - self.window)
        start = start_abs if start_abs < self.sink_blocks * bs else start_abs - evicted * bs
        return min(start, seq_len), min(self.sinks, num_tokens)

    def num_to_evict(self, num_tokens: int, evicted: int, table_len: int) -> int:
        bs = self.block_size
        start_abs = max(self.sinks, num_tokens - self.window)
        n = 0
        while table_len - n > self.sink_blocks + 1 and (self.sink_blocks + evicted + n + 1) * bs <= start_abs:
            n += 1
        return n

    def prefill_chunk(self) -> int:
        return max(self.block_size, min(PREFILL_CHUNK, self.window) // self.block_size * self.block_size)

    def peak_blocks(self, chunk: int) -> int:
        return self.sink_blocks + self.blocks_for(self.window + chunk) + 1


@dataclass(frozen=True, slots=True)
class ModelWindow(SinkWindow):
    """A layer's own window W, kept as W - 1 past tokens (`window`), no sinks, at absolute positions."""

    model_window = True

    @property
    def full_attention_tokens(self) -> float:
        return float("inf")


@dataclass(frozen=True, slots=True)
class KeepImportant(SinkWindow):
    """The user's window kept by attention (CacheConfig.eviction="importance"): the sink blocks (at least the first),
    the newest block and the most attended of the rest, `window` tokens in all; which blocks go is the cache's choice
    (KVCache.evict_unimportant), by the mass the kernels measured. Every held token keeps its position: nothing is
    re-rotated, so start() is (0, 0) and the held slots are all read."""

    by_importance = True

    @property
    def sink_blocks(self) -> int:
        return max(1, -(-self.sinks // self.block_size))

    @property
    def newest_blocks(self) -> int:
        """Blocks at the end that always stay: the one being filled and the one before it."""
        return 2

    @property
    def limit_blocks(self) -> int:
        """Most blocks held once a step is done: the sinks', the window's, and the one being filled."""
        return self.sink_blocks + -(-self.window // self.block_size) + 1

    def start(self, num_tokens: int, evicted: int) -> tuple[int, int]:
        return 0, 0

    def num_to_evict(self, num_tokens: int, evicted: int, table_len: int) -> int:
        return max(0, table_len - self.limit_blocks)


def sinks_at_first_positions(delta: int, first_slot: int, window: int | None, num_sinks: int, sink_blocks: int,
                             block_size: int) -> int:
    """How many leading held slots (the sinks, first among a step's rows) keep their first positions while the
    new tokens' in-cache positions trail their absolute ones by delta: none while delta is 0 (nothing left);
    with a window its sinks; a window removed after it slid keeps its whole sink blocks."""
    if not delta:
        return 0
    if window is not None:
        return min(num_sinks, first_slot)
    return min(sink_blocks * block_size, first_slot)
