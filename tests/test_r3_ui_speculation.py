"""Speculative decoding's readout claims no gain that did not happen (issue 37, item 7): tokens per step is not speed,
so the dashboard says what drafting saved or cost of decode time, measured against the time a plain step takes here,
or "no gain measured"; its tooltip says what "accepted" and "tokens/step" mean. The arithmetic on the engine's
numbers, then a real tiny engine whose verification steps are made slow: the line must say it cost time."""
from __future__ import annotations

import time

import pytest

from kvchat.app.dashboard.dock import Dashboard
from kvchat.app.dashboard.live_page import LivePage
from kvchat.app.dashboard.dashboard_data import DashboardData
from kvchat.engine.config import SamplingParams
from kvchat.engine.events import LayerBytes, MemoryProbe, SpecStats, StatsSnapshot
from fakes import engine_of, isolate_app, real_window, send

pytestmark = pytest.mark.gui
REPEATS = "the cat sat on the mat, the cat sat on the mat, the cat sat on the mat"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))


def snapshot(spec: SpecStats) -> StatsSnapshot:
    return StatsSnapshot(
        time_s=1.0, cache_label="fp32", layers=(LayerBytes(0, 1024, 1024, "fp32", "fp32"),), kv_bytes=2048,
        budget_bytes=1 << 20, block_size=16, blocks_used=1, blocks_free=10, blocks_budget=40, tokens_in_context=16,
        tokens_held=16, tokens_evicted=0, tokens_left=1000, bytes_per_token=128.0, prefill_tokens=8,
        prefill_tok_s=300.0, decode_tok_s=20.0, ttft_s=0.01, memory=MemoryProbe(200 << 20, 0, 0, 0), spec=spec)


def summary_of(qtbot, spec: SpecStats) -> LivePage:
    """The Live page of a dashboard that drew one snapshot carrying `spec`."""
    dash = Dashboard(DashboardData(start_s=0.0))
    qtbot.addWidget(dash)
    dash.data.add(snapshot(spec))
    dash.redraw()
    return dash.live


def test_the_time_saved_is_plain_steps_for_the_same_tokens_against_the_time_the_steps_took():
    """15 tokens in 10 steps taking 1.2 s, where a plain step takes 0.1 s: plain decoding would have taken 1.5 s."""
    assert SpecStats("lookup", 10, 5, 10, 15, 1.2, 0.1).time_saved == pytest.approx(0.2)
    # 1.4 tokens a step and still slower: each verification cost more than the tokens it gave
    assert SpecStats("lookup", 20, 4, 10, 14, 1.54, 0.1).time_saved == pytest.approx(-0.1)
    assert SpecStats("lookup", 20, 4, 10, 14, 1.54, 0.0).time_saved is None      # no plain step was timed
    assert SpecStats("lookup", 20, 4, 10, 14).time_saved is None                # a server's counts: no times


def test_the_line_says_saved_cost_or_no_gain_and_the_tooltip_explains_the_words(qtbot):
    saved = summary_of(qtbot, SpecStats("lookup", 10, 5, 10, 15, 1.2, 0.1))
    assert "drafts 50% accepted, 1.5 tokens/step, saved ~20% of decode time" in saved.summary.text()
    slower = summary_of(qtbot, SpecStats("lookup", 20, 4, 10, 14, 1.54, 0.1))
    text = slower.summary.text()
    assert "1.4 tokens/step, cost ~10% more decode time" in text and "saved" not in text
    for spec in (SpecStats("lookup", 20, 4, 10, 14, 1.54, 0.0), SpecStats("lookup", 20, 4, 10, 14, 1.39, 0.1)):
        assert "1.4 tokens/step, no gain measured" in summary_of(qtbot, spec).summary.text()   # untimed; within 5%
    tip = slower.summary.toolTip()
    assert "accepted: the share of the guessed tokens the model kept" in tip
    assert "tokens/step: the tokens each step of the model produced" in tip and "not faster by itself" in tip
    assert summary_of(qtbot, SpecStats("lookup", 0, 0, 7, 7)).summary.toolTip() == ""    # nothing drafted


def test_slow_verifications_are_reported_as_a_cost(qtbot, monkeypatch, tiny_llama):
    """A real tiny engine with prompt lookup, each verification step made 50 ms slower than a plain one: the reply
    drafted, and the dashboard says what that cost instead of a gain; the time it counts is within the reply's."""
    window = real_window(qtbot, str(tiny_llama), sampling=SamplingParams(temperature=0, max_new_tokens=24))
    window._set_speculative("lookup", 8)
    engine = engine_of(window)
    qtbot.waitUntil(lambda: engine.speculative.enabled, timeout=5000)
    step = engine.runner.step

    def slow_verification(items, *args, **kwargs):
        if any(kwargs.get("decode") or ()) and len(items[0][1]) > 1:
            time.sleep(0.05)
        return step(items, *args, **kwargs)
    monkeypatch.setattr(engine.runner, "step", slow_verification)
    stats = send(qtbot, window, REPEATS).stats
    spec = stats.spec
    assert spec.drafted > 0 and spec.plain_step_s > 0 and spec.time_saved < -0.05, spec
    assert 0 < spec.steps_s <= spec.tokens / stats.decode_tok_s * 1.001     # the steps' time is part of decoding's
    window.dashboard.redraw()
    summary = window.dashboard.live.summary.text()
    assert f"cost ~{-spec.time_saved:.0%} more decode time" in summary and "saved" not in summary, summary
