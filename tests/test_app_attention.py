"""The dashboard's Attention page: the engine's map drawn after a reply (layers × columns, blocks a layer no longer
holds in their own colour, linear layers as empty rows), newest / last reply, one layer's heads, hover and click naming
and reaching the message, a 30,000-token map bounded, Chinese strings, and "not measured" where there is no map."""
from __future__ import annotations

import numpy as np
import pytest

from fake_attention import fake_attention_map
from fakes import FakeLoader, isolate_app, open_window

from kvchat.app.bridge.attention_events import EMPTY, REMOTE, AttentionShown
from kvchat.app.bridge.attention_work import MAX_COLUMNS, column_texts
from kvchat.app.dashboard.attention_data import LEFT_RGB, LINEAR_RGB, cell_text, colours, pooled, scale_for
from kvchat.engine.config import SamplingParams

pytestmark = pytest.mark.gui


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


class Words:
    """A tokenizer of numbered words: token i decodes to "w{i}"."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"w{i}" for i in ids)


def page_with(qtbot, m, roles=("user", "assistant", "user", "assistant")):
    from kvchat.app.dashboard.attention_view import AttentionView
    page = AttentionView()
    qtbot.addWidget(page)
    page.resize(520, 900)
    page.show()
    reply = fake_attention_map(m.tokens, m.block_size, m.num_layers, m.num_heads, m.window, m.sinks,
                               m.layer_windows, tuple(i for i in range(m.num_layers) if not m.attends[i]),
                               m.message_starts, over="reply").bucketed(MAX_COLUMNS)
    texts = column_texts(Words(), m)
    page.show_attention(AttentionShown(1, m, reply, texts, column_texts(Words(), reply), roles))
    return page


def a_chat(n=600, **kw):
    return fake_attention_map(list(range(n)), 16, message_starts=(0, 100, 300, 420), **kw)


def drawn(plot) -> np.ndarray:
    return plot.image.image


def test_the_map_is_layers_by_columns_and_left_blocks_have_their_own_colour(qtbot):
    """A window cache over a hybrid model: one image row per layer and one column per block; blocks outside the window
    (and outside a sliding layer's own window) are LEFT_RGB, never the scale's 'no mass'; a linear layer is a labelled
    LINEAR_RGB row."""
    m = a_chat(window=256, sinks=4, layer_windows=(None, 64, None, None), linear=(2,))
    page = page_with(qtbot, m)
    image = drawn(page.layers_map)
    assert image.shape[:2] == (4, m.num_columns) == (4, 38)
    left = ~m.held
    assert left[0].any() and left[1].sum() > left[0].sum()      # the sliding layer holds less
    assert (image[0][left[0]][:, :3] == LEFT_RGB).all()
    assert (image[1][left[1]][:, :3] == LEFT_RGB).all()
    assert (image[2][:, :3] == LINEAR_RGB).all()
    assert not (image[0][m.held[0]][:, :3] == LEFT_RGB).all(axis=1).any()
    assert page.layers_map.window_edge.isVisible() and page.layers_map.sinks.xData is not None
    assert len(page.layers_map.boundaries.xData) == 2 * 3          # three messages after the first
    legend = page.legend.text().replace("&nbsp;", " ")
    assert "linear-attention layer" in legend and "no longer held" in legend
    assert page.summary.text().startswith("newest token · 4 layers × 2 heads · 600 tokens in 38 columns of 16")


def test_newest_and_last_reply_toggle_and_the_head_view(qtbot):
    """The toggle draws the other map; the head view is heads × columns of the layer chosen or clicked."""
    m = a_chat()
    page = page_with(qtbot, m)
    newest = drawn(page.layers_map).copy()
    page.reply_button.click()
    assert page.over == "reply" and page.current()[0].over == "reply"
    assert not np.array_equal(newest, drawn(page.layers_map))
    assert "mean over the last reply's 8 tokens" in page.summary.text()
    page.newest_button.click()
    assert np.array_equal(newest, drawn(page.layers_map))
    assert drawn(page.heads_map).shape[:2] == (2, m.num_columns)
    page.layer_spin.setValue(3)
    expected = colours(*pooled(m.mass[3], np.repeat(m.held[3][None], 2, 0))[:2], np.array([True, True]),
                       scale_for(m))
    assert np.array_equal(drawn(page.heads_map), expected)
    page.layers_map.clicked.emit(1, 10)
    assert page.layer_spin.value() == 1


def test_hover_names_the_layer_message_words_and_share(qtbot):
    """A cell's text: layer (and head), the message with its role, the block's words and the mass in percent."""
    m = a_chat(window=256, sinks=4)
    page = page_with(qtbot, m)
    text = page.hover_text(0, 25)                   # tokens 400-415: the second user message (index 2)
    assert text.splitlines()[0] == "layer 0"
    assert "message 3 (you) · tokens 400–415" in text
    assert "«w400 w401 w402" in text and "w415»" in text
    assert text.endswith("% of the attention")
    head = page.hover_text(1, 36, head=1)           # the newest blocks: the last reply, held
    assert head.startswith("layer 1 · head 1") and "message 4 (reply)" in head
    left = page.hover_text(0, 5)                    # slid out of the window
    assert "no longer held" in left and "%" not in left
    assert "attention sinks" in page.hover_text(0, 0)
    assert page.hover_text(9, 0) is None and page.hover_text(0, 99) is None


def test_clicking_a_cell_goes_to_its_message(qtbot):
    m = a_chat()
    page = page_with(qtbot, m)
    with qtbot.waitSignal(page.message_clicked) as clicked:
        page.layers_map.clicked.emit(0, 7)          # tokens 112-127: message 1 (the first reply)
    assert clicked.args == [1]
    with qtbot.waitSignal(page.message_clicked) as clicked:
        page.heads_map.clicked.emit(1, 30)          # tokens 480-...: message 3
    assert clicked.args == [3]


def test_a_30000_token_chat_is_bucketed_and_hovering_draws_nothing(qtbot):
    """30,000 tokens in blocks of 16 is 1,875 blocks: the engine is asked for at most MAX_COLUMNS and the image drawn
    at most MAX_DRAWN_COLUMNS wide; three hundred pointer moves work out at most one text each and draw no image."""
    from PySide6.QtCore import QPointF
    m = fake_attention_map(list(range(30_000)), 16, layers=32, heads=8, window=8192, sinks=4,
                           message_starts=tuple(range(0, 30_000, 700))).bucketed(1024)
    assert m.num_columns <= 1024
    page = page_with(qtbot, m, roles=("user", "assistant") * 22)
    assert drawn(page.layers_map).shape[:2] == (32, m.num_columns)
    images, texts = page.layers_map.images_set, page.hover_texts
    view = page.layers_map.getViewBox()
    for i in range(300):
        scene = view.mapViewToScene(QPointF((i * 3.3) % m.num_columns, (i * 0.37) % 32))
        page.layers_map.scene().sigMouseMoved.emit(scene)
    assert page.layers_map.images_set == images
    assert 0 < page.hover_texts - texts <= 300
    assert MAX_COLUMNS <= 4096


def test_words_of_a_long_column_are_elided():
    m = fake_attention_map(list(range(1000)), 16).bucketed(10)
    texts = column_texts(Words(), m)
    assert len(texts) == m.num_columns and " … " in texts[0] and len(texts[0]) <= 72
    assert cell_text(m, texts, (), 0, 0).splitlines()[1].startswith("message 1") is False   # no known starts


def test_without_a_map_the_page_says_not_measured_and_draws_nothing(qtbot):
    from kvchat.app.dashboard.attention_view import AttentionView
    page = AttentionView()
    qtbot.addWidget(page)
    page.show()
    assert page.summary.text().startswith("Not measured yet")
    page.set_missing(REMOTE)
    assert page.summary.text().startswith("Not measured: the model runs on a server")
    assert not page.maps.isVisible() and page.layers_map.image.image is None


def test_the_window_draws_the_map_after_each_reply_and_a_click_reaches_the_chat(qtbot):
    """Through the real signals: no map before a reply ("not measured yet"), the fake engine's map after one, a new
    map after the next, and a click on a cell scrolls the chat to that message."""
    window = open_window(qtbot, FakeLoader())
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    page = window.dashboard.attention
    window.dashboard.show_page("Attention")
    assert page.missing == EMPTY and page.summary.text().startswith("Not measured yet")
    window.settings = window.settings.__class__(window.settings.model, window.settings.cache,
                                                SamplingParams(max_new_tokens=5), window.settings.system_prompt)
    with qtbot.waitSignal(window.host.attention, timeout=10_000):
        window.send("what is a key value cache")
    qtbot.waitUntil(lambda: page.current()[0] is not None, timeout=5000)
    first = page.current()[0]
    assert drawn(page.layers_map).shape[:2] == (4, first.num_columns)
    assert page.shown.roles == ("user", "assistant")
    qtbot.waitUntil(lambda: not window.generating, timeout=5000)
    with qtbot.waitSignal(window.host.attention, timeout=10_000):
        window.send("and why does it grow")
    qtbot.waitUntil(lambda: page.current()[0] is not first and len(page.shown.roles) == 4, timeout=5000)
    assert "message 1 (you)" in page.hover_text(0, 0)
    seen = []
    window.chat.scroll_to_message = lambda index: seen.append(index)
    window.attention.go_to_message = window.chat.scroll_to_message
    page.message_clicked.disconnect()
    page.message_clicked.connect(window.attention.go_to_message)
    page.layers_map.clicked.emit(0, 0)
    assert seen == [0]


def test_a_remote_engine_is_not_measured(qtbot):
    from kvchat.engine.api import REMOTE as REMOTE_CAPS
    from kvchat.app.bridge.messages import EngineReady
    window = open_window(qtbot, FakeLoader(), autoload=False)
    window.attention._on_ready(EngineReady("tiny", "remote", 0, 0.0, capabilities=REMOTE_CAPS))
    page = window.dashboard.attention
    window.dashboard.show_page("Attention")
    assert page.missing == REMOTE and page.summary.text().startswith("Not measured: the model runs on a server")
    assert not page.replay.button.isVisible()


def test_the_page_and_its_hover_text_speak_chinese(qtbot, monkeypatch):
    """With the zh_CN catalog: the page's labels, summary, legend, hover text and replay row carry no English prose."""
    from PySide6.QtWidgets import QApplication

    from kvchat.app import i18n
    from test_i18n import english_in, english_words
    monkeypatch.setenv("KVCHAT_LANG", "zh_CN")
    app = QApplication.instance()
    assert i18n.install(app, "en") == "zh_CN"
    try:
        m = a_chat(window=256, sinks=4, linear=(2,))
        page = page_with(qtbot, m)
        texts = [page.hover_text(0, 25), page.hover_text(2, 3, head=0), page.hover_text(0, 5), page.summary.text(),
                 page.legend.text()]
        assert "第 0 层" in texts[0] and "占注意力的" in texts[0]
        problems = [t for t in texts if english_words(t.replace("«", " ").replace("»", " ").replace("w", " "))]
        assert not problems and not english_in(page)
        page.set_missing(REMOTE)
        assert page.summary.text().startswith("未测量")
    finally:
        for translator in app._kvchat_translators:
            app.removeTranslator(translator)
        app._kvchat_translators = []


def test_the_map_follows_a_streaming_reply(qtbot, monkeypatch):
    """While a reply streams the maps come at a low rate too (here every token: the interval set to 0), not only
    when it ends."""
    from kvchat.app.bridge import turn_stream
    monkeypatch.setattr(turn_stream, "ATTENTION_LIVE_S", 0.0)
    window = open_window(qtbot, FakeLoader())
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    window.settings = window.settings.__class__(window.settings.model, window.settings.cache,
                                                SamplingParams(max_new_tokens=5), window.settings.system_prompt)
    shown = []
    window.host.attention.connect(shown.append)
    with qtbot.waitSignal(window.host.turn_finished, timeout=10_000):
        window.send("what is a key value cache")
    qtbot.waitUntil(lambda: not window.generating, timeout=5000)
    qtbot.wait(50)
    assert len(shown) >= 3          # during the reply, and the one after it
