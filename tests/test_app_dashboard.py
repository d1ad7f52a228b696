"""The dashboard tells the truth at a glance: stable scales, markers that hide nothing, tokens left
with the model's context, idle gaps, what a mode costs, notices that stay, a layout that fits."""
from __future__ import annotations

import json
import math
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np
import pytest
from PySide6.QtCore import Qt

from kvchat.app.dashboard.dock import Dashboard
from kvchat.app.dashboard.dashboard_data import DashboardData, Marker, cluster_markers, stable_top, token_room
from kvchat.engine.config import CacheConfig, SamplingParams
from kvchat.engine.events import LayerBytes, MemoryProbe, StatsSnapshot
from fakes import CONTEXT_TOKENS, FakeLoader, isolate_app, open_window

pytestmark = pytest.mark.gui


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def snapshot(t=0.0, held=100, in_context=None, left=1000, context=0, fmt="int8", per_token_full=0.0, evicted=0,
             torch_bytes=0, gpu_bytes=0, decode=20.0, layers=2, bytes_per_token_layer=64.0):
    layer_bytes = int(held * bytes_per_token_layer / 2)
    return StatsSnapshot(
        time_s=t, cache_label=fmt, layers=tuple(LayerBytes(i, layer_bytes, layer_bytes, fmt, fmt) for i in range(layers)),
        kv_bytes=2 * layers * layer_bytes, budget_bytes=1 << 20, block_size=16, blocks_used=held // 16 + 1,
        blocks_free=10, blocks_budget=40, tokens_in_context=held if in_context is None else in_context,
        tokens_held=held, tokens_evicted=evicted, tokens_left=left, bytes_per_token=bytes_per_token_layer * layers,
        prefill_tokens=0, prefill_tok_s=300.0, decode_tok_s=decode, ttft_s=0.01,
        memory=MemoryProbe(200 << 20, torch_bytes, gpu_bytes, 0), full_precision_bytes_per_token=per_token_full,
        context_tokens=context)


def ready_window(qtbot, loader=None, size=None, **changes):
    window = open_window(qtbot, loader or FakeLoader(), autoload=False)
    if size:
        window.resize(*size)
    settings = window.settings
    fields = {name: getattr(settings, name) for name in ("model", "cache", "sampling", "system_prompt")}
    window.apply_settings(type(settings)(**{**fields, **changes}))
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    return window


def send(qtbot, window, text="Hello there model"):
    with qtbot.waitSignal(window.host.turn_finished, timeout=10_000):
        window.input.setPlainText(text)
        window.input.submit()
    qtbot.waitUntil(lambda: not window.generating, timeout=2000)


def switch(qtbot, window, fmt):
    with qtbot.waitSignal(window.host.mode_switched, timeout=5000):
        window.host.set_cache(window.session_cache.with_(k_format=fmt, v_format=fmt))
    window.dashboard.redraw()


# --- 1. per-layer bars on a stable scale ---

def test_int8_and_int4_shrink_bars_inside_a_fixed_full_precision_outline(qtbot):
    """fp32 model: int8 bars are a quarter of the outline, int4 an eighth, and the y-axis stays put."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=20))
    send(qtbot, window)
    window.dashboard.redraw()
    dash = window.dashboard
    outline = dash.live.full_bars.opts["height"][0]
    full_bar = dash.live.k_bars.opts["height"][0] + dash.live.v_bars.opts["height"][0]
    assert full_bar == pytest.approx(outline) and outline > 0
    y_range = dash.live.layer_plot.getPlotItem().getViewBox().viewRange()[1]
    for fmt, share in (("int8", 1 / 4), ("int4", 1 / 8)):
        switch(qtbot, window, fmt)
        bar = dash.live.k_bars.opts["height"][0] + dash.live.v_bars.opts["height"][0]
        assert dash.live.full_bars.opts["height"][0] == pytest.approx(outline)
        assert bar / outline == pytest.approx(share)
        assert dash.live.layer_plot.getPlotItem().getViewBox().viewRange()[1] == pytest.approx(y_range)
    assert "full precision" in dash.live.legends["layers"].text() and "int4" in dash.live.legends["layers"].text()


def test_layer_scale_grows_only_when_outgrown_and_restarts_on_reset(qtbot):
    """More tokens than the scale holds move the top up; a reset brings it back down to what is held."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=10))
    send(qtbot, window)
    first = window.dashboard.data.layer_top_bytes
    for _ in range(6):
        send(qtbot, window, "more words to grow the cache " * 20)
    grown = window.dashboard.data.layer_top_bytes
    assert grown > first
    with qtbot.waitSignal(window.host.reset_done, timeout=5000):
        window.reset_session()
    assert window.dashboard.data.layer_top_bytes < grown


