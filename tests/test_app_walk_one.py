"""The app as a new user walked it (issue 21, items 10 and 15-19): closing mid-prompt ends the process, Settings
refuses a window the budget cannot hold, the quality line never shows a measurement that did not measure, the
released-chats counter counts chats, evictions share one running marker, and loading and re-reading say so."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PySide6.QtWidgets import QDialogButtonBox

from kvchat.app.dashboard.dashboard_data import MAX_MARKERS, DashboardData
from kvchat.app.dashboard.pool_view import pool_summary
from kvchat.engine.config import CacheConfig, SamplingParams
from kvchat.engine.events import LayerBytes, MemoryProbe, PrefillProgress, StatsSnapshot
import fakes
from fakes import isolate_app, open_window, send
from tiny_models import tiny_model_dir

pytestmark = pytest.mark.gui
ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
INT4 = CacheConfig(k_format="int4", v_format="int4")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # head_dim 32, so int4 groups of 32 fit
    return tiny_model_dir(tmp_path_factory.mktemp("walk-one") / "model", hidden=128, heads=4, kv_heads=2, layers=3)


def real_window(qtbot, model: str, cache: CacheConfig | None = None, sampling: SamplingParams = GREEDY):
    return fakes.real_window(qtbot, model, cache, sampling)


def snapshot(t: float, evicted: int = 0, held: int = 100) -> StatsSnapshot:
    layers = tuple(LayerBytes(i, held * 32, held * 32, "int4", "int4") for i in range(2))
    return StatsSnapshot(time_s=t, cache_label="int4", layers=layers, kv_bytes=held * 128, budget_bytes=1 << 20,
                         block_size=16, blocks_used=held // 16 + 1, blocks_free=10, blocks_budget=40,
                         tokens_in_context=held + evicted, tokens_held=held, tokens_evicted=evicted, tokens_left=None,
                         bytes_per_token=128.0, prefill_tokens=0, prefill_tok_s=0.0, decode_tok_s=20.0, ttft_s=0.01,
                         memory=MemoryProbe(200 << 20, 0, 0, 0))


# --- item 10: closing while a long prompt is read ends the process ---

CLOSE_CHILD = textwrap.dedent("""
    import sys, time
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication
    app = QApplication([sys.argv[0]])
    from kvchat.app.store.history import HistoryStore
    from kvchat.app.shell.main_window import MainWindow
    from kvchat.app.store.settings_store import SettingsStore
    window = MainWindow(SettingsStore(), HistoryStore())
    window.show()
    state = {}

    def tick():
        if "sent" not in state and window.session_ready:
            state["sent"] = time.monotonic()
            window.input.setPlainText("word " * 6000)     # several prefill chunks of the default model
            window.input.submit()
        elif "sent" in state and "closed" not in state and time.monotonic() - state["sent"] > 1.0:
            state["closed"] = True
            busy = window.generating                  # the turn still runs: the close comes mid-prompt
            window.close()
            # on a fast machine the engine may end its chunk within the close's short wait ("joined")
            print("closed", "busy" if busy else "idle",
                  "deferred" if window.host.thread.isRunning() else "joined", flush=True)

    timer = QTimer(interval=50)
    timer.timeout.connect(tick)
    timer.start()
    code = app.exec()
    print("exited", code, flush=True)
""")


def test_closing_during_a_long_prompt_ends_the_process(tmp_path):
    """The app, closed while the default model reads a long prompt, hides at once and the process exits with 0
    once the engine thread has stopped (it used to run on with no window and the model in memory)."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", KVCHAT_DATA_DIR=str(tmp_path / "data"),
               KVCHAT_SETTINGS_FILE=str(tmp_path / "settings.ini"), KVCHAT_QUALITY_FILE=str(tmp_path / "q.json"))
    child = subprocess.Popen([sys.executable, "-c", CLOSE_CHILD], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = child.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
        pytest.fail(f"the app did not exit after its window was closed:\n{out[-2000:]}")
    assert "closed busy" in out, out[-2000:]     # the close really came while the engine was busy
    assert child.returncode == 0 and "exited 0" in out, out[-2000:]


# --- item 15: Settings refuses a window the budget cannot hold ---

def test_settings_refuse_a_window_the_budget_cannot_hold(qtbot, tiny_dir):
    """int4 with a window of 256 + 4 sinks in a budget of a few blocks: OK is disabled and the dialog says why and
    what budget would do; the engine refuses the same cache, so the chat keeps every cached token."""
    window = real_window(qtbot, tiny_dir, cache=INT4.with_(budget_mb=0.1))     # 19 blocks of 16 tokens
    send(qtbot, window, "word " * 40)               # the tiny model's tokenizer reads 200 tokens here
    held = window.latest_stats.tokens_held
    assert held > 200
    dialog = window.open_settings()
    ok = dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)
    assert ok.isEnabled()
    dialog.window.setValue(256)
    dialog.sinks.setValue(4)
    assert not ok.isEnabled()
    assert dialog.error_label.isVisible() and "cannot hold int4, window 256 + 4 sinks" in dialog.error_label.text()
    assert "raise the budget to 0.2 MiB or more" in dialog.error_label.text()
    dialog.budget.setValue(0.2)                     # what the message asks for is enough
    assert ok.isEnabled(), dialog.error_label.text()
    dialog.reject()
    with qtbot.waitSignal(window.host.error, timeout=10_000) as refused:
        window.host.set_cache(window.session_cache.with_(window=256, sinks=4))
    assert refused.args[0].kind == "cache" and "cannot hold" in refused.args[0].message
    window.host.poll_stats()
    qtbot.wait(300)
    assert window.latest_stats.tokens_held == held and window.session_cache == INT4.with_(budget_mb=0.1)


