"""The scheduler's only door into the engine: sequences, one batched step, blocks and bytes.

A handle is a sequence of the engine's shared KV pool (engine/kv/manager.py). A step runs every
scheduled sequence's new tokens through one forward pass (the linear layers see one batch, each
sequence attends over its own pages) and rolls all of them back if it fails.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from kvchat.engine.config import CacheConfig
from kvchat.engine.kv.layout import MIB
from kvchat.engine.kv.layout import KVLayout
from kvchat.engine.kv.sequence import Sequence as _Seq


@dataclass(eq=False)
class Sequence:
    """One request's cache: a sequence of the engine's pool."""
    seq: _Seq
    cache_config: CacheConfig


@dataclass(eq=False)
class _Served:
    """What serving keeps per engine beside the runner: its live handles and the layout block counts are in."""
    handles: set[Sequence] = field(default_factory=set)
    layout: KVLayout | None = None


_served: "weakref.WeakKeyDictionary[object, _Served]" = weakref.WeakKeyDictionary()     # by runner


def _runner(engine):
    return engine.runner


def _state(runner) -> _Served:
    state = _served.get(runner)
    if state is None:
        state = _served[runner] = _Served()
    return state


def new_sequence(engine, cache_config: CacheConfig) -> Sequence:
    """An empty sequence with no blocks, in the engine's pool (whose budget the config's budget_mb sets)."""
    runner = _runner(engine)
    if int(cache_config.budget_mb * MIB) != runner.budget_bytes:
        runner.set_budget(cache_config.budget_mb)
    seq = runner.new_sequence(cache_config)
    handle = Sequence(seq, cache_config)
    state = _state(runner)
    state.layout = seq.layout               # block counts below are in this layout's blocks
    state.handles.add(handle)
    return handle


def _handles(runner) -> set:
    return _state(runner).handles


def match_prefix(engine, handle: Sequence, ids: list[int]) -> int:
    """Adopt cached blocks holding the start of ids; returns the tokens that need no forward pass."""
    return _runner(engine).match_prefix(handle.seq, ids)


def step(engine, items: list[tuple[Sequence, list[int]]], decode: list[bool] | None = None,
         reading: frozenset = frozenset()) -> list[torch.Tensor]:
    """Feed each sequence its new token ids in one forward pass; returns each item's last-token logits [1, vocab], or
    every row's [T, vocab] for a verification (a decode item of several tokens: speculative decoding).
    decode[i]: item i is generated tokens (not prompt): the runner keeps each kind's numbers independent of
    the batch, so a request gives the same tokens alone or among others. reading: the handles whose prompt goes on
    after this step (a cache kept by attention chooses once it is read whole)."""
    return _runner(engine).step([(h.seq, ids) for h, ids in items], all_logits=False, decode=decode,
                                reading=frozenset(h.seq.seq_id for h in reading))


def keep_state(engine, handle: Sequence) -> bool:
    """Keep the sequence's recurrent state where it stands (a block boundary where its newest message begins) for
    requests that start the same (KVCache.publish_state, kept); False for a model without one, or no room."""
    return _runner(engine).cache.publish_state(handle.seq, keep=True)


def truncate(engine, handle: Sequence, n: int) -> None:
    """Take back the last n tokens (the drafts a verification rejected)."""
    if n:
        _runner(engine).truncate(handle.seq, n)


def draft_room(engine, handle: Sequence, most: int) -> int:
    """How many drafts may follow the sequence's next token in one verification (ModelRunner.draft_room)."""
    return _runner(engine).draft_room(handle.seq, most)


def speculator(engine, cache: CacheConfig | None = None):
    """A new request's speculation under the engine's setting now, or None when it is off."""
    from kvchat.engine.runtime.speculative import Speculator
    runner = _runner(engine)
    if not runner.speculation.enabled:
        return None
    return Speculator(runner.speculation, runner.draft_runner, runner.config.vocab_size, runner.step_costs, cache)


