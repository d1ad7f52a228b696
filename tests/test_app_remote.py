"""The app pointed at `kvchat serve` on loopback (tiny model): Settings' server choice, chat, Stop, New chat,
history, the dashboard's Server section from /metrics, local-only views marked unavailable, bad URL or key."""
from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import httpx
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialogButtonBox

from kvchat.engine import CacheConfig, SamplingParams
from kvchat.engine.serve.server import ServeConfig, Server
import fakes
from fakes import isolate_app, slow_steps

pytestmark = pytest.mark.gui

KEY = "s3cret"
SHORT = SamplingParams(temperature=0, max_new_tokens=8)
LONG = SamplingParams(temperature=1.0, max_new_tokens=3000, seed=3)


@pytest.fixture(scope="module")
def server(tiny_engine):
    srv = Server(tiny_engine, ServeConfig(port=0, model_id="tiny", api_key=KEY),
                 CacheConfig(k_format="fp32", v_format="fp32", budget_mb=0.5))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def remote_window(qtbot, url: str, key: str = KEY, model: str = "tiny", sampling=SHORT, wait=True):
    return fakes.remote_window(qtbot, url, key, model, sampling, wait)


def send(qtbot, window, text: str):
    with qtbot.waitSignal(window.host.turn_finished, timeout=30_000) as blocker:
        window.input.setPlainText(text)
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not window.generating, timeout=2000)
    return blocker.args[0]


def test_chat_stop_new_chat_and_history_through_the_server(qtbot, server):
    window = remote_window(qtbot, server.base_url)
    # saved once the connection worked; the status line names the server
    saved = window.store.load().remote
    assert saved is not None and saved.base_url == server.base_url and saved.api_key == KEY and saved.model == "tiny"
    assert server.base_url in window.status_label.text() and "tiny" in window.status_label.text()
    assert not window.reset_button.isEnabled()          # the server frees its own cache; nothing to reset here

    first = send(qtbot, window, "Hello! How are you?")
    assert first.finish_reason in ("eos", "length") and first.stats.prefill_tokens > 0
    assert [m.role for m in window.chat.messages()][0] == "user"
    first_id = window.conversation_id
    assert window.history.messages(first_id) == [{"role": "user", "content": "Hello! How are you?"},
                                                 {"role": "assistant", "content": first.text}]

    # Stop mid-reply: the stream closes, the partial reply is kept, the server frees the request
    window.settings = replace(window.settings, sampling=LONG)
    window.input.setPlainText("def add(a, b):")
    window.input.submit()
    qtbot.waitUntil(lambda: len(window.chat.reply_text()) > 5, timeout=20_000)
    with qtbot.waitSignal(window.host.turn_finished, timeout=5000) as blocker:
        qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
    assert blocker.args[0].finish_reason == "stopped"
    qtbot.waitUntil(lambda: window.send_button.isEnabled(), timeout=2000)
    assert window.history.messages(first_id)[-1]["content"] == blocker.args[0].text
    window.settings = replace(window.settings, sampling=SHORT)

    # New chat: empty, its own conversation; the old one stays in the list and in SQLite
    window.new_chat()
    qtbot.waitUntil(lambda: window.session_ready, timeout=10_000)
    assert window.chat.messages() == [] and window.conversation_id is None
    other = send(qtbot, window, "The quick brown fox")
    assert window.conversation_id != first_id
    assert set(window.conversations.ids()) == {first_id, window.conversation_id}
    assert other.stats.prefill_tokens < first.stats.prefill_tokens + 40

    # back to the first chat: its history is shown and goes to the server with the next message
    window.show_conversation(first_id)
    qtbot.waitUntil(lambda: window.session_ready, timeout=10_000)
    assert [m.text() for m in window.chat.messages()][:1] == ["Hello! How are you?"]
    follow = send(qtbot, window, "And again?")
    assert follow.stats.prefill_tokens > first.stats.prefill_tokens     # four earlier messages went along
    assert len(window.history.messages(first_id)) == 6


