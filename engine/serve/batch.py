"""The scheduler's only door into the engine: sequences, one batched step, blocks and bytes.

Everything the server needs from engine internals is here, so retargeting it at the engine's
shared block pool and batched forward changes this file only. The scheduler above it deals in
handles, token ids and block counts.

Today (one KV pool per Session) a handle is a Session, and the server's budget is emulated: the
blocks all live handles of an engine hold are summed against the blocks one budget of the serve
cache config holds, so admission and preemption behave as they will over a shared pool.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from ..config import CacheConfig


@dataclass(eq=False)
class Sequence:
    """One request's cache. `session` is today's carrier; the lead's version holds a block table."""
    session: object
    cache_config: CacheConfig


@dataclass
class _Live:
    num_blocks: int                                  # blocks one serve budget holds
    budget_bytes: int
    cache_config: CacheConfig | None = None
    handles: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


_LIVE: "weakref.WeakKeyDictionary[object, _Live]" = weakref.WeakKeyDictionary()


def _live(engine) -> _Live:
    live = _LIVE.get(engine)
    if live is None:
        raise RuntimeError("no sequence was opened on this engine yet: call new_sequence first")
    return live


def new_sequence(engine, cache_config: CacheConfig) -> Sequence:
    """An empty sequence with no blocks. Today: a Session of its own (its pool is never the limit)."""
    session = engine.new_session(cache=cache_config.with_(overflow="stop"))
    handle = Sequence(session, cache_config)
    live = _LIVE.setdefault(engine, _Live(0, 0))
    with live.lock:
        if not live.handles:        # the budget is the first live sequence's (one serve config at a time)
            live.num_blocks = session.cache.pool.num_blocks
            live.budget_bytes = int(cache_config.budget_mb * 2**20)
            live.cache_config = cache_config
        elif cache_config != live.cache_config:
            raise RuntimeError("sequences of one engine share one cache config; release the others first")
        live.handles.add(handle)
    return handle


def step(engine, items: list[tuple[Sequence, list[int]]]) -> list[torch.Tensor]:
    """Feed each sequence its new token ids; returns each item's last-token logits [vocab], float32.

    The caller has checked with blocks_needed/num_free_blocks that all items fit together. Today a
    loop over sessions; the batched forward replaces this body with one ragged step.
    """
    return [handle.session.append(ids, all_logits=False)[-1] for handle, ids in items]


def blocks_needed(engine, handle: Sequence, num_new: int) -> int:
    """Blocks the sequence must add to take num_new more tokens (0 while its last block has room)."""
    return handle.session.cache.blocks_needed(num_new)


def num_free_blocks(engine) -> int:
    """Blocks of the serve budget that no live sequence holds."""
    live = _live(engine)
    with live.lock:
        used = sum(h.session.cache.pool.num_used_blocks for h in live.handles)
    return live.num_blocks - used


def num_blocks(engine) -> int:
    """All blocks the serve budget holds."""
    return _live(engine).num_blocks


def fits(engine, handle: Sequence, num_new: int) -> bool:
    return blocks_needed(engine, handle, num_new) <= num_free_blocks(engine)


def release(engine, handle: Sequence) -> None:
    """Give every block of the sequence back; the handle is dead afterwards."""
    live = _LIVE.get(engine)
    handle.session.reset()
    if live is not None:
        with live.lock:
            live.handles.discard(handle)


def num_live(engine) -> int:
    live = _LIVE.get(engine)
    return len(live.handles) if live else 0


def usage(engine) -> float:
    """Share of the budget's blocks in use, 0.0-1.0 (what vLLM's kv_cache_usage_perc reports)."""
    live = _LIVE.get(engine)
    if live is None or not live.num_blocks:
        return 0.0
    return 1.0 - num_free_blocks(engine) / live.num_blocks


def kv_bytes(engine) -> int:
    """Bytes of KV pages all live sequences hold."""
    return sum(b for *_, b in kv_bytes_by_layer(engine))


def budget_bytes(engine) -> int:
    live = _LIVE.get(engine)
    return live.budget_bytes if live else 0


def kv_bytes_by_layer(engine) -> list[tuple[int, str, str, int]]:
    """(layer, "k" or "v", format label, bytes held) summed over live sequences."""
    live = _LIVE.get(engine)
    if live is None:
        return []
    with live.lock:
        handles = list(live.handles)
    totals: dict[tuple[int, str, str], int] = {}
    for h in handles:
        cache = h.session.cache
        for layer, ((k, v), (kc, vc)) in enumerate(zip(cache.layer_bytes(), cache.layers)):
            for comp, fmt, nbytes in (("k", kc.fmt.label, k), ("v", vc.fmt.label, v)):
                key = (layer, comp, fmt)
                totals[key] = totals.get(key, 0) + nbytes
    return [(layer, comp, fmt, b) for (layer, comp, fmt), b in sorted(totals.items())]


def prefix_cache_counts(engine) -> tuple[int, int]:
    """(tokens looked up, tokens found) in the prefix cache since load. 0, 0 until it is wired."""
    return 0, 0


def max_context(engine) -> int:
    """The model's context in tokens."""
    return int(engine.model.config.max_position_embeddings)


def stop_ids(engine) -> frozenset[int]:
    """Token ids that end a reply (EOS and the chat template's end-of-turn)."""
    return engine.stop_ids
