"""Replay with…: the open chat teacher-forced under another cache mode in the engine thread (a stand-in for
engine.runtime.replay here), with progress and Cancel; the result per reply on the Attention page and the first
divergent token marked in place in the chat; the chat itself unchanged; a budget too small refused before anything
starts; a new message stops a running replay."""
from __future__ import annotations

import sys

import pytest

from fake_attention import fake_replay_module
from fakes import FakeLoader, engine_of, isolate_app, open_window

from kvchat.app.bridge.attention_events import ReplayFailed, ReplayShown
from kvchat.engine.config import CacheConfig, SamplingParams

pytestmark = pytest.mark.gui


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)


def chat_with_reply(qtbot, monkeypatch, step_s: float = 0.0):
    """A window whose chat holds one question and the fake engine's five-word reply; the replay stand-in installed."""
    module = fake_replay_module(step_s=step_s)
    monkeypatch.setitem(sys.modules, "kvchat.engine.runtime.replay", module)
    window = open_window(qtbot, FakeLoader())
    qtbot.waitUntil(lambda: window.session_ready, timeout=5000)
    window.settings = window.settings.__class__(window.settings.model, window.settings.cache,
                                                SamplingParams(max_new_tokens=5), window.settings.system_prompt)
    with qtbot.waitSignal(window.host.turn_finished, timeout=10_000):
        window.send("what is a key value cache")
    qtbot.waitUntil(lambda: not window.generating, timeout=5000)
    return window, module


def replay_event(qtbot, window, kind, timeout=10_000):
    with qtbot.waitSignal(window.host.replay, timeout=timeout,
                          check_params_cb=lambda event: isinstance(event, kind)) as blocker:
        pass
    return blocker.args[0]


def test_a_replay_shows_each_reply_and_marks_its_first_divergence_in_place(qtbot, monkeypatch):
    """Under int4 the reply first diverges at its second token ("from"): the page gives top-1, KL and the tokens, the
    chat highlights "from" in the reply with the tooltip, and neither the chat nor the session changed."""
    window, module = chat_with_reply(qtbot, monkeypatch)
    session = engine_of(window).sessions[-1]
    before = [dict(m) for m in session.messages]
    shown_before = [m.text() for m in window.chat.chat_messages()]
    dialog = window.attention.open_dialog()
    assert dialog is not None and dialog.mode().k_format == "int4"
    with qtbot.waitSignal(window.host.replay, timeout=10_000,
                          check_params_cb=lambda event: isinstance(event, ReplayShown)) as blocker:
        dialog.accept()
    result = blocker.args[0]
    ids, mode, baseline, replies = module.calls[0]
    assert ids == session.token_ids and mode.k_format == mode.v_format == "int4" and baseline == session.cache_config
    assert replies == [(1, session.state.starts[1], len(ids))]
    reply = result.replies[0]
    assert (reply.offset, reply.length, reply.expected, reply.replayed) == (6, 4, "from", "banana")
    panel = window.dashboard.attention.replay
    assert panel.state == "shown" and "top-1 agreement <b>90.0%</b>" in panel.status.text()
    assert "«from» → «banana»" in panel.results.text() and "reply 1" in panel.results.text()
    marks = window.attention.marks
    [label] = marks.marked_labels()
    assert 'kvchat-divergence:0"><span' in label.text() and ">from</span>" in label.text()
    assert label.text().startswith("Hello ") and marks.tip_for(0) == \
        "Under int4 the model would have said «banana» here, not «from»."
    assert session.messages == before and [m.text() for m in window.chat.chat_messages()] == shown_before
    assert window.history.messages(window.conversation_id)[-1]["content"] == "Hello from the fake engine."


def test_progress_and_cancel_close_the_replays_sessions(qtbot, monkeypatch):
    """A slow replay reports progress; Cancel stops it between steps, the two sessions it made are closed, and the page
    says nothing was measured."""
    window, module = chat_with_reply(qtbot, monkeypatch, step_s=0.05)
    engine = engine_of(window)
    sessions = list(engine.sessions)
    panel = window.dashboard.attention.replay
    window.attention.start(CacheConfig(k_format="int4", v_format="int4"))
    assert panel.state == "running" and not panel.button.isEnabled()
    qtbot.waitUntil(lambda: panel.progress.maximum() > 1 and panel.progress.value() >= 1, timeout=5000)
    assert "of" in panel.progress.format()
    panel.cancel_button.click()
    event = replay_event(qtbot, window, ReplayFailed)
    assert event.cancelled and panel.state == "cancelled" and panel.status.text().startswith("Replay stopped")
    assert engine.sessions == sessions and panel.button.isEnabled()
    assert window.attention.marks.marked_labels() == []


