"""The app shows and explains linear-attention layers (issue 40): on the Live page a state layer is a constant bar of
its recurrent state in its own colour, named in the legend and its hover text, and the y-scale, outline and budget
share are the attention layers' alone; the Pool page says the state and its snapshots; Settings says which layers the
cache modes reach. A model without such layers shows none of it, and a real tiny Qwen3.5 gets all of it through the
app."""
from __future__ import annotations

from dataclasses import replace

import pytest

from kvchat.app.bridge.engine_facts import family_text
from kvchat.app.bridge.messages import format_bytes
from kvchat.app.dashboard.dashboard_data import (full_precision_bytes_per_token, full_precision_layer_bytes,
                                                 is_hybrid, layer_budget_share, layer_hover_text, layer_peak_bytes)
from kvchat.app.dashboard.live_page import STATE_COLOUR
from kvchat.app.dashboard.pool_view import PoolView, state_line
from kvchat.engine.config import CacheConfig, SamplingParams
from kvchat.engine.events import LayerBytes, MemoryProbe, PoolStats, StatsSnapshot
from fakes import isolate_app, live_dashboard, real_window, send
from tiny_models import tiny_family_dir

pytestmark = pytest.mark.gui

STATE = 4416                            # one linear layer's state in the tiny Qwen3.5 (engine/kv/state.py)
KV = 4096                               # K (and V) of one bf16 attention layer over 32 tokens, 2 heads of 32 dims
HELD = 29                               # tokens held: 2 blocks of 16


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def layers(with_state: bool = True, window: int | None = None) -> tuple[LayerBytes, ...]:
    """Qwen3.5's pattern in four layers: linear attention at 0 and 2 (or plain attention without state)."""
    out = []
    for i in range(4):
        if with_state and i % 2 == 0:
            out.append(LayerBytes(i, 0, 0, "state", "state", None, STATE, kind="linear_attention", state_bytes=STATE))
        else:
            out.append(LayerBytes(i, KV, KV, "bf16", "bf16", window, None if window is None else 2 * KV))
    return tuple(out)


def snapshot(with_state: bool = True, snapshots: tuple[int, ...] = (22,), per_token_full: float = 2 * 2 * KV / 32,
             window: int | None = None, budget: int = 1 << 20) -> StatsSnapshot:
    ls = layers(with_state, window)
    kv = sum(layer.k_bytes + layer.v_bytes for layer in ls)
    state = sum(layer.state_bytes for layer in ls)
    pool = PoolStats(budget, kv + state * (1 + len(snapshots)), budget - kv, 0, 0, 0, 2, 0, 0,
                     conversations=((1, 2, kv + state * (1 + len(snapshots)), True),))
    return StatsSnapshot(
        time_s=0.0, cache_label="auto", layers=ls, kv_bytes=kv, budget_bytes=budget, block_size=16, blocks_used=2,
        blocks_free=10, blocks_budget=40, tokens_in_context=HELD, tokens_held=HELD, tokens_evicted=0, tokens_left=1000,
        bytes_per_token=kv / 32, prefill_tokens=0, prefill_tok_s=300.0, decode_tok_s=20.0, ttft_s=0.01,
        memory=MemoryProbe(200 << 20, 0, 0, 0), full_precision_bytes_per_token=per_token_full, pool=pool,
        state_bytes=state, snapshots=snapshots if with_state else ())


def live(qtbot, snap: StatsSnapshot):
    return live_dashboard(qtbot, snap)