def test_stable_top_steps():
    """The top only rises, in 1-2-5 steps of KiB or MiB."""
    assert stable_top(0, 300 * 1024) == 500 * 1024
    assert stable_top(500 * 1024, 200 * 1024) == 500 * 1024
    assert stable_top(500 * 1024, 1.5 * 2**20) == 2 * 2**20


def test_full_precision_size_from_full_precision_layers_when_the_field_is_zero():
    """Without the engine's field, layers held in the model dtype still give the outline."""
    from kvchat.app.dashboard.dashboard_data import full_precision_bytes_per_token
    assert full_precision_bytes_per_token(snapshot(fmt="fp32", layers=3)) == pytest.approx(64.0 * 3)
    assert full_precision_bytes_per_token(snapshot(fmt="int8")) == 0.0
    assert full_precision_bytes_per_token(snapshot(fmt="int8", per_token_full=512.0)) == 512.0


# --- 2. events never hide data ---

def test_eviction_burst_collapses_into_one_marker_that_lists_them(qtbot):
    """Twenty evictions in a row are one running marker with a count; its tooltip sums their tokens."""
    data = DashboardData(start_s=0.0)
    dash = Dashboard(data)
    qtbot.addWidget(dash)
    dash.resize(520, 700)
    dash.show()
    data.add(snapshot(t=1.0))
    for i in range(20):
        data.add(snapshot(t=10.0 + i * 0.05, evicted=16 * (i + 1)))
    data.mark("mode", "→ int4", 50.0)
    dash.redraw()
    clusters = dash.live.event_strip.clusters
    assert [c.count for c in clusters] == [20, 1]
    assert "20× evicted" in clusters[0].label() and "evicted 320 tok in 20 steps" in clusters[0].tooltip()
    x0, x1 = dash.live.event_strip.placed[0][1:]
    assert dash.live.event_strip.cluster_at((x0 + x1) / 2) is clusters[0]
    # the KV-held line is drawn above every other curve, and marker lines behind all curves
    kv_z = dash.live.memory_curves["kv"].zValue()
    assert kv_z == max(curve.zValue() for curve in dash.live.memory_curves.values())
    assert all(line.zValue() < kv_z for _, line in dash.live._marker_lines)
    assert all(getattr(line, "label", None) is None for _, line in dash.live._marker_lines)   # no labels in the plot


def test_marker_labels_never_overlap():
    """Whatever the spacing, placed labels are disjoint and every marker is in exactly one of them."""
    rng = np.random.default_rng(0)
    markers = [Marker(float(t), kind, f"{kind} {i}") for i, (t, kind) in
               enumerate(zip(rng.uniform(0, 60, 40), rng.choice(["mode", "evict", "reset"], 40)))]
    placed = cluster_markers(markers, lambda t: t * 8.0, lambda text: 7.0 * len(text), right_px=480.0)
    for (_, _, right), (_, left, _) in zip(placed, placed[1:]):
        assert left >= right
    by_time = lambda m: (m.time_s, m.label)  # noqa: E731
    assert sorted((m for c, _, _ in placed for m in c.markers), key=by_time) == sorted(markers, key=by_time)
    assert all(x1 <= 480.0 for _, _, x1 in placed)