def test_a_budget_too_small_is_refused_before_anything_starts(qtbot, monkeypatch):
    window, module = chat_with_reply(qtbot, monkeypatch)
    engine_of(window).replay_refusal = "the KV budget (1 MiB) cannot hold the replay, which needs 3.0 MiB"
    window.attention.start(CacheConfig(k_format="int4", v_format="int4"))
    event = replay_event(qtbot, window, ReplayFailed)
    panel = window.dashboard.attention.replay
    assert not event.cancelled and module.calls == []
    assert panel.state == "failed" and "cannot hold the replay, which needs 3.0 MiB" in panel.status.text()


def test_a_new_message_stops_a_running_replay(qtbot, monkeypatch):
    window, module = chat_with_reply(qtbot, monkeypatch, step_s=0.05)
    panel = window.dashboard.attention.replay
    window.attention.start(CacheConfig(k_format="int4", v_format="int4"))
    qtbot.waitUntil(lambda: panel.progress.value() >= 1, timeout=5000)
    with qtbot.waitSignal(window.host.turn_finished, timeout=10_000):
        window.send("one more question")
    assert panel.state == "cancelled"


def test_the_dialog_refuses_the_chats_own_mode_and_a_window_below_a_block(qtbot):
    from kvchat.app.dialogs.replay_dialog import ReplayDialog
    from PySide6.QtWidgets import QDialogButtonBox
    dialog = ReplayDialog(CacheConfig())
    qtbot.addWidget(dialog)
    ok = dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)
    assert ok.isEnabled() and dialog.mode() == CacheConfig(k_format="int4", v_format="int4")
    dialog.window.setValue(8)
    assert not ok.isEnabled() and "smaller than one block" in dialog.error.text()
    dialog.window.setValue(0)
    dialog.k_format.setCurrentIndex(dialog.k_format.findData("auto"))
    dialog.v_format.setCurrentIndex(dialog.v_format.findData("auto"))
    assert not ok.isEnabled() and "own mode" in dialog.error.text()


def test_the_real_engine_draws_its_map_and_replays_the_chat(qtbot, tmp_path):
    """A tiny real model in the window: after a reply the Attention page holds the engine's own map (its 3 layers,
    every column of the chat); Replay with window 16 + 4 sinks runs the real replay and leaves the chat as it was."""
    from tiny_models import tiny_model_dir
    from fakes import real_window, send
    folder = tiny_model_dir(tmp_path / "model", hidden=128, heads=4, kv_heads=2, layers=3)
    window = real_window(qtbot, folder, sampling=SamplingParams(temperature=0.0, max_new_tokens=24))
    with qtbot.waitSignal(window.host.attention, timeout=60_000) as shown:
        send(qtbot, window, "the first message of a longer chat " * 3)
    m = shown.args[0].newest
    assert m is not None and m.num_layers == 3 and m.block_positions[-1] < len(m.tokens) <= m.column_end(
        m.num_columns - 1)
    qtbot.waitUntil(lambda: window.attention.page.current()[0] is m, timeout=5000)
    before = [m.text() for m in window.chat.chat_messages()]
    with qtbot.waitSignal(window.host.replay, timeout=60_000,
                          check_params_cb=lambda e: isinstance(e, (ReplayShown, ReplayFailed))) as blocker:
        window.attention.start(CacheConfig(k_format=window.session_cache.k_format,
                                           v_format=window.session_cache.v_format, window=16, sinks=4))
    result = blocker.args[0]
    assert isinstance(result, ReplayShown), result
    assert [r.index for r in result.replies] == [1] and result.tokens == result.replies[0].tokens > 0
    assert [m.text() for m in window.chat.chat_messages()] == before
