"""The app shows and explains layers that read an earlier layer's K and V (Gemma 4): on the Live page such a layer is
an empty box in its own colour, not a bar of bytes, named in the legend and its hover text, and the budget share,
outline and window counts are the layers holding their own KV alone; the status line and Settings count them apart;
Chinese says it too. A real tiny Gemma 4 gets all of it through the app."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvchat.app.bridge.engine_facts import family_text
from kvchat.app.dashboard.dashboard_data import (attention_layers, full_precision_bytes_per_token,
                                                 full_precision_layer_bytes, is_hybrid, layer_budget_share,
                                                 layer_hover_text, layer_kinds, layer_peak_bytes, shared_layers)
from kvchat.app.dashboard.live_page import SHARED_COLOUR
from kvchat.engine.config import CacheConfig, SamplingParams
from kvchat.engine.events import LayerBytes, MemoryProbe, StatsSnapshot
from kvchat.engine.model.config import ModelConfig
from fakes import isolate_app, live_dashboard, real_window, send
from tiny_models import tiny_family_dir

pytestmark = pytest.mark.gui

KV = 2048                               # K (and V) of one int8 layer here
HELD = 29


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def layers(kv: int = KV) -> tuple[LayerBytes, ...]:
    """The tiny Gemma 4's pattern: sliding 0, 1, 3 (window 8), global 2; layer 4 reads 3's KV, layer 5 reads 2's."""
    own = [LayerBytes(i, kv, kv, "int8", "int8", None if i == 2 else 8, None if i == 2 else 512) for i in range(4)]
    return (*own, LayerBytes(4, 0, 0, "int8", "int8", 8, None, kv_source=3),
            LayerBytes(5, 0, 0, "int8", "int8", None, None, kv_source=2))


def snapshot(kv: int = KV, held: int = HELD, per_token_full: float = 256.0) -> StatsSnapshot:
    ls = layers(kv)
    total = sum(layer.k_bytes + layer.v_bytes for layer in ls)
    return StatsSnapshot(
        time_s=0.0, cache_label="int8", layers=ls, kv_bytes=total, budget_bytes=1 << 20, block_size=16,
        blocks_used=2, blocks_free=10, blocks_budget=40, tokens_in_context=held, tokens_held=held, tokens_evicted=0,
        tokens_left=None, bytes_per_token=total / 32 if held else 0.0, prefill_tokens=0, prefill_tok_s=0.0,
        decode_tok_s=0.0, ttft_s=0.0, memory=MemoryProbe(200 << 20, 0, 0, 0),
        full_precision_bytes_per_token=per_token_full)


def live(qtbot, snap: StatsSnapshot):
    return live_dashboard(qtbot, snap)


def test_sharing_layers_hold_no_share_of_the_budget_the_outline_or_the_window_counts():
    """Four layers hold KV: the budget share is a quarter, the outline a quarter of the full per-token bytes, the
    window counts are 3 sliding + 1 global; the two sharing layers are no 0-byte layers in any average."""
    snap = snapshot()
    assert [layer.layer for layer in attention_layers(snap)] == [0, 1, 2, 3]
    assert [layer.layer for layer in shared_layers(snap)] == [4, 5]
    assert layer_budget_share(snap) == (1 << 20) / 4
    assert full_precision_layer_bytes(snap) == pytest.approx(256.0 * 32 / 4)      # 2 whole blocks of a hybrid
    assert layer_kinds(snap) == ((8, 3), (None, 1)) and is_hybrid(snap)
    full = replace(snap, layers=tuple(replace(layer, k_format="bf16", v_format="bf16") for layer in snap.layers),
                   full_precision_bytes_per_token=0.0)
    assert full_precision_bytes_per_token(full) == pytest.approx(4 * 2 * KV / HELD)   # not 6 layers, not 0-averaged


def test_sharing_layer_hover_says_whose_k_and_v_it_reads():
    snap = snapshot()
    assert layer_hover_text(snap, 4) == ("layer 4 reads layer 3's K and V: it holds no bytes of its own\n"
                                         "K int8, V int8: counted in layer 3's bar\n"
                                         "sliding: attends over the newest 8 tokens")
    assert layer_hover_text(snap, 5).endswith("counted in layer 2's bar\nglobal: attends over every token")
    assert layer_hover_text(snap, 3).startswith("layer 3\nK int8: 2,048 B")


def test_sharing_layers_are_empty_boxes_named_in_the_legend(qtbot):
    """Layers 4 and 5: an empty box in the sharing colour, no K or V bar, no outline, no hatched edge at 0; the legend
    says whose KV they read."""
    page = live(qtbot, snapshot()).live
    assert list(page.shared_bars.opts["x"]) == [4, 5] and page.shared_bars.isVisible()
    assert page.shared_bars.opts["brush"] is None and page.shared_bars.opts["pen"].color().name() == SHARED_COLOUR
    assert list(page.k_bars.opts["height"])[4:] == [0, 0]
    assert page.k_bars.opts["pens"][4:] == [None, None]
    assert list(page.full_bars.opts["x"]) == [0, 1, 2, 3]
    legend = page.legends["layers"].text()
    assert f'color:{SHARED_COLOUR}">□</span>&nbsp;2 sharing the KV of layers 2, 3: no bytes of their own' in legend
    assert "3 sliding (window 8)" in legend and "1 global" in legend
    one = replace(snapshot(), layers=snapshot().layers[:5])
    assert "1 sharing layer 3&#x27;s KV: no bytes of their own" in live(qtbot, one).live.legends["layers"].text()


