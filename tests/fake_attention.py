"""The fake engine's view of where attention goes (a plausible AttentionMap) and a stand-in for
engine.runtime.replay, for the Attention page's GUI tests (tests/fakes.py's sessions use the map)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvchat.engine.config import ConfigError


def fake_attention_map(tokens, block_size: int = 16, layers: int = 4, heads: int = 2,
                       window: int | None = None, sinks: int = 4, layer_windows: tuple = (), linear: tuple = (),
                       message_starts: tuple = (), over: str = "newest", seed: int = 0):
    """An AttentionMap with the shape of a real one: much mass on the first block (a sink), on the newest blocks and
    on each message's start, a little everywhere else; nothing where a layer holds no block (outside the cache's
    window, outside a sliding layer's own window); linear layers attend to nothing."""
    import numpy as np

    from kvchat.engine.runtime.attention_map import AttentionMap
    n = len(tokens)
    columns = -(-n // block_size)
    positions = np.arange(columns, dtype=np.int64) * block_size
    rng = np.random.default_rng(seed)
    age = (n - 1 - positions) / block_size
    base = np.exp(-age / (3.0 if over == "newest" else 8.0)) + 0.002 + 0.01 * rng.random((layers, heads, columns))
    base[..., 0] += 2.0
    for start in message_starts:
        if start is not None and start < n:
            base[..., start // block_size] += 0.05
    held = np.ones((layers, columns), bool)
    ends = np.minimum(positions + block_size, n)
    if window is not None and n > window + sinks:
        held &= (positions < sinks) | (ends > n - window)
    windows = tuple(layer_windows) + (None,) * (layers - len(layer_windows))
    for layer, own in enumerate(windows):
        if own is not None:
            held[layer] &= ends > n - own
    attends = np.array([layer not in linear for layer in range(layers)])
    mass = np.where(held[:, None, :] & attends[:, None, None], base, 0.0)
    totals = mass.sum(axis=-1, keepdims=True)
    mass = np.divide(mass, totals, out=np.zeros_like(mass), where=totals > 0).astype(np.float32)
    return AttentionMap(mass=mass, block_positions=positions, sink_mass=np.zeros((layers, heads), np.float32),
                        tokens=tuple(int(t) for t in tokens), block_size=block_size, over=over,
                        rows=1 if over == "newest" else 8, attends=attends, held=held,
                        sinks=sinks if window is not None else 0, window=window,
                        layer_windows=windows, message_starts=tuple(message_starts))


@dataclass(frozen=True)
class FakeReplyReplay:
    index: int
    start: int
    end: int
    tokens: int
    top1: float
    kl: float
    first_divergence: int | None
    expected: int | None
    replayed: int | str | None


@dataclass(frozen=True)
class FakeReplayResult:
    mode: str
    baseline: str
    tokens: int
    top1: float
    kl: float
    first_divergence: int | None
    replies: tuple
    seconds: float
    kv_bytes: int
    baseline_kv_bytes: int


def fake_replay_module(step_s: float = 0.0, diverge_at: int = 1):
    """Stands in for engine.runtime.replay (install it in sys.modules): two sessions of the engine read the ids, one
    step at a time, and are closed however the replay ends; under int4 each reply first diverges at its token
    `diverge_at`, where the mode would have said "banana" (the token the chat holds there comes as its id, the mode's
    as text: the app takes either)."""
    from types import ModuleType

    from kvchat.engine.runtime.fidelity import Cancelled
    module = ModuleType("kvchat.engine.runtime.replay")
    module.calls = []

    def check_replay_room(engine, baseline, mode, num_tokens):
        if engine.replay_refusal:
            raise ConfigError(engine.replay_refusal)

    def replay(engine, ids, mode, baseline, replies=None, should_stop=None, progress=None, step=1):
        module.calls.append((list(ids), mode, baseline, list(replies or ())))
        sessions = [engine.new_session(cache=baseline), engine.new_session(cache=mode)]
        try:
            for done in range(0, len(ids), step):
                if should_stop is not None and should_stop():
                    raise Cancelled()
                time.sleep(step_s)
                if progress is not None:
                    progress(done + step, len(ids))
        finally:
            for session in sessions:
                session.close()
        lossy = mode.k_format == "int4"
        out = []
        for index, start, end in replies or ():
            at = start + diverge_at if lossy and start + diverge_at < end else None
            out.append(FakeReplyReplay(index, start, end, end - start, 0.9 if lossy else 1.0, 0.05 if lossy else 0.0,
                                       at, ids[at] if at is not None else None, "banana" if at is not None else None))
        first = next((r.first_divergence for r in out if r.first_divergence is not None), None)
        return FakeReplayResult(mode.label(), baseline.label(), len(ids), 0.9 if lossy else 1.0,
                                0.05 if lossy else 0.0, first, tuple(out), 0.5, 1000, 2000)

    module.replay, module.check_replay_room = replay, check_replay_room
    return module