def _metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_dashboard_shows_the_servers_numbers_and_marks_local_only_views(qtbot, server, monkeypatch):
    slow_steps(monkeypatch, server.engine)      # the reply must still stream when the dashboard polls
    window = remote_window(qtbot, server.base_url, sampling=LONG)
    dash = window.dashboard
    assert dash.live.server_panel.isVisible() and dash.live.layers_unavailable.isVisible()
    assert not dash.live.layer_plot.isVisible() and not dash.live.gauge.isVisible()
    assert "not available for a remote server" in dash.live.layers_unavailable.text()
    assert "not available for a remote server" in dash.live.quality_row.label.text()
    assert not dash.live.quality_row.button.isVisible()

    # mid-reply the server reports this chat's request as running
    running = []
    window.host.stats.connect(lambda snap: running.append(snap.server and snap.server.requests_running))
    send(qtbot, window, "Once upon a time")
    assert 1 in running

    # idle (the server ends a request a moment after its last chunk): the panel's numbers are its /metrics
    def idle_on_the_panel():
        with qtbot.waitSignal(window.host.stats, timeout=5000):
            window.host.poll_stats()
        dash.redraw()
        return dash.live.server_panel.texts()["running"] == "0"
    qtbot.waitUntil(idle_on_the_panel, timeout=10_000)
    metrics = _metrics(server)
    texts = dash.live.server_panel.texts()
    assert texts["kv_usage"] == f"{metrics['vllm:kv_cache_usage_perc']:.1%}"
    assert texts["running"] == "0" and texts["waiting"] == "0"
    assert texts["decode"].endswith("tok/s") and texts["ttft"].endswith("ms")
    assert float(texts["ttft"].split()[0]) > 0
    assert "%" in texts["prefix"] or "no prefix lookups" in texts["prefix"]
    assert server.base_url in dash.live.summary.text()
    assert "kv" not in dash.live.applicable_series() and "budget" not in dash.live.applicable_series()

    for page in ("Pool", "Plan", "Lengths"):
        dash.show_page(page)
        assert dash.current_page() is dash.unavailable
        assert f"{page}</b>: not available for a remote server" in dash.unavailable.text()
    dash.show_page("Live")
    assert dash.current_page().objectName() == "dashboardBody"


def test_wrong_key_or_url_shows_a_banner_and_the_app_keeps_running(qtbot, server):
    from kvchat.app.store.settings_store import RemoteSettings
    window = remote_window(qtbot, server.base_url, key="wrong", wait=False)
    qtbot.waitUntil(lambda: window.last_error is not None, timeout=20_000)
    assert window.banner.isVisible() and "API key" in window.banner.text()
    assert "Could not connect to the server" in window.banner.text()
    assert window.store.load().remote is None           # not saved: the connection did not work

    window.last_error = None
    window.apply_settings(replace(window.settings, remote=RemoteSettings("http://127.0.0.1:9/v1", KEY, "tiny")))
    qtbot.waitUntil(lambda: window.last_error is not None, timeout=20_000)
    assert "cannot reach" in window.banner.text() and window.isVisible()

    window.last_error = None                            # fixed in Settings: it connects and chats
    window.apply_settings(replace(window.settings, remote=RemoteSettings(server.base_url, KEY, "tiny")))
    qtbot.waitUntil(lambda: window.session_ready, timeout=20_000)
    assert send(qtbot, window, "Hi").finish_reason in ("eos", "length")
    assert window.store.load().remote.base_url == server.base_url


def test_settings_dialog_fetches_models_and_explains_errors(qtbot, server):
    from kvchat.app.dialogs.settings_dialog import SERVER_CHOICE, SettingsDialog
    from kvchat.app.store.settings_store import AppSettings
    dialog = SettingsDialog(AppSettings())
    qtbot.addWidget(dialog)
    ok = dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)
    dialog.engine_choice.setCurrentText(SERVER_CHOICE)
    assert not dialog.cache_box.isEnabled() and not dialog.model_box.isEnabled()
    assert dialog.api_key.echoMode() != dialog.api_key.EchoMode.Normal
    assert not ok.isEnabled() and "base URL" in dialog.error_label.text()
    dialog.server_url.setText("localhost:8000")
    assert not ok.isEnabled() and "http://" in dialog.error_label.text()

    dialog.server_url.setText(server.base_url)
    dialog.api_key.setText("wrong")
    with qtbot.waitSignal(dialog.models_fetched, timeout=15_000):
        qtbot.mouseClick(dialog.fetch_button, Qt.MouseButton.LeftButton)
    assert "API key" in dialog.server_status.text()

    dialog.api_key.setText(KEY)
    with qtbot.waitSignal(dialog.models_fetched, timeout=15_000):
        dialog.fetch_models()
    assert [dialog.server_model.itemText(i) for i in range(dialog.server_model.count())] == ["tiny"]
    assert ok.isEnabled()
    result = dialog.result_settings()
    assert result.remote.base_url == server.base_url and result.remote.api_key == KEY and result.remote.model == "tiny"

    dialog.engine_choice.setCurrentText("This computer")
    assert dialog.result_settings().remote is None and dialog.cache_box.isEnabled()


def test_back_to_this_computer_brings_the_local_views_back(qtbot, server, tiny_llama):
    window = remote_window(qtbot, server.base_url)
    dash = window.dashboard
    dash.show_page("Pool")
    assert dash.current_page() is dash.unavailable
    window.apply_settings(replace(window.settings, model=tiny_llama, remote=None))
    qtbot.waitUntil(lambda: window.session_ready and not window.engine_info.capabilities.remote, timeout=30_000)
    assert window.store.load().remote is None and window.store.last_server().base_url == server.base_url
    assert dash.current_page() is dash.pool_view
    dash.show_page("Live")
    assert not dash.live.server_panel.isVisible() and dash.live.layer_plot.isVisible() and not dash.live.layers_unavailable.isVisible()
    assert "not available" not in dash.live.quality_row.label.text()
    assert "server" not in window.status_label.text()
    assert window.reset_button.isEnabled()