def test_memory_legend_lists_only_what_this_machine_reports(qtbot):
    """No torch-allocator or NVML entry on a CPU-only machine; they appear once reported."""
    data = DashboardData(start_s=0.0)
    dash = Dashboard(data)
    qtbot.addWidget(dash)
    data.add(snapshot(t=1.0))
    dash.redraw()
    legend = dash.live.legends["memory"].text()
    assert "KV held" in legend and "torch" not in legend and "NVML" not in legend
    assert dash.live.memory_curves["torch"].getData()[0] is None or len(dash.live.memory_curves["torch"].getData()[0]) == 0
    data.add(snapshot(t=2.0, torch_bytes=50 << 20, gpu_bytes=80 << 20))
    dash.redraw()
    assert "torch allocator" in dash.live.legends["memory"].text() and "NVML" in dash.live.legends["memory"].text()


# --- 3. tokens left: budget or context ---

def test_token_room_takes_the_smaller_limit():
    """Budget 1,000 left and context 8,192: the budget binds; budget 100,000: the context does."""
    assert token_room(snapshot(held=100, left=1000, context=8192)).binding == "budget"
    room = token_room(snapshot(held=100, in_context=150, left=100_000, context=8192))
    assert (room.left, room.binding, room.context_limit) == (8192 - 150, "context", 8192)
    assert token_room(snapshot(held=100, left=None, context=8192)).left is None
    assert token_room(snapshot(held=100, left=5000, context=0)).binding == "budget"


