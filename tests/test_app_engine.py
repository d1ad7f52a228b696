"""The app over the real engine: a tiny random-weight model for speed, the default model for one chat."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import time

import pytest
from PySide6.QtCore import QObject, Qt, QTimer

from kvchat.engine.config import CacheConfig, SamplingParams
from tiny_models import tiny_model_dir, write_bad_folder
from fakes import isolate_app, open_window, send

pytestmark = pytest.mark.gui
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
# What a frozen GUI looks like, not a speed target: engine work run on the GUI thread by mistake (reading the
# question takes 0.5 s on the default model) fails it. On this shared 2-core machine the longest ordinary gap
# measured 26-51 ms in full runs, before and after the same change, so a 50 ms line failed on noise.
STALL_LIMIT_S = 0.100


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # head_dim 32, so int4 groups of 32 fit
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", hidden=128, heads=4, kv_heads=2, layers=3)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


class StallMeter(QObject):
    """Ticks every 5 ms in the GUI thread and records the longest gap between ticks."""

    def __init__(self):
        super().__init__()
        self.longest_s = 0.0
        self._last: float | None = None
        self._timer = QTimer(self, interval=5)
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.timeout.connect(self._tick)

    def start(self) -> None:
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def _tick(self) -> None:
        now = time.perf_counter()
        self.longest_s = max(self.longest_s, now - self._last)
        self._last = now


def real_window(qtbot, model: str, cache: CacheConfig | None = None, sampling: SamplingParams = GREEDY,
                timeout: int = 30_000):
    window = open_window(qtbot, _real_loader(), autoload=False)
    base = window.settings
    window.apply_settings(type(base)(model, cache or base.cache, sampling, base.system_prompt))
    qtbot.waitUntil(lambda: window.session_ready or window.last_error is not None, timeout=timeout)
    assert window.last_error is None, window.last_error
    qtbot.waitExposed(window)
    qtbot.wait(300)                     # the first paint of a new window is not what the stall test measures
    return window


def _real_loader():
    from kvchat.app.bridge.loader import default_loader as _default_loader

    return _default_loader


def measured_send(qtbot, window, text: str, timeout: int = 30_000):
    """Send and return (TurnFinished, longest GUI stall in s). Load from other processes only adds
    stalls, so a turn over the limit is measured once more and the better of the two is kept."""
    best = None
    for attempt in range(2):
        meter = StallMeter()
        meter.start()
        finished = send(qtbot, window, text, timeout)
        meter.stop()
        best = meter.longest_s if best is None else min(best, meter.longest_s)
        if best <= STALL_LIMIT_S:
            break
        print(f"GUI stall {meter.longest_s * 1000:.1f} ms on attempt {attempt + 1}; measuring one more turn")
    return finished, best


def test_tiny_model_send_receive_and_stall(qtbot, tiny_dir):
    """A reply from the real engine streams into the chat while the GUI loop never stalls past 100 ms."""
    window = real_window(qtbot, tiny_dir, sampling=SamplingParams(temperature=0.0, max_new_tokens=200))
    send(qtbot, window, "Warm up")      # first-use costs (fonts, first plot data) are paid once, not per turn
    qtbot.wait(300)
    finished, stall = measured_send(qtbot, window, "Hello there")
    assert finished.finish_reason in ("length", "eos")
    assert window.chat.messages()[-1].text() == finished.text
    assert window.dashboard.data.latest.tokens_held > 0
    assert stall <= STALL_LIMIT_S, f"GUI stalled {stall * 1000:.1f} ms"


def test_tiny_model_stop_mid_reply(qtbot, tiny_dir):
    """Stop during a long real reply ends it as 'stopped' well before max_new_tokens."""
    window = real_window(qtbot, tiny_dir, sampling=SamplingParams(temperature=0.0, max_new_tokens=100_000))
    window.input.setPlainText("Go on forever")
    window.input.submit()
    qtbot.waitUntil(lambda: len(window.chat.reply_text()) > 0, timeout=20_000)
    with qtbot.waitSignal(window.host.turn_finished, timeout=5000) as blocker:
        window.stop()
    finished = blocker.args[0]
    assert finished.finish_reason == "stopped"
    assert finished.stats.tokens_held < 100_000


def test_tiny_model_mode_switch_changes_layer_bytes(qtbot, tiny_dir):
    """Switching the open chat from fp32 to int8 and then int4 shrinks each layer's bytes live, tokens kept."""
    window = real_window(qtbot, tiny_dir, cache=CacheConfig(k_format="fp32", v_format="fp32"))
    send(qtbot, window, "Hello, cache")
    full = window.dashboard.data.latest
    assert all(layer.k_format == "fp32" for layer in full.layers)
    sizes = [full.kv_bytes]
    for fmt in ("int8", "int4"):
        with qtbot.waitSignal(window.host.mode_switched, timeout=10_000):
            window.apply_settings(type(window.settings)(window.settings.model,
                                                        CacheConfig(k_format=fmt, v_format=fmt),
                                                        window.settings.sampling, ""))
        snapshot = window.dashboard.data.latest
        assert snapshot.tokens_held == full.tokens_held
        assert all(layer.k_format.startswith(fmt) and layer.v_format.startswith(fmt) for layer in snapshot.layers)
        sizes.append(snapshot.kv_bytes)
    assert sizes[0] > sizes[1] > sizes[2] > 0
    window.dashboard.redraw()
    assert "int4" in window.status_label.text()
    assert send(qtbot, window, "And more").finish_reason in ("length", "eos")


