"""The app as a new user walked it, round two (issue 21, items 20-21): a remote server that goes away, what the
app offers and polls in remote mode, window sizes, and the names, marks and bars the walk found wrong."""
from __future__ import annotations

import os
import socket
import threading
from dataclasses import replace

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import Qt

from kvchat.engine import CacheConfig, SamplingParams
from kvchat.engine.serve.server import ServeConfig, Server
import fakes
from fakes import isolate_app, open_window, slow_steps

pytestmark = pytest.mark.gui

SHORT = SamplingParams(temperature=0, max_new_tokens=8)
LONG = SamplingParams(temperature=1.0, max_new_tokens=3000, seed=3)


class Cut:
    """A loopback TCP relay in front of a real server: `kill()` drops every connection mid-byte and stops
    listening, as a killed server does; it counts the requests for /metrics that pass through."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.metrics_requests = 0
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(65536):
                if from_client:
                    self.metrics_requests += data.count(b"GET /metrics ")
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def kill(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)    # wakes accept(); the port then refuses connections
        except OSError:
            pass
        self.listener.close()
        with self._lock:
            for s in self._sockets:
                try:                    # shutdown first: it wakes the relay threads blocked in recv
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass


@pytest.fixture(scope="module")
def server(tiny_engine):
    srv = Server(tiny_engine, ServeConfig(port=0, model_id="tiny"),
                 CacheConfig(k_format="fp32", v_format="fp32", budget_mb=0.5))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def remote_window(qtbot, url: str, sampling=SHORT):
    return fakes.remote_window(qtbot, url, sampling=sampling)


def send(qtbot, window, text: str):
    with qtbot.waitSignal(window.host.turn_finished, timeout=30_000) as blocker:
        window.input.setPlainText(text)
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not window.generating, timeout=2000)
    return blocker.args[0]


def notices(window) -> list[str]:
    return [m.text() for m in window.chat.messages() if m.role == "notice"]


def test_a_server_killed_mid_reply_keeps_the_reply_says_so_and_keeps_the_next_message(qtbot, server):
    cut = Cut(int(server.base_url.split(":")[2].split("/")[0]))
    window = remote_window(qtbot, cut.base_url, sampling=LONG)
    window.input.setPlainText("def add(a, b):")
    window.input.submit()
    qtbot.waitUntil(lambda: len(window.chat.reply_text()) > 10, timeout=20_000)
    with qtbot.waitSignal(window.host.turn_finished, timeout=10_000) as blocker:
        cut.kill()
    qtbot.waitUntil(lambda: not window.generating, timeout=2000)
    event = blocker.args[0]
    assert event.finish_reason == "disconnected" and len(event.text) > 10
    said = notices(window)[-1]
    assert said.startswith("the server went away mid-reply (") and "the partial reply is kept" in said
    assert "\n" not in said and "RemoteError" not in said and "Traceback" not in said
    assert window.history.messages(window.conversation_id)[-1] == {"role": "assistant", "content": event.text}
    dash = window.dashboard
    dash.redraw()
    assert all(v.startswith("server unreachable") for k, v in dash.live.server_panel.texts().items()
               if k in ("kv_usage", "running", "waiting", "prefix"))
    assert "disconnected" in window.status_label.text()

    # the next message cannot go anywhere: said in one line, and it stays in the input box, unsaved
    saved = window.history.messages(window.conversation_id)
    refused = send(qtbot, window, "Are you there?")
    assert refused.finish_reason == "unreachable"
    assert window.input.toPlainText() == "Are you there?"
    said = notices(window)[-1]
    assert said.startswith("the server is unreachable (Connection refused at ") and "\n" not in said
    assert "Errno" not in said and "input box" in said
    assert window.history.messages(window.conversation_id) == saved
    assert [m.text() for m in window.chat.chat_messages()][-1] == event.text     # not shown as sent either
    assert "disconnected" in window.status_label.text()


def test_metrics_are_read_about_once_a_second_while_streaming(qtbot, server, monkeypatch):
    slow_steps(monkeypatch, server.engine)      # a reply long enough to count polls in
    cut = Cut(int(server.base_url.split(":")[2].split("/")[0]))
    window = remote_window(qtbot, cut.base_url, sampling=replace(LONG, max_new_tokens=400))
    stats = []
    window.host.stats.connect(stats.append)
    before = cut.metrics_requests
    import time
    started = time.monotonic()
    try:
        send(qtbot, window, "def add(a, b):")
    finally:
        cut.kill()                                      # later tests check that nothing here still listens
    seconds = time.monotonic() - started
    assert len(stats) > 3 * (seconds + 1)               # the worker asks for stats many times a second...
    assert cut.metrics_requests - before <= seconds / 1.0 + 2   # ...but /metrics goes out at about 1 Hz


def test_regenerate_and_continue_are_not_offered_for_a_remote_server(qtbot, server):
    window = remote_window(qtbot, server.base_url)
    send(qtbot, window, "Hello")
    reply = window.chat.chat_messages()[-1]
    assert reply.role == "assistant" and reply.message_id is not None
    assert reply.regenerate_button.isHidden() and reply.continue_button.isHidden()
    assert not window.actions.regenerate_action.isEnabled() and not window.actions.continue_action.isEnabled()
    assert reply.copy_message_button.isVisible() and reply.delete_button.isEnabled()


def test_the_live_page_fits_a_narrow_dock_in_remote_mode(qtbot, server):
    window = remote_window(qtbot, server.base_url)
    window.resize(1024, 700)
    window.resizeDocks([window.dock], [300], Qt.Orientation.Horizontal)
    dash = window.dashboard
    qtbot.waitUntil(lambda: window.dock.width() <= 310, timeout=2000)
    send(qtbot, window, "Hello")                        # the Server section's longest values are shown
    dash.redraw()
    qtbot.wait(50)
    body, viewport = dash.current_page(), dash.live.viewport()
    assert body.objectName() == "dashboardBody" and dash.live.server_panel.isVisible()
    assert body.width() <= viewport.width() and dash.live.server_panel.width() <= viewport.width()


def test_settings_in_server_mode_fit_the_screen_and_scroll(qtbot, server):
    from PySide6.QtWidgets import QApplication, QDialogButtonBox

    from kvchat.app.dialogs.settings_dialog import SERVER_CHOICE, SettingsDialog
    from kvchat.app.store.settings_store import AppSettings, RemoteSettings
    dialog = SettingsDialog(AppSettings(), last_server=RemoteSettings(server.base_url, "", "tiny"))
    qtbot.addWidget(dialog)
    dialog.engine_choice.setCurrentIndex(dialog.engine_choice.findData(SERVER_CHOICE))
    dialog.show()
    qtbot.waitExposed(dialog)
    screen = QApplication.primaryScreen().availableGeometry()
    content = dialog.scroll.widget()
    assert content.sizeHint().height() > screen.height() * 0.9       # more than fits (offscreen: 800 px)...
    assert dialog.frameGeometry().height() <= screen.height()        # ...so the dialog stays on the screen
    assert dialog.scroll.verticalScrollBar().maximum() > 0           # and its groups scroll
    ok = dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)
    assert ok.isVisible() and ok.mapTo(dialog, ok.rect().bottomLeft()).y() <= dialog.height()
    assert dialog.scroll.horizontalScrollBar().maximum() == 0        # nothing cut at the side
    dialog.scroll.ensureWidgetVisible(dialog.language_choice)
    assert dialog.language_choice.visibleRegion().boundingRect().height() > 0


def _local_window(qtbot, loader):
    window = open_window(qtbot, loader)
    qtbot.waitUntil(lambda: window.session_ready or window.last_error is not None, timeout=30_000)
    assert window.last_error is None, window.last_error
    return window


def test_after_a_relaunch_the_plan_marks_the_chats_own_mode(qtbot):
    from kvchat.app.dashboard.plan_panel import PLAN_FORMATS
    from fakes import FakeLoader
    int4 = next(i for i, (_, k, v) in enumerate(PLAN_FORMATS) if (k, v) == ("int4", "int4"))
    window = _local_window(qtbot, FakeLoader())
    send(qtbot, window, "Hello there")
    with qtbot.waitSignal(window.host.mode_switched, timeout=10_000):
        window.host.set_cache(window.session_cache.with_(k_format="int4", v_format="int4"))
    chat = window.conversation_id
    window.close()
    qtbot.waitUntil(lambda: not window.host.thread.isRunning(), timeout=10_000)

    again = _local_window(qtbot, FakeLoader())          # the same data dir and settings: a relaunch
    assert again.conversation_id == chat and again.settings.cache.k_format == "auto"
    again.dashboard.show_page("Plan")
    again.panels.refresh()
    plan = again.dashboard.plan
    assert plan.cache.k_format == "int4" and plan.chosen == int4
    assert plan.chart.columns[int4].selected and not plan.chart.columns[0].selected
    assert plan.apply_button.text() == "In use by this chat" and not plan.apply_button.isEnabled()
    assert "in <b>int4</b>" in plan.summary.text()


def test_the_models_page_lists_the_built_in_model_it_runs(qtbot, monkeypatch, tmp_path):
    from pathlib import Path

    from kvchat.app.dialogs.models_page import BUILT_IN
    from kvchat.engine.model.source import default_gguf_path
    from fakes import FakeLoader
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: home))
    for var in ("HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)
    loader = FakeLoader()
    window = _local_window(qtbot, loader)
    assert window.settings.model == "default"
    dialog = window.open_models()
    qtbot.waitUntil(lambda: not dialog.scanning, timeout=20_000)
    assert dialog.table.rowCount() == 1 and "1 model found (1 loadable)" in dialog.summary.text()
    entry = dialog.selected_entry()                     # the model in use is the one selected
    assert entry.source == BUILT_IN and entry.path == str(default_gguf_path()) and entry.architecture == "llama"
    assert dialog.table.current_row == 0 and entry.parameters > 100_000_000
    with qtbot.waitSignal(dialog.model_chosen) as chosen:      # loaded as Settings names it, not by its path
        qtbot.mouseClick(dialog.load_button, Qt.MouseButton.LeftButton)
    assert chosen.args == ["default"] and window.settings.model == "default" and len(loader.engines) == 1


def test_full_precision_bars_fill_their_outline_on_a_part_filled_block(qtbot, tiny_llama):
    """The real tiny engine: a layer held at full precision is exactly its full-precision outline, also while its
    last block is part-filled (the outline counted tokens, the bar whole blocks)."""
    cache = CacheConfig(k_format="int8", v_format="int8", full_precision_layers=(0,), block_size=16)
    window = fakes.real_window(qtbot, tiny_llama, cache, SHORT)
    send(qtbot, window, "Hello there")
    snap = window.latest_stats
    assert snap.tokens_held % snap.block_size != 0 and not snap.layers[0].k_format.startswith("int8")
    dash = window.dashboard
    dash.redraw()
    outline = dash.live.full_bars.opts["height"]
    bars = dash.live.k_bars.opts["height"] + dash.live.v_bars.opts["height"]
    assert bars[0] == pytest.approx(outline[0])         # layer 0 is held at full precision
    assert bars[0] * snap.tokens_held < outline[0] * snap.blocks_used * snap.block_size


def _darkest(image, rect) -> int:
    """The darkest grey level in `rect` of `image` (where the text is)."""
    from PySide6.QtGui import QColor
    return min(QColor(image.pixel(x, y)).lightness() for x in range(rect.left(), rect.right())
               for y in range(rect.top(), rect.bottom()))


@pytest.fixture
def styled(qapp):
    """The app's own style sheet, as kvchat runs (sizes and colours depend on it)."""
    from kvchat.app.shell.main import load_style
    before = qapp.styleSheet()
    load_style(qapp)
    yield
    qapp.setStyleSheet(before)