def test_gauge_says_which_limit_binds_and_shows_the_context(qtbot):
    """A big budget: the fake model's 2,048-token context binds; a tiny budget: the budget does;
    a window never fills."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=8))
    send(qtbot, window)
    window.dashboard.redraw()
    gauge, latest = window.dashboard.live.gauge, window.dashboard.data.latest
    assert gauge.binding == "context" and gauge.room.left == CONTEXT_TOKENS - latest.tokens_in_context
    assert f"context {CONTEXT_TOKENS:,}" in gauge.text() and "context binds" in gauge.text()
    switch(qtbot, window, "auto")
    with qtbot.waitSignal(window.host.mode_switched, timeout=5000):
        window.host.set_cache(window.session_cache.with_(budget_mb=0.25))
    window.dashboard.redraw()
    assert gauge.binding == "budget" and gauge.room.left == window.dashboard.data.latest.tokens_left
    with qtbot.waitSignal(window.host.mode_switched, timeout=5000):
        window.host.set_cache(window.session_cache.with_(budget_mb=64, window=256))
    window.dashboard.redraw()
    assert gauge.binding == "window" and "bounded, never fills" in gauge.text() and gauge.room.left is None


# --- 4. idle is idle ---

def test_rate_curves_break_when_nothing_is_generating(qtbot):
    """Snapshots taken while idle, and silences between samples, are gaps in the tokens/s curve."""
    data = DashboardData(start_s=0.0)
    dash = Dashboard(data)
    qtbot.addWidget(dash)
    data.add(snapshot(t=1.0, decode=20.0))
    data.add(snapshot(t=1.1, decode=22.0))
    data.add(snapshot(t=5.0, decode=22.0), generating=False)     # e.g. a mode switch after the reply
    data.add(snapshot(t=9.0, decode=30.0))
    decode = list(data.series["decode"])
    assert decode[:2] == [20.0, 22.0] and math.isnan(decode[2]) and math.isnan(decode[3]) and decode[-1] == 30.0
    assert list(data.series["kv"])[2] == list(data.series["kv"])[1]      # memory holds its value instead
    dash.redraw()
    assert dash.live.decode_curve.opts["connect"] == "finite"
    assert np.isnan(dash.live.decode_curve.getData()[1]).sum() >= 2
    assert "idle" in dash.live.series_hover_text("speed", 5.0)
    assert "idle" not in dash.live.summary.text()
    data.add(snapshot(t=12.0, decode=30.0), generating=False)
    dash.redraw()
    assert "idle · last reply: decode 30.0 tok/s" in dash.live.summary.text()


# --- 5. what the mode costs ---

def test_measure_button_measures_in_the_engine_thread_and_caches_on_disk(qtbot, tmp_path):
    """'not measured yet' until Measure; then top-1 and KL from bench_quality's code, stored in JSON
    and shown again without measuring when the mode comes back."""
    window = ready_window(qtbot, cache=CacheConfig(k_format="int4", v_format="int4"))
    row = window.dashboard.live.quality_row
    assert row.state == "not measured" and "not measured yet" in row.label.text() and row.button.isVisible()
    with qtbot.waitSignal(window.host.quality, timeout=20_000) as blocker:
        qtbot.mouseClick(row.button, Qt.MouseButton.LeftButton)
        assert row.state == "measuring"
    result = blocker.args[0]
    assert 0.0 < result.top1_agreement < 1.0 and result.mean_kl > 0 and result.tokens == 256
    assert row.state == "measured" and f"{result.top1_agreement:.1%}" in row.label.text()
    stored = json.loads((tmp_path / "quality.json").read_text())
    assert list(stored) == ["fake-model · fp32 · cpu | int4 · blocks of 16"]
    switch(qtbot, window, "auto")
    assert row.state == "reference"
    switch(qtbot, window, "int4")
    assert row.state == "measured"          # from the store: no second measurement
    assert window.quality.measuring is None


def test_a_send_cancels_the_measurement_and_the_reply_still_comes(qtbot):
    """The measurement yields to the user: a message sent meanwhile cancels it within one step."""
    window = ready_window(qtbot, FakeLoader(step_s=0.05), cache=CacheConfig(k_format="int8", v_format="int8"),
                          sampling=SamplingParams(max_new_tokens=3))
    with qtbot.waitSignal(window.host.quality, timeout=10_000) as blocker:
        window.quality.measure()
        qtbot.wait(120)
        window.input.setPlainText("hi")
        window.input.submit()
    assert type(blocker.args[0]).__name__ == "QualityCancelled" and not blocker.args[0].error
    qtbot.waitUntil(lambda: not window.generating, timeout=5000)
    assert window.dashboard.live.quality_row.state == "not measured"


def test_measure_on_a_real_tiny_model_uses_bench_quality(tiny_engine):
    """A real engine: int4 agrees with full precision on most tokens and the KL is small but not zero."""
    from kvchat.app.bridge.measure import measure
    result = measure(tiny_engine, CacheConfig(k_format="int4", v_format="int4"), num_tokens=64)
    assert result.tokens == 64 and 0.5 < result.top1_agreement <= 1.0 and 0.0 < result.mean_kl < 1.0


def test_quality_store_survives_a_damaged_file(tmp_path):
    from kvchat.app.store.quality import QualityResult, QualityStore
    path = tmp_path / "q.json"
    path.write_text("{not json")
    store = QualityStore(path)
    assert store.get("m", "int4") is None
    store.put(QualityResult("m", "int4", 0.97, 0.006, 256, 3.0))
    assert QualityStore(path).get("m", "int4").top1_agreement == 0.97


# --- 6. text ---

def test_reset_result_stays_as_a_notice_in_mib(qtbot):
    """The reset result is a notice in the dashboard, in MiB, that stays after the status line clears."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=30))
    send(qtbot, window)
    with qtbot.waitSignal(window.host.reset_done, timeout=5000):
        window.reset_session()
    dash = window.dashboard
    assert dash.live.notice.isVisible() and "MiB of KV memory" in dash.live.notice_label.text()
    window.statusBar().clearMessage()
    assert dash.live.notice.isVisible()
    with qtbot.waitSignal(window.host.reset_done, timeout=5000):
        window.reset_session()
    assert "already empty" in dash.live.notice_label.text()
    switch(qtbot, window, "int4")
    assert "Switched the cache to int4" in dash.live.notice_label.text() and "MiB" in dash.live.notice_label.text()
    assert "GiB" not in dash.live.summary.text() and "1,024 MiB budget" in dash.live.summary.text()


# --- 7. layout ---