# --- item 18: evictions share one running marker ---

def test_window_evictions_merge_into_one_marker_and_load_and_mode_markers_stay():
    """Two hundred evictions of a window after a load and a mode switch are one running marker (count and tokens
    summed, updated in place); the load and mode-switch markers are still there. A reset ends the run."""
    data = DashboardData(start_s=0.0)
    data.mark("load", "model loaded", 0.5)
    data.add(snapshot(t=1.0))
    data.mark("mode", "→ int4, window 256 + 4 sinks", 1.5)
    for i in range(200):
        data.add(snapshot(t=2.0 + i * 0.5, evicted=16 * (i + 1)))
    assert 200 > MAX_MARKERS
    kinds = [m.kind for m in data.markers]
    assert kinds == ["load", "mode", "evict"]
    running = data.markers[-1]
    assert (running.count, running.tokens, running.time_s) == (200, 3200, 2.0)
    assert running.label == "evicted 3,200 tok in 200 steps"
    data.mark("reset", "reset −1 MiB", 200.0)
    data.add(snapshot(t=201.0, evicted=3216))
    assert [m.kind for m in data.markers] == ["load", "mode", "evict", "reset", "evict"]
    assert data.markers[-1].count == 1 and data.markers[-1].label == "evicted 16 tok"


# --- item 16: the quality line never shows a measurement that did not measure ---

def test_quality_is_not_measured_under_a_budget_that_cannot_hold_it(qtbot, tiny_dir, tmp_path):
    """A budget that holds the chat's window but not the measurement's two sessions: Measure says so in one line,
    nothing is stored and Measure stays. With room, the result is stored under a key that names the weights and the
    block size, it compared every token, and Measure stays as "Measure again"."""
    windowed = INT4.with_(window=256, sinks=4, budget_mb=0.2)
    window = real_window(qtbot, tiny_dir, cache=windowed)
    row = window.dashboard.live.quality_row
    assert row.state == "not measured" and row.button.isVisible()
    with qtbot.waitSignal(window.host.quality, timeout=60_000) as blocker:
        window.quality.measure()
    assert blocker.args[0].error.startswith("the KV budget (0.2 MiB) cannot hold the measurement")
    assert row.state == "failed" and row.button.isVisible() and "raise the budget" in row.label.text()
    assert not (tmp_path / "quality.json").exists()
    with qtbot.waitSignal(window.host.mode_switched, timeout=10_000):
        window.host.set_cache(windowed.with_(budget_mb=4.0))
    with qtbot.waitSignal(window.host.quality, timeout=120_000) as blocker:
        window.quality.measure()
    result = blocker.args[0]
    assert result.tokens == 256 + 4 + 256 and (result.top1_agreement < 1.0 or result.mean_kl > 0.0)
    assert result.mode == "int4, window 256 + 4 sinks · blocks of 16" and "fp32 · cpu" in result.model
    assert row.state == "measured" and row.button.isVisible() and row.button.text() == "Measure again"


# --- item 17: the released counter counts chats ---

def _engine(window):
    return window.host.worker._engine


def regenerate(qtbot, window):
    with qtbot.waitSignal(window.host.turn_finished, timeout=60_000):
        window.actions.regenerate_last()
    qtbot.waitUntil(lambda: not window.generating, timeout=5000)