def test_an_empty_cache_draws_without_dividing_by_zero(qtbot):
    """Nothing held yet, no full-precision figure: every bar is 0 (the peak is the sliding layers' window line), the
    boxes still stand, the hovers read."""
    empty = snapshot(kv=0, held=0, per_token_full=0.0)
    assert layer_peak_bytes(empty) == 512 and full_precision_layer_bytes(empty) == 0
    page = live(qtbot, empty).live
    assert list(page.shared_bars.opts["height"]) == pytest.approx([0.04] * 2)          # 4% of the 1 KiB floor
    assert not page.full_bars.isVisible()
    assert layer_hover_text(empty, 4).startswith("layer 4 reads layer 3's K and V")
    assert "total 0 B" in layer_hover_text(empty, 0)


def test_a_model_without_sharing_layers_shows_none_of_it(qtbot):
    plain = replace(snapshot(), layers=snapshot().layers[:4])
    page = live(qtbot, plain).live
    assert not page.shared_bars.isVisible() and "no bytes of their own" not in page.legends["layers"].text()


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> str:
    return tiny_family_dir(tmp_path_factory.mktemp("g4"), "gemma4")


def test_status_line_counts_sharing_layers_apart(gemma4):
    """Gemma-4-E4B's shape (42 layers, the last 18 sharing): the windows count the 24 that hold KV."""
    cfg = json.loads((Path(gemma4) / "config.json").read_text())
    cfg.update(num_hidden_layers=42, num_kv_shared_layers=18, sliding_window=512,
               layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7)
    e4b = ModelConfig.from_hf(cfg)
    assert set(e4b.kv_sources.values()) == {22, 23}
    assert family_text(e4b) == "gemma4 · 42 layers (20 sliding 512 + 4 global + 18 sharing KV)"
    cfg.update(layer_types=["full_attention"] * 42)
    assert family_text(ModelConfig.from_hf(cfg)) == "gemma4 · 42 layers (24 own KV + 18 sharing KV)"


def test_settings_and_plan_say_which_layers_the_formats_reach(qtbot, gemma4):
    from kvchat.app.dashboard.plan_panel import PlanPanel
    from kvchat.app.dialogs.settings_dialog import SettingsDialog
    from kvchat.app.store.settings_store import AppSettings

    dialog = SettingsDialog(AppSettings(), num_layers=42, shared_kv_layers=18)
    qtbot.addWidget(dialog)
    assert dialog.state_note.text() == ("The formats and the window apply to the 24 layers that hold K and V of "
                                        "their own; this model's other 18 layers read the K and V of an earlier "
                                        "layer, in that layer's format.")
    assert not dialog.state_note.isHidden()
    panel = PlanPanel()
    qtbot.addWidget(panel)
    panel.set_model(ModelConfig.from_hf(json.loads((Path(gemma4) / "config.json").read_text())), "fp32", "cpu")
    panel.set_conversation(CacheConfig(), 20, 20, 1 << 20, True)
    panel.refresh()
    assert "3 of the 4 layers holding KV slide (window 8): only the other 1 grow" in panel.context_label.text()


def test_chinese_says_it_too(qtbot):
    from PySide6.QtCore import QCoreApplication, QTranslator

    from kvchat.app.i18n import catalog
    translator = QTranslator()
    assert translator.load(str(catalog("zh_CN")))
    app = QCoreApplication.instance()
    app.installTranslator(translator)
    try:
        text = layer_hover_text(snapshot(), 4)
        assert "第 4 层" in text and "K" in text and "reads" not in text and "sliding" not in text
        page = live(qtbot, snapshot()).live
        assert "no bytes" not in page.legends["layers"].text()
    finally:
        app.removeTranslator(translator)


def test_a_real_gemma4_shows_its_sharing_layers_through_the_app(qtbot, gemma4):
    """The real engine's numbers: layers 4 and 5 hold nothing and are boxes; the status line, the hover and the
    Settings note come from the loaded model."""
    window = real_window(qtbot, gemma4, cache=CacheConfig(budget_mb=16),
                         sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
    send(qtbot, window, "hello there")
    assert window.engine_info.shared_kv_layers == 2
    assert "gemma4 · 6 layers (3 sliding 8 + 1 global + 2 sharing KV)" in window.status_label.text()
    dash = window.dashboard
    dash.redraw()
    latest = dash.data.latest
    assert [(layer.layer, layer.kv_source, layer.k_bytes + layer.v_bytes) for layer in latest.layers[4:]] == \
        [(4, 3, 0), (5, 2, 0)]
    assert list(dash.live.shared_bars.opts["x"]) == [4, 5]
    assert list(dash.live.full_bars.opts["x"]) == [0, 1, 2, 3]
    assert dash.live.layer_hover_text(5).startswith("layer 5 reads layer 2's K and V: it holds no bytes of its own")
    dialog = window.open_settings()
    assert dialog.state_note.text().startswith("The formats and the window apply to the 4 layers that hold K and V")
    dialog.reject()
