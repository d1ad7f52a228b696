"""Hybrid models (sliding + global layers) are planned and shown with one arithmetic: `kvchat estimate`, the Plan
page, Lengths and the Models page agree with engine.kv.layout's conversation_bytes to the byte, a token past the
windows adds only the global layers' bytes, and the dashboard and status line say which layers slide."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import dataclasses
import itertools

import pytest

from kvchat.engine.config import CacheConfig
from kvchat.engine.events import LayerBytes, MemoryProbe, StatsSnapshot
from kvchat.engine.kv.layout import conversation_bytes, kv_layout, layer_window_bytes, max_conversation_tokens
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.plan.estimate import ModelFacts, cache_for, describe_windows, estimate, model_facts, window_counts
from kvchat.engine.units import GIB, MIB

WINDOW = 64


def gemma_shaped(layers: int = 12, window: int = WINDOW) -> ModelConfig:
    """A Llama-family shape whose layers follow Gemma 3's pattern: five sliding over `window`, then one global. The
    arithmetic reads only the description, so this needs no Gemma forward."""
    base = ModelConfig.from_hf(dict(model_type="llama", vocab_size=320, hidden_size=64, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                    max_position_embeddings=4096))
    specs = tuple(spec if (i + 1) % 6 == 0 else dataclasses.replace(spec, window=window)
                  for i, spec in enumerate(base.layers))
    return dataclasses.replace(base, layers=specs)


def facts_of(mc: ModelConfig) -> ModelFacts:
    return ModelFacts("gemma-shaped", "preset", mc, 1_000_000, 2_000_000, "F16")


CASES = list(itertools.product(("fp16", "int8", "int4", "int4/int8"), (1, 16), (None, 32), (10, 63, 64, 65, 200, 513)))


@pytest.mark.parametrize("fmt, block_size, window, tokens", CASES)
def test_estimate_plan_and_lengths_size_a_hybrid_conversation_as_the_layout_does(fmt, block_size, window, tokens):
    from kvchat.app.dashboard.lengths_data import ConversationBytes
    from kvchat.app.dashboard.plan_panel import plan_bars
    mc = gemma_shaped()
    cache = cache_for(fmt, block_size, window, sinks=4)
    expected = conversation_bytes(mc, cache, tokens, "fp32", "cpu")
    e = estimate(facts_of(mc), tokens, formats=(fmt,), block_size=block_size, window=window, sinks=4,
                 memory_bytes=GIB, device="cpu")
    row = e.rows[0]
    assert row.kv_bytes == expected
    if window is None:
        assert row.max_context == max_conversation_tokens(mc, cache, e.kv_room_bytes, "fp32", "cpu")
    bar = next(b for b in plan_bars(mc, "fp32", "cpu", cache, tokens, tokens, 8 * MIB)
               if (b.cache.k_format, b.cache.v_format) == (cache.k_format, cache.v_format)) \
        if fmt in ("int8", "int4") else None
    if bar is not None:
        assert bar.num_bytes == bar.now_bytes == expected
        assert bar.max_tokens == max_conversation_tokens(mc, cache, 8 * MIB, "fp32", "cpu")
    lengths = ConversationBytes(mc, cache.with_(window=None), "fp32", "cpu")
    assert lengths.sequence_bytes(tokens, window, 4) == expected


def test_the_estimate_forecasts_with_the_engine_function_and_the_global_layers_growth():
    mc = gemma_shaped()
    e = estimate(facts_of(mc), 1000, formats=("fp16",), memory_bytes=2 * GIB, device="cpu")
    row = e.rows[0]
    room = e.kv_room_bytes
    assert row.max_context == max_conversation_tokens(mc, cache_for("fp16"), room, "fp32", "cpu")
    # past the windows a token adds K and V of the two global layers only: 2 layers x 2 x 2 KV heads x 16 x 2 B
    assert row.bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert kv_layout(mc, cache_for("fp16")).bytes_per_token == 6 * row.bytes_per_token
    assert e.layer_windows == ((WINDOW, 10), (None, 2))
    assert describe_windows([WINDOW] * 10 + [None] * 2) == "10 sliding 64 + 2 global"
    assert describe_windows([None] * 3) == ""


def test_at_eight_windows_a_gemma_shape_holds_the_hybrid_share_not_the_full_count():
    mc = gemma_shaped()
    cache = cache_for("fp16", block_size=16)
    tokens = 8 * WINDOW
    full = kv_layout(mc, cache).sequence_bytes(tokens)
    held = conversation_bytes(mc, cache, tokens)
    share = 1 / 6 + 5 / 6 * WINDOW / tokens
    # the sliding layers hold their window plus the block being filled: at most two blocks more than the window
    slack = 5 / 6 * 2 * 16 / tokens
    assert share * full <= held <= (share + slack) * full
    assert held < 0.4 * full


def test_user_window_on_a_hybrid_model_bounds_every_layer():
    mc = gemma_shaped()
    cache = cache_for("int8", window=32, sinks=4)
    assert max_conversation_tokens(mc, cache, GIB) is None
    row = estimate(facts_of(mc), 5000, formats=("int8",), window=32, sinks=4, memory_bytes=GIB, device="cpu").rows[0]
    assert row.max_context is None
    assert row.kv_bytes == conversation_bytes(mc, cache, 5000)


def test_window_bytes_is_where_a_sliding_layer_stops_growing():
    mc = gemma_shaped(layers=6)
    cache = cache_for("int4", block_size=16)
    caps = layer_window_bytes(mc, cache)
    assert caps[5] is None and all(c is not None for c in caps[:5])
    one = dataclasses.replace(mc, num_layers=1, layers=mc.layers[:1], qkv_bias=False)
    grown = [conversation_bytes(one, cache, n) for n in range(1, 12 * WINDOW)]
    assert max(grown) == caps[0]
    assert grown[-1] <= caps[0]


# --- the dashboard and the status line -------------------------------------------------------------------------

def hybrid_snapshot(held: int = 300) -> StatsSnapshot:
    mc = gemma_shaped()
    cache = CacheConfig(k_format="int8", v_format="int8")
    caps = layer_window_bytes(mc, cache)
    layers = []
    for i, spec in enumerate(mc.layers):
        tokens = held if spec.window is None else min(held, spec.window + 15)
        layers.append(LayerBytes(i, tokens * 40, tokens * 40, "int8", "int8", spec.window, caps[i]))
    kv = sum(layer.k_bytes + layer.v_bytes for layer in layers)
    return StatsSnapshot(time_s=0.0, cache_label="int8", layers=tuple(layers), kv_bytes=kv, budget_bytes=64 * MIB,
                         block_size=16, blocks_used=held // 16 + 1, blocks_free=100, blocks_budget=200,
                         tokens_in_context=held, tokens_held=held, tokens_evicted=0, tokens_left=1000,
                         bytes_per_token=80.0, prefill_tokens=0, prefill_tok_s=0.0, decode_tok_s=10.0, ttft_s=0.1,
                         memory=MemoryProbe(1 << 30, 0, 0, 0))


@pytest.mark.gui
def test_dashboard_marks_sliding_layers_and_draws_their_window(qtbot):
    from PySide6.QtCore import Qt
    from kvchat.app.dashboard.dock import Dashboard
    dash = Dashboard()
    qtbot.addWidget(dash)
    snap = hybrid_snapshot()
    dash.data.add(snap)
    dash.live._draw_layers(snap)
    xs, ys = dash.live.window_ticks.getData()
    sliding = [layer for layer in snap.layers if layer.window is not None]
    assert len(xs) == 2 * len(sliding) == 20
    scale = 1024.0 if dash.data.layer_top_bytes < MIB else MIB
    assert sorted(set(ys.round(6))) == sorted({round(layer.window_bytes / scale, 6) for layer in sliding})
    legend = dash.live.legends["layers"].text()
    assert "10 sliding (window 64)" in legend and "2 global" in legend
    brushes = dash.live.k_bars.opts["brushes"]
    assert brushes[0].style() == Qt.BrushStyle.BDiagPattern and brushes[5].style() == Qt.BrushStyle.SolidPattern
    assert "sliding: keeps the newest 64 tokens" in dash.live.layer_hover_text(0)
    assert "global: holds every token" in dash.live.layer_hover_text(5)
    # a model whose layers all keep the same tokens looks as it always did
    flat = dataclasses.replace(snap, layers=tuple(dataclasses.replace(layer, window=None, window_bytes=None)
                                                  for layer in snap.layers))
    dash.live._draw_layers(flat)
    assert len(dash.live.window_ticks.getData()[0] or ()) == 0
    assert "sliding" not in dash.live.legends["layers"].text()


def test_status_line_names_the_family_and_its_layers():
    from kvchat.app.bridge.engine_facts import family_text
    assert family_text(gemma_shaped()) == "llama · 12 layers (10 sliding 64 + 2 global)"
    assert family_text(dataclasses.replace(gemma_shaped(), layers=gemma_shaped().layers[5:6] * 12)) == \
        "llama · 12 layers"
    assert window_counts([512, None, 512, 1024]) == ((512, 2), (1024, 1), (None, 1))


# --- presets of the new families, built through their family ------------------------------------------------------

def test_gemma_3_1b_preset_is_its_published_shape():
    facts = model_facts("gemma-3-1b")
    mc = facts.config
    assert (mc.model_type, mc.num_layers, mc.hidden_size, mc.num_kv_heads, mc.head_dim) == ("gemma3_text", 26, 1152, 1, 256)
    assert window_counts(layer.window for layer in mc.layers) == ((512, 22), (None, 4))
    assert [i for i, layer in enumerate(mc.layers) if layer.window is None] == [5, 11, 17, 23]
    assert facts.parameters == 999_885_952          # google/gemma-3-1b-pt's safetensors
    e = estimate(facts, 8192, formats=("fp16",), memory_bytes=16 * GIB, device="cpu")
    fp16 = e.rows[0]
    # each token past the window adds K and V of the 4 global layers: 4 x 2 x 1 x 256 x 2 B
    assert fp16.bytes_per_token == 4 * 2 * 256 * 2


@pytest.mark.parametrize("name, layers, windows", [
    ("gemma-3-4b", 34, ((1024, 29), (None, 5))), ("gemma-3-12b", 48, ((1024, 40), (None, 8))),
    ("gemma-3-27b", 62, ((1024, 52), (None, 10))), ("qwen3-0.6b", 28, ((None, 28),)),
    ("qwen3-32b", 64, ((None, 64),)), ("phi-4-mini", 32, None)])
def test_new_presets_build_through_their_family(name, layers, windows):
    mc = model_facts(name).config
    assert mc.num_layers == layers
    if windows is not None:
        assert window_counts(layer.window for layer in mc.layers) == windows


def test_phi_4_mini_preset_counts_its_published_parameters():
    facts = model_facts("phi-4-mini")
    assert facts.parameters == 3_836_021_760        # microsoft/Phi-4-mini-instruct's safetensors headers
    assert facts.config.layers[0].rope.dims == 96   # partial_rotary_factor 0.75 of head_dim 128


@pytest.mark.gui
def test_plan_page_says_which_layers_slide_and_sizes_them_by_the_hybrid_arithmetic(qtbot):
    from kvchat.app.dashboard.plan_panel import PlanPanel
    panel = PlanPanel()
    qtbot.addWidget(panel)
    mc = gemma_shaped()
    panel.set_model(mc, "fp32", "cpu")
    panel.set_conversation(CacheConfig(k_format="int8", v_format="int8"), 300, 300, 8 * MIB, True)
    panel.refresh()
    assert "10 of 12 layers slide (window 64): only the other 2 grow" in panel.context_label.text()
    int8 = next(bar for bar in panel.bars if bar.cache.k_format == "int8" and bar.cache.v_format == "int8")
    assert int8.now_bytes == conversation_bytes(mc, int8.cache, 300)
    plain = ModelConfig.from_hf(dict(model_type="llama", vocab_size=320, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=128))
    panel.set_model(plain, "fp32", "cpu")
    panel.refresh()
    assert "slide" not in panel.context_label.text()


# --- the engine holds what the plan says ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gemma3_engine(tmp_path_factory):
    from kvchat.engine import Engine, EngineConfig
    from tiny_models import tiny_family_dir
    folder = tiny_family_dir(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3")     # 5 sliding (window 16) + 1 global
    return Engine.load(EngineConfig(model=folder)), folder


@pytest.mark.parametrize("fmt, block_size, window, tokens", [
    (f, b, w, n) for f, b, w, n in itertools.product(("fp16", "int8", "int4/int8", "auto"), (1, 4, 16), (None, 24, 12),
                                                     (10, 40, 130))
    if not (w == 12 and b == 16)])          # a user window must hold a block
def test_estimate_equals_what_a_hybrid_engine_holds(tiny_gemma3_engine, fmt, block_size, window, tokens):
    from tiny_models import random_ids
    engine, folder = tiny_gemma3_engine
    session = engine.new_session(cache=cache_for(fmt, block_size, window, sinks=4))
    session.append(random_ids(engine, tokens))
    stats = session.stats()
    row = estimate(model_facts(folder), tokens, formats=(fmt,), block_size=block_size, window=window, sinks=4,
                   memory_bytes=GIB, device=str(engine.device)).rows[0]
    assert row.kv_bytes == stats.kv_bytes
    windows = [layer.window for layer in stats.layers]
    assert len(windows) == 6 and windows[5] == window
    assert all(w == (16 if window is None else min(16, window)) for w in windows[:5])


# --- the app with the real engine: the status line names the family; a base model says so -----------------------

def _window_on(qtbot, monkeypatch, tmp_path, model: str):
    from kvchat.app.store.settings_store import SettingsStore
    from kvchat.app.bridge.loader import default_loader as _default_loader
    from fakes import isolate_app, open_window
    isolate_app(monkeypatch, tmp_path)
    store = SettingsStore()
    store.save(dataclasses.replace(store.load(), model=model))
    window = open_window(qtbot, _default_loader)
    qtbot.waitUntil(lambda: window.session_ready, timeout=60_000)
    return window


@pytest.mark.gui
def test_status_line_of_a_loaded_gemma3_names_its_sliding_and_global_layers(qtbot, monkeypatch, tmp_path,
                                                                            tiny_gemma3_engine):
    _, folder = tiny_gemma3_engine
    window = _window_on(qtbot, monkeypatch, tmp_path, folder)
    window.statusBar().clearMessage()
    assert "gemma3 · 6 layers (5 sliding 16 + 1 global)" in window.status_label.text()
    assert not window.banner.isVisible()            # its folder has a chat template


@pytest.mark.gui
def test_a_base_model_is_named_as_such_before_the_first_message(qtbot, monkeypatch, tmp_path):
    from pathlib import Path
    from tiny_models import tiny_model_dir
    folder = tiny_model_dir(tmp_path / "base", seed=5)
    (Path(folder) / "chat_template.jinja").unlink()
    window = _window_on(qtbot, monkeypatch, tmp_path, folder)
    assert window.banner.isVisible() and "no chat template" in window.banner.text()
    assert "plain-text chat (no template)" in window.status_label.text()