def blocks_needed(engine, handle: Sequence, num_new: int) -> int:
    """Blocks the sequence must add to take num_new more tokens (a shared partial block counts: it is copied)."""
    seq = handle.seq
    if seq.hybrid:      # a hybrid model's conversation: every group's bytes, counted in its first group's blocks
        return -(-_runner(engine).bytes_needed(seq, num_new) // seq.layout.block_bytes)
    need = max(0, seq.layout.blocks_for(seq.seq_len + num_new) - len(seq.block_table))
    return need + int(num_new > 0 and _runner(engine).shared_partial(seq))


def _block_bytes(engine) -> int:
    layout = _state(_runner(engine)).layout
    if layout is None:
        raise RuntimeError("no sequence was opened on this engine yet: call new_sequence first")
    return layout.block_bytes


def blocks_for_bytes(engine, nbytes: int) -> int:
    """Blocks of the budget that nbytes of cache take (a quantized layout's tails and heads included)."""
    return -(-nbytes // _block_bytes(engine))


def num_free_blocks(engine) -> int:
    """Blocks of the budget no request holds: prefix blocks kept only for reuse count as free (as in vLLM), and
    so do the blocks of idle app conversations on the same engine, which give them back when asked."""
    runner = _runner(engine)
    keep = {h.seq.seq_id for h in _handles(runner)}
    return max(0, runner.room_bytes(keep) // _block_bytes(engine))


def num_blocks(engine) -> int:
    """All blocks the budget holds."""
    return _runner(engine).budget_bytes // _block_bytes(engine)


def fits(engine, handle: Sequence, num_new: int) -> bool:
    return blocks_needed(engine, handle, num_new) <= num_free_blocks(engine)


def release(engine, handle: Sequence) -> None:
    """Give every block of the sequence back (full prefix blocks stay reusable); the handle is dead afterwards."""
    runner = _runner(engine)
    runner.close(handle.seq)
    _handles(runner).discard(handle)


def export(engine, handle: Sequence) -> tuple[int, list, dict[str, torch.Tensor]]:
    """(tokens held, per KV group its metadata, the tensors) of a sequence's cache, byte for byte as stored, copied
    to host memory (engine/kv/saved.py): what the preemption tier keeps."""
    runner = _runner(engine)
    with runner.lock:
        groups, tensors = runner.export_kv(handle.seq)
        return handle.seq.num_tokens, groups, tensors


def import_cache(engine, handle: Sequence, groups: list, tensors: dict[str, torch.Tensor]) -> None:
    """Fill an empty sequence with an exported cache (under new block ids); engine.kv.saved.CacheFileError says why
    it cannot be (no room now, or a copy that does not fit the pages), and the sequence then holds nothing. The other
    live requests keep their blocks: only reusable prefix blocks and idle conversations give theirs up."""
    runner = _runner(engine)
    runner.import_kv(handle.seq, groups, tensors, keep=sequence_ids(list(_handles(runner))))


def pool_on_gpu(engine) -> bool:
    return torch.device(_runner(engine).device).type == "cuda"


def num_live(engine) -> int:
    """Live server sequences (the app's conversations on the same engine are not counted)."""
    return len(_handles(_runner(engine)))


def usage(engine) -> float:
    """Share of the budget in use, 0.0-1.0 (vLLM's kv_cache_usage_perc: reusable blocks count as free)."""
    total = num_blocks(engine)
    return 1.0 - num_free_blocks(engine) / total if total else 0.0


def kv_bytes(engine) -> int:
    """Bytes the pool holds."""
    return _runner(engine).held_bytes


def budget_bytes(engine) -> int:
    return _runner(engine).budget_bytes


def kv_bytes_by_layer(engine) -> list[tuple[int, str, str, int]]:
    """(layer, "k" or "v", format label, bytes held) summed over live sequences."""
    runner = _runner(engine)
    totals: dict[tuple[int, str, str], int] = {}
    for seq in runner.sequences():
        for layer, ((k, v), fmts) in enumerate(zip(runner.layer_bytes(seq), runner.layer_formats(seq))):
            if fmts is None:            # a linear-attention layer: its recurrent state (kv/state.py), float32
                held = seq.state.layout.layer_bytes if seq.state is not None else 0
                totals[(layer, "state", "fp32")] = totals.get((layer, "state", "fp32"), 0) + held
                continue
            kf, vf = fmts
            for comp, fmt, nbytes in (("k", kf.label, k), ("v", vf.label, v)):
                totals[(layer, comp, fmt)] = totals.get((layer, comp, fmt), 0) + nbytes
    return [(layer, comp, fmt, b) for (layer, comp, fmt), b in sorted(totals.items())]


def bytes_by_sequence(engine) -> dict[int, int]:
    """Sequence id -> KV bytes it holds (all layers, K and V), for every live sequence of the engine's pool."""
    runner = _runner(engine)
    return {seq.seq_id: sum(k + v for k, v in runner.layer_bytes(seq))
            for seq in runner.sequences()}


def sequence_ids(handles: list[Sequence]) -> frozenset[int]:
    """The pool ids of these handles' sequences, every KV group."""
    return frozenset(m.seq_id for h in handles for m in h.seq.members)


def sequence_id(handle: Sequence) -> int:
    return handle.seq.seq_id


def prefix_cache_counts(engine) -> tuple[int, int]:
    """(tokens looked up, tokens found) in the prefix cache since load."""
    return _runner(engine).prefix_counts()


def max_context(engine) -> int:
    """The model's context in tokens."""
    return int(engine.model.config.max_position_embeddings)


def vocab_size(engine) -> int:
    """The logits' width: token ids a logit bias may name."""
    return int(_runner(engine).config.vocab_size)


def stop_ids(engine) -> frozenset[int]:
    """Token ids that end a reply (EOS and the chat template's end-of-turn)."""
    return engine.stop_ids