def test_state_layers_are_constant_bars_in_their_own_colour_beside_kv_bars(qtbot):
    """Layers 0 and 2 draw their 4,416-byte state (KiB scale) in the state colour and no K or V; layers 1 and 3 draw
    K and V, inside a full-precision outline at their own height; the legend and title name the state."""
    page = live(qtbot, snapshot()).live
    assert list(page.state_bars.opts["x"]) == [0, 2]
    assert list(page.state_bars.opts["height"]) == pytest.approx([STATE / 1024] * 2)
    assert page.state_bars.opts["brush"].color().name() == STATE_COLOUR and page.state_bars.isVisible()
    assert list(page.k_bars.opts["height"]) == pytest.approx([0, KV / 1024, 0, KV / 1024])
    assert list(page.v_bars.opts["height"]) == pytest.approx([0, KV / 1024, 0, KV / 1024])
    assert list(page.full_bars.opts["x"]) == [1, 3]                 # no outline over a state
    assert list(page.full_bars.opts["height"]) == pytest.approx([2 * KV / 1024] * 2)   # bf16 is full precision
    legend = page.legends["layers"].text()
    assert f'color:{STATE_COLOUR}">■</span>&nbsp;state of 2 linear-attention layers, constant' in legend
    assert "full precision" in legend and "global" not in legend
    assert page.sections["layers"].text() == "KV and state bytes per layer (KiB)"


def test_state_layer_hover_says_what_it_keeps_and_that_cache_modes_skip_it(qtbot):
    """A state layer's hover names its bytes and what does not apply; an attention layer's budget share is what the
    state and its snapshot leave of the budget, over the attention layers."""
    snap = snapshot()
    assert layer_hover_text(snap, 2) == ("layer 2: linear attention\nkeeps a recurrent state of 4,416 B (4.31 KiB), "
                                         "the same at any length\nno K or V: cache modes (formats, window) do not "
                                         "apply to it; the state stays fp32")
    attention = layer_hover_text(snap, 1)
    assert attention.startswith("layer 1\nK bf16: 4,096 B") and "full precision would hold 8.00 KiB (100% of it)" \
        in attention
    share = ((1 << 20) - 2 * 2 * STATE) / 2
    assert layer_budget_share(snap) == share
    assert attention.endswith(f"of its budget share ({format_bytes(share)})")


def test_scale_and_outline_count_attention_layers_only():
    """Full precision per token, where the engine does not say it, averages the attention layers (the states are not
    0-byte layers) and counts only them; an attention layer's outline is its own 8 KiB, not spread over four layers;
    the peak is the tallest bar, a state's included."""
    assert full_precision_bytes_per_token(snapshot(per_token_full=0.0)) == pytest.approx(2 * 2 * KV / HELD)
    engine_side = snapshot()                            # what the engine reports: two attention layers at 256 B
    assert full_precision_layer_bytes(engine_side) == pytest.approx(2 * KV)
    assert layer_peak_bytes(engine_side) == pytest.approx(2 * KV)
    tall = LayerBytes(0, 0, 0, "state", "state", None, 20_000, kind="linear_attention", state_bytes=20_000)
    tall_state = replace(engine_side, layers=(tall,) + engine_side.layers[1:])
    assert layer_peak_bytes(tall_state) == 20_000


def test_a_window_over_the_attention_layers_is_not_a_hybrid_model(qtbot):
    """Qwen3.5 with a user window: every attention layer slides, the state layers keep no tokens: no "global" layers
    in the legend, no window line on a state bar."""
    snap = snapshot(window=48)
    assert not is_hybrid(snap)
    page = live(qtbot, snap).live
    assert "global" not in page.legends["layers"].text() and "sliding" not in page.legends["layers"].text()
    ticks, _ = page.window_ticks.getData()
    assert ticks is None or len(ticks) == 0


def test_pool_page_says_the_state_and_its_snapshots(qtbot):
    """The state in MiB, each snapshot's token count and their bytes together; nothing without a state."""
    assert state_line(8832, ()) == "This chat's recurrent state: <b>0.01 MiB</b> (no snapshot kept yet)"
    assert state_line(3 << 20, (22,)) == ("This chat's recurrent state: <b>3.00 MiB</b> (1 snapshot kept at token "
                                          "22; 3.00 MiB)")
    assert state_line(3 << 20, (22, 1_029, 2_055)) == ("This chat's recurrent state: <b>3.00 MiB</b> (3 snapshots "
                                                       "kept at tokens 22, 1,029, 2,055; 9.00 MiB)")
    assert state_line(0, ()) == ""
    view = PoolView()
    qtbot.addWidget(view)
    snap = snapshot(snapshots=(22, 29))
    view.set_pool(snap.pool, [], snap.state_bytes, snap.snapshots)
    assert not view.state.isHidden() and "2 snapshots kept at tokens 22, 29" in view.state.text()
    assert "turn boundary" in view.state.toolTip()
    view.set_pool(snap.pool, [], 0, ())
    assert view.state.isHidden()


