"""Reset reports what the pool got back: replies kept as alternatives share the prompt's blocks, and a shared block
returns its bytes once, when its last reference goes."""
from __future__ import annotations

import pytest

from kvchat.engine import CacheConfig, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def _chat_with_alternatives(engine):
    for seq in list(engine.runner.cache.sequences()):
        engine.runner.close(seq)
    engine.clear_prefix_cache()
    s = engine.new_session(cache=CacheConfig(k_format="fp32", v_format="fp32"))
    s.reply(PROMPT, GREEDY)
    for seed in (1, 2):
        list(s.regenerate(SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed)))
    assert sum(a.seq is not None for a in s.alternatives) == 2
    assert engine.runner.pool_view().shared_blocks > 0          # the prompt's blocks are shared three ways
    return s


def test_reset_returns_the_drop_of_the_pools_held_bytes(tiny_engine):
    """Three replies over one prompt: reset reports the fall of the pool's held bytes, not each sharer's bytes."""
    runner, manager = tiny_engine.runner, tiny_engine.runner.cache._blocks
    s = _chat_with_alternatives(tiny_engine)
    held = runner.held_bytes
    per_sharer = sum(manager.sequence_bytes(seq) for seq in [s.seq] + [a.seq for a in s.alternatives])
    freed = s.reset()
    assert freed == held - runner.held_bytes > 0
    assert freed < per_sharer
    manager.check()


def test_reset_and_clearing_the_prefix_cache_return_each_block_once(tiny_engine):
    """Full prompt blocks stay held for prefix reuse after a session's reset and come back when the prefix cache
    is cleared: the two figures add up to everything the pool held, each block once."""
    runner = tiny_engine.runner
    s = _chat_with_alternatives(tiny_engine)
    held = runner.held_bytes
    freed = s.reset()
    assert runner.cache._blocks.pool.num_evictable > 0
    assert freed + tiny_engine.clear_prefix_cache() == held
    assert runner.held_bytes == 0
    runner.cache.check()


@pytest.mark.gui
def test_the_apps_reset_notice_states_the_fall_of_the_pools_held_bytes(qtbot, tiny_llama, monkeypatch, tmp_path):
    """The app's Reset (the session's reset, then the prefix cache cleared) reports what the pool held before less
    what it holds after, and its notice shows that figure."""
    from fakes import isolate_app
    from kvchat.app.dashboard.bar_widgets import format_mib
    from test_app_engine import real_window, send

    isolate_app(monkeypatch, tmp_path)
    window = real_window(qtbot, tiny_llama, cache=CacheConfig(k_format="fp32", v_format="fp32"),
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=6, seed=3))
    send(qtbot, window, PROMPT)
    for _ in range(2):
        with qtbot.waitSignal(window.host.turn_finished, timeout=60_000):
            window.actions.regenerate_last()
        qtbot.waitUntil(lambda: not window.generating, timeout=5000)
    runner = window.host.worker._engine.runner
    assert runner.pool_view().shared_blocks > 0
    held = runner.held_bytes
    with qtbot.waitSignal(window.host.reset_done, timeout=10_000) as blocker:
        window.reset_session()
    freed = blocker.args[0].freed_bytes
    assert freed == held - runner.held_bytes > 0
    assert format_mib(freed) in window.last_reset_message