@pytest.mark.parametrize("size", [(1024, 700), (1600, 1000)])
def test_dashboard_fits_without_cutting_anything(qtbot, size):
    """At both sizes every plot keeps its minimum height inside the dock without scrolling, and no
    legend overlaps a plot."""
    window = ready_window(qtbot, size=size, sampling=SamplingParams(max_new_tokens=8))
    send(qtbot, window)
    dash = window.dashboard
    dash.live.show_notice("Switched the cache to int4: KV memory 4.22 MiB → 2.13 MiB for the same 96 tokens.")
    dash.redraw()
    qtbot.wait(50)
    body = dash.live.widget()
    assert body.height() <= dash.live.viewport().height() + 1
    plots = [dash.live.layer_plot, dash.live.speed_plot, dash.live.memory_plot]
    for plot in plots:
        assert plot.height() >= plot.minimumHeight()
        for legend in dash.live.legends.values():
            assert not legend.geometry().intersects(plot.geometry())
    assert not dash.live.event_strip.geometry().intersects(dash.live.memory_plot.geometry())


def test_sidebar_elides_long_titles_once_and_right_click_keeps_the_open_chat(qtbot):
    """A long title is cut once to the list's width; right-clicking another chat does not mark it open."""
    window = ready_window(qtbot, sampling=SamplingParams(max_new_tokens=2))
    send(qtbot, window, "first chat")
    first = window.conversation_id
    window.new_chat()
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    send(qtbot, window, "a very long question about key value caches " * 4)
    second = window.conversation_id
    sidebar = window.conversations
    top = sidebar.item(0)
    title_line = top.text().splitlines()[0]
    assert title_line.count("…") <= 1 and "\n" not in top.data(Qt.ItemDataRole.UserRole + 1)[0]
    assert sidebar.fontMetrics().horizontalAdvance(title_line) <= sidebar.viewport().width()
    assert title_line.endswith("…")
    other = sidebar.item(1)
    assert other.data(Qt.ItemDataRole.UserRole) == first
    qtbot.mouseClick(sidebar.viewport(), Qt.MouseButton.RightButton, pos=sidebar.visualItemRect(other).center())
    assert sidebar.currentItem().data(Qt.ItemDataRole.UserRole) == second
    assert [item.data(Qt.ItemDataRole.UserRole) for item in sidebar.selectedItems()] == [second]
    assert window.conversation_id == second


def test_the_dock_makes_its_tabs_from_the_page_registry(qtbot, monkeypatch):
    """Tabs come from the registered pages in their order (Live, Pool, Plan, Lengths, Attention; Experts hidden until
    a model routes to experts), and a page registered between two others gets its tab there with its title and
    tooltip."""
    from PySide6.QtWidgets import QLabel

    from kvchat.app.dashboard import registry
    dash = Dashboard()
    qtbot.addWidget(dash)
    titles = [dash.switcher.tabText(i) for i in range(dash.switcher.count())]
    assert titles == ["Live", "Pool", "Plan", "Lengths", "Experts", "Attention"]
    assert dash.page_names() == ["Live", "Pool", "Plan", "Lengths", "Attention"]
    assert dash.current_page().objectName() == "dashboardBody"

    monkeypatch.setattr(registry, "_PAGES", dict(registry._PAGES))    # the extra page leaves with this test
    registry.register(registry.Page("Extra", "Extra", "an extra page", lambda _data: QLabel("extra", objectName="extra"),
                                    order=35))
    with pytest.raises(ValueError):                 # a second module cannot claim the same tab
        registry.register(registry.Page("Extra", "Other", "", lambda _data: QLabel(), order=36))
    with pytest.raises(ValueError):                 # nor the same place in the row
        registry.register(registry.Page("Another", "Another", "", lambda _data: QLabel(), order=35))
    grown = Dashboard()
    qtbot.addWidget(grown)
    assert grown.page_names() == ["Live", "Pool", "Plan", "Extra", "Lengths", "Attention"]
    index = grown.page_names().index("Extra")
    assert grown.switcher.tabToolTip(index) == "an extra page"
    grown.show_page("Extra")
    assert grown.current_page().objectName() == "extra"
