"""Which blocks a conversation kept by attention lets go (CacheConfig.eviction="importance"): the least attended.

A block's score is the most attention any query head of the group's layers gave it, over the last prompt's observed
rows (SnapKV's observation window: a prompt's last 32 rows, kv/attention_log.OBSERVED) plus the reply's mean row so
far (the mass H2O accumulates, as a mean so a long reply does not outweigh the prompt; each block's mean over the rows
that could see it, so a block the reply wrote is not starved by the rows read before it). The maximum over heads keeps
a block that one head needs (a retrieval head finding a fact) where a mean would drown it in the others. The sink
blocks and the newest blocks always stay (KeepImportant); ties go oldest first, and a conversation nothing was
measured for yet loses its oldest blocks, as a window would.
"""
from __future__ import annotations

import torch

from kvchat.engine.kv.attention_log import AttentionLog


def block_scores(log: AttentionLog | None, layers: tuple[int, ...], num_blocks: int,
                 num_tokens: int) -> torch.Tensor | None:
    """[num_blocks] float: each table position's score (0 where nothing attended it), or None: nothing measured."""
    if log is None:
        return None
    parts = [got[0] for got in (log.over_prompt(num_tokens), log.over_reply(num_tokens, since_made=True)) if got is not None]
    if not parts:
        return None
    cols = max(p.shape[-1] for p in parts) - 1          # the last column is the learned sink's share
    mass = torch.zeros(parts[0].shape[0], parts[0].shape[1], cols)
    for p in parts:
        mass[..., :p.shape[-1] - 1] += p[..., :-1]
    if layers:
        mass = mass[list(layers)]
    if log.unit == log.block_size:
        per_block = mass                                    # columns are blocks already
    else:                                                   # columns are tokens: a block's mass is their sum
        bs = log.block_size
        pad = -cols % bs
        per_block = torch.nn.functional.pad(mass, (0, pad)).view(*mass.shape[:2], -1, bs).sum(-1)
    score = per_block.amax(dim=(0, 1))
    out = torch.zeros(num_blocks)
    n = min(num_blocks, score.shape[0])
    out[:n] = score[:n]
    return out


def choose(table: list[int | None], sink_blocks: int, newest: int, count: int,
           scores: torch.Tensor | None) -> list[int]:
    """Table positions of the `count` held blocks to let go: never a sink block or one of the newest `newest`
    positions; the lowest scores first (the oldest among equals; the oldest alone without scores)."""
    candidates = [i for i in range(sink_blocks, len(table) - newest) if table[i] is not None]
    if scores is not None:
        candidates.sort(key=lambda i: (float(scores[i]), i))
    return sorted(candidates[:count])
