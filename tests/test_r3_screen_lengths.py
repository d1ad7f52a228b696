"""The Lengths page's numbers are true: each conversation's share is a fraction of a whole that contains it (a chat
only on disk is not divided by what the pool holds), and the window advice follows from the median and longest
length the page shows."""
from __future__ import annotations

import os
import re
from dataclasses import replace

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from kvchat.app.store.history import HistoryStore
from kvchat.app.dashboard.lengths_data import histogram, no_window_text, suggest_window
from kvchat.app.dashboard.lengths_view import share_rows
from kvchat.app.dashboard.pool_view import PoolOwners, pool_rows
from kvchat.engine.config import CacheConfig, SamplingParams
from kvchat.engine.events import PoolStats
from kvchat.engine.kv.layout import kv_layout
from fakes import FakeLoader, fake_model_config, isolate_app, open_window

# median 240, longest 3,551: a quarter of the chats are ten times the median and hold most of the KV
SKEWED = [120, 200, 240, 240, 240, 260, 2600, 3000, 3551]
PERCENT = re.compile(r"([\d.]+)%")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def test_a_few_chats_ten_times_the_median_get_a_window_for_them():
    """With a median of 240 and a longest of 3,551 the advice is a window for the long ones, whose share of the KV
    is the chart's bytes of those conversations over all of its bytes."""
    layout = kv_layout(fake_model_config(), CacheConfig())
    s = suggest_window(SKEWED, layout, 8192, 4, "fp32")
    assert s is not None
    assert (s.window, s.num_long, s.num_total) == (512, 3, 9)
    bins = histogram(SKEWED, layout.sequence_bytes)
    long_bytes = sum(b.num_bytes for b in bins if b.low >= 2048)
    assert s.long_share == pytest.approx(long_bytes / sum(b.num_bytes for b in bins))
    assert "3 of 9 conversations are over 516 tokens" in s.text()


def test_no_window_advice_states_the_numbers_it_follows_from():
    """No suggestion only when nothing is past the window; the advice says the window, the median and the longest."""
    layout = kv_layout(fake_model_config(), CacheConfig())
    tokens = [300, 400, 500]
    assert suggest_window(tokens, layout, 8192, 4, "fp32") is None
    assert no_window_text(tokens, 8192, 4) == ("No conversation is over 516 tokens (median 400, longest 500): a "
                                               "window of 512 + 4 sinks would keep every one whole, so none is "
                                               "needed.")


def _pool_with_a_big_chat_on_disk(budget: int = 1000) -> PoolStats:
    # the open chat holds 100 bytes of the pool; three chats are only on disk, one far larger than the pool holds
    return PoolStats(budget_bytes=budget, held_bytes=100, free_bytes=budget - 100, evictable_blocks=0,
                     evictable_bytes=0, shared_blocks=0, blocks_in_use=1, prefix_queries=0, prefix_hits=0,
                     conversations=((7, 1, 100, True),), saved=(("42", 2523), ("43", 94), ("44", 79)))


def test_shares_of_chats_in_the_pool_and_on_disk_are_fractions_of_their_sum():
    """A chat on disk of 25 times the pool's held bytes: every share at most 100%, and together they make 100%."""
    owners = PoolOwners()
    rows = pool_rows(_pool_with_a_big_chat_on_disk(), owners, {42: "Ships", 43: "Maps", 44: "Birds"}.get)
    bars = share_rows(rows, 1000)
    assert [r.where for r in rows] == ["pool", "disk", "disk", "disk"]
    total = sum(r.num_bytes for r in rows)
    assert [bar.fraction for bar in bars] == pytest.approx([r.num_bytes / total for r in rows])
    assert sum(bar.fraction for bar in bars) == pytest.approx(1.0)
    assert bars[1].text.startswith("90% · ") and bars[1].text.endswith("on disk")


@pytest.mark.gui
def test_the_lengths_page_shows_no_share_above_100_percent_and_advice_that_fits_its_chart(qtbot):
    """The page itself, fed a pool whose chats are mostly on disk and a history with a median of 240 tokens and a
    longest of 3,551: no bar past its track, no share above 100%, and the advice names a window for the long ones."""
    history = HistoryStore()
    ids = []
    for i, words in enumerate(SKEWED):
        cid = history.create(f"chat {i}", CacheConfig())
        history.add_message(cid, "user", " ".join(["word"] * (words // 2)))
        history.add_message(cid, "assistant", " ".join(["reply"] * (words - words // 2)))
        ids.append(cid)
    history.close()
    window = open_window(qtbot, FakeLoader(), autoload=False)
    base = window.settings
    window.apply_settings(type(base)("default", CacheConfig(), SamplingParams(max_new_tokens=8), ""))
    qtbot.waitUntil(lambda: window.session_ready, timeout=60_000)
    window.dashboard.show_page("Lengths")
    window.panels.refresh()
    qtbot.waitUntil(lambda: len(window.panels.tokens) == len(SKEWED), timeout=5000)
    pool = replace(_pool_with_a_big_chat_on_disk(), saved=((str(ids[-1]), 2523), (str(ids[-2]), 94),
                                                         (str(ids[-3]), 79)))
    window._on_stats(replace(window.latest_stats, pool=pool))
    window.panels.refresh_lengths()
    view = window.dashboard.lengths
    bars = view.open_bars.rows
    assert len(bars) == 4
    assert all(0.0 <= bar.fraction <= 1.0 for bar in bars)
    shares = [float(PERCENT.search(bar.text).group(1)) for bar in bars]
    assert max(shares) <= 100 and sum(bar.fraction for bar in bars) == pytest.approx(1.0)
    assert "median <b>240</b>" in view.summary.text() and "longest <b>3,551</b>" in view.summary.text()
    assert "3 of 9 conversations are over 516 tokens" in view.suggestion_label.text()
