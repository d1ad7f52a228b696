"""Leaving a window mode says what the window took: the tokens no longer in the cache, in the object set_cache
returns, in the switch notice and in the quality line, and no notice claims "the same N tokens" when N changed."""
from __future__ import annotations

import pytest

from kvchat.engine import CacheConfig, SamplingParams

FULL = CacheConfig(k_format="fp32", v_format="fp32")
WINDOWED = FULL.with_(window=64, sinks=4)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6      # about three windows of the tiny tokenizer
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def test_set_cache_reports_the_tokens_the_window_took(tiny_engine):
    """A chat that slid past a 64 + 4 window, switched to a full cache: the evicted blocks' tokens are lost (the
    full cache holds the rest, more than the window attended to), and set_cache says both."""
    s = tiny_engine.new_session(cache=WINDOWED)
    s.reply(PROMPT, GREEDY)
    evicted = s.seq.evicted * s.seq.block_size
    assert evicted > 0 and s.seq.tokens_held == 68
    switch = s.set_cache(FULL)
    assert switch.tokens_lost == evicted
    assert (switch.tokens_before, switch.tokens_after) == (68, s.seq.num_tokens - evicted)
    assert s.stats().tokens_evicted == switch.tokens_lost
    s.close()


def test_a_switch_within_the_window_loses_nothing(tiny_engine):
    """A short chat inside the window: the same tokens before and after, none lost."""
    s = tiny_engine.new_session(cache=WINDOWED)
    s.reply("Hello there", GREEDY)
    switch = s.set_cache(FULL)
    assert switch.tokens_lost == 0 and switch.tokens_before == switch.tokens_after == s.seq.num_tokens
    s.close()


@pytest.mark.gui
def test_the_switch_notice_and_quality_line_say_what_the_window_took(qtbot, tiny_llama, monkeypatch, tmp_path):
    """The app over the real engine: the notice names the tokens lost and the new count, not 'the same N tokens',
    and the quality line of the full cache does not say 'nothing lost'."""
    from fakes import isolate_app, real_window, send

    isolate_app(monkeypatch, tmp_path)
    reference = CacheConfig()                                       # full precision in the model's dtype
    window = real_window(qtbot, tiny_llama, cache=reference.with_(window=64, sinks=4), sampling=GREEDY)
    send(qtbot, window, PROMPT)
    seq = window.host.worker._session.seq
    evicted = seq.evicted * seq.block_size
    assert evicted > 0
    with qtbot.waitSignal(window.host.mode_switched, timeout=10_000):
        window.host.set_cache(reference)
    notice = window.dashboard.live.notice_label.text()
    held = window.host.worker._session.seq.tokens_held
    assert f"{evicted:,} tokens of this chat are no longer in the cache" in notice
    assert f"holding {held:,} tokens (before: 68)" in notice and "the same" not in notice
    quality = window.dashboard.live.quality_row.label.text()
    assert "nothing lost" not in quality and f"{evicted:,} tokens of this chat left an earlier window" in quality
