"""The dashboard and the status line know mixtures of experts: the Experts page draws which experts the last turn used
per layer (the summary, the image's values and colours, a cell's tooltip, all from known counts), a dense model shows
none of it, the status line names the experts and gpt-oss's learned sinks, gpt-oss's sliding layers are capped like
Gemma's, and a real tiny Qwen3-MoE's turn through the app shows exactly its snapshot's counts."""
from __future__ import annotations

import math

import numpy as np
import pytest
from PySide6.QtCore import QPointF

from kvchat.app.dashboard.dock import Dashboard
from kvchat.app.bridge.engine_facts import family_text
from kvchat.app.dashboard.experts_view import DARK_RGB, DENSE_RGB, NONE_RGB, PENDING_RGB
from kvchat.engine.events import LayerBytes, MemoryProbe, StatsSnapshot
from kvchat.engine.model.config import ModelConfig
from fakes import FakeLoader, fake_model_config, isolate_app, open_window, real_window, send

pytestmark = pytest.mark.gui

EXPERTS, USED, TOKENS = 16, 4, 10
# layer 2 is dense; each routed layer's counts add up to TOKENS x USED = 40
COUNTS = ((5, 5, 5, 5, 5, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0),        # 8 experts, 5 tokens each
          (10, 10, 10, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),    # 4 experts: every token took the same four
          None,
          (1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 1, 2, 2, 1, 1, 2))        # all 16


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def moe_config(**fields) -> ModelConfig:
    cfg = dict(model_type="qwen3_moe", vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
               num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32, num_experts=EXPERTS,
               num_experts_per_tok=USED, mlp_only_layers=[2], max_position_embeddings=2048)
    return ModelConfig.from_hf({**cfg, **fields})


def snapshot(experts=COUNTS, layers=4, t=0.0) -> StatsSnapshot:
    return StatsSnapshot(
        time_s=t, cache_label="int8", layers=tuple(LayerBytes(i, 1024, 1024, "int8", "int8") for i in range(layers)),
        kv_bytes=2048 * layers, budget_bytes=1 << 20, block_size=16, blocks_used=1, blocks_free=10, blocks_budget=40,
        tokens_in_context=TOKENS, tokens_held=TOKENS, tokens_evicted=0, tokens_left=1000, bytes_per_token=64.0,
        prefill_tokens=6, prefill_tok_s=300.0, decode_tok_s=20.0, ttft_s=0.01, memory=MemoryProbe(200 << 20, 0, 0, 0),
        experts=experts)


def experts_page(qtbot, config, snap) -> Dashboard:
    dash = Dashboard()
    qtbot.addWidget(dash)
    dash.resize(480, 620)
    dash.show()
    dash.set_model(config)
    dash.data.add(snap)
    if "Experts" in dash.page_names():
        dash.show_page("Experts")
    dash.redraw()
    return dash


def test_summary_line_counts_layers_experts_and_the_share_used(qtbot):
    """3 routed layers x 16 experts, 4 per token; 40 routings per layer are 10 tokens; 8 + 4 + 16 of 48 experts
    took a token: 58%."""
    view = experts_page(qtbot, moe_config(), snapshot()).experts
    assert view.summary.text() == ("3 of 4 layers × 16 experts, 4 per token (the others dense); "
                                   "last turn: 10 tokens, 58% of experts used at least once")
    assert "100%&nbsp;(layer&nbsp;1,&nbsp;expert&nbsp;0)" in view.legend.text()   # the busiest: 10 of 10 tokens
    assert "an even spread gives each 25%" in view.legend.text()     # 4 of 16
    assert "dense&nbsp;layer" in view.legend.text()


def test_image_values_are_each_experts_share_of_its_layers_tokens(qtbot):
    """Row per layer, column per expert: count / tokens; NaN for the dense layer; white where no token went, the
    darkest blue where the most did, grey for the dense layer."""
    view = experts_page(qtbot, moe_config(), snapshot()).experts
    want = np.array([[math.nan] * EXPERTS if c is None else [n / TOKENS for n in c] for c in COUNTS])
    np.testing.assert_array_equal(view.shares, want)
    rgba = view.image.image
    assert rgba.shape == (4, EXPERTS, 4)
    assert tuple(rgba[0, 8, :3]) == NONE_RGB and tuple(rgba[1, 4, :3]) == NONE_RGB
    assert tuple(rgba[1, 0, :3]) == DARK_RGB                   # 100% of layer 1's tokens: the busiest
    assert all(tuple(px[:3]) == DENSE_RGB for px in rgba[2])
    # more tokens, darker: layer 3's expert 5 (6 tokens) against its expert 0 (1 token)
    assert rgba[3, 5, :3].sum() < rgba[3, 0, :3].sum() < sum(NONE_RGB)