def test_disabled_menu_items_look_disabled_under_the_apps_style(qtbot, styled):
    from PySide6.QtGui import QAction
    from PySide6.QtWidgets import QMenu

    menu = QMenu()
    qtbot.addWidget(menu)
    enabled, disabled = QAction("Regenerate reply", menu), QAction("Regenerate reply", menu)
    disabled.setEnabled(False)
    menu.addAction(enabled)
    menu.addAction(disabled)
    menu.popup(menu.pos())
    qtbot.waitExposed(menu)
    image = menu.grab().toImage()
    shown = _darkest(image, menu.actionGeometry(enabled)), _darkest(image, menu.actionGeometry(disabled))
    assert shown[0] < 80 and shown[1] > shown[0] + 60      # dark text, and a clearly lighter grey
    menu.close()


def test_a_long_streamed_reply_shows_its_last_line(qtbot, styled):
    """The bubble is as tall as its wrapped text at the width it has (it was capped at the height the text
    wants at its preferred, wider width: the last lines were cut)."""
    from PySide6.QtWidgets import QLabel

    from kvchat.app.chat.chat_view import ChatView
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(620, 500)
    view.show()
    qtbot.waitExposed(view)
    text = ("Here is a long answer. " * 12 + "\n\n") * 5 + "- item one is long " * 6 + "\n- item two\n\nThe last line."
    view.add_message("user", "tell me")
    view.begin_reply()
    for i in range(0, len(text), 40):
        view.append_reply(text[i:i + 40])
        qtbot.wait(1)
    reply = view.end_reply(text)
    qtbot.wait(50)
    labels = [w for w in reply._widgets if isinstance(w, QLabel)]
    assert labels and all(label.height() >= label.heightForWidth(label.width()) for label in labels)
    assert reply.height() >= reply.layout().totalHeightForWidth(reply.width())