def test_released_counter_counts_chats_not_the_engines_sequences(qtbot, tiny_dir):
    """One chat, regenerated until the engine released kept replies' sequences for room: no chat was released, so
    the Pool and the status line say nothing. A second chat that needs the room releases the first: that is one."""
    window = real_window(qtbot, tiny_dir, cache=INT4.with_(budget_mb=0.2),
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=96, seed=1))
    send(qtbot, window, "word " * 30)
    released_log = _engine(window).runner.cache._blocks.released_log
    for _ in range(6):
        regenerate(qtbot, window)
    assert released_log, "the budget was meant to make the engine release kept replies"
    assert window.latest_stats.pool.released == 0
    assert "Released the cache" not in window.statusBar().currentMessage()
    assert "released" not in pool_summary(window.latest_stats.pool)
    first = window.conversation_id
    window.new_chat()
    qtbot.waitUntil(lambda: window.session_ready, timeout=10_000)
    send(qtbot, window, "more " * 80)              # 400 tokens: room only once the first chat gives its blocks back
    assert window.latest_stats.pool.released == 1, released_log
    assert "1 idle conversation released" in pool_summary(window.latest_stats.pool)
    assert window.conversation_id != first


# --- item 19: loading and reading again say what happens ---

def test_a_refused_load_replaces_the_load_step_on_the_live_page(qtbot, tmp_path):
    """A model folder the engine refuses: the Live page says the load failed and why, not "locating model"."""
    from kvchat.app.bridge.loader import default_loader as _default_loader
    from tiny_models import write_bad_folder
    bad = write_bad_folder(tmp_path / "bad-model", "llama")
    window = open_window(qtbot, _default_loader, autoload=False)
    steps = []
    window.host.progress.connect(lambda event: steps.append(event.message))
    base = window.settings
    window.apply_settings(type(base)(bad, base.cache, base.sampling, base.system_prompt))
    qtbot.waitUntil(lambda: window.last_error is not None, timeout=30_000)
    assert window.last_error.kind == "load" and "locating model" in steps
    summary = window.dashboard.live.summary.text()
    assert "locating model" not in summary
    assert window.last_error.title in summary and window.last_error.message.split(":")[0] in summary


def test_a_reopened_chat_says_how_many_tokens_it_reads_before_the_reply(qtbot, tiny_dir):
    """A saved chat opened after a restart holds no cache: its next Send first says, in the reply bubble and on the
    Live page, how many tokens it reads again; the first token (or the end) takes the line away."""
    from kvchat.app.store.history import HistoryStore
    from kvchat.app.store.settings_store import SettingsStore
    history = HistoryStore()
    chat = history.create("a long one", INT4)
    history.add_message(chat, "user", "word " * 160)     # 800 tokens in the tiny model's tokenizer
    history.add_message(chat, "assistant", "fine " * 20)
    history.close()
    SettingsStore().set_last_conversation(chat)
    window = real_window(qtbot, tiny_dir, cache=INT4)
    assert window.conversation_id == chat
    seen, progress = [], []

    def on_reading(event):
        window.dashboard.redraw()
        if isinstance(event, PrefillProgress):      # more than one chunk: how far the reading got, too
            progress.append(window.chat.messages()[-1].text())
            return
        seen.append((event.tokens, window.chat.messages()[-1].text(), window.dashboard.live.summary.text()))
    window.host.reading.connect(on_reading)
    finished = send(qtbot, window, "and now?")
    assert len(seen) == 2 and seen[-1][0] == 0
    tokens, bubble, summary = seen[0]
    assert tokens > 850 and abs(tokens - finished.stats.prefill_tokens) <= 16
    assert bubble == summary.split("<br>")[1] == f"reading {tokens:,} tokens of this chat…"
    assert progress[0] == f"reading this chat: 512 / {finished.stats.prefill_tokens:,} tokens…", progress
    assert window.dashboard.live.reading == "" and "reading" not in window.chat.messages()[-1].text()
    window.host.reading.disconnect(on_reading)
    send(qtbot, window, "again")                  # the cache holds the chat now: nothing to announce
    assert len(seen) == 2


def test_a_measurement_that_compared_nothing_is_refused(monkeypatch, tiny_dir):
    """Whatever the reason (here the comparison is made to report it), a result with fewer tokens compared than the
    text has, or an empty cache, raises a one-line error instead of becoming a stored 100 % / KL 0."""
    import kvchat.engine.runtime.fidelity as fidelity
    from kvchat.app.bridge.measure import measure
    from kvchat.engine import Engine, EngineConfig
    from kvchat.engine.config import ConfigError
    engine = Engine.load(EngineConfig(model=tiny_dir))
    hollow = {"mode": {"tokens": 0, "kv_bytes": 0, "top1_agreement": 1.0, "mean_kl": 0.0}}
    monkeypatch.setattr(fidelity, "compare_modes", lambda *args, **kwargs: hollow)
    with pytest.raises(ConfigError, match="only 0 of 64 tokens were compared"):
        measure(engine, INT4, num_tokens=64)
