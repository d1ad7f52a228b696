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

from engine import CacheConfig, SamplingParams
from engine.serve.server import ServeConfig, Server
from fakes import isolate_app, open_window

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
    from app.settings_store import RemoteSettings
    from app.worker import _default_loader
    window = open_window(qtbot, _default_loader, autoload=False)
    window.apply_settings(replace(window.settings, sampling=sampling, remote=RemoteSettings(url, "", "tiny")))
    qtbot.waitUntil(lambda: window.session_ready or window.last_error is not None, timeout=20_000)
    assert window.last_error is None, window.last_error
    return window


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
    assert all(v.startswith("server unreachable") for k, v in dash.server_panel.texts().items()
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
    assert "disconnected" in window.status_label.text()


def test_metrics_are_read_about_once_a_second_while_streaming(qtbot, server):
    cut = Cut(int(server.base_url.split(":")[2].split("/")[0]))
    window = remote_window(qtbot, cut.base_url, sampling=replace(LONG, max_new_tokens=400))
    stats = []
    window.host.stats.connect(stats.append)
    before = cut.metrics_requests
    import time
    started = time.monotonic()
    send(qtbot, window, "def add(a, b):")
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
    body, viewport = dash.current_page(), dash.scroll.viewport()
    assert body.objectName() == "dashboardBody" and dash.server_panel.isVisible()
    assert body.width() <= viewport.width() and dash.server_panel.width() <= viewport.width()
