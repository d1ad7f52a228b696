"""Live switch of a session's cache mode: convert the blocks held, never run the model again.

Components whose format does not change keep their pages byte for byte (a stored value is never
re-quantized); the others are dequantized and written in the new format. Blocks that fall out of
a new window go back to the pool.
"""
from __future__ import annotations

import math

import torch

from .config import CacheConfig, ConfigError
from .kv_cache import MIB, Component, KVCache


def _surviving_blocks(cache: KVCache, config: CacheConfig, sink_blocks: int) -> list[int]:
    """Indices into cache.table of the blocks a window in `config` keeps."""
    keep = list(range(len(cache.table)))
    if config.window is None:
        return keep
    bs = cache.block_size
    start_abs = max(config.sinks, cache.num_tokens - config.window)
    evicted = cache.evicted_blocks
    while len(keep) > sink_blocks + 1:
        first_abs = (sink_blocks + evicted) * bs
        if first_abs + bs > start_abs:
            break
        keep.pop(sink_blocks)
        evicted += 1
    return keep


def _slot_values(comp: Component, cache: KVCache, blocks: list[int]) -> torch.Tensor:
    """Float values of the chosen table blocks laid end to end: [len(blocks) * bs, H, D]."""
    bs = cache.block_size
    last = len(cache.table) - 1
    parts = []
    for i in blocks:
        if comp.fmt.is_quantized and i == last and cache.seq_len % bs:
            parts.append(comp.tail.float())
        elif i == 0 and comp.head is not None:
            parts.append(comp.head.float())
        else:
            ids = torch.tensor([cache.table[i]], dtype=torch.long, device=cache.device)
            parts.append(comp.read_blocks(ids)[0])
    if not parts:
        return torch.empty(0, comp.num_heads, comp.head_dim)
    return torch.cat(parts)


def convert_cache(old: KVCache, config: CacheConfig) -> KVCache:
    m = old.model
    bad = [i for i in config.full_precision_layers if i >= m.num_layers]
    if bad:
        raise ConfigError(f"full_precision_layers {bad} do not exist: the model has layers 0-{m.num_layers - 1}")
    if config.block_size != old.block_size and old.evicted_blocks:
        raise ConfigError("the block size can change only before the window has evicted tokens: reset the session first")
    if config.block_size != old.block_size:
        return _rebuild(old, config)
    sink_blocks = math.ceil(config.sinks / config.block_size) if config.window else 0
    if old.evicted_blocks and config.window is not None and sink_blocks != old.num_sink_blocks:
        raise ConfigError(f"the window has already evicted tokens around {old.config.sinks} sinks; changing the number "
                          f"of sinks now needs a reset")
    if old.evicted_blocks:
        sink_blocks = old.num_sink_blocks
    keep = _surviving_blocks(old, config, sink_blocks)
    new = KVCache(m, config, old.model_dtype, old.device)
    if len(keep) > new.pool.num_blocks:
        need_mb = len(keep) * new.layout_bytes(config)[0] / MIB
        raise ConfigError(f"the conversation holds {old.tokens_held} tokens, which need {need_mb:.1f} MiB in "
                          f"{config.label()}, more than the {config.budget_mb:g} MiB budget: raise the budget, "
                          f"use a window or a smaller format, or reset the session")
    new.table = new.pool.allocate_many(len(keep))
    new._resize_pages()
    dropped = len(old.table) - len(keep)
    new.num_tokens = old.num_tokens
    new.evicted_blocks = old.evicted_blocks + dropped
    new.num_sink_blocks = sink_blocks if (config.window is not None or old.evicted_blocks) else 0
    seq_len = new.seq_len
    old_ids = torch.tensor([old.table[i] for i in keep], dtype=torch.long, device=old.device)
    new_ids = torch.tensor(new.table, dtype=torch.long, device=old.device)
    for old_comps, new_comps in zip(old.layers, new.layers):
        for oc, nc in zip(old_comps, new_comps):
            if oc.fmt == nc.fmt:
                for name, t in oc.pages.items():
                    nc.pages[name][new_ids] = t[old_ids]
                if oc.tail is not None:
                    nc.tail = oc.tail.clone()
                if oc.head is not None and keep and keep[0] == 0:
                    nc.head = oc.head.clone()
            elif seq_len:
                nc.write(_slot_values(oc, old, keep)[:seq_len], 0, new.table)
    return new


def _rebuild(old: KVCache, config: CacheConfig) -> KVCache:
    """New block size: lay every token out again (only possible while nothing was evicted)."""
    new = KVCache(old.model, config, old.model_dtype, old.device)
    n = old.seq_len
    need = math.ceil(n / config.block_size)
    if need > new.pool.num_blocks:
        raise ConfigError(f"the conversation's {n} tokens do not fit the {config.budget_mb:g} MiB budget in "
                          f"{config.label()}: raise the budget or reset the session")
    new.table = new.pool.allocate_many(need)
    new._resize_pages()
    new.num_tokens = old.num_tokens
    all_blocks = list(range(len(old.table)))
    for old_comps, new_comps in zip(old.layers, new.layers):
        for oc, nc in zip(old_comps, new_comps):
            if n:
                nc.write(_slot_values(oc, old, all_blocks)[:n], 0, new.table)
    new._evict()
    return new