def test_tiny_model_reset_frees_all_kv(qtbot, tiny_dir):
    """Reset session frees every block: KV bytes go to 0 and the next turn still answers."""
    window = real_window(qtbot, tiny_dir)
    send(qtbot, window, "Fill the cache a little")
    held = window.dashboard.data.latest.kv_bytes
    with qtbot.waitSignal(window.host.reset_done, timeout=10_000) as blocker:
        window.reset_session()
    assert blocker.args[0].freed_bytes == held > 0
    assert window.dashboard.data.latest.kv_bytes == 0
    assert window.dashboard.data.latest.blocks_used == 0
    assert "returned" in window.statusBar().currentMessage()
    assert send(qtbot, window, "Still there?").finish_reason in ("length", "eos")


def test_tiny_model_budget_too_small_for_prompt(qtbot, tiny_dir):
    """A prompt that cannot fit the KV budget ends the turn with the engine's advice shown in the chat."""
    window = real_window(qtbot, tiny_dir, cache=CacheConfig(budget_mb=0.05))
    finished = send(qtbot, window, "hello " * 200)
    assert finished.finish_reason == "budget"
    notice = [m for m in window.chat.messages() if m.role == "notice"][-1]
    assert "raise the budget" in notice.text()
    assert window.send_button.isEnabled()


@pytest.mark.parametrize("case", ["missing", "architecture", "corrupt"])
def test_real_load_errors_explained(qtbot, tmp_path, tiny_dir, case):
    """A missing, unsupported or corrupt model gives a one-line message with what to do; the app stays up."""
    if case == "missing":
        model, expected = str(tmp_path / "nowhere"), "does not exist"
    elif case == "architecture":
        model, expected = write_bad_folder(tmp_path / "gpt2", "gpt2"), "unsupported architecture"
    else:
        folder = tmp_path / "corrupt"
        folder.mkdir()
        with open(os.path.join(tiny_dir, "config.json")) as config:
            (folder / "config.json").write_text(config.read())
        (folder / "model.safetensors").write_bytes(b"not a safetensors file")
        model, expected = str(folder), "corrupt"
    window = open_window(qtbot, _real_loader(), autoload=False)
    base = window.settings
    with qtbot.waitSignal(window.host.error, timeout=30_000):
        window.apply_settings(type(base)(model, base.cache, base.sampling, ""))
    assert expected in window.banner.text()
    assert window.banner.settings_button.isVisible()
    assert not window.send_button.isEnabled() and window.input.isEnabled()


@pytest.mark.slow
def test_default_model_chat_and_stall(qtbot):
    """The default model answers a question in the window, and the GUI loop never stalls past 100 ms."""
    window = real_window(qtbot, "default", sampling=SamplingParams(temperature=0.0, max_new_tokens=24),
                         timeout=240_000)
    finished, stall = measured_send(qtbot, window, "What is the capital of France? Answer in one sentence.",
                                    timeout=120_000)
    assert "Paris" in finished.text
    assert "Paris" in window.chat.messages()[-1].text()
    assert window.dashboard.data.latest.tokens_held > 0
    print(f"longest GUI stall while the default model generated: {stall * 1000:.1f} ms")
    assert stall <= STALL_LIMIT_S, f"GUI stalled {stall * 1000:.1f} ms"
