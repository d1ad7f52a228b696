"""What a session reports after a step: its StatsSnapshot, its share of the engine's KV pool, and the
forecast of the tokens that still fit. Every byte count comes from what the runner holds; the conversation's own
counts from its SessionState (engine/runtime/session_state.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvchat.engine.events import LayerBytes, PoolStats, StatsSnapshot
from kvchat.engine.kv.layout import layer_window_bytes, layer_windows, window_peak_bytes
from kvchat.engine.runtime import memory


@dataclass(frozen=True, slots=True)
class CacheSwitch:
    """What a live switch of the cache mode did to the conversation's tokens (Session.set_cache)."""

    tokens_before: int                  # tokens the cache held (the window attends to) before the switch
    tokens_after: int                   # and after
    tokens_lost: int                    # of the conversation, no longer in the cache: they left a window (now or
                                        # earlier), and a full cache does not bring them back; a reset reads them again


def tokens_left(session) -> int | None:
    """More tokens that fit in the budget in this mode (idle conversations released); None when a window bounds
    the cache instead (any length fits)."""
    seq = session.state.seq
    if seq.geometry.window is not None:     # the group that keeps the most is windowed: every group is bounded
        return None
    if session.runner.cache.can_spill(seq) and session.info.max_context:    # past the budget, blocks go to disk:
        return max(0, session.info.max_context - seq.num_tokens)            # the model's context binds
    layout = seq.layout
    room = session.runner.room_bytes({seq.seq_id}) - (layout.fixed_bytes - seq.side_bytes)
    if seq.groups:
        # the windowed groups still take what they lack of their windows; past them only the first group grows
        for m in seq.groups[1:]:
            room -= max(0, window_peak_bytes(m.layout, m.geometry) - len(m.block_table) * m.layout.block_bytes
                        - m.side_bytes)
    in_last = len(seq.block_table) * layout.block_size - seq.seq_len
    return max(0, room // layout.block_bytes * layout.block_size + in_last)


def pool_stats(session) -> PoolStats:
    v = session.runner.pool_view()
    mine = {session.state.seq.seq_id}            # a conversation by its first group (KVCacheManager.view)
    return PoolStats(
        budget_bytes=v.budget_bytes, held_bytes=v.held_bytes, free_bytes=v.free_bytes,
        evictable_blocks=v.evictable_blocks, evictable_bytes=v.evictable_bytes, shared_blocks=v.shared_blocks,
        blocks_in_use=v.blocks_in_use, prefix_queries=v.prefix_queries, prefix_hits=v.prefix_hits,
        conversations=tuple((sid, blocks, nbytes, sid in mine) for sid, blocks, nbytes, released in v.sequences
                            if blocks),
        released=session.runner.released_count(), storage_bytes=session.runner.storage_bytes(),
        in_host=_in_host(session.runner), **_saved(session))


def _in_host(runner) -> tuple:
    """The host tier beside a GPU pool: warm conversations released to it, with the bytes each copy holds."""
    tier = runner.host_tier
    if tier is None:
        return ()
    from kvchat.engine.runtime.warm import host_key
    return tuple((s.warm[1], tier.bytes_of(host_key(s))) for s in list(runner.warm_sessions)
                 if s.state.tier == "host" and s.warm is not None)


def _saved(session) -> dict:
    """The disk tier, as any warm conversation of this engine sees it (a new chat not kept yet sees the others')."""
    warm = session.warm or next((s.warm for s in list(session.runner.warm_sessions) if s.warm), None)
    if warm is None:
        return {}
    store, _key, identity = warm
    files, total = store.totals()
    model = store.path("", identity).name.removesuffix(".kvcache").lstrip("-")
    return {"saved_files": files, "saved_bytes": total, "saved_budget_bytes": store.budget_bytes,
            "saved": tuple((key, n) for key, n, m in store.entries() if m == model)}


def snapshot(session) -> StatsSnapshot:
    state = session.state
    seq = state.seq
    c = session.cache_config
    layout = seq.layout
    runner = session.runner
    windows = layer_windows(runner.config, c)
    caps = layer_window_bytes(runner.config, c, runner.dtype_name, str(runner.device))
    layers = tuple(layer_stats(runner, seq, windows, caps))
    t = state.turn_times
    tier = runner.cache.tier_of(seq)
    on_disk = len(tier.records) if tier is not None and not tier.failed else 0   # a failed file's blocks are gone
    budget = session.runner.budget_bytes
    free = session.runner.free_bytes()
    return StatsSnapshot(
        time_s=time.monotonic(),
        cache_label=c.label(),            # "auto" stays: the app names it in the user's words
        layers=layers,
        kv_bytes=sum(l.k_bytes + l.v_bytes for l in layers),
        budget_bytes=budget,
        block_size=c.block_size,
        blocks_used=sum(len(m.block_table) for m in seq.members),
        blocks_free=max(0, free // layout.block_bytes),
        blocks_budget=layout.budget_blocks(budget),
        tokens_in_context=len(state.token_ids),
        tokens_held=seq.tokens_held,
        tokens_evicted=seq.num_tokens - seq.tokens_held - on_disk * c.block_size,   # on disk is not gone
        tokens_left=tokens_left(session),
        bytes_per_token=layout.bytes_per_token,
        prefill_tokens=t.prefill_tokens,
        prefill_tok_s=t.prefill_tok_s,
        decode_tok_s=t.decode_tok_s,
        ttft_s=t.ttft_s,
        memory=memory.probe(),
        weight_bytes=session.info.weight_bytes,
        weights_label=session.info.weights_label,
        context_tokens=session.info.max_context,
        full_precision_bytes_per_token=runner.layout(c).full_precision_bytes_per_token,   # every layer (all groups)
        prefix_reused_tokens=t.reused,
        pool=pool_stats(session),
        notice=state.notice or tier_notice(tier),
        spec=t.spec,
        experts=runner.model.expert_counts(),
        state_bytes=seq.state.layout.bytes if seq.state is not None else 0,
        snapshots=tuple(sorted(seq.state.snapshots)) if seq.state is not None else (),
        summary_bytes=sum(m.layout.summary_bytes * len(m.block_table) for m in seq.members),
        blocks_read=blocks_read(runner, seq),
        blocks_on_disk=on_disk,
        tier_fetches=(tier.fetches, tier.hits) if tier is not None else (0, 0),
    )


def tier_notice(tier) -> str:
    if tier is None or not tier.failed:
        return ""
    return f"{tier.failed}: the conversation goes on with the blocks in memory (answers may differ)"


def blocks_read(runner, seq) -> tuple[int, int]:
    """Retrieval: (blocks read, blocks held) by the conversation's last generated token, per layer (rounded)."""
    read, held, rows = runner.blocks_read.get(seq.members[0].seq_id, (0, 0, 0))
    return (round(read / rows), round(held / rows)) if rows else (0, 0)


def layer_stats(runner, seq, windows, caps):
    """Every layer's bytes: K and V with their formats and window, a linear-attention layer's state (its formats
    read "state": cache modes do not apply to it), or none for a layer reading another layer's K and V."""
    state = seq.state
    sources = runner.model.config.kv_sources
    formats = runner.layer_formats(seq)
    for i, ((k, v), fmts) in enumerate(zip(runner.layer_bytes(seq), formats)):
        if i in sources:                    # another layer's K and V, read in its formats: no bytes of its own
            src = formats[sources[i]]
            yield LayerBytes(i, 0, 0, src[0].label, src[1].label, windows[i], None, kv_source=sources[i])
        elif fmts is None:                  # no KV: a linear-attention layer
            held = state.layout.layer_bytes if state is not None else 0
            yield LayerBytes(i, 0, 0, "state", "state", None, held, kind="linear_attention", state_bytes=held)
        else:
            yield LayerBytes(i, k, v, fmts[0].label, fmts[1].label, windows[i], caps[i])