def test_engine_errors_name_the_setting_by_its_label(qtbot):
    import re

    from kvchat.app.engine_text import engine_text
    from kvchat.app.dialogs.settings_dialog import SettingsDialog
    from kvchat.app.store.settings_store import AppSettings
    from kvchat.engine.config import ConfigError
    dialog = SettingsDialog(AppSettings())
    qtbot.addWidget(dialog)
    dialog.block_size.setValue(16)
    dialog.window.setValue(8)
    assert dialog.error_label.text().startswith("Window (tokens) = 8 is smaller than one block")
    dialog.window.setValue(0)
    dialog.budget.setValue(0)
    assert dialog.error_label.text().startswith("KV budget = 0.0: ")
    # every field the engine's own checks name reaches the user by its label, not as the code spells it
    bad = [dict(block_size=0), dict(sinks=-1), dict(window=0), dict(budget_mb=float("nan")), dict(overflow="x"),
           dict(k_scheme="x"), dict(k_format="x"), dict(full_precision_layers=(-1,))]
    for changes in bad:
        with pytest.raises(ConfigError) as refused:
            CacheConfig(**changes)
        shown = engine_text(str(refused.value))
        assert not re.search(r"\b[a-z]+_[a-z_]+\b|\b[a-z]+=", shown), shown
    for changes in (dict(temperature=float("nan")), dict(top_p=2.0), dict(top_k=-1), dict(max_new_tokens=0)):
        with pytest.raises(ConfigError) as refused:
            SamplingParams(**changes)
        shown = engine_text(str(refused.value))
        assert not re.search(r"\b[a-z]+_[a-z_]+\b|\b(temperature|top_p|top_k)\b", shown), shown