def test_tooltip_names_layer_expert_and_tokens_where_the_pointer_is(qtbot, monkeypatch):
    """The pointer over column 3 of row 0 (layer 0 on top) says layer 0, expert 3, 5 of 10 tokens."""
    dash = experts_page(qtbot, moe_config(), snapshot())
    view = dash.experts
    shown = []
    monkeypatch.setattr("kvchat.app.dashboard.experts_view.QToolTip.showText", lambda pos, text, widget=None: shown.append(text))
    qtbot.waitUntil(lambda: view.plot.getViewBox().sceneBoundingRect().width() > 0)
    box = view.plot.getViewBox()
    for x, y in ((3.5, 0.5), (5.5, 3.5), (7.5, 2.5)):
        view._hover(box.mapViewToScene(QPointF(x, y)))
    assert shown == ["layer 0 · expert 3\n5 of 10 tokens (50.0%)\nlayer 0: 8 of 16 experts took a token",
                     "layer 3 · expert 5\n6 of 10 tokens (60.0%)\nlayer 3: 16 of 16 experts took a token",
                     "layer 2: dense (no experts)"]
    assert view.hover_text(1, 9) == "layer 1 · expert 9\n0 of 10 tokens (0.0%)\nlayer 1: 4 of 16 experts took a token"
    assert view.hover_text(4, 0) is None and view.hover_text(0, EXPERTS) is None


def test_before_any_turn_the_page_says_so_and_a_stale_snapshot_is_not_drawn(qtbot):
    """No counts yet (the engine reports None for every layer): the summary says no turn yet, routed rows are pale,
    not white (which would claim zero tokens). Counts of another shape (another model's) are not drawn either."""
    for experts in ((None,) * 4, COUNTS[:3], ((1, 2),) * 4):
        view = experts_page(qtbot, moe_config(), snapshot(experts=experts)).experts
        assert view.summary.text() == "3 of 4 layers × 16 experts, 4 per token (the others dense); no turn yet"
        assert tuple(view.image.image[0, 0, :3]) == PENDING_RGB
        assert view.hover_text(0, 0) == "layer 0 · expert 0\nno turn yet"


def test_a_model_routed_in_every_layer_is_summed_without_dense_words(qtbot):
    config = moe_config(num_hidden_layers=2, mlp_only_layers=[], num_experts=8, num_experts_per_tok=2)
    view = experts_page(qtbot, config, snapshot(experts=((3, 1, 0, 0, 0, 0, 0, 0), (1, 1, 1, 1, 0, 0, 0, 0)),
                                                layers=2)).experts
    assert view.summary.text() == "2 layers × 8 experts, 2 per token; last turn: 2 tokens, 38% of experts used at " \
                                  "least once"      # 6 of 16
    assert "dense" not in view.legend.text()


def test_a_dense_model_has_no_experts_page(qtbot):
    """A dense model's dashboard hides the page; its status line names no experts or sinks."""
    dash = experts_page(qtbot, fake_model_config(), snapshot(experts=()))
    assert dash.page_names() == ["Live", "Pool", "Plan", "Lengths", "Attention"]
    assert not dash.switcher.isTabVisible(dash._page_keys.index("Experts"))
    assert dash.experts.use is None and dash.experts.shares.size == 0
    text = family_text(fake_model_config())
    assert text == "llama · 4 layers"
    # an MoE model loaded before: the page goes with the next dense model, and the Live page is shown
    dash.set_model(moe_config())
    dash.show_page("Experts")
    dash.set_model(fake_model_config())
    assert dash.page_names()[dash.switcher.currentIndex()] == "Live" and "Experts" not in dash.page_names()


def test_a_dense_window_lists_no_experts_page(qtbot):
    window = open_window(qtbot, FakeLoader())
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    assert window.dashboard.page_names() == ["Live", "Pool", "Plan", "Lengths", "Attention"]
    assert "expert" not in window.status_label.text()