def test_settings_note_names_the_layers_cache_modes_reach(qtbot):
    """18 of 24 layers linear: the note counts the 6 the formats and window reach; none for another model or a model
    without linear layers."""
    from kvchat.app.dialogs.settings_dialog import SettingsDialog
    from kvchat.app.store.settings_store import AppSettings

    dialog = SettingsDialog(AppSettings(), num_layers=24, linear_layers=18)
    qtbot.addWidget(dialog)
    assert dialog.state_note.text() == ("The formats and the window apply to this model's 6 attention layers only; "
                                        "its 18 linear-attention layers keep an fp32 state of fixed size.")
    assert not dialog.state_note.isHidden()
    dialog.model_edit.setText("/somewhere/else.gguf")            # another model: the note is not about it
    assert dialog.state_note.isHidden()
    plain = SettingsDialog(AppSettings(), num_layers=24)
    qtbot.addWidget(plain)
    assert plain.state_note.isHidden() and plain.state_note.text() == ""


def test_a_model_without_state_layers_shows_none_of_it(qtbot):
    """Four attention layers: no state bar, legend entry, title word or pool line; the budget share is a quarter."""
    snap = snapshot(with_state=False)
    dash = live(qtbot, snap)
    page = dash.live
    assert not page.state_bars.isVisible() and len(page.state_bars.opts["x"]) == 0
    assert list(page.full_bars.opts["x"]) == [0, 1, 2, 3]
    assert "linear" not in page.legends["layers"].text()
    assert page.sections["layers"].text() == "KV bytes per layer (KiB)"
    assert layer_budget_share(snap) == (1 << 20) / 4
    assert "linear" not in layer_hover_text(snap, 0)
    dash.show_page("Pool")
    dash.pool_view.set_pool(snap.pool, [], snap.state_bytes, snap.snapshots)
    assert dash.pool_view.state.isHidden()


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> str:
    return tiny_family_dir(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


def test_a_real_qwen35_shows_its_state_through_the_app(qtbot, qwen35):
    """The real engine's numbers, end to end: the status line's layer kinds, two 4,416-byte state bars at layers 0
    and 2, the Pool page's state and the snapshot of the first turn, and the settings note from the engine's facts
    (2 of 4 layers)."""
    window = real_window(qtbot, qwen35, cache=CacheConfig(budget_mb=16),
                         sampling=SamplingParams(temperature=0.0, max_new_tokens=6))
    send(qtbot, window, "hello there")
    assert window.engine_info.linear_layers == 2
    assert family_text(window.engine_info.model_config) == "qwen3_5 · 4 layers (2 linear attention + 2 attention)"
    dash = window.dashboard
    dash.redraw()
    latest = dash.data.latest
    assert latest.state_bytes == 2 * STATE and latest.snapshots
    assert list(dash.live.state_bars.opts["x"]) == [0, 2]
    assert list(dash.live.state_bars.opts["height"]) == pytest.approx([STATE / 1024] * 2)
    assert list(dash.live.full_bars.opts["x"]) == [1, 3]
    dash.show_page("Pool")
    window.panels.refresh()
    tokens = ", ".join(f"{t:,}" for t in latest.snapshots)
    assert not dash.pool_view.state.isHidden() and f"at token{'s' if len(latest.snapshots) > 1 else ''} {tokens}" \
        in dash.pool_view.state.text()
    dialog = window.open_settings()
    assert dialog.state_note.text().startswith("The formats and the window apply to this model's 2 attention layers")
    dialog.reject()