def test_full_precision_has_one_name_in_settings_the_status_line_and_the_plan(qtbot):
    from fakes import FakeLoader
    window = _local_window(qtbot, FakeLoader())
    assert window.session_cache.k_format == "auto"
    assert "full precision" in window.status_label.text() and "auto" not in window.status_label.text()
    window.dashboard.show_page("Plan")
    window.panels.refresh()
    plan = window.dashboard.plan
    assert plan.bars[0].name == "full precision" and plan.chart.columns[0].label == "full precision"
    dtype = plan.bars[0].full_dtype                             # what it is on this model, where one looks
    assert dtype in ("fp32", "bf16", "fp16") and f"({dtype})" in plan.chart.columns[0].tip
    dialog = window.open_settings()
    shown = [dialog.k_format.itemText(i) for i in range(dialog.k_format.count())]
    assert "full precision" in shown and "auto" not in shown
    assert dialog.k_format.currentText() == "full precision" and dialog.cache_config().k_format == "auto"
    dialog.reject()


def test_a_server_that_ends_the_reply_with_an_error_is_said_in_one_line(qtbot, tiny_engine):
    srv = Server(tiny_engine, ServeConfig(port=0, model_id="tiny"),
                 CacheConfig(k_format="fp32", v_format="fp32", budget_mb=0.5))
    srv.start()
    try:
        window = remote_window(qtbot, srv.base_url, sampling=LONG)
        window.input.setPlainText("def add(a, b):")
        window.input.submit()
        qtbot.waitUntil(lambda: len(window.chat.reply_text()) > 10, timeout=20_000)
        with qtbot.waitSignal(window.host.error, timeout=10_000) as failed:
            srv.scheduler.shutdown()                    # the server cancels the request: an error event in the stream
        said = notices(window)[-1]
        assert failed.args[0].message.startswith("the server ended the reply: ")
        assert "RemoteError" not in said and "\n" not in said
    finally:
        srv.stop()


def test_the_live_summary_names_full_precision_as_settings_do(qtbot, tiny_llama):
    """The real engine's snapshot names the mode by its value, so the Live page says "full precision", not the
    dtype it resolved to ("bf16" there beside "full precision" in the chat list and the quality line)."""
    window = fakes.real_window(qtbot, str(tiny_llama), CacheConfig(), SHORT)
    send(qtbot, window, "Hello")
    window.dashboard.redraw()
    summary = window.dashboard.live.summary.text()
    mode = summary.partition("</b>")[0]                # the weights' own dtype may follow later in the line
    assert mode == "<b>full precision", summary
