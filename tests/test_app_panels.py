"""The dashboard's Pool, Plan and Lengths tabs: the shared pool per conversation, cache formats planned with
kv_layout and applied live, and the saved conversations' lengths with a window for the long ones."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import QPointF, Qt

from kvchat.app.store.history import HistoryStore
from kvchat.app.dashboard.lengths_data import histogram, suggest_window
from kvchat.app.dashboard.plan_panel import PLAN_FORMATS
from kvchat.app.dashboard.pool_view import PoolOwners, pool_rows
from kvchat.engine.config import CacheConfig, SamplingParams
from kvchat.engine.events import PoolStats
from kvchat.engine.kv.layout import kv_layout
from tiny_models import tiny_model_dir
from fakes import FakeLoader, fake_model_config, isolate_app, open_window, send

pytestmark = pytest.mark.gui
SYSTEM_PROMPT = " ".join(["You are a careful assistant who answers in one short sentence."] * 10)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # head_dim 32, so int4 groups of 32 fit
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", hidden=128, heads=4, kv_heads=2, layers=3)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def ready_window(qtbot, loader, model="default", system_prompt="", max_new_tokens=8, cache=None):
    from kvchat.app.bridge.loader import default_loader as _default_loader

    window = open_window(qtbot, loader or _default_loader, autoload=False)
    base = window.settings
    window.apply_settings(type(base)(model, cache or base.cache, SamplingParams(temperature=0.0,
                                                                                max_new_tokens=max_new_tokens),
                                     system_prompt))
    qtbot.waitUntil(lambda: window.session_ready or window.last_error is not None, timeout=60_000)
    assert window.last_error is None, window.last_error
    return window


def show_tab(window, name):
    window.dashboard.show_page(name)
    window.panels.refresh()


# --- Pool ---

def test_pool_rows_name_the_open_chat_and_number_the_unknown_ones():
    """Sequences map to the chats they were seen with; the open one first, unknown ones numbered."""
    pool = PoolStats(budget_bytes=1000, held_bytes=600, free_bytes=400, evictable_blocks=1, evictable_bytes=50,
                     shared_blocks=2, blocks_in_use=9, prefix_queries=10, prefix_hits=4,
                     conversations=((7, 3, 300, False), (8, 2, 100, False), (9, 4, 200, True), (10, 1, 50, False)))
    owners = PoolOwners()
    owners.learn(PoolStats(**{**{f: getattr(pool, f) for f in pool.__slots__},
                              "conversations": ((7, 3, 300, True),)}), 41)
    owners.learn(PoolStats(**{**{f: getattr(pool, f) for f in pool.__slots__},
                              "conversations": ((10, 1, 50, True),)}), 41)
    rows = pool_rows(pool, owners, {41: "Colours"}.get)
    assert [(r.seq_id, r.label, r.current) for r in rows] == [
        (9, "this chat", True), (7, "Colours", False), (8, "other chat 1", False), (10, "Colours (earlier copy)", False)]
    assert rows[1].budget_share == pytest.approx(0.3)
    assert pool.hit_rate == pytest.approx(0.4)


def test_pool_view_on_the_real_tiny_engine_shows_a_shared_system_prompt(qtbot, tiny_dir):
    """Two chats with the same long system prompt through the real worker: shared blocks, a hit rate > 0, one
    bar per chat named by its title, the open one highlighted, numbers on hover."""
    window = ready_window(qtbot, None, tiny_dir, SYSTEM_PROMPT)
    send(qtbot, window, "What is a cache?")
    first = window.conversation_id
    window.new_chat()
    qtbot.waitUntil(lambda: window.session_ready, timeout=10_000)
    send(qtbot, window, "Name three colours.")
    second = window.conversation_id
    show_tab(window, "Pool")
    view = window.dashboard.pool_view
    pool = view.pool
    assert pool.shared_blocks > 0 and pool.hit_rate > 0
    assert "shared" in view.summary.text() and f"{pool.hit_rate:.0%}" in view.summary.text()
    labels = {row.conversation_id: row for row in view.rows}
    assert set(labels) == {first, second}
    assert labels[second].current and not labels[first].current
    assert labels[second].label == "Name three colours." and labels[first].label == "What is a cache?"
    bars = view.conversation_bars
    assert bars.rows[0].bold and bars.rows[0].label == "Name three colours."
    tip = bars.tip_at(bars.row_rect(0).center())
    assert f"{labels[second].blocks:,} blocks" in tip and "open now" in tip
    assert labels[second].num_bytes == dict((c[0], c[2]) for c in pool.conversations)[labels[second].seq_id]
    blocks_tip = view.block_bar.tip_at(QPointF(2, 5))
    assert f"{pool.shared_blocks:,} blocks referenced by more than one conversation" in blocks_tip
    assert "Free" in view.budget_bar.tip_at(QPointF(view.budget_bar.width() - 3, 5))


# --- Plan ---

def _plan_matches_kv_layout(window, tokens):
    plan = window.dashboard.plan
    plan.slider.setValue(tokens)
    info, cache = window.engine_info, window.session_cache
    assert [column.values[0] for column in plan.chart.columns] == [
        float(kv_layout(info.model_config, cache.with_(k_format=k, v_format=v), info.dtype, info.device)
              .sequence_bytes(plan.tokens, cache.window, cache.sinks)) for _, k, v in PLAN_FORMATS]


def _apply(qtbot, window, index):
    plan = window.dashboard.plan
    plan.format_box.setCurrentIndex(index)
    assert plan.apply_button.isEnabled()
    with qtbot.waitSignal(window.host.mode_switched, timeout=30_000):
        qtbot.mouseClick(plan.apply_button, Qt.MouseButton.LeftButton)
    window.panels.refresh()


def test_plan_bars_are_kv_layout_and_apply_switches_the_open_chat_fake_engine(qtbot):
    """Bars equal kv_layout's bytes at the slider's context (with and without a window); Apply switches this
    chat's K/V formats live and keeps the rest of its cache config; the default settings stay."""
    window = ready_window(qtbot, FakeLoader(), cache=CacheConfig(window=256, sinks=4, block_size=8, budget_mb=64))
    send(qtbot, window, "Hello there model")
    show_tab(window, "Plan")
    plan = window.dashboard.plan
    assert plan.slider.maximum() == fake_model_config().max_position_embeddings
    for tokens in (1, 200, 1000, 2048):
        _plan_matches_kv_layout(window, tokens)
    assert plan.chart.line.value == 64 * 1024 * 1024
    assert plan.slider.mark == window.latest_stats.tokens_in_context
    before = window.session_cache
    _apply(qtbot, window, 3)                                    # int4
    assert window.session_cache == before.with_(k_format="int4", v_format="int4")
    assert window.history.get(window.conversation_id).cache == window.session_cache
    assert window.settings.cache.k_format == "auto"             # the default for new chats is untouched
    assert not plan.apply_button.isEnabled() and "In use" in plan.apply_button.text()
    window.session_cache = window.session_cache.with_(window=None)
    window.panels.refresh()
    _plan_matches_kv_layout(window, 1500)


