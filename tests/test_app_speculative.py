"""Speculative decoding in the app: the Settings row is saved and switches the engine live (and each engine
loaded later), a setting the engine refuses is reported, not a crash, and the dashboard's speed line says how
many drafts were accepted and how many tokens each step gave. Real tiny engine, a real window offscreen."""
from __future__ import annotations

from dataclasses import replace

import pytest
from PySide6.QtCore import QSettings

from kvchat.app.store.settings_store import SettingsStore
from kvchat.engine.config import SamplingParams, SpeculativeConfig
from kvchat.engine.events import SpecStats
from fakes import isolate_app, real_window, send as send_message

pytestmark = pytest.mark.gui
SHORT = SamplingParams(temperature=0, max_new_tokens=24)
REPEATS = "the cat sat on the mat, the cat sat on the mat, the cat sat on the mat"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    isolate_app(monkeypatch, tmp_path)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))


def send(qtbot, window, text):
    finished = send_message(qtbot, window, text)
    window.dashboard.redraw()
    return finished


def engine_of(window):
    return window.host.worker._engine


def test_the_settings_row_is_saved_and_switches_the_engine_live(qtbot, tiny_llama):
    """Off by default in the app; then prompt lookup with 8, off, and lookup with 3 drafts: each OK saves the choice
    and the engine's next turn uses it."""
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    assert window.store.speculative() == ("off", 8)
    qtbot.waitUntil(lambda: not engine_of(window).speculative.enabled, timeout=5000)
    dialog = window.open_settings()
    assert dialog.findChild(type(dialog.spec_method), "specMethod") is dialog.spec_method
    assert dialog.speculative() == ("off", 8) and dialog.spec_tokens.maximum() == 32
    dialog.spec_method.setCurrentIndex(dialog.spec_method.findData("lookup"))
    dialog.accept()
    assert SettingsStore().speculative() == ("lookup", 8)
    qtbot.waitUntil(lambda: engine_of(window).speculative == SpeculativeConfig("lookup", k=8), timeout=5000)
    dialog = window.open_settings()
    assert dialog.speculative() == ("lookup", 8)
    dialog.spec_method.setCurrentIndex(dialog.spec_method.findData("off"))
    assert not dialog.spec_tokens.isEnabled()          # no drafts to count with speculation off
    dialog.accept()
    assert SettingsStore().speculative() == ("off", 8)
    qtbot.waitUntil(lambda: not engine_of(window).speculative.enabled, timeout=5000)

    dialog = window.open_settings()
    assert dialog.speculative() == ("off", 8)
    dialog.spec_method.setCurrentIndex(dialog.spec_method.findData("lookup"))
    dialog.spec_tokens.setValue(3)
    dialog.accept()
    assert SettingsStore().speculative() == ("lookup", 3)
    qtbot.waitUntil(lambda: engine_of(window).speculative == SpeculativeConfig("lookup", k=3), timeout=5000)


def test_a_saved_choice_applies_to_a_newly_loaded_engine_and_a_refused_one_is_reported(qtbot, tiny_llama):
    """The stored setting reaches an engine loaded after it; a method the engine refuses shows an error and
    leaves the engine as it was."""
    SettingsStore().set_speculative("off", 4)
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    qtbot.waitUntil(lambda: engine_of(window).speculative == SpeculativeConfig("off", k=4), timeout=5000)
    window.host.set_speculative("warp", 4)
    qtbot.waitUntil(lambda: window.last_error is not None, timeout=5000)
    assert window.last_error.kind == "speculative" and "choose off, lookup or draft" in window.last_error.message
    assert engine_of(window).speculative == SpeculativeConfig("off", k=4)
    assert window.session_ready


def test_a_damaged_stored_setting_falls_back_to_the_default(qtbot, tmp_path):
    """An unknown method, or a draft count that is not a number from 1 to 32, reads back as the default."""
    store = SettingsStore()
    for stored, read in ((("warp", "8"), ("off", 8)), (("lookup", "lots"), ("lookup", 8)),
                         (("off", "0"), ("off", 8)), (("draft", "99"), ("off", 8)), (("lookup", "12"), ("lookup", 12))):
        raw = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
        raw.setValue("engine/speculative", stored[0])
        raw.setValue("engine/spec_tokens", stored[1])
        raw.sync()
        assert SettingsStore().speculative() == read, stored
    store.set_speculative("off", 16)
    assert SettingsStore().speculative() == ("off", 16)


def test_the_speed_line_shows_accepted_drafts_and_tokens_per_step_only_with_speculation_on(qtbot, tiny_llama):
    """A reply that copies the chat: "drafts N% accepted, T tokens/step" after the decode rate; with speculation
    off the line has no such part, and a turn that found nothing to draft says so instead of 0%."""
    window = real_window(qtbot, str(tiny_llama), sampling=SHORT)
    window._set_speculative("lookup", 8)
    qtbot.waitUntil(lambda: engine_of(window).speculative.enabled, timeout=5000)
    spec = send(qtbot, window, REPEATS).stats.spec
    assert spec is not None and spec.drafted > 0 and spec.steps > 0
    summary = window.dashboard.live.summary.text()
    shown = f"drafts {spec.acceptance_rate:.0%} accepted, {spec.tokens_per_step:.1f} tokens/step"
    assert shown in summary and summary.index("tok/s") < summary.index(shown) < summary.index("prefill"), summary

    window._set_speculative("off", 8)
    finished = send(qtbot, window, REPEATS)
    assert finished.stats.spec is None
    summary = window.dashboard.live.summary.text()
    assert "decode" in summary and "drafts" not in summary and "tokens/step" not in summary, summary

    window.dashboard.data.add(replace(finished.stats, spec=SpecStats("lookup", 0, 0, 7, 7)), generating=False)
    window.dashboard.redraw()
    assert "nothing drafted" in window.dashboard.live.summary.text()
