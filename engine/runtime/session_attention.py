"""A session's view of where attention goes: watching its conversation (the cache measures each step's rows into an
AttentionLog, engine/kv/attention_log.py) and reading the log as an AttentionMap (engine/runtime/attention_map.py).
"""
from __future__ import annotations

import numpy as np

from kvchat.engine.config import ConfigError
from kvchat.engine.kv.attention_log import AttentionLog
from kvchat.engine.runtime.attention_map import MAX_COLUMNS, OVER, WEIGHTS, AttentionMap


def watch(session, weights: str | None = "blocks") -> None:
    """Measure the conversation's attention from its next step on, per block ("blocks") or per token ("dense");
    None stops and frees what was measured."""
    if weights is not None and weights not in WEIGHTS:
        raise ConfigError(f"weights={weights!r}: choose 'blocks' (per cached block) or 'dense' (per token)")
    runner, state = session.runner, session.state
    log = None
    if weights is not None:
        c = runner.config
        log = AttentionLog(c.num_layers, c.num_heads, session.seq.block_size, weights)
    state.attention_log = log
    runner.cache.watch(session.seq, log)


def follow(session) -> None:
    """The log follows the conversation when its sequence changes (a live cache switch, an alternative chosen)."""
    log = session.state.attention_log
    if log is not None and session.runner.cache.attention_log(session.seq) is not log:
        session.runner.cache.watch(session.seq, log)


def attention_map(session, over: str = "newest", weights: str = "blocks",
                  max_columns: int = MAX_COLUMNS) -> AttentionMap | None:
    """The conversation's attention as measured: for its newest computed token, averaged over the last reply, or
    over the last prompt's observed rows. None: not watched, or nothing measured since (a reset, a read not yet
    done). ConfigError for what cannot be given (dense weights of a log kept per block)."""
    if over not in OVER:
        raise ConfigError(f"over={over!r}: choose one of {', '.join(OVER)}")
    if weights not in WEIGHTS:
        raise ConfigError(f"weights={weights!r}: choose 'blocks' or 'dense'")
    if not isinstance(max_columns, int) or max_columns < 1:
        raise ConfigError(f"max_columns={max_columns!r}: a whole number of columns, at least 1")
    log = session.state.attention_log
    if log is None:
        return None
    if weights == "dense" and log.weights != "dense":
        raise ConfigError("dense weights need the conversation watched per token: watch_attention('dense'), then "
                          "the next reply")
    n = session.seq.num_tokens
    rows = 1
    if over == "newest":
        got = log.newest(n)
        mass = None if got is None else got[0]
    elif over == "reply":
        got = log.over_reply(n)
        mass, rows = (None, 0) if got is None else got
    else:
        got = log.over_prompt(n)
        mass, rows = (None, 0) if got is None else got
    if mass is None or log.held is None:
        return None
    unit = log.unit
    C = -(-n // unit)
    out = np.zeros((log.num_layers, log.num_heads, C), dtype=np.float32)
    m = min(C, mass.shape[-1] - 1)
    out[..., :m] = mass[..., :m].numpy()
    held = np.zeros((log.num_layers, C), dtype=bool)
    h = min(C, log.held.shape[-1])
    held[:, :h] = log.held[:, :h].numpy()
    sink = mass[..., -1].numpy().astype(np.float32)
    if weights == "blocks" and unit == 1:           # a dense log read per block
        out, held, unit = _per_block(out, held, log.block_size)
    layers = session.runner.config.layers
    config = session.cache_config
    result = AttentionMap(
        mass=out, block_positions=np.arange(out.shape[-1], dtype=np.int64) * unit, sink_mass=sink,
        tokens=tuple(session.token_ids[:n]), block_size=unit, over=over, rows=int(rows),
        attends=np.array([spec.linear is None for spec in layers]), held=held,
        sinks=config.sinks if config.window is not None else 0,
        window=config.window if config.eviction == "window" else None,
        layer_windows=tuple(spec.window for spec in layers), message_starts=tuple(session.state.starts),
        kept_by="retrieval" if config.retrieval_blocks is not None else config.eviction,
        on_disk=_on_disk(session, out.shape[-1], unit))
    return result.bucketed(max_columns)


def _on_disk(session, columns: int, unit: int) -> np.ndarray | None:
    """bool [columns]: the columns whose block retrieval moved to disk past the budget; None without a usable tier."""
    tier = session.runner.cache.tier_of(session.state.seq)
    if tier is None or tier.failed or not tier.records:
        return None
    flags = np.zeros(columns, dtype=bool)
    bs = session.state.seq.block_size
    for p in tier.records:                      # table positions: block p holds tokens p*bs .. p*bs + bs - 1
        flags[p * bs // unit:min(columns, -(-(p + 1) * bs // unit))] = True
    return flags


def _per_block(mass: np.ndarray, held: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray, int]:
    C = mass.shape[-1]
    starts = np.arange(0, C, bs)
    return (np.add.reduceat(mass, starts, axis=2).astype(np.float32), np.logical_or.reduceat(held, starts, axis=1),
            bs)