def test_plan_on_the_real_tiny_engine_matches_the_cache_and_switches_it(qtbot, tiny_dir):
    """On the real engine, the open chat's tick in its own format is the bytes its sequence holds; Apply to int8
    switches the real cache and the held bytes follow the plan."""
    window = ready_window(qtbot, None, tiny_dir, max_new_tokens=20)
    send(qtbot, window, "Tell me about memory.")
    show_tab(window, "Plan")
    _plan_matches_kv_layout(window, 777)
    plan = window.dashboard.plan
    latest = window.latest_stats
    mine = next(c for c in latest.pool.conversations if c[3])
    assert plan.bars[0].now_bytes == mine[2]                     # full precision: the plan is the engine's bytes
    _apply(qtbot, window, 1)                                    # int8
    assert window.session_cache.k_format == window.session_cache.v_format == "int8"
    stats = window.latest_stats
    assert stats.layers[0].k_format.startswith("int8")
    show_tab(window, "Plan")
    mine = next(c for c in stats.pool.conversations if c[3])
    assert plan.bars[1].now_bytes == mine[2]


# --- Lengths ---

LENGTHS = [100] * 6 + [300] * 2 + [5000, 9000]                  # words = tokens for the fake tokenizer


def _fill(history: HistoryStore) -> list[int]:
    ids = []
    for i, words in enumerate(LENGTHS):
        cid = history.create(f"chat {i}", CacheConfig())
        history.add_message(cid, "user", " ".join(["word"] * (words // 2)))
        history.add_message(cid, "assistant", " ".join(["reply"] * (words - words // 2)))
        ids.append(cid)
    return ids


def test_history_lengths_counts_messages_and_characters(tmp_path):
    history = HistoryStore(tmp_path / "h.sqlite3")
    ids = _fill(history)
    empty = history.create("empty", CacheConfig(), "be brief")
    lengths = {c.id: c for c in history.lengths()}
    assert lengths[ids[0]].num_messages == 2
    assert lengths[ids[0]].num_chars == len(" ".join(["word"] * 50)) + len(" ".join(["reply"] * 50))
    assert (lengths[empty].num_messages, lengths[empty].num_chars) == (0, len("be brief"))
    history.close()


def test_lengths_tab_histogram_and_window_suggestion_from_a_saved_history(qtbot):
    """Saved chats of known lengths: exact bins, the engine thread's token counts, and a window suggestion
    whose bytes are kv_layout's."""
    history = HistoryStore()
    _fill(history)
    history.close()
    window = ready_window(qtbot, FakeLoader(), cache=CacheConfig(k_format="int8", v_format="int8", sinks=4))
    show_tab(window, "Lengths")
    qtbot.waitUntil(lambda: len(window.panels.tokens) == len(LENGTHS), timeout=5000)
    window.panels.refresh()
    view = window.dashboard.lengths
    assert sorted(t for _, t in window.panels.tokens.values()) == sorted(LENGTHS)
    assert [(b.low, b.high, b.count) for b in view.bins] == [
        (0, 256, 6), (256, 512, 2), (512, 1024, 0), (1024, 2048, 0), (2048, 4096, 0), (4096, 8192, 1),
        (8192, 16384, 1)]
    info = window.engine_info
    layout = kv_layout(info.model_config, window.session_cache, info.dtype, info.device)
    assert [b.num_bytes for b in view.bins][-1] == layout.sequence_bytes(9000)
    s = view.suggestion
    assert (s.window, s.sinks, s.num_long, s.num_total) == (512, 4, 2, 10)
    assert s.cap_bytes == max(layout.sequence_bytes(n, 512, 4) for n in (5000, 9000))
    full = [layout.sequence_bytes(n) for n in LENGTHS]
    assert s.long_share == pytest.approx(sum(full[-2:]) / sum(full))
    assert s.saved_bytes == sum(layout.sequence_bytes(n) - layout.sequence_bytes(n, 512, 4) for n in (5000, 9000))
    text = view.suggestion_label.text()
    assert "2 of 10 conversations are over 516 tokens" in text and "a window of 512 + 4 sinks" in text
    tip = view.chart.tip_at(view.chart.column_rect(0).center())
    assert "6 conversations with fewer than 256 tokens (60%)" in tip


def test_no_window_suggested_when_no_conversation_is_long():
    layout = kv_layout(fake_model_config(), CacheConfig())
    assert suggest_window([100, 200, 300, 400], layout, 2048, 4, "fp32") is None
    assert histogram([], layout.sequence_bytes) == []


# --- layout ---

@pytest.mark.parametrize("size", [(1024, 700), (1600, 1000)])
def test_pages_fit_the_dock_and_the_switcher_sits_in_its_title_bar(qtbot, size):
    """Every page shows whole without scrolling at both window sizes; the page switcher costs no row."""
    history = HistoryStore()
    _fill(history)
    history.close()
    window = ready_window(qtbot, FakeLoader())
    window.resize(*size)
    send(qtbot, window, "Hello there model")
    dash = window.dashboard
    assert dash.switcher.parentWidget() is window.dock.titleBarWidget()
    for name in ("Pool", "Plan", "Lengths"):
        dash.show_page(name)
        window.panels.refresh()
        qtbot.wait(50)
        scroll = dash.pages.currentWidget()
        assert scroll.widget().height() <= scroll.viewport().height() + 1, name
        if name == "Plan":
            button = dash.plan.apply_button
            assert button.isVisible() and scroll.viewport().rect().contains(
                button.mapTo(scroll.viewport(), button.rect().bottomRight()))


def test_a_closed_window_reads_its_closed_history_no_more(qtbot):
    """The history closes as the window goes (as the app and the tests do): no page refresh touches it after."""
    window = ready_window(qtbot, FakeLoader())
    window.dashboard.show_page("Lengths")
    window.panels.refresh()
    window.history.close()
    window.close()
    window.panels._mark_lengths_stale()
    qtbot.wait(3 * 250)                 # several refresh periods: an exception in the Qt loop fails the test
    assert not window.panels.timer.isActive()


def test_pool_rows_add_the_chats_whose_cache_is_only_on_disk():
    """Chats of this history saved on disk and not in the pool get a row each (newest first); a chat in the pool
    is not shown twice; a file whose chat is gone or whose key is not a chat id is left out."""
    pool = PoolStats(budget_bytes=1000, held_bytes=300, free_bytes=700, evictable_blocks=0, evictable_bytes=0,
                     shared_blocks=0, blocks_in_use=3, prefix_queries=0, prefix_hits=0,
                     conversations=((7, 3, 300, True),), saved=(("42", 500), ("41", 200), ("99", 10), ("x", 5)))
    owners = PoolOwners()
    owners.learn(pool, 41)
    rows = pool_rows(pool, owners, {41: "Colours", 42: "Ships"}.get)
    assert [(r.label, r.where, r.num_bytes) for r in rows] == [("Colours", "pool", 300), ("Ships", "disk", 500)]
    from kvchat.app.dashboard.pool_view import conversation_bar_rows
    bars = conversation_bar_rows(rows, 1000)
    assert bars[1].text.endswith("on disk") and "reads it back" in bars[1].tip and bars[1].fraction == 1.0


def test_pool_rows_show_chats_moved_to_host_memory_before_those_on_disk():
    """Beside a GPU pool a released chat's cache is in host memory: its row says so, and its saved file (if any) is
    not shown a second time."""
    pool = PoolStats(budget_bytes=1000, held_bytes=300, free_bytes=700, evictable_blocks=0, evictable_bytes=0,
                     shared_blocks=0, blocks_in_use=3, prefix_queries=0, prefix_hits=0,
                     conversations=((7, 3, 300, True),), in_host=(("43", 250),), saved=(("43", 240), ("42", 500)))
    owners = PoolOwners()
    owners.learn(pool, 41)
    rows = pool_rows(pool, owners, {41: "Colours", 42: "Ships", 43: "Maps"}.get)
    assert [(r.label, r.where, r.num_bytes) for r in rows] == [("Colours", "pool", 300), ("Maps", "host", 250),
                                                              ("Ships", "disk", 500)]
    from kvchat.app.dashboard.pool_view import conversation_bar_rows
    bars = conversation_bar_rows(rows, 1000)
    assert bars[1].text.endswith("in host memory") and "copies it back" in bars[1].tip
    assert bars[2].text.endswith("on disk")