def test_status_line_names_experts_per_token_and_learned_sinks():
    assert family_text(moe_config()) == "qwen3_moe · 4 layers · 16 experts, 4 active per token in 3 of 4 layers"
    assert family_text(moe_config(mlp_only_layers=[])) == "qwen3_moe · 4 layers · 16 experts, 4 active per token"
    oss = ModelConfig.from_hf(dict(model_type="gpt_oss", vocab_size=320, hidden_size=64, num_hidden_layers=4,
                                   num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
                                   num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   max_position_embeddings=131072))
    assert family_text(oss) == ("gpt_oss · 4 layers (2 sliding 128 + 2 global) · 32 experts, 4 active per token · "
                                "learned attention sinks")


# --- the real engine ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_oss_stats(tmp_path_factory):
    from kvchat.engine import Engine, EngineConfig, SamplingParams
    from tiny_models import tiny_family_dir
    folder = tiny_family_dir(tmp_path_factory.mktemp("gpt-oss"), "gpt_oss")   # window 16 on layers 0 and 2
    engine = Engine.load(EngineConfig(model=folder, weights="int4"))
    session = engine.new_session()
    session.reply("Tell me a long story about a cat and a dog, please.",
                  SamplingParams(temperature=0.0, max_new_tokens=24))
    return engine.model.config, session.stats()


def test_gpt_oss_alternate_layers_are_capped_at_their_window_as_gemmas_are(qtbot, gpt_oss_stats):
    """gpt-oss's sliding layers (0, 2) hold 16 tokens and draw the window-full line, its global ones (1, 3) grow;
    its experts page shows the snapshot's counts; its status line names its sinks."""
    config, stats = gpt_oss_stats
    assert stats.tokens_held > 16
    assert [layer.window for layer in stats.layers] == [16, None, 16, None]
    assert stats.layers[0].k_bytes < stats.layers[1].k_bytes
    dash = experts_page(qtbot, config, stats)
    dash.show_page("Live")
    dash.redraw()
    x, y = dash.live.window_ticks.getData()
    assert sorted(set(np.round(x).astype(int))) == [0, 2]           # one capped line over each sliding layer
    assert "2 sliding (window 16)" in dash.live.legends["layers"].text()
    assert "sliding: keeps the newest 16 tokens" in dash.live.layer_hover_text(0)
    assert "global: holds every token" in dash.live.layer_hover_text(1)
    dash.show_page("Experts")
    np.testing.assert_allclose(dash.experts.shares * (sum(stats.experts[0]) // 2), np.array(stats.experts, float),
                               rtol=1e-12)
    assert family_text(config).endswith("4 experts, 2 active per token · learned attention sinks")


def test_a_real_qwen3_moe_turn_shows_its_snapshots_counts(qtbot, tmp_path):
    """The app on a tiny Qwen3-MoE folder (8 experts, 3 per token, layer 1 dense), 1024 x 700: before the first
    message the page says no turn yet; after one, its image, summary and tooltips are the snapshot's counts, and
    all six pages' tabs fit in the dock's title."""
    from tiny_models import tiny_family_dir
    folder = tiny_family_dir(tmp_path / "qwen3-moe", "qwen3_moe")
    window = real_window(qtbot, folder)
    window.resize(1024, 700)
    dash = window.dashboard
    assert dash.page_names() == ["Live", "Pool", "Plan", "Lengths", "Experts", "Attention"]
    assert "qwen3_moe · 3 layers · 8 experts, 3 active per token in 2 of 3 layers" in window.status_label.text()
    dash.show_page("Experts")
    assert dash.experts.summary.text().endswith("; no turn yet")
    finished = send(qtbot, window, "Which experts will read this sentence?")
    dash.redraw()
    counts = finished.stats.experts
    assert counts == dash.data.latest.experts and counts[1] is None and len(counts[0]) == 8
    tokens = sum(counts[0]) // 3
    assert sum(counts[0]) == sum(counts[2]) == 3 * tokens > 0
    shares = dash.experts.shares
    assert np.isnan(shares[1]).all()
    np.testing.assert_allclose(shares[[0, 2]] * tokens, np.array([counts[0], counts[2]], float), rtol=1e-12)
    used = sum(1 for layer in (0, 2) for n in counts[layer] if n)
    assert dash.experts.summary.text() == (
        f"2 of 3 layers × 8 experts, 3 per token (the others dense); last turn: {tokens} tokens, "
        f"{used / 16:.0%} of experts used at least once")
    assert dash.experts.hover_text(2, 7).startswith(f"layer 2 · expert 7\n{counts[2][7]} of {tokens} tokens")
    qtbot.wait(50)
    assert dash.switcher.width() >= dash.switcher.sizeHint().width()     # no tab scrolled out of sight
